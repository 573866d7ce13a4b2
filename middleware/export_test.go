package middleware

// EnvelopeKeys returns the failure envelope's keys, in the order of Envelope.fields, its
// one list, for the tests of package middleware_test.
func EnvelopeKeys() []string {
	var e Envelope
	fs := e.fields()
	out := make([]string, 0, len(fs))
	for _, f := range fs {
		out = append(out, f.key)
	}
	return out
}

// InEnvelope is inEnvelope, for the tests.
var InEnvelope = inEnvelope
