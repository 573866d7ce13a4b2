package middleware

// EnvelopeKeys returns the failure envelope's keys, in the order of envelopeFields, its
// one list, for the tests of package middleware_test.
func EnvelopeKeys() []string {
	out := make([]string, 0, len(envelopeFields))
	for _, f := range envelopeFields {
		out = append(out, f.key)
	}
	return out
}

// InEnvelope is inEnvelope, for the tests.
var InEnvelope = inEnvelope
