#!/usr/bin/env bash
# The whole test suite, the one command the README gives and CI runs:
#   formatting and vet, every package's tests with the race detector against a real
#   RabbitMQ (AMQP_URI, default amqp://guest:guest@127.0.0.1:5672/), the fuzz corpus,
#   and the quickstart in both of its modes.
# Where no broker answers it starts one: a local rabbitmq-server if installed, else
# `docker compose up`. Under CI=true a broker that cannot be had fails the run;
# elsewhere the integration tests skip, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
export AMQP_URI="${AMQP_URI:-amqp://guest:guest@127.0.0.1:5672/}"
CI="${CI:-}"

step() { printf '\n==> %s\n' "$*"; }

step "gofmt"
unformatted=$(gofmt -l . | grep -v '^benchmarks/' || true)
if [ -n "$unformatted" ]; then
  echo "gofmt would change:"; echo "$unformatted"; exit 1
fi

step "go vet"
go vet ./... ./_examples/quickstart

step "broker at AMQP_URI"
broker=ok
if ! go run ./internal/cmd/waitbroker -timeout 2s 2>/dev/null; then
  broker=missing
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
  if go run ./internal/cmd/waitbroker -timeout 90s; then broker=ok; fi
fi
if [ "$broker" != ok ]; then
  if [ "$CI" = "true" ]; then
    echo "FAIL: no RabbitMQ at AMQP_URI and none could be started; under CI=true that is a failure"; exit 1
  fi
  echo "WARNING: no RabbitMQ; integration tests will skip"
fi

# The broker-restart test needs rabbitmqctl for the broker at AMQP_URI, and no other
# package's tests running meanwhile: packages run one at a time (-p 1).
if [ "$broker" = ok ] && command -v rabbitmqctl >/dev/null 2>&1 && rabbitmqctl -q status >/dev/null 2>&1; then
  export AMQPRETRY_BROKER_RESTART="${AMQPRETRY_BROKER_RESTART:-1}"
fi

step "go test -race (all packages, fuzz corpus included)"
go test -race -count=1 -p 1 -timeout 30m ./...

step "quickstart, in-process (no broker)"
env -u AMQP_URI go run ./_examples/quickstart

if [ "$broker" = ok ]; then
  for backend in ttl-tiers binary-levels memory; do
    step "quickstart on RabbitMQ, DELAY_BACKEND=$backend"
    DELAY_BACKEND=$backend go run ./_examples/quickstart
  done
fi

step "benchmarks module builds"
(cd benchmarks 2>/dev/null && go vet ./...) || [ ! -d benchmarks ]
echo "all checks passed"
