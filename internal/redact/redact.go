// Package redact keeps passwords out of what the library and its tests print.
package redact

import "net/url"

// URI returns uri with its password replaced by "xxxxx", or a placeholder when uri is
// not an amqp:// or amqps:// URI with a host (url.Parse takes many malformed URIs,
// such as "amqp//user:pass@host/", for a path that still holds the password).
func URI(uri string) string {
	u, err := url.Parse(uri)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" || u.Opaque != "" {
		return "(unparseable amqp uri)"
	}
	return u.Redacted()
}
