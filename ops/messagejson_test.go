package ops_test

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/amqpretry/amqpretry/middleware"
	"github.com/amqpretry/amqpretry/ops"
)

// TestMessageJSONCarriesTheEnvelopesTags: Message's doc says the Envelope's fields keep
// their own snake_case JSON tags, at the top level of a Message's JSON object (issue
// 25: it said they had none). Every field of the Envelope has a tag, and a Message
// renders each set one under that name.
func TestMessageJSONCarriesTheEnvelopesTags(t *testing.T) {
	env := reflect.TypeOf(middleware.Envelope{})
	var names []string
	for i := range env.NumField() {
		tag, _, _ := strings.Cut(env.Field(i).Tag.Get("json"), ",")
		if tag == "" || tag == "-" || tag != strings.ToLower(tag) {
			t.Errorf("middleware.Envelope.%s: JSON tag %q, want a snake_case name", env.Field(i).Name, tag)
		}
		names = append(names, tag)
	}
	// Every field set, so that omitempty and omitzero hide none.
	var m ops.Message
	m.UUID = "u"
	v := reflect.ValueOf(&m.Envelope).Elem()
	for i := range v.NumField() {
		switch f := v.Field(i); {
		case f.Type() == reflect.TypeOf(time.Time{}):
			f.Set(reflect.ValueOf(time.Now()))
		case f.Kind() == reflect.String:
			f.SetString("x")
		case f.Kind() == reflect.Int, f.Kind() == reflect.Int64:
			f.SetInt(1)
		case f.Kind() == reflect.Slice && f.Type().Elem().Kind() == reflect.String:
			f.Set(reflect.Append(f, reflect.ValueOf("x").Convert(f.Type().Elem())))
		case f.Kind() == reflect.Bool:
			f.SetBool(true)
		default:
			t.Fatalf("middleware.Envelope.%s: set it in this test (%s)", env.Field(i).Name, f.Type())
		}
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var got map[string]any
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if _, ok := got[name]; !ok {
			t.Errorf("a Message's JSON has no top-level %q (the Envelope's tag): %s", name, b)
		}
	}
	if _, ok := got["Envelope"]; ok {
		t.Errorf("a Message's JSON nests the Envelope: %s", b)
	}
}
