// Package glue holds the template of the transport packages wamqp2 and wamqp3
// (retry.go.tmpl), from which internal/cmd/genglue writes them.
package glue

//go:generate sh -c "cd ../.. && go run ./internal/cmd/genglue"
