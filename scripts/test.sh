#!/usr/bin/env bash
# The whole test suite, the one command the README gives and CI runs:
#   formatting and vet; every package's tests with the race detector against a real
#   RabbitMQ (AMQP_URI, default amqp://guest:guest@127.0.0.1:5672/), the fuzz corpus;
#   the quickstart in both of its modes; then the packages whose tests talk to the
#   broker again on RabbitMQ 4.x (scripts/rabbitmq4.sh); the no-loss test on both.
# Where no broker answers at AMQP_URI it starts one: a local rabbitmq-server if installed,
# else `docker compose up`. Under CI=true a broker that cannot be had fails the run;
# elsewhere the integration tests skip, saying why.
#
# Opt-ins (CI=true turns all of them on):
#   AMQPRETRY_BROKER_RESTART=1  run the tests that restart the broker or cut its
#                               connections (rabbitmqctl, see AMQPRETRY_RABBITMQCTL);
#                               never done to a broker unless asked
#   RABBITMQ4=1                 also run on RabbitMQ 4.x: a node of its own on
#                               127.0.0.1:5674 in a chroot (root; ~90 s the first time)
#   AMQPRETRY_NOLOSS=1          run the no-loss test (internal/noloss; minutes, needs
#                               AMQPRETRY_BROKER_RESTART=1) on each broker
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
export AMQP_URI="${AMQP_URI:-amqp://guest:guest@127.0.0.1:5672/}"
CI="${CI:-}"
rabbitmq4="$root/scripts/rabbitmq4.sh"
uri4=$("$rabbitmq4" uri)

# Step timings, printed at the end whether the run passes or not.
t_all=$SECONDS
cur="" cur_t0=0
timings=()
end_step() {
  if [ -n "$cur" ]; then timings+=("$(printf '%5d s  %s%s' $((SECONDS - cur_t0)) "$cur" "${1:-}")"); fi
  cur=""
}
step() {
  end_step
  cur="$*" cur_t0=$SECONDS
  printf '\n==> %s\n' "$*"
}
summary() {
  local rc=$?
  if [ "$rc" != 0 ]; then end_step "  (FAILED)"; else end_step; fi
  printf '\n==> step timings\n'
  if [ "${#timings[@]}" -gt 0 ]; then printf '%s\n' "${timings[@]}"; fi
  printf '%5d s  total\n' $((SECONDS - t_all))
  if [ "$rc" = 0 ]; then echo "all checks passed"; else echo "FAILED (exit $rc)"; fi
}
trap summary EXIT

# The opt-ins. Under CI=true all of them; elsewhere only what the caller set.
if [ "$CI" = "true" ]; then
  export AMQPRETRY_BROKER_RESTART="${AMQPRETRY_BROKER_RESTART:-1}"
  RABBITMQ4=1
  NOLOSS=1
else
  RABBITMQ4="${RABBITMQ4:-}"
  NOLOSS="${AMQPRETRY_NOLOSS:-}"
fi
# The no-loss test runs in steps of its own, never inside the race-detector runs.
unset AMQPRETRY_NOLOSS
# AMQP_URI naming the 4.x node: restart tests must use its rabbitmqctl, not the machine's.
if [ "$AMQP_URI" = "$uri4" ] && [ -z "${AMQPRETRY_RABBITMQCTL:-}" ]; then
  export AMQPRETRY_RABBITMQCTL="$rabbitmq4 ctl"
fi

notes=()
if [ "${AMQPRETRY_BROKER_RESTART:-}" != 1 ]; then
  notes+=("SKIPPED: the restart and fault-injection tests (they stop the broker's application and close its connections with rabbitmqctl). Opt in with AMQPRETRY_BROKER_RESTART=1 ./scripts/test.sh, on a broker no one else is using; CI=true does.")
fi
if [ "$RABBITMQ4" != 1 ]; then
  notes+=("SKIPPED: the RabbitMQ 4.x run. Opt in with RABBITMQ4=1 ./scripts/test.sh (root; starts a node of its own on 127.0.0.1:5674 with scripts/rabbitmq4.sh, ~90 s the first time); CI=true does.")
fi
if [ -d internal/noloss ] && [ "$NOLOSS" != 1 ]; then
  notes+=("SKIPPED: the no-loss test (internal/noloss). Opt in with AMQPRETRY_NOLOSS=1 AMQPRETRY_BROKER_RESTART=1 ./scripts/test.sh; CI=true does.")
fi
print_notes() { if [ "${#notes[@]}" -gt 0 ]; then printf '%s\n' "${notes[@]}"; fi; }
print_notes

step "gofmt"
unformatted=$(gofmt -l . | grep -v '^benchmarks/' || true)
if [ -n "$unformatted" ]; then
  echo "gofmt would change:"; echo "$unformatted"; exit 1
fi

step "go vet"
go vet ./... ./_examples/quickstart
(cd metrics && go vet ./...)

step "staticcheck"
# Pinned: the module proxy serves exact versions. staticcheck.conf says what is off.
go run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...
(cd metrics && go run honnef.co/go/tools/cmd/staticcheck@v0.8.2 ./...)

step "shell scripts parse"
for f in scripts/*.sh .ci/run; do bash -n "$f"; done
if command -v shellcheck >/dev/null 2>&1; then shellcheck scripts/*.sh .ci/run; fi

step "broker at AMQP_URI ($AMQP_URI)"
broker=ok
if ! go run ./internal/cmd/waitbroker -timeout 2s 2>/dev/null; then
  broker=missing
  if [ "$AMQP_URI" = "$uri4" ]; then
    "$rabbitmq4" start >/dev/null || true
  else
    if [ "$CI" = "true" ] && ! command -v rabbitmq-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "installing rabbitmq-server from the distribution's packages"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rabbitmq-server >/dev/null
    fi
    if command -v rabbitmq-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "starting the local rabbitmq-server"
      rabbitmq-server -detached || true
    elif command -v docker >/dev/null 2>&1 && docker compose version >/dev/null 2>&1; then
      echo "starting RabbitMQ with docker compose"
      docker compose up -d --wait || true
    fi
  fi
  if go run ./internal/cmd/waitbroker -timeout 90s; then broker=ok; fi
fi
if [ "$broker" != ok ]; then
  if [ "$CI" = "true" ]; then
    echo "FAIL: no RabbitMQ at AMQP_URI and none could be started; under CI=true that is a failure"; exit 1
  fi
  echo "WARNING: no RabbitMQ; integration tests will skip"
fi

# Packages run one at a time (-p 1): the restart tests must have the broker to
# themselves.
step "go test -race (all packages, fuzz corpus included) on the broker at AMQP_URI"
go test -race -count=1 -p 1 -timeout 30m ./...

step "metrics module: go test -race (a module of its own, on the broker at AMQP_URI)"
(cd metrics && go test -race -count=1 ./...)

step "quickstart, in-process (no broker)"
env -u AMQP_URI go run ./_examples/quickstart

if [ "$broker" = ok ]; then
  for backend in ttl-tiers binary-levels memory; do
    step "quickstart on RabbitMQ, DELAY_BACKEND=$backend"
    DELAY_BACKEND=$backend go run ./_examples/quickstart
  done
fi

# The no-loss test: thousands of messages through retries while the broker's
# connections are closed and its application restarted (so it needs
# AMQPRETRY_BROKER_RESTART=1; without the race detector, which would only slow it).
noloss() {
  step "no-loss test on $1"
  AMQPRETRY_NOLOSS=1 go test -count=1 -timeout 30m -run TestNoLoss -v ./internal/noloss
}
if [ "$NOLOSS" = 1 ] && [ -d internal/noloss ]; then
  noloss "the broker at AMQP_URI"
fi

if [ "$RABBITMQ4" = 1 ]; then
  step "RabbitMQ 4.x: scripts/rabbitmq4.sh start"
  if ! "$rabbitmq4" start >/dev/null; then
    echo "FAIL: could not start RabbitMQ 4.x (scripts/rabbitmq4.sh start)"; exit 1
  fi
  # Every package whose tests reach the broker (through internal/brokertest) runs
  # again; the pure-logic ones ran once above.
  pkgs=$(go list -test -f '{{if .ForTest}}{{.ForTest}}{{range .Deps}} {{.}}{{end}}{{end}}' ./... |
    awk '$1 == "github.com/amqpretry/amqpretry/internal/brokertest" { print $1; next }
         { for (i = 2; i <= NF; i++) if ($i == "github.com/amqpretry/amqpretry/internal/brokertest") { print $1; break } }' | sort -u)
  if [ -z "$pkgs" ]; then pkgs=./...; fi
  step "go test -race on RabbitMQ 4.x ($uri4): $(echo "$pkgs" | sed 's|github.com/amqpretry/amqpretry|.|' | tr '\n' ' ')"
  # shellcheck disable=SC2086 # one word per package
  AMQP_URI=$uri4 AMQPRETRY_RABBITMQCTL="$rabbitmq4 ctl" go test -race -count=1 -p 1 -timeout 30m $pkgs
  for backend in ttl-tiers binary-levels; do
    step "quickstart on RabbitMQ 4.x, DELAY_BACKEND=$backend"
    AMQP_URI=$uri4 DELAY_BACKEND=$backend go run ./_examples/quickstart
  done
  if [ "$NOLOSS" = 1 ] && [ -d internal/noloss ]; then
    AMQP_URI=$uri4 AMQPRETRY_RABBITMQCTL="$rabbitmq4 ctl" noloss "RabbitMQ 4.x"
  fi
fi

step "benchmarks module builds"
(cd benchmarks 2>/dev/null && go vet ./...) || [ ! -d benchmarks ]
end_step
echo
print_notes
