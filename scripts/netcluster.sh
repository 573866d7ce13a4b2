#!/usr/bin/env bash
# A three-node RabbitMQ 4.3 cluster whose nodes and clients each live in a network
# namespace of their own, for tests that cut, split and degrade the network between them
# (the partition test, internal/testsupport/noloss/partition_test.go). Nothing of it
# touches the machine's own network: the namespaces are joined by veth pairs to a bridge
# that itself lives in a namespace this script creates, on addresses of the benchmarking
# range 198.18.0.0/24 that exist only there, with no route anywhere else.
#
#   namespace         address       what runs in it
#   amqpretry-pbr     (none)        the bridge br0 and the host ends of the veths
#   amqpretry-pn1..3  198.18.0.1-3  node N: amqpretryp<N>@pn<N>, AMQP 5672, dist 25672,
#                                   its own epmd on 4369
#   amqpretry-pc1     198.18.0.11   clients (side A of a split: nodes 1 and 2)
#   amqpretry-pc2     198.18.0.12   clients (side B of a split: node 3)
#   amqpretry-pobs    198.18.0.10   the test's own connections (publish, count, drain);
#                                   side A of a split, never degraded
#
# The nodes share the 4.3 chroot of `scripts/rabbitmq4.sh 4.3` (built on first use,
# under the lock those scripts take, so never twice at once), each with files of its
# own under /var/lib/amqpretry-netcluster/pN inside it and one Erlang cookie. Node names resolve
# through an Erlang inetrc file (ERL_INETRC), not the chroot's shared /etc/hosts.
# guest/guest logs in from the clients' addresses (loopback_users = none: the
# namespaces reach nothing but each other). RabbitMQ 4.3 has no partition handling
# setting: Khepri (metadata) and quorum queues are Raft and recover by Raft's rules,
# and a 4.3 node ignores cluster_partition_handling; the nodes run with the defaults.
#
#   scripts/netcluster.sh start       create the namespaces, start the three nodes (a
#                                     fresh cluster: data of an earlier run is wiped),
#                                     join them, print the three AMQP URIs
#   scripts/netcluster.sh stop        kill the nodes (SIGKILL: the next start wipes their
#                                     data) and whatever else runs in the chroot with
#                                     the cluster's mark or in its namespaces, delete
#                                     every namespace (and with them the veths and the
#                                     bridge), unmount the chroot's /proc if idle;
#                                     idempotent, also after a failed or half-done start
#   scripts/netcluster.sh uris        the three AMQP URIs
#   scripts/netcluster.sh ctl N ARGS  rabbitmqctl ARGS against node N, from its namespace
#   scripts/netcluster.sh exec NS CMD run CMD in namespace NS (1, 2, 3, c1, c2, obs)
#   scripts/netcluster.sh netns NS    the path of NS's namespace (/run/netns/...)
#   scripts/netcluster.sh status      cluster_status as each node sees it
#   scripts/netcluster.sh await       wait until each node lists three running nodes
#
# Faults (an endpoint is 1, 2, 3, c1, c2 or obs; each adds to those in place):
#   cut A B          drop every packet between A and B (nftables, in A's namespace)
#   oneway A B       drop the packets from A to B only; B to A still pass
#   isolate N        cut node N from the other two nodes (clients still reach it)
#   split "A.." "B.."  cut every endpoint of the first group from every one of the second
#   down X           ip link set down X's interface (as a pulled cable: nothing passes)
#   degrade [DELAY_MS [LOSS_PCT [REORDER_PCT]]]  on every endpoint but obs: tc netem delay,
#                    loss and reordering where the kernel has netem; without it (as on
#                    these CI machines), the userspace delayer
#                    internal/testsupport/netdelay (built with go on first use) in each
#                    namespace delays every packet leaving eth0 DELAY_MS, sent to it by
#                    an iptables NFQUEUE rule, and drops LOSS_PCT at random; no
#                    reordering. Where that cannot run either, nftables drops LOSS_PCT
#                    and there is no delay. Each is said on stderr; prints what it
#                    applied: "netem ...", "nfqueue ..." or "nft-loss ..."
#   heal             remove every fault: rules flushed, links up, qdiscs deleted,
#                    delayers stopped (the packets they keep accepted at once)
#
# Needs root, ip (iproute2), nsenter, and nft (installed with apt-get when missing);
# degrade without netem needs go and iptables (installed with apt-get when missing).
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

LOG_TAG=netcluster
# shellcheck source=lib/rabbitmq-chroot.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib/rabbitmq-chroot.sh"
select_series 4.3

BASE=/var/lib/amqpretry-netcluster # in the chroot: HOME (the cookie, inetrc), a dir per node
NET=198.18.0
NS_PREFIX=amqpretry-p
BRIDGE_NS=${NS_PREFIX}br
ENDPOINTS=(1 2 3 c1 c2 obs)
MARK=AMQPRETRY_NETCLUSTER=1 # in every chroot process's environment: what stop kills
# The delayers of degrade without netem: the binary, and a pid and log file per
# endpoint. Outside the repository; stop deletes it.
DELAY_RUN=/run/amqpretry-netcluster
DELAY_BIN=$DELAY_RUN/netdelay
DELAY_QUEUE=27 # the NFQUEUE number, in each endpoint's own namespace

ns_of() {
  case "$1" in
    1 | 2 | 3) echo "${NS_PREFIX}n$1" ;;
    c1 | c2 | obs) echo "$NS_PREFIX$1" ;;
    *) die "no endpoint '$1' (1, 2, 3, c1, c2 or obs)" ;;
  esac
}

ip_of() {
  case "$1" in
    1 | 2 | 3) echo "$NET.$1" ;;
    obs) echo "$NET.10" ;;
    c1) echo "$NET.11" ;;
    c2) echo "$NET.12" ;;
    *) die "no endpoint '$1' (1, 2, 3, c1, c2 or obs)" ;;
  esac
}

# The veth end on the bridge of endpoint $1 (at most 15 characters).
port_of() { echo "p-$1"; }

in_ns() { local ns; ns=$(ns_of "$1"); shift; ip netns exec "$ns" "$@"; }

select_node() {
  case "$1" in 1 | 2 | 3) ;; *) die "no node '$1' (1, 2 or 3)" ;; esac
  N=$1
  NODE="amqpretryp$N@pn$N"
  DIR="$BASE/p$N"
  node_env=(
    env -i
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
    HOME="$BASE"
    LANG=C.UTF-8
    LC_ALL=C.UTF-8
    "$MARK"
    ERL_INETRC="$BASE/inetrc"
    ERL_EPMD_PORT=4369
    RABBITMQ_NODENAME="$NODE"
    RABBITMQ_USE_LONGNAME=false
    RABBITMQ_CONF_ENV_FILE="$DIR/etc/rabbitmq-env.conf"
    RABBITMQ_CONFIG_FILE="$DIR/etc/rabbitmq.conf"
    RABBITMQ_CONFIG_FILES="$DIR/etc/conf.d"
    RABBITMQ_ADVANCED_CONFIG_FILE="$DIR/etc/advanced.config"
    RABBITMQ_ENABLED_PLUGINS_FILE="$DIR/etc/enabled_plugins"
    RABBITMQ_MNESIA_BASE="$DIR/data"
    RABBITMQ_LOG_BASE="$DIR/log"
  )
}

# As the chroot's rabbitmq user, in node N's namespace (no new mount namespace).
node_run() {
  local ids
  ids=$(awk -F: '$1 == "rabbitmq" { print $3 ":" $4 }' "$ROOT/etc/passwd")
  [ -n "$ids" ] || die "no rabbitmq user in $ROOT/etc/passwd"
  nsenter --net="/run/netns/$(ns_of "$N")" \
    chroot --userspec="$ids" --groups="${ids#*:}" "$ROOT" "${node_env[@]}" "$@"
}

node_ctl() {
  # shellcheck disable=SC2016 # expanded by the chroot's sh
  node_run sh -c 'cd "$HOME" && exec /usr/lib/rabbitmq/bin/rabbitmqctl "$@"' rabbitmqctl -n "$NODE" "$@" 9>&-
}

uris() { echo "amqp://guest:guest@$NET.1:5672/ amqp://guest:guest@$NET.2:5672/ amqp://guest:guest@$NET.3:5672/"; }

need_tools() {
  need_root
  command -v ip >/dev/null || die "needs ip (iproute2)"
  command -v nsenter >/dev/null || die "needs nsenter (util-linux)"
  if ! command -v nft >/dev/null; then
    log "installing nftables"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables >/dev/null; } \
      || die "could not install nftables (apt-get install nftables)"
  fi
}

ns_exists() { [ -e "/run/netns/$1" ]; }

# The namespaces, the bridge and one veth pair per endpoint (idempotent: what exists
# is kept).
make_net() {
  if ! ns_exists "$BRIDGE_NS"; then ip netns add "$BRIDGE_NS"; fi
  ip -n "$BRIDGE_NS" link set lo up
  if ! ip -n "$BRIDGE_NS" link show br0 >/dev/null 2>&1; then
    ip -n "$BRIDGE_NS" link add br0 type bridge
  fi
  ip -n "$BRIDGE_NS" link set br0 up
  local e ns port
  for e in "${ENDPOINTS[@]}"; do
    ns=$(ns_of "$e")
    port=$(port_of "$e")
    if ! ns_exists "$ns"; then ip netns add "$ns"; fi
    ip -n "$ns" link set lo up
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
      ip -n "$BRIDGE_NS" link del "$port" 2>/dev/null || true
      # Created in the bridge's namespace, the peer moved into the endpoint's: neither
      # end ever exists in the machine's own namespace.
      ip -n "$BRIDGE_NS" link add "$port" type veth peer name eth0 netns "$ns"
      ip -n "$BRIDGE_NS" link set "$port" master br0
      ip -n "$ns" addr add "$(ip_of "$e")/24" dev eth0
    fi
    ip -n "$BRIDGE_NS" link set "$port" up
    ip -n "$ns" link set eth0 up
    nft_table "$e"
  done
}

# The (empty) nftables table of endpoint $1's namespace where faults add their rules.
nft_table() {
  in_ns "$1" nft -f - <<'EOF'
table inet amqpretry
delete table inet amqpretry
table inet amqpretry {
  chain input { type filter hook input priority 0; policy accept; }
  chain output { type filter hook output priority 0; policy accept; }
}
EOF
}

write_files() {
  local n
  mkdir -p "$ROOT$BASE"
  {
    echo "% amqpretry: node names of scripts/netcluster.sh"
    for n in 1 2 3; do echo "{host, {198,18,0,$n}, [\"pn$n\"]}."; done
    echo '{host, {127,0,0,1}, ["localhost"]}.'
    echo "{lookup, [file, native]}."
  } >"$ROOT$BASE/inetrc"
  for n in 1 2 3; do
    select_node "$n"
    mkdir -p "$ROOT$DIR/etc/conf.d" "$ROOT$DIR/data" "$ROOT$DIR/log"
    cat >"$ROOT$DIR/etc/rabbitmq-env.conf" <<EOF
# amqpretry: node $n of scripts/netcluster.sh, alone in network namespace $(ns_of "$n")
NODENAME=$NODE
USE_LONGNAME=false
NODE_IP_ADDRESS=0.0.0.0
NODE_PORT=5672
DIST_PORT=25672
MNESIA_BASE=$DIR/data
LOG_BASE=$DIR/log
CONFIG_FILE=$DIR/etc/rabbitmq.conf
CONFIG_FILES=$DIR/etc/conf.d
ADVANCED_CONFIG_FILE=$DIR/etc/advanced.config
ENABLED_PLUGINS_FILE=$DIR/etc/enabled_plugins
export ERL_INETRC=$BASE/inetrc
# No busy-waiting schedulers: the machine's brokers share these cores.
SERVER_ADDITIONAL_ERL_ARGS="+sbwt none +sbwtdcpu none +sbwtdio none"
EOF
    cat >"$ROOT$DIR/etc/rabbitmq.conf" <<EOF
# amqpretry: node $n of scripts/netcluster.sh. Its namespace reaches only the other
# namespaces of the script (198.18.0.0/24, no route out): guest may log in from them.
listeners.tcp.1 = 0.0.0.0:5672
loopback_users = none
# No cluster_partition_handling: RabbitMQ 4.3 has none (Khepri and quorum queues
# recover by Raft's rules; the key is accepted and ignored).
# The three nodes form the cluster as they boot (start joins any that did not).
cluster_formation.peer_discovery_backend = classic_config
cluster_formation.classic_config.nodes.1 = amqpretryp1@pn1
cluster_formation.classic_config.nodes.2 = amqpretryp2@pn2
cluster_formation.classic_config.nodes.3 = amqpretryp3@pn3
EOF
    echo '[].' >"$ROOT$DIR/etc/enabled_plugins"
  done
  ensure_cookie "$BASE/.erlang.cookie"
  select_node 1
  chroot "$ROOT" chown -R rabbitmq:rabbitmq "$BASE"
}

running() { node_ctl -q ping >/dev/null 2>&1; }

running_nodes() {
  node_ctl -q cluster_status --formatter json 2>/dev/null \
    | sed -n 's/.*"running_nodes":\[\([^]]*\)\].*/\1/p' | tr -d '"' | tr ',' '\n' | sed '/^$/d'
}

joined() {
  node_ctl -q cluster_status --formatter json 2>/dev/null \
    | sed -n 's/.*"disk_nodes":\[\([^]]*\)\].*/\1/p' | grep -q '"amqpretryp1@pn1"'
}

launch() {
  log "starting $NODE in $(ns_of "$N") at $(ip_of "$N"):5672"
  # shellcheck disable=SC2016 # expanded by the chroot's sh
  node_run sh -c 'cd "$HOME" && exec /usr/lib/rabbitmq/bin/rabbitmq-server -detached' \
    >/dev/null 2>&1 </dev/null 9>&-
}

await_node() {
  local i
  for i in $(seq 120); do
    if running; then break; fi
    if [ "$i" = 120 ]; then
      tail -n 40 "$ROOT$DIR/log/$NODE.log" >&2 2>/dev/null || true
      die "$NODE did not answer within 60 s; logs in $ROOT$DIR/log"
    fi
    sleep 0.5
  done
  node_ctl -q await_startup --timeout 180 >/dev/null \
    || { tail -n 40 "$ROOT$DIR/log/$NODE.log" >&2 2>/dev/null || true; die "$NODE did not boot within 180 s; logs in $ROOT$DIR/log"; }
}

# Waits (up to $1 s, default 120) until every node lists three running nodes.
await_clustered() {
  local limit=${1:-120} n pids=() rc=0
  # The three nodes asked at once (rabbitmqctl takes seconds to start).
  for n in 1 2 3; do
    (
      select_node "$n"
      t0=$SECONDS
      while :; do
        got=$(running_nodes | wc -l)
        if [ "$got" = 3 ]; then exit 0; fi
        if [ $((SECONDS - t0)) -ge "$limit" ]; then
          node_ctl cluster_status >&2 || true
          die "$NODE: $got of 3 nodes running in its cluster_status after $limit s"
        fi
        sleep 0.5
      done
    ) &
    pids+=($!)
  done
  for n in "${pids[@]}"; do wait "$n" || rc=1; done
  [ "$rc" = 0 ] || die "the cluster did not list its three nodes on every node within $limit s"
}

start() {
  need_tools
  lock
  # Built here only when missing, under the lock that scripts/rabbitmq4.sh and
  # scripts/cluster.sh take while they build it: never two builds at once.
  [ -f "$ROOT/$READY" ] || build
  # The userspace delayer of degrade (for kernels without netem) made ready now, outside
  # the faults' deadlines: iptables installed and netdelay built. A failure here is
  # degrade's to report, if it needs them.
  delayer_ready || true
  local t0=$SECONDS n
  make_net
  select_node 1
  if [ -n "$(chroot_pids_with "$MARK")" ] && [ "$(running_nodes | wc -l)" = 3 ]; then
    log "three nodes already running clustered"
    uris; return
  fi
  # A fresh cluster: what an earlier (maybe failed) run left is gone.
  kill_leftovers
  rm -rf --one-file-system "${ROOT:?}$BASE"
  write_files
  mount_proc "$ROOT"
  for n in 1 2 3; do select_node "$n"; launch; done
  for n in 1 2 3; do select_node "$n"; await_node; done
  for n in 2 3; do
    select_node "$n"
    if ! joined; then
      log "joining $NODE to amqpretryp1@pn1"
      node_ctl -q stop_app >/dev/null
      node_ctl -q join_cluster amqpretryp1@pn1 >/dev/null
      node_ctl -q start_app >/dev/null
      node_ctl -q await_startup --timeout 180 >/dev/null
    fi
  done
  await_clustered 120
  log "three nodes running clustered ($(cat "$ROOT/$READY")) in their namespaces after $((SECONDS - t0)) s"
  uris
}

# This shell and its ancestors, one id a line.
ancestors() {
  local p=$$
  while [ -n "$p" ] && [ "$p" != 0 ]; do
    echo "$p"
    p=$(awk '/^PPid:/ { print $2 }' "/proc/$p/status" 2>/dev/null)
  done
}

# Kills every process of this cluster: those in the chroot with its mark, and any
# process left in its namespaces (a client the test started).
kill_leftovers() {
  local p e ns pids
  for p in $(chroot_pids_with "$MARK"); do kill -9 "$p" 2>/dev/null || true; done
  for e in "${ENDPOINTS[@]}" br; do
    if [ "$e" = br ]; then ns=$BRIDGE_NS; else ns=$(ns_of "$e"); fi
    ns_exists "$ns" || continue
    # Never this script or its callers (a process whose main thread visited a
    # namespace shows in it).
    pids=$(ip netns pids "$ns" 2>/dev/null | grep -vxF -f <(ancestors) || true)
    # shellcheck disable=SC2086 # a list of ids
    if [ -n "$pids" ]; then kill -9 $pids 2>/dev/null || true; fi
  done
  local i
  for i in $(seq 40); do
    [ -z "$(chroot_pids_with "$MARK")" ] && return
    sleep 0.25
  done
  log "processes still in the chroot after SIGKILL: $(chroot_pids_with "$MARK" | tr '\n' ' ')"
}

stop() {
  need_root
  local e ns
  if [ -f "$ROOT/$READY" ]; then
    lock
    # No clean shutdown: start wipes the data anyway, and a node cut from its majority
    # may never answer a stop.
    kill_leftovers
  fi
  delayer_stop "${ENDPOINTS[@]}"
  for e in "${ENDPOINTS[@]}"; do
    ns=$(ns_of "$e")
    if ns_exists "$ns"; then ip netns del "$ns"; fi
  done
  rm -rf --one-file-system "$DELAY_RUN"
  if ns_exists "$BRIDGE_NS"; then ip netns del "$BRIDGE_NS"; fi
  if [ -f "$ROOT/$READY" ]; then unmount_if_idle; fi
  log "stopped: no namespace of $NS_PREFIX* left"
}

# --- faults ---------------------------------------------------------------------

need_net() {
  need_root
  ns_exists "$BRIDGE_NS" || die "no cluster network (start it: $0 start)"
}

# drop FROM TO [both]: rules in FROM's namespace dropping its packets to TO (and, with
# both, TO's packets to it).
drop() {
  local a=$1 b=$2 both=${3:-}
  in_ns "$a" nft add rule inet amqpretry output ip daddr "$(ip_of "$b")" drop
  if [ -n "$both" ]; then
    in_ns "$a" nft add rule inet amqpretry input ip saddr "$(ip_of "$b")" drop
  fi
}

cut() { need_net; drop "$1" "$2" both; log "cut $1 <-> $2"; }

oneway() { need_net; drop "$1" "$2"; log "cut $1 -> $2 (one way)"; }

isolate() {
  need_net
  select_node "$1"
  local n
  for n in 1 2 3; do
    if [ "$n" != "$1" ]; then drop "$1" "$n" both; fi
  done
  log "node $1 cut from the other nodes"
}

split() {
  need_net
  local a b
  for a in $1; do
    for b in $2; do drop "$a" "$b" both; done
  done
  log "split: {$1} | {$2}"
}

down() {
  need_net
  ip -n "$BRIDGE_NS" link set "$(port_of "$1")" down
  in_ns "$1" ip link set eth0 down
  log "link of $1 down"
}

# --- the userspace delayer (degrade without netem) -------------------------------

# Builds internal/testsupport/netdelay into $DELAY_BIN once (stop deletes it); fails,
# said on stderr, when go or iptables is missing and cannot be had.
delayer_ready() {
  if ! command -v iptables >/dev/null; then
    log "installing iptables (the NFQUEUE rules of the delayer)"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables >/dev/null; } \
      || { log "could not install iptables (apt-get install iptables)"; return 1; }
  fi
  [ -x "$DELAY_BIN" ] && return 0
  command -v go >/dev/null || { log "no go on PATH to build internal/testsupport/netdelay"; return 1; }
  mkdir -p "$DELAY_RUN"
  log "building internal/testsupport/netdelay into $DELAY_BIN"
  (cd "$(dirname "${BASH_SOURCE[0]}")/../internal/testsupport/netdelay" && go build -o "$DELAY_BIN.tmp" .) >&2 \
    && mv "$DELAY_BIN.tmp" "$DELAY_BIN"
}

# The pid of endpoint $1's delayer while it runs, else nothing. The process is
# setsid, then ip, then netdelay (each execs the next); a zombie does not run.
delayer_pid() {
  local pid
  pid=$(cat "$DELAY_RUN/$1.pid" 2>/dev/null) || return 0
  case "$(cat "/proc/$pid/comm" 2>/dev/null)" in netdelay | ip | setsid) ;; *) return 0 ;; esac
  if [ "$(awk '{ print $3 }' "/proc/$pid/stat" 2>/dev/null)" != Z ]; then echo "$pid"; fi
}

# Starts a delayer in endpoint $1's namespace delaying each packet that leaves eth0
# $2 ms and dropping $3 % at random. The rule comes once the delayer is bound to the
# queue; with --queue-bypass, packets pass undelayed whenever none is.
delayer_start() {
  local e=$1 delay=$2 loss=$3 i
  delayer_stop "$e"
  # Its own session (the test kills a command's process group on timeout), no
  # descriptor of this script (the caller reads its output to the end).
  setsid ip netns exec "$(ns_of "$e")" "$DELAY_BIN" -queue "$DELAY_QUEUE" -delay "${delay}ms" -loss "$loss" \
    </dev/null >"$DELAY_RUN/$e.log" 2>&1 9>&- &
  echo $! >"$DELAY_RUN/$e.pid"
  # Its "ready" comes within a second on an idle machine; the deadline is for a loaded
  # one (CI runs its lanes side by side on two cores).
  for i in $(seq 600); do
    if grep -qx ready "$DELAY_RUN/$e.log" 2>/dev/null; then break; fi
    if [ -z "$(delayer_pid "$e")" ]; then
      log "the delayer of $e exited before it was ready: $(cat "$DELAY_RUN/$e.log" 2>/dev/null)"
      delayer_stop "$e"
      return 1
    fi
    if [ "$i" = 600 ]; then
      log "the delayer of $e did not start within 60 s: $(cat "$DELAY_RUN/$e.log" 2>/dev/null)"
      delayer_stop "$e"
      return 1
    fi
    sleep 0.1
  done
  in_ns "$e" iptables -w -A OUTPUT -o eth0 -j NFQUEUE --queue-num "$DELAY_QUEUE" --queue-bypass
}

# Stops the delayers of endpoints $@: each one's rule deleted, then SIGTERM (it
# accepts the packets it keeps at once and exits once none came for 100 ms), all at
# once; SIGKILL for any left after 5 s.
delayer_stop() {
  local e pid i running stopping=()
  for e in "$@"; do
    [ -f "$DELAY_RUN/$e.pid" ] || continue # written before the rule, deleted after it
    if ns_exists "$(ns_of "$e")" && command -v iptables >/dev/null; then
      in_ns "$e" iptables -w -F OUTPUT 2>/dev/null || true
    fi
    pid=$(delayer_pid "$e")
    if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
    stopping+=("$e")
  done
  [ "${#stopping[@]}" -gt 0 ] || return 0
  for i in $(seq 50); do
    running=""
    for e in "${stopping[@]}"; do
      if [ -n "$(delayer_pid "$e")" ]; then running=yes; fi
    done
    if [ -z "$running" ]; then break; fi
    sleep 0.1
  done
  for e in "${stopping[@]}"; do
    pid=$(delayer_pid "$e")
    if [ -n "$pid" ]; then
      log "the delayer of $e still ran 5 s after SIGTERM: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$DELAY_RUN/$e.pid"
  done
}

# The shortest of three TCP connects from node 1 to node 2's AMQP port, in ms: one
# round trip between two nodes (with degrade, each end's delay once).
connect_ms() {
  # shellcheck disable=SC2016 # expanded by that bash
  in_ns 1 bash -c 'best=""
    for i in 1 2 3; do
      t0=$(date +%s%N)
      exec 3<>"/dev/tcp/$1/5672" || continue
      t=$((($(date +%s%N) - t0) / 1000000))
      exec 3>&-
      if [ -z "$best" ] || [ "$t" -lt "$best" ]; then best=$t; fi
    done
    echo "${best:-no}"' connect "$NET.2" 2>/dev/null
}

degrade() {
  need_net
  local delay=${1:-200} loss=${2:-5} reorder=${3:-0} e applied="" delayer=""
  for e in 1 2 3 c1 c2; do
    local args=(delay "${delay}ms")
    if [ "$loss" != 0 ]; then args+=(loss "${loss}%"); fi
    if [ "$reorder" != 0 ]; then args+=(reorder "${reorder}%"); fi
    if in_ns "$e" tc qdisc replace dev eth0 root netem "${args[@]}" 2>/dev/null; then
      applied="netem ${args[*]}"
      continue
    fi
    # No netem in this kernel (CONFIG_NET_SCH_NETEM): the userspace delayer, and
    # where it cannot run, random loss through nftables.
    if [ -z "$delayer" ]; then
      if delayer_ready; then delayer=yes; else delayer=no; fi
    fi
    if [ "$delayer" = yes ]; then
      delayer_start "$e" "$delay" "$loss" || die "could not delay the packets of $e (log: $DELAY_RUN/$e.log)"
      applied="nfqueue delay ${delay}ms loss ${loss}% (no netem in this kernel: internal/testsupport/netdelay; no reordering)"
      continue
    fi
    if [ "$loss" != 0 ]; then
      in_ns "$e" nft add rule inet amqpretry output numgen random mod 100 '<' "$loss" drop
    fi
    applied="nft-loss ${loss}% (no netem in this kernel and no delayer: no delay, no reordering)"
  done
  applied="$applied; a TCP connect node 1 to node 2 now takes $(connect_ms) ms"
  log "degraded every link but obs's: $applied"
  echo "$applied"
}

heal() {
  need_net
  local e
  delayer_stop "${ENDPOINTS[@]}"
  for e in "${ENDPOINTS[@]}"; do
    ns_exists "$(ns_of "$e")" || continue
    ip -n "$BRIDGE_NS" link set "$(port_of "$e")" up 2>/dev/null || true
    in_ns "$e" ip link set eth0 up
    in_ns "$e" tc qdisc del dev eth0 root 2>/dev/null || true
    in_ns "$e" nft flush table inet amqpretry 2>/dev/null || nft_table "$e"
  done
  log "healed"
}

status() {
  need_net
  local n
  for n in 1 2 3; do
    select_node "$n"
    printf '%s: ' "$NODE"
    running_nodes | tr '\n' ' '
    echo
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  uris) uris ;;
  ctl)
    shift
    select_node "${1:-}"
    shift
    need_root
    node_ctl "$@"
    ;;
  exec)
    shift
    need_root
    e=${1:-}
    shift
    in_ns "$e" "$@"
    ;;
  netns) echo "/run/netns/$(ns_of "${2:-}")" ;;
  status) status ;;
  await) need_net; await_clustered "${2:-120}" ;;
  cut) cut "${2:-}" "${3:-}" ;;
  oneway) oneway "${2:-}" "${3:-}" ;;
  isolate) isolate "${2:-}" ;;
  split) split "${2:-}" "${3:-}" ;;
  down) down "${2:-}" ;;
  degrade) shift; degrade "$@" ;;
  heal) heal ;;
  *)
    echo "usage: $0 start|stop|uris|status|await [S]|ctl N ARGS...|exec NS CMD...|netns NS|cut A B|oneway A B|isolate N|split \"A..\" \"B..\"|down X|degrade [DELAY_MS [LOSS_PCT [REORDER_PCT]]]|heal" >&2
    exit 2
    ;;
esac
