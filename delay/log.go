package delay

import "github.com/ThreeDotsLabs/watermill"

// warner is a logger with a WARN level. watermill.LoggerAdapter has none: where the
// logger given has a Warn method it is used, else the line goes out at ERROR, so that
// alerting on errors sees it.
type warner interface {
	Warn(msg string, fields watermill.LogFields)
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
	l.Error(msg, err, fields)
}
