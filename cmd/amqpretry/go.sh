#!/usr/bin/env bash
# Runs the go command in this module, from any directory, against the library of this
# checkout: the same as plain `go` in cmd/amqpretry, which uses go.work there (`use`
# of the library and of this module, and a replace of the library's required version
# by its directory).
#
# go.mod requires the library at a version and has no replace directive, because
# `go install github.com/amqpretry/amqpretry/cmd/amqpretry@<version>` refuses a module
# that has one; go.work is what builds it from a checkout.
#
#   cmd/amqpretry/go.sh vet ./...
#   cmd/amqpretry/go.sh test -race -count=1 ./...
#   cmd/amqpretry/go.sh build -o /tmp/amqpretry .
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here"
GOWORK="$here/go.work" go "$@"
