package middleware

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

type customError struct{}

func (customError) Error() string { return "custom" }

func TestErrorTypes(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want string
	}{
		{"plain", errors.New("x"), "*errors.errorString"},
		{"wrapped", fmt.Errorf("a: %w", customError{}), "*fmt.wrapError > middleware.customError"},
		{"joined", errors.Join(customError{}, errors.New("y")), "*errors.joinError > middleware.customError > *errors.errorString"},
		{"marked", Permanent(customError{}), "*middleware.permanentError > middleware.customError"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := errorTypes(tt.err); got != tt.want {
				t.Errorf("errorTypes = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestEnvelopeIsBounded(t *testing.T) {
	err := errors.New(strings.Repeat("é", 10_000))
	for range 100 {
		err = fmt.Errorf("layer: %w", err)
	}
	md := map[string]string{}
	failure{err: err, attempt: 3, at: time.Now(), handler: strings.Repeat("h", 5000)}.record(md)
	total := 0
	for k, v := range md {
		total += len(k) + len(v)
		if !utf8.ValidString(v) {
			t.Errorf("%s is not valid UTF-8 after truncation", k)
		}
	}
	if len(md[ErrorKey]) > MaxErrorBytes {
		t.Errorf("%s is %d bytes, over %d", ErrorKey, len(md[ErrorKey]), MaxErrorBytes)
	}
	if n := strings.Count(md[ErrorTypesKey], " > ") + 1; n != MaxErrorTypes {
		t.Errorf("%s lists %d types, want the cap %d", ErrorTypesKey, n, MaxErrorTypes)
	}
	if total > 8*1024 {
		t.Errorf("envelope is %d bytes, want it far below frame_max", total)
	}
}

func TestRecordKeepsFirstFailure(t *testing.T) {
	first := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	md := map[string]string{}
	failure{err: errors.New("a"), at: first, exchange: "orders", key: "created"}.record(md)
	failure{err: errors.New("b"), at: first.Add(time.Minute), exchange: "amqpretry.deliver", key: "q"}.record(md)
	if md[FirstFailureKey] != first.Format(time.RFC3339Nano) {
		t.Errorf("%s = %s, want the first failure", FirstFailureKey, md[FirstFailureKey])
	}
	if md[LastFailureKey] != first.Add(time.Minute).Format(time.RFC3339Nano) {
		t.Errorf("%s = %s, want the latest failure", LastFailureKey, md[LastFailureKey])
	}
	if md[OriginalExchangeKey] != "orders" || md[OriginalRoutingKeyKey] != "created" {
		t.Errorf("original exchange/key = %q/%q, want orders/created", md[OriginalExchangeKey], md[OriginalRoutingKeyKey])
	}
	if md[ErrorKey] != "b" {
		t.Errorf("%s = %q, want the latest error", ErrorKey, md[ErrorKey])
	}
}

func TestClassifyMarks(t *testing.T) {
	tests := []struct {
		name string
		err  error
		want Decision
	}{
		{"plain", errors.New("x"), Decision{}},
		{"permanent", fmt.Errorf("ctx: %w", Permanent(errors.New("bad input"))), Decision{Permanent: true}},
		{"retry after", RetryAfter(errors.New("429"), 30*time.Second), Decision{Delay: 30 * time.Second}},
		{"negative retry after", RetryAfter(errors.New("429"), -time.Second), Decision{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := DefaultClassify(ClassifyParams{Err: tt.err}); got != tt.want {
				t.Errorf("DefaultClassify = %+v, want %+v", got, tt.want)
			}
		})
	}
	if Permanent(nil) != nil || RetryAfter(nil, time.Second) != nil {
		t.Error("marking a nil error must give nil")
	}
}
