#!/usr/bin/env bash
# Watermill's own pub/sub test suite for watermill-amqp, with and without amqpretry
# (issue 17, point 4). For each major (v2, v3) it runs the module's own pkg/amqp tests
# twice, under -race, on the broker at AMQP_URI:
#   as shipped   go test on the dependency package itself, from the module cache;
#   with retry   the same test files, except that every subscriber the suite builds
#                (amqp.NewSubscriber, amqp.NewSubscriberWithConnection in
#                pubsub_test.go) is built from wamqp2/wamqp3
#                New(...).SubscriberConfig(): pubsub_test.go is patched with sed at run
#                time and given, with `go test -overlay`, instead of the original,
#                beside our wrapper
#                internal/testsupport/watermillsuite/overlay/v<major>_test.go. The
#                overlay cannot touch the module cache, so this run tests a copy of the
#                module (made here, checked identical) that a temporary -modfile
#                replaces it with.
# and fails unless both runs passed the same tests, skipped the same tests and failed
# none. Every Retry of a run shares one prefix and one 1s tier; at the end the script
# deletes that prefix's queues and exchanges and the queues and exchanges the suite
# left (new since the start and named as the suite names them), then checks that none
# is left.
#
#   scripts/watermill-suite.sh [--short|--full] [2] [3]
#
# Short (the default, for CI) is `go test -short`, the suite's own knob, in all four
# runs alike: fewer messages and subscribers in the same tests (the same 209 test
# results per major: 195 pass, 14 skip); about 4 minutes in all on a 2-CPU machine.
# --full, the suite's full message counts, takes about 32 minutes (each of the four
# runs 7 to 9 minutes under -race).
#
# Environment:
#   AMQP_URI                 broker (default amqp://guest:guest@127.0.0.1:5672/); the
#                            suite gets it as WATERMILL_TEST_AMQP_URI
#   AMQPRETRY_RABBITMQCTL    rabbitmqctl command for that broker (default rabbitmqctl;
#                            for the 4.3 node: "$PWD/scripts/rabbitmq4.sh 4.3 ctl")
#   WATERMILL_SUITE_FULL=1   the full run (as --full)
#   AMQPRETRY_SUITE_SRC      the amqpretry source tree to test (default: this checkout)
#   WATERMILL_SUITE_KEEP=1   keep the temporary directory (go test -json outputs)
#
# The Go side (test dependencies pinned at the versions watermill-amqp's go.mod and
# watermill's name, the comparison, the deletion) is the module
# internal/testsupport/watermillsuite, a module of its own so that the root go.mod gains
# nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
suite=$root/internal/testsupport/watermillsuite
export AMQP_URI="${AMQP_URI:-amqp://guest:guest@127.0.0.1:5672/}"
src="${AMQPRETRY_SUITE_SRC:-$root}"
src=$(cd "$src" && pwd)
short=1
if [ "${WATERMILL_SUITE_FULL:-}" = 1 ]; then short=""; fi
majors=()
for arg in "$@"; do
  case "$arg" in
    --short) short=1 ;;
    --full) short="" ;;
    2 | 3) majors+=("$arg") ;;
    *) echo "usage: $0 [--short|--full] [2] [3]" >&2; exit 2 ;;
  esac
done
if [ "${#majors[@]}" = 0 ]; then majors=(3 2); fi
mode=full
shortflag=()
if [ "$short" = 1 ]; then mode=short; shortflag=(-short); fi
read -r -a ctl <<<"${AMQPRETRY_RABBITMQCTL:-rabbitmqctl}"

# The vhost of AMQP_URI, for rabbitmqctl: the path after the host, percent-decoded;
# none means "/".
vhost=${AMQP_URI#*://}
case "$vhost" in */*) vhost=${vhost#*/} ;; *) vhost="" ;; esac
vhost=${vhost%%\?*}
if [ -z "$vhost" ]; then vhost=/; else vhost=$(printf '%b' "${vhost//%/\\x}"); fi

prefix="amqpretry-wmsuite-$(date +%s)-$$"
tmp=$(mktemp -d)
t_all=$SECONDS

list() { # list queues|exchanges: names on the broker, one a line, sorted
  "${ctl[@]}" -q --no-table-headers -p "$vhost" "list_$1" name | LC_ALL=C sort -u
}
# The suite names its topics topic-<test ID> (a UUID), with suffixes, plus topicXXX.
suite_names='^(topic-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}([-_].*)?|topicXXX)$'
# ours KIND: what to delete of KIND: this run's prefix, and the suite's names that are
# new since the start.
ours() {
  list "$1" >"$tmp/$1.after"
  {
    grep -E "^$prefix\\." "$tmp/$1.after" || true
    LC_ALL=C comm -13 "$tmp/$1.before" "$tmp/$1.after" | grep -E "$suite_names" || true
  } | LC_ALL=C sort -u
}
cleanup_broker() {
  local kind n left=0
  for kind in queues exchanges; do
    ours "$kind" >"$tmp/$kind.delete"
    n=$(wc -l <"$tmp/$kind.delete")
    echo "broker: deleting $n $kind ($(grep -c -E "^$prefix\\." "$tmp/$kind.delete" || true) of prefix $prefix, the rest left by the suite)"
    sed "s/^/${kind%s} /" "$tmp/$kind.delete" | "$tmp/suite" delete
  done
  for kind in queues exchanges; do
    ours "$kind" >"$tmp/$kind.left"
    if [ -s "$tmp/$kind.left" ]; then
      echo "broker: LEFT OVER $kind:"; sed 's/^/  /' "$tmp/$kind.left"; left=1
    fi
  done
  others=$(LC_ALL=C comm -13 "$tmp/queues.before" "$tmp/queues.after" | grep -c -v -E "$suite_names|^$prefix\\." || true)
  if [ "$left" = 0 ]; then
    echo "broker: nothing of this run left (queues and exchanges compared with the start; $others new queues of others left alone)"
  fi
  return "$left"
}
finish() {
  local rc=$?
  if [ -f "$tmp/queues.before" ] && [ -x "$tmp/suite" ]; then
    cleanup_broker || rc=1
  fi
  if [ "${WATERMILL_SUITE_KEEP:-}" = 1 ]; then
    echo "kept $tmp"
  else
    chmod -R u+w "$tmp" 2>/dev/null || true
    rm -rf "$tmp"
  fi
  printf '%5d s  total (%s)\n' $((SECONDS - t_all)) "$mode"
  if [ "$rc" = 0 ]; then echo "watermill suite: same results with and without amqpretry"; else echo "watermill suite: FAILED (exit $rc)"; fi
  exit "$rc"
}
trap finish EXIT

# The module's go.mod and go.sum with amqpretry taken from $src.
cp "$suite/go.mod" "$tmp/base.mod"
cp "$suite/go.sum" "$tmp/base.sum"
(cd "$suite" && go mod edit -modfile="$tmp/base.mod" -replace="github.com/amqpretry/amqpretry=$src")
(cd "$suite" && go build -modfile="$tmp/base.mod" -o "$tmp/suite" ./cmd/suite)

echo "==> watermill-amqp suite ($mode), majors ${majors[*]}, broker $AMQP_URI (vhost $vhost), prefix $prefix, amqpretry from $src"
list queues >"$tmp/queues.before"
list exchanges >"$tmp/exchanges.before"

# record NAME: the go test -json stream on stdin to $tmp/NAME.json, without the output
# of the tests that passed (hundreds of MB of trace logging); with
# WATERMILL_SUITE_KEEP=1 also whole, to $tmp/NAME.full.json.
record() {
  if [ "${WATERMILL_SUITE_KEEP:-}" = 1 ]; then
    tee "$tmp/$1.full.json" | "$tmp/suite" record "$tmp/$1.json"
  else
    "$tmp/suite" record "$tmp/$1.json"
  fi
}

export WATERMILL_TEST_AMQP_URI=$AMQP_URI AMQPRETRY_SUITE_PREFIX=$prefix
rc=0
for major in "${majors[@]}"; do
  module=github.com/ThreeDotsLabs/watermill-amqp/v$major
  pkg=$module/pkg/amqp
  modsrc=$(cd "$suite" && go list -modfile="$tmp/base.mod" -m -f '{{.Dir}}' "$module")
  if [ -z "$modsrc" ] || [ ! -f "$modsrc/pkg/amqp/pubsub_test.go" ]; then
    (cd "$suite" && go mod download -modfile="$tmp/base.mod" "$module")
    modsrc=$(cd "$suite" && go list -modfile="$tmp/base.mod" -m -f '{{.Dir}}' "$module")
  fi

  # The copy of the module, its modfile, and the overlay.
  copy=$tmp/watermill-amqp-v$major
  cp -R "$modsrc" "$copy"
  chmod -R u+w "$copy"
  if ! diff -r "$modsrc" "$copy" >/dev/null; then
    echo "FAIL: the copy of $modsrc differs from it"; exit 1
  fi
  cp "$tmp/base.mod" "$tmp/retry$major.mod"
  cp "$tmp/base.sum" "$tmp/retry$major.sum"
  (cd "$suite" && go mod edit -modfile="$tmp/retry$major.mod" -replace="$module=$copy")
  sed -e 's/amqp\.NewSubscriber(/amqpretryNewSubscriber(/g' \
    -e 's/amqp\.NewSubscriberWithConnection(/amqpretryNewSubscriberWithConnection(/g' \
    "$copy/pkg/amqp/pubsub_test.go" >"$tmp/pubsub_test.v$major.go"
  patched=$(grep -v '^[[:space:]]*//' "$tmp/pubsub_test.v$major.go" | grep -c 'amqpretryNewSubscriber' || true)
  if [ "$patched" = 0 ] || grep -q 'amqp\.NewSubscriber' "$tmp/pubsub_test.v$major.go"; then
    echo "FAIL: could not patch the subscriber constructors of $pkg's pubsub_test.go"; exit 1
  fi
  cat >"$tmp/overlay$major.json" <<EOF
{"Replace": {
  "$copy/pkg/amqp/pubsub_test.go": "$tmp/pubsub_test.v$major.go",
  "$copy/pkg/amqp/amqpretry_subscriber_test.go": "$suite/overlay/v${major}_test.go"
}}
EOF

  gotest=(go test -race -count=1 -json -timeout 30m -tags amqpretry_watermillsuite ${shortflag[@]+"${shortflag[@]}"})
  echo "==> v$major as shipped: ${gotest[*]} $pkg"
  t0=$SECONDS
  (cd "$suite" && "${gotest[@]}" -modfile="$tmp/base.mod" "$pkg" 2>&1 | record "v$major.base") || true
  base_wall=$((SECONDS - t0))
  echo "==> v$major with amqpretry ($patched constructor calls patched): same, on the copy, with the overlay"
  t0=$SECONDS
  (cd "$suite" && "${gotest[@]}" -modfile="$tmp/retry$major.mod" -overlay="$tmp/overlay$major.json" "$pkg" 2>&1 | record "v$major.retry") || true
  retry_wall=$((SECONDS - t0))
  "$tmp/suite" compare -major "$major" -mode "$mode" \
    -base "$tmp/v$major.base.json" -retry "$tmp/v$major.retry.json" \
    -base-wall "$base_wall" -retry-wall "$retry_wall" || rc=1
done
[ "$rc" = 0 ] # the EXIT trap (finish) reports and cleans up
