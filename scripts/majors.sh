#!/usr/bin/env bash
# The README's first snippet, built as a user of each watermill-amqp major would build
# it (issue 17): a fresh module that requires only watermill v1.5.1, that major and this
# library (replaced by this checkout), with the snippet in a function. The program must
# build, and `go list -deps` of it must show no package of the other major. The snippet
# is the README's own (its first ```go block after "## Use"), its imports switched to the
# major under test; `{ ... }` becomes `{ return err }`.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
snippet=$(awk '/^## Use/ { use = 1 } use && /^```go$/ { in_block = 1; next } in_block && /^```$/ { exit } in_block' README.md)
if [ -z "$snippet" ]; then echo "majors: no Go snippet under '## Use' in README.md" >&2; exit 1; fi

declare -A version=([2]=v2.1.3 [3]=v3.0.1)
for major in 3 2; do
  other=$((5 - major))
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064 # expand now: each major has its own directory
  trap "rm -rf '$tmp'" EXIT
  imports=$(printf '%s\n' "$snippet" | awk '/^import \(/ { f = 1; next } f && /^\)/ { exit } f' |
    sed -e "s#watermill-amqp/v3#watermill-amqp/v$major#" -e "s#amqpretry/wamqp3#amqpretry/wamqp$major#")
  body=$(printf '%s\n' "$snippet" | awk '/^import \(/ { f = 1; next } f && /^\)/ { f = 0; done = 1; next } !f && done' |
    sed -e 's/{ \.\.\. }/{ return err }/' -e "s/wamqp3\./wamqp$major./g")
  cat >"$tmp/main.go" <<GO
package main

import (
	"errors"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
$imports
)

var errThrottled = errors.New("429 too many requests")

func bad(*message.Message) bool      { return false }
func callAPI(*message.Message) error { return nil }

func run(uri string, logger watermill.LoggerAdapter, router *message.Router) error {
$body
	return err
}

func main() {
	_ = run
	_, _ = os.Getenv, time.Second
}
GO
  cat >"$tmp/go.mod" <<MOD
module snippet

go 1.24.0

require (
	github.com/ThreeDotsLabs/watermill v1.5.1
	github.com/ThreeDotsLabs/watermill-amqp/v$major ${version[$major]}
	github.com/amqpretry/amqpretry v0.0.0-00010101000000-000000000000
)

replace github.com/amqpretry/amqpretry => $root
MOD
  (
    cd "$tmp"
    GOFLAGS=-mod=mod go mod tidy >/dev/null 2>"$tmp/tidy.err" || { cat "$tmp/tidy.err" >&2; exit 1; }
    go vet . || { echo "majors: the README snippet does not build on watermill-amqp v$major:" >&2; cat main.go >&2; exit 1; }
    leaked=$(go list -deps . | grep -c "watermill-amqp/v$other/" || true)
    if [ "$leaked" != 0 ]; then
      echo "majors: a watermill-amqp v$major program compiles $leaked packages of v$other:" >&2
      go list -deps . | grep "watermill-amqp/v$other/" >&2
      exit 1
    fi
    echo "watermill-amqp v$major: the README snippet builds; no watermill-amqp/v$other package among its $(go list -deps . | wc -l) dependencies"
  )
  rm -rf "$tmp"
  trap - EXIT
done
