#!/usr/bin/env bash
# Each example builds on the public API alone, in a module of its own: copied into a
# fresh module outside the repository (a module path of its own, so that an import of
# an internal package of the library fails to build), with the example's requirements
# and a replace of the library's modules by this checkout, it must build and vet.
#
#   scripts/examples.sh            every example (_examples/*/ and amqp1/examples/*/ with a go.mod)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
examples=()
for d in _examples/*/ amqp1/examples/*/; do
  if [ -f "$d/go.mod" ]; then examples+=("${d%/}"); fi
done
if [ "${#examples[@]}" = 0 ]; then echo "no example with a go.mod"; exit 1; fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ex in "${examples[@]}"; do
  dir="$tmp/$(echo "$ex" | tr / -)"
  mkdir -p "$dir"
  cp "$ex"/*.go "$ex/go.mod" "$ex/go.sum" "$dir"/
  (
    cd "$dir"
    go mod edit -module example.com/user/"$(basename "$ex")" \
      -dropreplace github.com/amqpretry/amqpretry -dropreplace github.com/amqpretry/amqpretry/amqp1 \
      -replace github.com/amqpretry/amqpretry="$root"
    if grep -q 'github.com/amqpretry/amqpretry/amqp1 ' go.mod; then
      go mod edit -replace github.com/amqpretry/amqpretry/amqp1="$root/amqp1"
    fi
    if ! out=$(go build -o /dev/null . 2>&1) || ! vet=$(go vet . 2>&1); then
      echo "$ex does not build in a module of its own ($dir):"
      echo "${out:-}${vet:-}"
      exit 1
    fi
    echo "$ex: builds in a fresh module outside the repository"
  )
done
