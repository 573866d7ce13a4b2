package topology

import (
	"errors"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/amqpretry/amqpretry/internal/amqperr"
)

func TestErrorsNameTheObject(t *testing.T) {
	notFound := &amqp.Error{Code: amqp.NotFound, Reason: "NOT_FOUND - no queue 'q'", Server: true}
	refused := &amqp.Error{Code: amqp.AccessRefused, Reason: "ACCESS_REFUSED", Server: true}
	if err := checkError("queue", "q", notFound); !errors.Is(err, ErrMissing) || err.Error() != `queue "q": not found: Exception (404) Reason: "NOT_FOUND - no queue 'q'"` {
		t.Errorf("checkError 404: %v", err)
	}
	if err := checkError("exchange", "x", refused); errors.Is(err, ErrMissing) || !strings.Contains(err.Error(), `check exchange "x"`) || !amqperr.IsCode(err, amqp.AccessRefused) {
		t.Errorf("checkError 403: %v", err)
	}
	b := Binding{Exchange: "x", Destination: "q", Key: "k"}
	if err := b.bindError(notFound); !errors.Is(err, ErrMissing) || !strings.Contains(err.Error(), `binding of "q" to exchange "x" with key "k"`) {
		t.Errorf("bindError 404: %v", err)
	}
	if err := b.bindError(refused); errors.Is(err, ErrMissing) || !strings.Contains(err.Error(), `bind "q" to exchange "x" with key "k"`) {
		t.Errorf("bindError 403: %v", err)
	}
}
