#!/usr/bin/env bash
# A RabbitMQ 4.x node for the test suite, beside the machine's own broker and isolated
# from it: Debian's rabbitmq-server in a `debootstrap --variant=minbase` chroot kept
# outside the clone and reused across runs. Two series, each with its own chroot and
# node (the series argument is optional and defaults to 4.0, so `scripts/rabbitmq4.sh
# start` is what it always was):
#
#   scripts/rabbitmq4.sh [4.0|4.3] start      build the chroot if missing, start the node
#                                             if it is not running, print its AMQP URI
#   scripts/rabbitmq4.sh [4.0|4.3] stop       stop the node and its epmd; unmount the
#                                             chroot's /proc unless another node of the
#                                             chroot (scripts/cluster.sh) still runs
#   scripts/rabbitmq4.sh [4.0|4.3] ctl ARGS   rabbitmqctl ARGS against this node only
#   scripts/rabbitmq4.sh [4.0|4.3] uri        print the AMQP URI (whether or not it runs)
#
#   series  packages                  chroot (env var to move it)           node                  AMQP  AMQPS  dist   epmd  uid/gid
#   4.0     trixie: 4.0.5, OTP 27     /var/lib/amqpretry/rabbitmq4          amqpretry4@localhost  5674  5676   25674  4374  64674
#           (AMQPRETRY_RABBITMQ4_ROOT, AMQPRETRY_RABBITMQ4_UID)
#   4.3     forky: 4.3.6, OTP 29      /var/lib/amqpretry/rabbitmq43         amqpretry43@localhost 5675  5677   25675  4375  64675
#           (AMQPRETRY_RABBITMQ43_ROOT, AMQPRETRY_RABBITMQ43_UID)
#
# e.g. AMQP_URI=$(scripts/rabbitmq4.sh 4.3 start)
#      AMQPRETRY_RABBITMQCTL="$PWD/scripts/rabbitmq4.sh 4.3 ctl"
#
# Isolation from the machine's broker (rabbit@localhost on 5672, dist 25672, epmd 4369)
# and from each other: AMQP and distribution on 127.0.0.1 only, on the ports above; each
# node its own epmd on 127.0.0.1 (ERL_EPMD_PORT) and its own Erlang cookie, readable only
# inside its chroot; AMQPS on the port above with scripts/tls.sh's certificates; one
# plugin (rabbitmq_auth_mechanism_ssl: SASL EXTERNAL), so nothing else listens.
# `ctl` runs the chroot's rabbitmqctl with the node name and epmd port given explicitly,
# so it cannot reach another node. Package scripts in the chroot start nothing
# (policy-rc.d exits 101), and the chroot's rabbitmq user gets a uid/gid unused on the
# machine (the build refuses one that is taken). The 4.3 chroot is shared with the
# three nodes of scripts/cluster.sh, which use their own files, ports, epmd and cookie.
#
# Needs root, debootstrap (installed with apt-get when missing) and the Debian mirror
# the machine's apt sources name (AMQPRETRY_RABBITMQ4_MIRROR overrides it, for both
# series). The first start builds the chroot: ~330 MB, one to three minutes (debootstrap
# and install); later starts take a few seconds. The shared chroot code is in
# scripts/lib/rabbitmq-chroot.sh.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

LOG_TAG=rabbitmq4
# shellcheck source=lib/rabbitmq-chroot.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/rabbitmq-chroot.sh"

series=4.0
case "${1:-}" in 4.0 | 4.3) series=$1; shift ;; esac
select_series "$series"
case "$series" in
  4.0)
    NODE=amqpretry4@localhost
    AMQP_PORT=5674
    TLS_PORT=5676
    DIST_PORT=25674
    EPMD_PORT=4374
    CTL_DIST_MIN=35690 # rabbitmqctl's own transient listener, clear of the machine's 35672-35682
    CTL_DIST_MAX=35699
    ;;
  4.3)
    LOG_TAG=rabbitmq43
    NODE=amqpretry43@localhost
    AMQP_PORT=5675
    TLS_PORT=5677
    DIST_PORT=25675
    EPMD_PORT=4375
    CTL_DIST_MIN=35700
    CTL_DIST_MAX=35709
    ;;
esac
URI="amqp://guest:guest@127.0.0.1:${AMQP_PORT}/"

# The environment every command in the chroot runs with: nothing from the caller's,
# so neither its RABBITMQ_* nor its ERL_* variables can point the chroot's tools at
# another node.
node_env=(
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

# rabbitmqctl against this node: inside the chroot (its cookie), with the node name and
# epmd port given explicitly, as the chroot's rabbitmq user.
ctl() {
  [ -f "$ROOT/$READY" ] || die "no RabbitMQ $SERIES chroot at $ROOT; run: $0 $SERIES start"
  local a
  for a in "$@"; do
    case "$a" in
      -n | -n* | --node | --node=* | -l | --longnames | --erlang-cookie | --erlang-cookie=*)
        die "ctl talks to $NODE only; $a is not accepted" ;;
    esac
  done
  need_root
  # start mounts /proc and stop unmounts it: without it the node cannot be running.
  mountpoint -q "$ROOT/proc" || die "$NODE is not running (start it with: $0 $SERIES start)"
  as_rabbitmq sh -c 'cd /var/lib/rabbitmq && exec /usr/lib/rabbitmq/bin/rabbitmqctl "$@"' rabbitmqctl -n "$NODE" "$@" 9>&-
}

running() { ctl -q ping >/dev/null 2>&1; }

start() {
  need_root
  lock
  [ -f "$ROOT/$READY" ] || build
  # The node's files, in the places the package's tools look by default.
  write_node_config /etc/rabbitmq
  ensure_cookie /var/lib/rabbitmq/.erlang.cookie
  in_root "$ROOT" chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq /etc/rabbitmq
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
      unmount_if_idle
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
  # Its epmd and what is left of its processes, found by its own epmd port inside the
  # chroot, never the machine's nor the cluster's.
  if [ -f "$ROOT/$READY" ]; then stop_epmd; fi
  unmount_if_idle
  log "stopped; the chroot stays at $ROOT (remove it with: rm -rf --one-file-system $ROOT)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  ctl) shift; ctl "$@" ;;
  uri) echo "$URI" ;;
  *) echo "usage: $0 [4.0|4.3] start|stop|ctl ARGS...|uri" >&2; exit 2 ;;
esac
