package main

import (
	"log/slog"
	"maps"
	"os"
	"slices"

	"github.com/ThreeDotsLabs/watermill"
)

// logger prints what the library and Watermill log at WARN and ERROR, on stderr, in
// slog's text format (level=WARN ...). Its Warn method gives the library a WARN level,
// which Watermill's own loggers lack: a poisoning, expected here, is logged at WARN,
// and a line at ERROR is something to fix.
type logger struct {
	watermill.LoggerAdapter
	slog *slog.Logger
}

func newLogger() logger {
	l := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	return logger{LoggerAdapter: watermill.NewSlogLogger(l), slog: l}
}

// Warn logs msg at WARN.
func (l logger) Warn(msg string, fields watermill.LogFields) {
	var args []any
	for _, k := range slices.Sorted(maps.Keys(fields)) {
		args = append(args, k, fields[k])
	}
	l.slog.Warn(msg, args...)
}
