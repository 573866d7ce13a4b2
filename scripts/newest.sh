#!/usr/bin/env bash
# Tomorrow's dependencies (issue 43): go.mod keeps the oldest versions the library
# supports, but Go builds a program with the highest version any of its modules
# requires, so users get the newest amqp091-go and watermill-amqp as soon as anything
# else needs them. This builds, vets and tests the library, its sibling modules and
# the examples against exact newer versions, in a copy of the checkout (go.mod is not
# touched):
#
#   scripts/newest.sh MODULE@VERSION...     e.g. github.com/rabbitmq/amqp091-go@v1.16.0
#
# In the copy, each module requires the given versions (`go get`, then `go mod tidy`;
# a module that does not use one drops it again), which `go list -m` must then show;
# every module builds and vets; and the tests of NEWEST_TESTS (default: the marshaler's,
# the suite of each watermill-amqp major, the middleware's broker tests) run with the
# race detector against the broker at AMQP_URI, the one that makes watermill-amqp
# reconnect without it. scripts/test.sh gives the pins (one line,
# bumped like any other pin).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" = 0 ]; then echo "usage: scripts/newest.sh MODULE@VERSION..." >&2; exit 2; fi
pins=("$@")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The working tree (committed or not), without what git ignores.
git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  if [ -f "$f" ]; then printf '%s\0' "$f"; fi
done | xargs -0 cp --parents -t "$tmp"
cd "$tmp"
# The command module requires the library at a version without a replace (its
# go.work builds it from a checkout); here it gets the replace the other modules
# have, and no go.work, so that go get and go mod tidy edit its go.mod alone.
rm -f cmd/amqpretry/go.work
(cd cmd/amqpretry && go mod edit -replace github.com/amqpretry/amqpretry=../..)

modules=(. metrics cmd/amqpretry amqp1 _examples/quickstart amqp1/examples/quickstart)
for m in "${modules[@]}"; do
  (
    cd "$m"
    go get "${pins[@]}" >/dev/null 2>"$tmp/get.err" || { cat "$tmp/get.err" >&2; exit 1; }
    go mod tidy 2>"$tmp/tidy.err" || { cat "$tmp/tidy.err" >&2; exit 1; }
    have=()
    for p in "${pins[@]}"; do
      mod=${p%@*} want=${p#*@}
      got=$(go list -m -f '{{.Version}}' "$mod" 2>/dev/null || true)
      if [ -z "$got" ]; then continue; fi # not among this module's dependencies
      if [ "$got" != "$want" ]; then
        echo "FAIL: $m builds with $mod $got, not the pinned $want" >&2
        exit 1
      fi
      have+=("${mod#github.com/}@$got")
    done
    go build ./...
    go vet ./...
    echo "$m: builds and vets with ${have[*]:-none of the pins}"
  )
done

# The tests that read deliveries and headers with amqp091-go and watermill-amqp: the
# marshaler's (in process), then, on the broker at AMQP_URI, the suite of each
# watermill-amqp major (internal/testsupport/gluetest) and the middleware's broker tests.
go test -race -count=1 ./xdeath ./internal/marshal
tests=${NEWEST_TESTS:-'^(TestSuite|TestVerifyModeNamesWhatIsMissing|TestStartWarnsAboutTheDeliveryLimit)$'}
go test -race -count=1 -timeout 15m -p 1 -run "$tests" ./wamqp3 ./wamqp2 ./middleware
# A delivery amqp091-go v1.16.0 cannot read makes watermill-amqp reconnect, which races
# with itself (internal/testsupport/gluetest/race.go): that test skips itself under
# -race, and runs here without it.
go test -count=1 -timeout 5m -run '^TestSuite$/^UnreadableHeadersEndInThePoisonQueue$' -v ./wamqp3 ./wamqp2
