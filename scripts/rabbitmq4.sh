#!/usr/bin/env bash
# A RabbitMQ 4.x node for the test suite, beside the machine's own broker and isolated
# from it: Debian trixie's rabbitmq-server (4.0.x) in a `debootstrap --variant=minbase`
# chroot kept outside the clone and reused across runs.
#
#   scripts/rabbitmq4.sh start      build the chroot if missing, start the node if it is
#                                   not running, print its AMQP URI
#   scripts/rabbitmq4.sh stop       stop the node and its epmd, unmount the chroot's /proc
#   scripts/rabbitmq4.sh ctl ARGS   rabbitmqctl ARGS against this node only
#   scripts/rabbitmq4.sh uri        print the AMQP URI (whether or not the node runs)
#
# Isolation from the machine's broker (rabbit@localhost on 5672, dist 25672, epmd 4369):
# node amqpretry4@localhost; AMQP on 127.0.0.1:5674 only; distribution on
# 127.0.0.1:25674; its own epmd on 127.0.0.1:4374 (ERL_EPMD_PORT); its own Erlang cookie,
# readable only inside the chroot; no plugins (an empty enabled_plugins), so nothing else
# listens. `ctl` runs the chroot's rabbitmqctl with the node name and epmd port given
# explicitly, so it cannot reach the machine's node. Package scripts in the chroot start
# nothing (policy-rc.d exits 101), and the chroot's rabbitmq user gets a uid/gid unused
# on the machine.
#
# Needs root, debootstrap (installed with apt-get when missing) and the Debian mirror
# the machine's apt sources name. About 90 s the first time (debootstrap and install,
# ~330 MB), 5 s to start afterwards.
#
# Environment:
#   AMQPRETRY_RABBITMQ4_ROOT    the chroot (default /var/lib/amqpretry/rabbitmq4)
#   AMQPRETRY_RABBITMQ4_MIRROR  the Debian mirror (default: the machine's apt sources')
#   AMQPRETRY_RABBITMQ4_UID     uid and gid of the chroot's rabbitmq user (default 64674)
set -euo pipefail

ROOT="${AMQPRETRY_RABBITMQ4_ROOT:-/var/lib/amqpretry/rabbitmq4}"
ROOT=$(realpath -m "$ROOT") # as /proc/PID/root shows it
SUITE=trixie
NODE=amqpretry4@localhost
AMQP_PORT=5674
DIST_PORT=25674
EPMD_PORT=4374
CTL_DIST_MIN=35690 # rabbitmqctl's own transient listener, clear of the machine's 35672-35682
CTL_DIST_MAX=35699
RMQ_ID="${AMQPRETRY_RABBITMQ4_UID:-64674}"
URI="amqp://guest:guest@127.0.0.1:${AMQP_PORT}/"
READY=.amqpretry-ready # written last: a chroot without it is unfinished and rebuilt

log() { printf 'rabbitmq4: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

# The environment every command in the chroot runs with: nothing from the caller's,
# so neither its RABBITMQ_* nor its ERL_* variables can point the chroot's tools at
# another node.
chroot_env=(
  env -i
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  HOME=/var/lib/rabbitmq
  LANG=C.UTF-8
  LC_ALL=C.UTF-8
  ERL_EPMD_PORT="$EPMD_PORT"
  ERL_EPMD_ADDRESS=127.0.0.1
  RABBITMQ_NODENAME="$NODE"
  RABBITMQ_USE_LONGNAME=false
  RABBITMQ_CTL_DIST_PORT_MIN="$CTL_DIST_MIN"
  RABBITMQ_CTL_DIST_PORT_MAX="$CTL_DIST_MAX"
)

in_root() { chroot "$1" "${chroot_env[@]}" "${@:2}"; }

# As the chroot's rabbitmq user, by the ids in the chroot's own passwd file.
as_rabbitmq() {
  local ids
  ids=$(awk -F: '$1 == "rabbitmq" { print $3 ":" $4 }' "$ROOT/etc/passwd")
  [ -n "$ids" ] || die "no rabbitmq user in $ROOT/etc/passwd"
  chroot --userspec="$ids" --groups="${ids#*:}" "$ROOT" "${chroot_env[@]}" "$@"
}

need_root() { [ "$(id -u)" = 0 ] || die "needs root (chroot, mount)"; }

# The mirror of the machine's own apt sources for its Debian release.
mirror() {
  if [ -n "${AMQPRETRY_RABBITMQ4_MIRROR:-}" ]; then
    echo "$AMQPRETRY_RABBITMQ4_MIRROR"; return
  fi
  local codename m=""
  # shellcheck disable=SC1091
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    if [ ! -r "$f" ] || [ -n "$m" ]; then continue; fi
    m=$(awk -v c="$codename" '
      function flush() {
        if (!done && uri != "" && enabled !~ /^no/ && (" " types " ") ~ / deb / && (" " suites " ") ~ (" " c " ")) { print uri; done = 1 }
        types = suites = uri = enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      { key = tolower($1); val = $0; sub(/^[^:]*:[ \t]*/, "", val) }
      key == "types:" { types = val }
      key == "uris:" { uri = $2 }
      key == "suites:" { suites = val }
      key == "enabled:" { enabled = tolower(val) }
      END { flush() }' "$f" | head -n1)
  done
  if [ -z "$m" ] && [ -r /etc/apt/sources.list ]; then
    m=$(awk -v c="$codename" '$1 == "deb" {
          i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
          if ($(i + 1) == c) { print $i; exit } }' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

# Mounts below dir, deepest first.
mounts_under() { awk -v d="$1" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/self/mounts | sort -r; }

unmount_all() {
  local m
  for m in $(mounts_under "$1"); do umount "$m" 2>/dev/null || umount -l "$m"; done
}

mount_proc() {
  local r=$1
  mountpoint -q "$r/proc" || mount -t proc proc "$r/proc"
  # debootstrap leaves device nodes in the chroot's /dev; bind the machine's only if
  # they are missing.
  if [ ! -c "$r/dev/null" ] || [ ! -c "$r/dev/urandom" ]; then
    mountpoint -q "$r/dev" || mount --bind /dev "$r/dev"
  fi
}

# The ids of processes whose root is the chroot: the node, its epmd and helpers.
chroot_pids() {
  local p root
  for p in /proc/[0-9]*; do
    root=$(readlink "$p/root" 2>/dev/null) || continue
    if [ "$root" = "$ROOT" ]; then echo "${p#/proc/}"; fi
  done
}

build() {
  need_root
  local tmp="$ROOT.partial" m t0=$SECONDS
  if [ -e "$ROOT" ]; then
    die "$ROOT exists but is not a finished chroot (no $READY); remove it (rm -rf --one-file-system $ROOT) or set AMQPRETRY_RABBITMQ4_ROOT"
  fi
  if [ -e "$tmp" ]; then
    log "removing an unfinished chroot at $tmp"
    unmount_all "$tmp"
    rm -rf --one-file-system "$tmp"
  fi
  if getent passwd "$RMQ_ID" >/dev/null || getent group "$RMQ_ID" >/dev/null; then
    die "uid/gid $RMQ_ID is taken on this machine; set AMQPRETRY_RABBITMQ4_UID to a free one"
  fi
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  m=$(mirror)
  mkdir -p "$(dirname "$ROOT")"
  log "debootstrap --variant=minbase $SUITE $tmp $m (about a minute)"
  debootstrap --variant=minbase "$SUITE" "$tmp" "$m" >"$(dirname "$ROOT")/debootstrap.log" 2>&1 \
    || { tail -n 30 "$(dirname "$ROOT")/debootstrap.log" >&2; die "debootstrap failed; log: $(dirname "$ROOT")/debootstrap.log"; }
  log "debootstrap took $((SECONDS - t0)) s"

  t0=$SECONDS
  printf '#!/bin/sh\n# amqpretry: package scripts start no services in this chroot\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$tmp/etc/hosts"
  echo amqpretry-rabbitmq4 >"$tmp/etc/hostname"
  # The package's own adduser call finds this user and keeps its ids (uid 101, what it
  # would pick, is postgres on these machines).
  in_root "$tmp" groupadd --system --gid "$RMQ_ID" rabbitmq
  in_root "$tmp" useradd --system --uid "$RMQ_ID" --gid rabbitmq --home-dir /var/lib/rabbitmq \
    --no-create-home --shell /usr/sbin/nologin --comment "RabbitMQ messaging server" rabbitmq
  mount_proc "$tmp"
  log "installing rabbitmq-server in the chroot"
  in_root "$tmp" DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends rabbitmq-server \
    >"$(dirname "$ROOT")/install.log" 2>&1 \
    || { tail -n 30 "$(dirname "$ROOT")/install.log" >&2; unmount_all "$tmp"; die "installing rabbitmq-server failed; log: $(dirname "$ROOT")/install.log"; }
  in_root "$tmp" apt-get clean
  # Whatever the package scripts may have started despite policy-rc.d.
  local p
  for p in $(ROOT=$tmp chroot_pids); do kill "$p" 2>/dev/null || true; done

  mkdir -p "$tmp/etc/rabbitmq"
  cat >"$tmp/etc/rabbitmq/rabbitmq-env.conf" <<EOF
# amqpretry: a node of its own beside the machine's broker (see scripts/rabbitmq4.sh)
NODENAME=$NODE
USE_LONGNAME=false
NODE_IP_ADDRESS=127.0.0.1
NODE_PORT=$AMQP_PORT
DIST_PORT=$DIST_PORT
CTL_DIST_PORT_MIN=$CTL_DIST_MIN
CTL_DIST_PORT_MAX=$CTL_DIST_MAX
export ERL_EPMD_PORT=$EPMD_PORT
export ERL_EPMD_ADDRESS=127.0.0.1
export ERL_FLAGS="-kernel inet_dist_use_interface {127,0,0,1}"
# No busy-waiting schedulers: the machine's broker shares these cores.
SERVER_ADDITIONAL_ERL_ARGS="+sbwt none +sbwtdcpu none +sbwtdio none"
EOF
  cat >"$tmp/etc/rabbitmq/rabbitmq.conf" <<EOF
# amqpretry: AMQP on loopback only. guest/guest works from 127.0.0.1 (loopback_users).
listeners.tcp.1 = 127.0.0.1:$AMQP_PORT
EOF
  echo '[].' >"$tmp/etc/rabbitmq/enabled_plugins"
  od -An -tx1 -N16 /dev/urandom | tr -d ' \n' | tr a-f A-F >"$tmp/var/lib/rabbitmq/.erlang.cookie"
  chmod 400 "$tmp/var/lib/rabbitmq/.erlang.cookie"
  in_root "$tmp" chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq /etc/rabbitmq
  unmount_all "$tmp"
  local version
  # shellcheck disable=SC2016 # dpkg-query's format, not the shell's
  version=$(in_root "$tmp" dpkg-query -W -f '${Version}' rabbitmq-server)
  echo "$version" >"$tmp/$READY"
  mv "$tmp" "$ROOT"
  log "rabbitmq-server $version installed in $((SECONDS - t0)) s at $ROOT"
}

# rabbitmqctl against this node: inside the chroot (its cookie), with the node name and
# epmd port given explicitly, as the chroot's rabbitmq user.
ctl() {
  [ -f "$ROOT/$READY" ] || die "no RabbitMQ 4.x chroot at $ROOT; run: $0 start"
  local a
  for a in "$@"; do
    case "$a" in
      -n | -n* | --node | --node=* | -l | --longnames | --erlang-cookie | --erlang-cookie=*)
        die "ctl talks to $NODE only; $a is not accepted" ;;
    esac
  done
  need_root
  # start mounts /proc and stop unmounts it: without it the node cannot be running.
  mountpoint -q "$ROOT/proc" || die "$NODE is not running (start it with: $0 start)"
  as_rabbitmq sh -c 'cd /var/lib/rabbitmq && exec /usr/lib/rabbitmq/bin/rabbitmqctl "$@"' rabbitmqctl -n "$NODE" "$@" 9>&-
}

running() { ctl -q ping >/dev/null 2>&1; }

# One start or stop at a time (two test runs may start the node together). The node
# must not inherit the lock's descriptor: it would hold the lock for its lifetime.
lock() {
  mkdir -p "$(dirname "$ROOT")"
  exec 9>"$ROOT.lock"
  flock -w 600 9 || die "another start or stop holds $ROOT.lock"
}

start() {
  need_root
  lock
  [ -f "$ROOT/$READY" ] || build
  mount_proc "$ROOT"
  if running; then
    log "$NODE already running"
    echo "$URI"; return
  fi
  local t0=$SECONDS
  log "starting $NODE ($(cat "$ROOT/$READY")) on 127.0.0.1:$AMQP_PORT"
  as_rabbitmq sh -c 'cd /var/lib/rabbitmq && exec /usr/lib/rabbitmq/bin/rabbitmq-server -detached' \
    >/dev/null 2>&1 </dev/null 9>&-
  local i
  for i in $(seq 120); do
    if running; then break; fi
    if [ "$i" = 120 ]; then
      tail -n 40 "$ROOT/var/log/rabbitmq/$NODE.log" >&2 2>/dev/null || true
      if [ -z "$(chroot_pids)" ]; then unmount_all "$ROOT"; fi
      die "$NODE did not answer within 60 s (is another copy of it running, or are ports $AMQP_PORT, $DIST_PORT, $EPMD_PORT taken?); logs in $ROOT/var/log/rabbitmq"
    fi
    sleep 0.5
  done
  ctl -q await_startup --timeout 60 >/dev/null
  log "$NODE started in $((SECONDS - t0)) s"
  echo "$URI"
}

stop() {
  need_root
  lock
  if [ ! -d "$ROOT" ]; then log "no chroot at $ROOT"; return; fi
  if [ -f "$ROOT/$READY" ] && running; then
    log "stopping $NODE"
    ctl -q stop >/dev/null || true
  fi
  # Its epmd, found on its own port inside the chroot, never the machine's.
  if [ -f "$ROOT/$READY" ] && [ -n "$(chroot_pids)" ]; then
    as_rabbitmq epmd -kill >/dev/null 2>&1 || true
  fi
  local i p
  for i in $(seq 40); do
    [ -z "$(chroot_pids)" ] && break
    if [ "$i" = 20 ]; then for p in $(chroot_pids); do kill "$p" 2>/dev/null || true; done; fi
    if [ "$i" = 40 ]; then for p in $(chroot_pids); do kill -9 "$p" 2>/dev/null || true; done; fi
    sleep 0.5
  done
  unmount_all "$ROOT"
  log "stopped; the chroot stays at $ROOT (remove it with: rm -rf --one-file-system $ROOT)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  ctl) shift; ctl "$@" ;;
  uri) echo "$URI" ;;
  *) echo "usage: $0 start|stop|ctl ARGS...|uri" >&2; exit 2 ;;
esac
