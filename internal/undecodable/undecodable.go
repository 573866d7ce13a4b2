// Package undecodable tells the errors of a payload that can never decode: classified
// permanent by default (amqpretry.DecisionOf), since no retry decodes it.
package undecodable

import (
	"encoding/json"
	"reflect"
	"strings"
)

// protobufPrefix starts the package path of every error type of protobuf-go
// (google.golang.org/protobuf/internal/errors): what errors.Is(err, proto.Error)
// matches, read without importing protobuf-go, which a program that does not use it
// would then link.
const protobufPrefix = "google.golang.org/protobuf/"

// Is tells whether err itself, not its chain, is a decode error: encoding/json's
// *json.SyntaxError or *json.UnmarshalTypeError, or an error of protobuf-go.
func Is(err error) bool {
	switch err.(type) {
	case *json.SyntaxError, *json.UnmarshalTypeError:
		return true
	}
	t := reflect.TypeOf(err)
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	return strings.HasPrefix(t.PkgPath(), protobufPrefix)
}

// In tells whether err's chain has a decode error (Is), as errors.As walks it.
func In(err error) bool {
	for err != nil {
		if Is(err) {
			return true
		}
		switch u := err.(type) {
		case interface{ Unwrap() error }:
			err = u.Unwrap()
		case interface{ Unwrap() []error }:
			for _, inner := range u.Unwrap() {
				if In(inner) {
					return true
				}
			}
			return false
		default:
			return false
		}
	}
	return false
}
