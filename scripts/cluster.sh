#!/usr/bin/env bash
# A three-node RabbitMQ 4.3 cluster for tests that kill and restart nodes, beside the
# machine's broker and the single nodes of scripts/rabbitmq4.sh, isolated from all of
# them. The three nodes share the 4.3 chroot of `scripts/rabbitmq4.sh 4.3` (Debian
# forky's rabbitmq-server 4.3.x; built on first use, through the same code,
# scripts/lib/rabbitmq-chroot.sh), each with files of its own under
# /var/lib/amqpretry-cluster/cN inside it.
#
#   scripts/cluster.sh start            build the chroot if missing, start the nodes that
#                                       are not running, join nodes 2 and 3 to node 1 the
#                                       first time, wait until all three run clustered,
#                                       print the three AMQP URIs
#   scripts/cluster.sh stop             stop the three nodes and the cluster's epmd;
#                                       unmount the chroot's /proc unless another node of
#                                       the chroot (the 4.3 single node) still runs
#   scripts/cluster.sh kill NODE        SIGKILL node NODE's Erlang VM (beam.smp)
#   scripts/cluster.sh restart NODE     stop NODE if it runs, start it, wait until it has
#                                       rejoined (cluster_status shows 3 running nodes);
#                                       the other two must run (a node boots only once a
#                                       majority of the cluster runs)
#   scripts/cluster.sh ctl NODE ARGS    rabbitmqctl ARGS against node NODE only
#   scripts/cluster.sh uris             print the three AMQP URIs, space-separated,
#                                       whether or not they run
#
#   NODE  node name              AMQP (127.0.0.1)  AMQPS  dist (127.0.0.1)  data in the chroot
#   1     amqpretryc1@localhost  5681              5691   25681             /var/lib/amqpretry-cluster/c1
#   2     amqpretryc2@localhost  5682              5692   25682             /var/lib/amqpretry-cluster/c2
#   3     amqpretryc3@localhost  5683              5693   25683             /var/lib/amqpretry-cluster/c3
#
# One epmd for the cluster on 127.0.0.1:4380 (ERL_EPMD_PORT) and one Erlang cookie
# (/var/lib/amqpretry-cluster/.erlang.cookie in the chroot), neither shared with any
# other node on the machine; rabbitmqctl's own listener in 35710-35739. AMQPS with
# scripts/tls.sh's certificates; one plugin, rabbitmq_auth_mechanism_ssl.
# guest/guest logs in from 127.0.0.1 (loopback_users, the default).
# e.g. AMQPRETRY_RABBITMQCTL="$PWD/scripts/cluster.sh ctl 1"
#
# RabbitMQ 4.3 keeps its metadata in Khepri (Raft): the cluster serves while a majority
# (two of three) runs. Needs root; the chroot's settings (AMQPRETRY_RABBITMQ43_ROOT,
# AMQPRETRY_RABBITMQ43_UID, AMQPRETRY_RABBITMQ4_MIRROR) are scripts/rabbitmq4.sh's.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

LOG_TAG=cluster
# shellcheck source=lib/rabbitmq-chroot.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/rabbitmq-chroot.sh"
select_series 4.3

EPMD_PORT=4380
BASE=/var/lib/amqpretry-cluster # in the chroot: HOME (the cookie), and one dir a node
NODES=(1 2 3)

# Sets the variables of node $1 (NODE, ports, its directory) and node_env, the
# environment every command for it runs with: nothing from the caller's, so neither
# its RABBITMQ_* nor its ERL_* variables can point the chroot's tools elsewhere.
select_node() {
  case "$1" in 1 | 2 | 3) ;; *) die "no node '$1' (1, 2 or 3)" ;; esac
  N=$1
  NODE="amqpretryc$N@localhost"
  AMQP_PORT=$((5680 + N))
  TLS_PORT=$((5690 + N))
  DIST_PORT=$((25680 + N))
  CTL_DIST_MIN=$((35700 + 10 * N))
  CTL_DIST_MAX=$((35709 + 10 * N))
  DIR="$BASE/c$N"
  node_env=(
    env -i
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    HOME="$BASE"
    LANG=C.UTF-8
    LC_ALL=C.UTF-8
    ERL_EPMD_PORT="$EPMD_PORT"
    ERL_EPMD_ADDRESS=127.0.0.1
    RABBITMQ_NODENAME="$NODE"
    RABBITMQ_USE_LONGNAME=false
    RABBITMQ_CTL_DIST_PORT_MIN="$CTL_DIST_MIN"
    RABBITMQ_CTL_DIST_PORT_MAX="$CTL_DIST_MAX"
    # The node's own files, not the chroot's /etc/rabbitmq and /var/lib/rabbitmq (the
    # 4.3 single node's).
    RABBITMQ_CONF_ENV_FILE="$DIR/etc/rabbitmq-env.conf"
    RABBITMQ_CONFIG_FILE="$DIR/etc/rabbitmq.conf"
    RABBITMQ_CONFIG_FILES="$DIR/etc/conf.d"
    RABBITMQ_ADVANCED_CONFIG_FILE="$DIR/etc/advanced.config"
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/etc/enabled_plugins"
    RABBITMQ_MNESIA_BASE="$DIR/data"
    RABBITMQ_LOG_BASE="$DIR/log"
  )
}

uri() { echo "amqp://guest:guest@127.0.0.1:$((5680 + $1))/"; }

uris() { echo "$(uri 1) $(uri 2) $(uri 3)"; }

# rabbitmqctl against the selected node: inside the chroot (the cluster's cookie), with
# the node name and epmd port given explicitly, as the chroot's rabbitmq user.
node_ctl() {
  # shellcheck disable=SC2016 # expanded by the chroot's sh
  as_rabbitmq sh -c 'cd "$HOME" && exec /usr/lib/rabbitmq/bin/rabbitmqctl "$@"' rabbitmqctl -n "$NODE" "$@" 9>&-
}

ctl() {
  select_node "${1:-}"
  shift
  [ -f "$ROOT/$READY" ] || die "no RabbitMQ 4.3 chroot at $ROOT; run: $0 start"
  local a
  for a in "$@"; do
    case "$a" in
      -n | -n* | --node | --node=* | -l | --longnames | --erlang-cookie | --erlang-cookie=*)
        die "ctl $N talks to $NODE only; $a is not accepted" ;;
    esac
  done
  need_root
  mountpoint -q "$ROOT/proc" || die "$NODE is not running (start the cluster with: $0 start)"
  node_ctl "$@"
}

running() { mountpoint -q "$ROOT/proc" && node_ctl -q ping >/dev/null 2>&1; }

# The running nodes the selected node's cluster_status lists, one a line.
running_nodes() {
  node_ctl -q cluster_status --formatter json 2>/dev/null \
    | sed -n 's/.*"running_nodes":\[\([^]]*\)\].*/\1/p' | tr -d '"' | tr ',' '\n' | sed '/^$/d'
}

# Whether the selected node knows node 1 as a member of its cluster.
joined() {
  node_ctl -q cluster_status --formatter json 2>/dev/null \
    | sed -n 's/.*"disk_nodes":\[\([^]]*\)\].*/\1/p' | grep -q '"amqpretryc1@localhost"'
}

# Writes the selected node's files (idempotent).
node_files() {
  write_node_config "$DIR/etc" "MNESIA_BASE=$DIR/data
LOG_BASE=$DIR/log
CONFIG_FILE=$DIR/etc/rabbitmq.conf
CONFIG_FILES=$DIR/etc/conf.d
ADVANCED_CONFIG_FILE=$DIR/etc/advanced.config
ENABLED_PLUGINS_FILE=$DIR/etc/enabled_plugins"
  mkdir -p "$ROOT$DIR/etc/conf.d" "$ROOT$DIR/data" "$ROOT$DIR/log"
}

prepare() {
  need_root
  [ -f "$ROOT/$READY" ] || build
  local n
  for n in "${NODES[@]}"; do select_node "$n"; node_files; done
  ensure_cookie "$BASE/.erlang.cookie"
  in_root "$ROOT" chown -R rabbitmq:rabbitmq "$BASE"
  mount_proc "$ROOT"
}

# Starts the selected node's VM, detached, unless it runs; does not wait for its boot.
launch() {
  if running; then return; fi
  if [ -n "$(node_vm_pids "$NODE")" ]; then
    die "$NODE has a VM (pid $(node_vm_pids "$NODE" | tr '\n' ' ')) that does not answer; kill it: $0 kill $N"
  fi
  log "starting $NODE on 127.0.0.1:$AMQP_PORT"
  # shellcheck disable=SC2016 # expanded by the chroot's sh
  as_rabbitmq sh -c 'cd "$HOME" && exec /usr/lib/rabbitmq/bin/rabbitmq-server -detached' \
    >/dev/null 2>&1 </dev/null 9>&-
}

# Waits until the selected node answers and has booted.
await_node() {
  local i
  for i in $(seq 120); do
    if running; then break; fi
    if [ "$i" = 120 ]; then
      tail -n 40 "$ROOT$DIR/log/$NODE.log" >&2 2>/dev/null || true
      die "$NODE did not answer within 60 s (are ports $AMQP_PORT, $DIST_PORT, $EPMD_PORT taken?); logs in $ROOT$DIR/log"
    fi
    sleep 0.5
  done
  node_ctl -q await_startup --timeout 180 >/dev/null \
    || { tail -n 40 "$ROOT$DIR/log/$NODE.log" >&2 2>/dev/null || true; die "$NODE did not boot within 180 s; logs in $ROOT$DIR/log"; }
}

# Waits until the selected node's cluster_status lists all three nodes as running.
await_clustered() {
  local i got
  for i in $(seq 120); do
    got=$(running_nodes | wc -l)
    if [ "$got" = 3 ]; then return; fi
    if [ "$i" = 120 ]; then
      node_ctl cluster_status >&2 || true
      die "$NODE: $got of 3 nodes running in its cluster_status after 60 s"
    fi
    sleep 0.5
  done
}

start() {
  lock
  prepare
  local n t0=$SECONDS
  select_node 1
  if [ "$(running_nodes | wc -l)" = 3 ]; then
    log "three nodes already running clustered"
    uris; return
  fi
  # All at once: a node of an existing cluster boots only once a majority of it runs.
  for n in "${NODES[@]}"; do select_node "$n"; launch; done
  for n in "${NODES[@]}"; do select_node "$n"; await_node; done
  for n in 2 3; do
    select_node "$n"
    if ! joined; then
      log "joining $NODE to amqpretryc1@localhost"
      node_ctl -q stop_app >/dev/null
      node_ctl -q join_cluster amqpretryc1@localhost >/dev/null
      node_ctl -q start_app >/dev/null
      node_ctl -q await_startup --timeout 180 >/dev/null
    fi
  done
  for n in "${NODES[@]}"; do select_node "$n"; await_clustered; done
  log "three nodes running clustered ($(cat "$ROOT/$READY")) after $((SECONDS - t0)) s"
  uris
}

# SIGKILL of the node's Erlang VM: no shutdown, as when its machine dies.
kill_node() {
  need_root
  select_node "${1:-}"
  local pids
  pids=$(node_vm_pids "$NODE")
  if [ -z "$pids" ]; then log "$NODE is not running"; return; fi
  log "kill -9 $NODE (beam.smp pid $(echo "$pids" | tr '\n' ' '))"
  # shellcheck disable=SC2086 # one or more ids
  kill -9 $pids
  # The VM is gone from node_vm_pids as soon as the kernel has freed its memory (its
  # environ and cmdline read empty), which is before it closes the VM's files: until
  # then its listeners still take connections and reset them. Killed means both gone.
  local i
  for i in $(seq 40); do
    if [ -z "$(node_vm_pids "$NODE")" ] && [ -z "$(ss -Hltn "( sport = :$AMQP_PORT or sport = :$TLS_PORT )")" ]; then return; fi
    sleep 0.25
  done
  die "$NODE's VM, or its listener on $AMQP_PORT or $TLS_PORT, is still there 10 s after SIGKILL"
}

restart_node() {
  select_node "${1:-}"
  lock
  prepare
  select_node "$1"
  local t0=$SECONDS
  if running; then
    log "stopping $NODE"
    node_ctl -q stop >/dev/null || true
    local i
    for i in $(seq 120); do [ -z "$(node_vm_pids "$NODE")" ] && break; sleep 0.5; done
  fi
  launch
  await_node
  await_clustered
  log "$NODE rejoined after $((SECONDS - t0)) s"
}

stop() {
  need_root
  lock
  if [ ! -f "$ROOT/$READY" ]; then log "no chroot at $ROOT"; return; fi
  local n pids=()
  # All at once: the last nodes of a Raft cluster would otherwise wait for a majority
  # that is already gone.
  for n in "${NODES[@]}"; do
    select_node "$n"
    if running; then
      log "stopping $NODE"
      node_ctl -q stop >/dev/null 2>&1 &
      pids+=($!)
    fi
  done
  for n in "${pids[@]}"; do wait "$n" || true; done
  # The cluster's epmd, on its own port inside the chroot, never another node's.
  select_node 1
  stop_epmd
  unmount_if_idle
  log "stopped; data stays in $ROOT$BASE (remove it for a new cluster)"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  kill) kill_node "${2:-}" ;;
  restart) restart_node "${2:-}" ;;
  ctl) shift; ctl "$@" ;;
  uris) uris ;;
  *) echo "usage: $0 start|stop|kill NODE|restart NODE|ctl NODE ARGS...|uris  (NODE: 1, 2 or 3)" >&2; exit 2 ;;
esac
