// Package amqperr reads the errors RabbitMQ answers with over AMQP 0-9-1: their reply
// code and their text. Package topology, the declarations' checks and the fixes the
// library suggests all read them the same way, here.
package amqperr

import (
	"errors"
	"regexp"

	amqp "github.com/rabbitmq/amqp091-go"
)

// IsCode tells whether err is an AMQP error with the given reply code.
func IsCode(err error, code int) bool {
	var amqpErr *amqp.Error
	return errors.As(err, &amqpErr) && amqpErr.Code == code
}

// Reason is the broker's text of an AMQP error, or err's own text.
func Reason(err error) string {
	var amqpErr *amqp.Error
	if errors.As(err, &amqpErr) {
		return amqpErr.Reason
	}
	return err.Error()
}

// InequivalentArg finds the argument named by a 406 PRECONDITION_FAILED that refused
// a declaration clashing with an existing one.
var InequivalentArg = regexp.MustCompile(`inequivalent arg '([^']+)'`)
