# shellcheck shell=bash
# Shared by scripts/rabbitmq4.sh and scripts/cluster.sh (sourced, not run): a Debian
# chroot containing rabbitmq-server, built with `debootstrap --variant=minbase` from the
# machine's own apt mirror, kept outside the clone and reused across runs, and the
# helpers that run and find processes in it.
#
# select_series 4.0|4.3 sets what a chroot is made of:
#   4.0  Debian trixie (RabbitMQ 4.0.x), AMQPRETRY_RABBITMQ4_ROOT (default
#        /var/lib/amqpretry/rabbitmq4), rabbitmq uid/gid AMQPRETRY_RABBITMQ4_UID (64674)
#   4.3  Debian forky (RabbitMQ 4.3.x, Erlang/OTP 29), AMQPRETRY_RABBITMQ43_ROOT (default
#        /var/lib/amqpretry/rabbitmq43), rabbitmq uid/gid AMQPRETRY_RABBITMQ43_UID (64675)
# AMQPRETRY_RABBITMQ4_MIRROR names the Debian mirror for both (default: the machine's
# apt sources').
#
# The caller then sets node_env, the `env -i ...` words every command in the chroot runs
# with (in_root, as_rabbitmq), and LOG_TAG, the prefix of its messages.

LOG_TAG=${LOG_TAG:-rabbitmq}
READY=.amqpretry-ready # written last: a chroot without it is unfinished and rebuilt

log() { printf '%s: %s\n' "$LOG_TAG" "$*" >&2; }
die() { log "$*"; exit 1; }

need_root() { [ "$(id -u)" = 0 ] || die "needs root (chroot, mount)"; }

select_series() {
  case "$1" in
    4.0)
      SERIES=4.0
      ROOT_VAR=AMQPRETRY_RABBITMQ4_ROOT
      ROOT="${AMQPRETRY_RABBITMQ4_ROOT:-/var/lib/amqpretry/rabbitmq4}"
      SUITE=trixie
      SUITE_SCRIPT=""
      UID_VAR=AMQPRETRY_RABBITMQ4_UID
      RMQ_ID="${AMQPRETRY_RABBITMQ4_UID:-64674}"
      ;;
    4.3)
      SERIES=4.3
      ROOT_VAR=AMQPRETRY_RABBITMQ43_ROOT
      ROOT="${AMQPRETRY_RABBITMQ43_ROOT:-/var/lib/amqpretry/rabbitmq43}"
      SUITE=forky
      # bookworm's debootstrap has no forky script; sid's fits.
      SUITE_SCRIPT=/usr/share/debootstrap/scripts/sid
      UID_VAR=AMQPRETRY_RABBITMQ43_UID
      RMQ_ID="${AMQPRETRY_RABBITMQ43_UID:-64675}"
      ;;
    *) die "unknown RabbitMQ series '$1' (4.0 or 4.3)" ;;
  esac
  ROOT=$(realpath -m "$ROOT") # as /proc/PID/root shows it
}

# The environment the build runs the chroot's commands with: nothing from the caller's.
build_env=(
  env -i
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
  HOME=/root
  LANG=C.UTF-8
  LC_ALL=C.UTF-8
)

in_build_root() { chroot "$1" "${build_env[@]}" "${@:2}"; }

# shellcheck disable=SC2154 # node_env: the caller's
in_root() { chroot "$1" "${node_env[@]}" "${@:2}"; }

# As the chroot's rabbitmq user, by the ids in the chroot's own passwd file.
# shellcheck disable=SC2154 # node_env: the caller's
as_rabbitmq() {
  local ids
  ids=$(awk -F: '$1 == "rabbitmq" { print $3 ":" $4 }' "$ROOT/etc/passwd")
  [ -n "$ids" ] || die "no rabbitmq user in $ROOT/etc/passwd"
  chroot --userspec="$ids" --groups="${ids#*:}" "$ROOT" "${node_env[@]}" "$@"
}

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

# The ids of processes whose root is the chroot ($ROOT): nodes, epmds and helpers.
chroot_pids() {
  local p root
  for p in /proc/[0-9]*; do
    root=$(readlink "$p/root" 2>/dev/null) || continue
    if [ "$root" = "$ROOT" ]; then echo "${p#/proc/}"; fi
  done
}

# The ids of processes in the chroot whose environment has VAR=VALUE ($1): every
# command in the chroot runs with the node_env of its node, so ERL_EPMD_PORT=N finds
# the processes of the nodes on that epmd (and the epmd), RABBITMQ_NODENAME=X those
# started for node X (its VM, its helpers, rabbitmqctl runs against it).
chroot_pids_with() {
  local p
  for p in $(chroot_pids); do
    if tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxF "$1"; then echo "$p"; fi
  done
}

# The Erlang VM (beam.smp) of node $1 running in the chroot: the node takes its name
# from RABBITMQ_NODENAME (its command line has none) and boots with `-s rabbit boot`,
# which rabbitmqctl's VM, run with the same environment, does not.
node_vm_pids() {
  local p
  for p in $(pgrep -x beam.smp); do
    [ "$(readlink "/proc/$p/root" 2>/dev/null)" = "$ROOT" ] || continue
    tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxF "RABBITMQ_NODENAME=$1" || continue
    if tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -q -- ' -s rabbit boot '; then echo "$p"; fi
  done
}

# stop_epmd: kills the epmd on EPMD_PORT inside the chroot, then what is left of the
# processes with that port in their environment (TERM after 10 s, KILL after 20 s).
stop_epmd() {
  if [ -n "$(chroot_pids_with "ERL_EPMD_PORT=$EPMD_PORT")" ]; then
    as_rabbitmq epmd -kill >/dev/null 2>&1 || true
  fi
  local i p
  for i in $(seq 40); do
    [ -z "$(chroot_pids_with "ERL_EPMD_PORT=$EPMD_PORT")" ] && break
    if [ "$i" = 20 ]; then for p in $(chroot_pids_with "ERL_EPMD_PORT=$EPMD_PORT"); do kill "$p" 2>/dev/null || true; done; fi
    if [ "$i" = 40 ]; then for p in $(chroot_pids_with "ERL_EPMD_PORT=$EPMD_PORT"); do kill -9 "$p" 2>/dev/null || true; done; fi
    sleep 0.5
  done
}

# Unmounts what start mounted, unless some process still runs in the chroot (another
# node of it).
unmount_if_idle() {
  if [ -z "$(chroot_pids)" ]; then
    unmount_all "$ROOT"
  else
    log "leaving $ROOT/proc mounted: other processes still run in the chroot"
  fi
}

# One build, start or stop in the chroot at a time (two test runs may start nodes
# together). The nodes must not inherit the lock's descriptor: it would keep the lock
# for their lifetime.
lock() {
  mkdir -p "$(dirname "$ROOT")"
  exec 9>"$ROOT.lock"
  flock -w 600 9 || die "another start or stop has $ROOT.lock locked"
}

# Builds the chroot at $ROOT: debootstrap, the rabbitmq user, rabbitmq-server (no
# service started), apt's cache cleaned. Node configuration is the callers'.
build() {
  need_root
  local tmp="$ROOT.partial" m t0=$SECONDS
  local dlog="$ROOT.debootstrap.log" ilog="$ROOT.install.log"
  if [ -e "$ROOT" ]; then
    die "$ROOT exists but is not a finished chroot (no $READY); remove it (rm -rf --one-file-system $ROOT) or set $ROOT_VAR"
  fi
  if [ -e "$tmp" ]; then
    log "removing an unfinished chroot at $tmp"
    unmount_all "$tmp"
    rm -rf --one-file-system "$tmp"
  fi
  if getent passwd "$RMQ_ID" >/dev/null || getent group "$RMQ_ID" >/dev/null; then
    die "uid/gid $RMQ_ID is taken on this machine; set $UID_VAR to a free one"
  fi
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
  fi
  if [ -n "$SUITE_SCRIPT" ] && [ ! -f "$SUITE_SCRIPT" ]; then
    die "debootstrap script $SUITE_SCRIPT missing (is debootstrap installed?)"
  fi
  m=$(mirror)
  mkdir -p "$(dirname "$ROOT")"
  log "debootstrap --variant=minbase $SUITE $tmp $m $SUITE_SCRIPT (a minute or three)"
  # shellcheck disable=SC2086 # SUITE_SCRIPT: one word or none
  debootstrap --variant=minbase "$SUITE" "$tmp" "$m" $SUITE_SCRIPT >"$dlog" 2>&1 \
    || { tail -n 30 "$dlog" >&2; unmount_all "$tmp"; die "debootstrap failed; log: $dlog"; }
  log "debootstrap took $((SECONDS - t0)) s"

  t0=$SECONDS
  printf '#!/bin/sh\n# amqpretry: package scripts start no services in this chroot\nexit 101\n' >"$tmp/usr/sbin/policy-rc.d"
  chmod 755 "$tmp/usr/sbin/policy-rc.d"
  # minbase has no /etc/hosts: 4.3 dies at start with {epmd_error,"localhost",nxdomain}.
  printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$tmp/etc/hosts"
  echo "amqpretry-rabbitmq-${SERIES/./}" >"$tmp/etc/hostname"
  # The package's own adduser call finds this user and keeps its ids (uid 101, what it
  # would pick, is postgres on these machines).
  in_build_root "$tmp" groupadd --system --gid "$RMQ_ID" rabbitmq
  in_build_root "$tmp" useradd --system --uid "$RMQ_ID" --gid rabbitmq --home-dir /var/lib/rabbitmq \
    --no-create-home --shell /usr/sbin/nologin --comment "RabbitMQ messaging server" rabbitmq
  mount_proc "$tmp"
  if [ "$SERIES" != 4.0 ]; then
    # A suite under development: its InRelease may be expired by the machine's clock.
    log "apt-get update in the chroot"
    in_build_root "$tmp" apt-get update -q -o Acquire::Check-Valid-Until=false >"$ilog" 2>&1 \
      || { tail -n 30 "$ilog" >&2; unmount_all "$tmp"; die "apt-get update in the chroot failed; log: $ilog"; }
  fi
  log "installing rabbitmq-server in the chroot"
  in_build_root "$tmp" DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends rabbitmq-server \
    >>"$ilog" 2>&1 \
    || { tail -n 30 "$ilog" >&2; unmount_all "$tmp"; die "installing rabbitmq-server failed; log: $ilog"; }
  in_build_root "$tmp" apt-get clean
  # Whatever the package scripts may have started despite policy-rc.d.
  local p
  for p in $(ROOT=$tmp chroot_pids); do kill "$p" 2>/dev/null || true; done
  echo '[].' >"$tmp/etc/rabbitmq/enabled_plugins"
  in_build_root "$tmp" chown -R rabbitmq:rabbitmq /var/lib/rabbitmq /var/log/rabbitmq /etc/rabbitmq
  unmount_all "$tmp"
  local version
  # shellcheck disable=SC2016 # dpkg-query's format, not the shell's
  version=$(in_build_root "$tmp" dpkg-query -W -f '${Version}' rabbitmq-server)
  echo "$version" >"$tmp/$READY"
  mv "$tmp" "$ROOT"
  log "rabbitmq-server $version installed in $((SECONDS - t0)) s at $ROOT"
}

# Writes a node's configuration into directory $1 of the chroot (rabbitmq-env.conf,
# rabbitmq.conf, enabled_plugins), from NODE, AMQP_PORT, DIST_PORT, EPMD_PORT,
# CTL_DIST_MIN, CTL_DIST_MAX, TLS_PORT; $2 is extra rabbitmq-env.conf lines. AMQP, AMQPS
# (TLS_PORT, with the certificates of scripts/tls.sh copied into $1/tls) and the
# distribution listen on 127.0.0.1 only; one plugin, rabbitmq_auth_mechanism_ssl (SASL
# EXTERNAL with a client certificate), which listens on nothing.
write_node_config() {
  local dir="$ROOT$1" tag
  tag=$(basename "$0")
  mkdir -p "$dir"
  cat >"$dir/rabbitmq-env.conf" <<EOF
# amqpretry: a node of its own beside the machine's broker (written by scripts/$tag)
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
${2:-}
EOF
  cat >"$dir/rabbitmq.conf" <<EOF
# amqpretry: AMQP on loopback only. guest/guest works from 127.0.0.1 (loopback_users).
listeners.tcp.1 = 127.0.0.1:$AMQP_PORT
EOF
  local tls
  tls="$(dirname "${BASH_SOURCE[0]}")/../tls.sh"
  "$tls" install "$dir/tls"
  "$tls" conf "$TLS_PORT" "$1/tls" ANONYMOUS >>"$dir/rabbitmq.conf"
  echo '[rabbitmq_auth_mechanism_ssl].' >"$dir/enabled_plugins"
}

# Writes a fresh Erlang cookie at path $1 of the chroot unless it has one.
ensure_cookie() {
  local f="$ROOT$1"
  [ -s "$f" ] && return
  mkdir -p "$(dirname "$f")"
  od -An -tx1 -N16 /dev/urandom | tr -d ' \n' | tr a-f A-F >"$f"
  chmod 400 "$f"
}
