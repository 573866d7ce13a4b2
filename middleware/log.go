package middleware

import "github.com/ThreeDotsLabs/watermill"

// Log helpers: WARN where the logger has it.

// warner is a logger with a WARN level. watermill.LoggerAdapter has none: where the
// logger given has a Warn method it is used; else a notice goes out at INFO, and a
// warning at ERROR when it carries an error (so that alerting on errors sees it), at
// INFO when it does not.
type warner interface {
	Warn(msg string, fields watermill.LogFields)
}

// notice logs msg at WARN, or at INFO where the logger has no WARN level: something
// was adjusted, or the library is dealing with it (an outage begins), and nothing
// needs fixing.
func notice(l watermill.LoggerAdapter, msg string, fields watermill.LogFields) {
	if w, ok := l.(warner); ok {
		w.Warn(msg, fields)
		return
	}
	l.Info(msg, fields)
}

// warn logs msg at WARN, or at ERROR with err where the logger has no WARN level.
func warn(l watermill.LoggerAdapter, msg string, err error, fields watermill.LogFields) {
	if w, ok := l.(warner); ok {
		if err != nil {
			fields = fields.Add(watermill.LogFields{"err": err.Error()})
		}
		w.Warn(msg, fields)
		return
	}
	if err == nil {
		l.Info(msg, fields) // never err=<nil>
		return
	}
	l.Error(msg, err, fields)
}

// withErr adds err to fields, as warn does; nothing for nil, never err=<nil>.
func withErr(fields watermill.LogFields, err error) watermill.LogFields {
	if err != nil {
		fields = fields.Add(watermill.LogFields{"err": err.Error()})
	}
	return fields
}

// debugs tells whether l may write a DEBUG line: not watermill's NopLogger (the
// default), nor a StdLoggerAdapter without a DebugLogger (NewStdLogger with debug
// false), whose Debug drops it. The line every retry logs at DEBUG is not built for
// them: its fields cost a dozen allocations per retry (BenchmarkFailurePath).
func debugs(l watermill.LoggerAdapter) bool {
	switch l := l.(type) {
	case watermill.NopLogger:
		return false
	case *watermill.StdLoggerAdapter:
		return l.DebugLogger != nil
	}
	return true
}
