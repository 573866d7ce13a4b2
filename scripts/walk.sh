#!/usr/bin/env bash
# Issue 44's walk of one failed message, measured. It runs from the closure
# engine.Middleware returns to the confirmed publish (ttl-tiers) or the settle
# (delayed-retry), and back. Hops: the distinct caller->callee pairs of the repository's
# functions, internal packages included; the compiler's wrappers (X-fm, X.deferwrapN,
# (*T).M of a method on T, type:.hash) are skipped, and a deferred X.funcN is called by
# X. Files: those of the functions on the walk. Returns: calls into a file entered before.
#
#   scripts/walk.sh [ttl-tiers|delayed-retry] [AMQP_URI]
#
# ttl-tiers (the default) runs on amqp://guest:guest@127.0.0.1:5672/, delayed-retry on
# the RabbitMQ 4.3 node of scripts/rabbitmq4.sh (its quorum work queue holds the
# retry). It builds internal/testsupport/walk/scenario (one message that fails once,
# then succeeds) without optimisations or inlining, runs it under `dlv trace` (Delve,
# the pinned version below, installed into a temporary directory), and prints what
# the walk command (internal/testsupport/walk) finds in the trace: the tree of calls,
# then hops, files and returns. WALK_TRACE=FILE keeps a copy of the trace. The
# scenario deletes the queues and exchanges it declared; with rabbitmqctl at hand
# (AMQPRETRY_RABBITMQCTL, or the 4.3 node's), the script checks that none is left.
# Not part of scripts/test.sh: the figures are for reading, not for failing a build.
set -euo pipefail
cd "$(dirname "$0")/.."
dlv_version=v1.27.2

backend=${1:-ttl-tiers}
case "$backend" in
  ttl-tiers)
    want='(*engine).fail'
    uri=${2:-amqp://guest:guest@127.0.0.1:5672/}
    ctl=${AMQPRETRY_RABBITMQCTL:-rabbitmqctl} ;;
  delayed-retry)
    want='(*engine).settle'
    uri=${2:-$(scripts/rabbitmq4.sh 4.3 uri)}
    ctl=${AMQPRETRY_RABBITMQCTL:-scripts/rabbitmq4.sh 4.3 ctl} ;;
  *)
    echo "walk: backend $backend: use ttl-tiers or delayed-retry" >&2
    exit 2 ;;
esac

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
GOBIN="$tmp" go install "github.com/go-delve/delve/cmd/dlv@$dlv_version"
go build -gcflags=all='-N -l' -o "$tmp/scenario" ./internal/testsupport/walk/scenario
# dlv trace prints the program's output on stdout and the trace on stderr.
status=0
(cd "$tmp" && ./dlv trace --exec ./scenario 'github.com/amqpretry/amqpretry[./]' -- \
  -backend "$backend" -uri "$uri" >scenario.out 2>trace.txt) || status=$?
if [ -n "${WALK_TRACE:-}" ]; then cp "$tmp/trace.txt" "$WALK_TRACE"; fi
prefix=$(sed -n 's/^scenario: done, prefix //p' "$tmp/scenario.out")
if [ "$status" != 0 ] || [ -z "$prefix" ]; then
  cat "$tmp/scenario.out" >&2
  grep -v '^>' "$tmp/trace.txt" | tail -n 20 >&2 || true
  echo "walk: the scenario did not finish (dlv exit status $status): is the broker at $uri up?" >&2
  exit 1
fi

go run ./internal/testsupport/walk -want "$want" "$tmp/trace.txt" .

# shellcheck disable=SC2086 # $ctl is a command line: split it
if left=$($ctl list_queues -q name 2>/dev/null && $ctl list_exchanges -q name 2>/dev/null); then
  left=$(printf '%s\n' "$left" | grep -F "$prefix" || true)
  if [ -n "$left" ]; then
    printf '%s\n' "$left" >&2
    echo "walk: the scenario left these behind, under $prefix: delete them" >&2
    exit 1
  fi
  echo "cleanup: nothing left under $prefix"
fi
