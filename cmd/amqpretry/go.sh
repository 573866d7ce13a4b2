#!/usr/bin/env bash
# Runs the go command in this module against the library of this checkout.
#
# go.mod requires the library at a version and has no replace directive, because
# `go install github.com/amqpretry/amqpretry/cmd/amqpretry@<version>` refuses a module
# that has one. To build and test against the working tree instead, this script makes
# a throwaway workspace (GOWORK=<tmp>/go.work: `use` of the library and of this
# directory, and a replace of the required version by the library's directory, which
# a go.work may list) and runs go in it; nothing is written into the checkout.
#
#   cmd/amqpretry/go.sh vet ./...
#   cmd/amqpretry/go.sh test -race -count=1 ./...
#   cmd/amqpretry/go.sh build -o /tmp/amqpretry .
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
want=$(sed -n 's/^go //p' "$here/go.mod")
cat >"$tmp/go.work" <<WORK
go $want

use (
	$root
	$here
)

// Also for the version go.mod requires: go would otherwise read that version's go.mod.
replace github.com/amqpretry/amqpretry v0.0.0-00010101000000-000000000000 => $root
WORK
cd "$here"
GOWORK="$tmp/go.work" go "$@"
