#!/usr/bin/env bash
# Certificates for the TLS tests, and the TLS listener of the machine's RabbitMQ 3.10.
# The 4.x nodes (scripts/rabbitmq4.sh) and the cluster (scripts/cluster.sh) get theirs
# from scripts/lib/rabbitmq-chroot.sh, with the same certificates.
#
#   scripts/tls.sh certs          make what is missing or about to expire (idempotent),
#                                 print the directory
#   scripts/tls.sh dir            print the directory
#   scripts/tls.sh conf PORT DIR [MECH]  print the rabbitmq.conf lines of a TLS listener
#                                 on 127.0.0.1:PORT with the broker's copies in DIR (and
#                                 a fourth SASL mechanism, ANONYMOUS on 4.x)
#   scripts/tls.sh install DIR    copy ca.pem, server.pem and server.key into DIR (a
#                                 broker's own copies; making them first if missing)
#   scripts/tls.sh check PORT     exit 0 when 127.0.0.1:PORT completes a TLS handshake
#                                 with the server certificate below, 1 otherwise
#   scripts/tls.sh rabbitmq310    give the machine's RabbitMQ 3.10 (/etc/rabbitmq) its TLS
#                                 listener on 127.0.0.1:5671 and SASL EXTERNAL (plugin
#                                 rabbitmq_auth_mechanism_ssl); restart it once when
#                                 that port does not answer TLS (every connection to it
#                                 drops: a shared broker restarts only when it must)
#
# The directory (AMQPRETRY_TLS_DIR, default /var/lib/amqpretry/tls, outside the clone):
#   ca.pem, ca.key            the test CA (the only CA the brokers trust)
#   server.pem, server.key    the brokers' certificate: SAN DNS:localhost, IP:127.0.0.1
#   client.pem, client.key    a client certificate, CN amqpretry-tls-client (SASL EXTERNAL)
#   wrongca.pem, wrongca.key  a second CA that signed nothing the brokers present
# EC P-256 keys, valid ten years, remade when one expires within 30 days or no longer
# chains to ca.pem. Needs openssl (installed with apt-get when missing).
#
#   broker              AMQPS (127.0.0.1)   AMQP
#   3.10 (machine's)    5671                5672
#   4.0  (rabbitmq4.sh) 5676                5674
#   4.3  (rabbitmq4.sh) 5677                5675
#   cluster node N      5690+N              5680+N
set -euo pipefail

DIR="${AMQPRETRY_TLS_DIR:-/var/lib/amqpretry/tls}"
CLIENT_CN=amqpretry-tls-client
CONF310=/etc/rabbitmq/rabbitmq.conf
TLS310=/etc/rabbitmq/tls
PORT310=5671

log() { printf 'tls: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

need_openssl() {
  command -v openssl >/dev/null 2>&1 && return
  [ "$(id -u)" = 0 ] || die "openssl is missing (apt-get install openssl, as root)"
  log "installing openssl"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl >/dev/null
}

# fresh NAME [CA]: NAME.pem exists, is valid for 30 more days and chains to CA.pem.
fresh() {
  local f="$DIR/$1.pem"
  [ -s "$f" ] && [ -s "$DIR/$1.key" ] || return 1
  openssl x509 -checkend $((30 * 86400)) -noout -in "$f" >/dev/null 2>&1 || return 1
  if [ -n "${2:-}" ]; then openssl verify -CAfile "$DIR/$2.pem" "$f" >/dev/null 2>&1 || return 1; fi
}

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# ca NAME CN
ca() {
  fresh "$1" && return 0
  log "making CA $1 ($2)"
  newkey "$DIR/$1.key"
  openssl req -x509 -new -key "$DIR/$1.key" -sha256 -days 3650 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$DIR/$1.pem" 2>/dev/null
  rm -f "$DIR/server.pem" "$DIR/client.pem" # signed by the old key, if any
}

# leaf NAME CN EXTENSIONS: a certificate signed by ca.
leaf() {
  fresh "$1" ca && return 0
  log "making certificate $1 ($2)"
  newkey "$DIR/$1.key"
  local ext
  ext=$(mktemp)
  printf '%s\n' "$3" >"$ext"
  openssl req -new -key "$DIR/$1.key" -subj "/CN=$2" -out "$DIR/$1.csr" 2>/dev/null
  openssl x509 -req -in "$DIR/$1.csr" -CA "$DIR/ca.pem" -CAkey "$DIR/ca.key" -CAcreateserial \
    -days 3650 -sha256 -extfile "$ext" -out "$DIR/$1.pem" 2>/dev/null
  rm -f "$ext" "$DIR/$1.csr"
}

certs() {
  need_openssl
  mkdir -p "$DIR"
  chmod 755 "$DIR"
  ca ca "amqpretry test CA"
  ca wrongca "amqpretry wrong CA"
  leaf server localhost "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1"
  leaf client "$CLIENT_CN" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
  # Certificates public; keys root's (the brokers read copies of their own).
  chmod 644 "$DIR"/*.pem
  chmod 600 "$DIR"/*.key
  echo "$DIR"
}

check() {
  local port=${1:?port}
  [ -s "$DIR/ca.pem" ] || return 1
  timeout 10 openssl s_client -connect "127.0.0.1:$port" -servername localhost -verify_hostname localhost \
    -CAfile "$DIR/ca.pem" -verify_return_error -brief </dev/null >/dev/null 2>&1
}

# The rabbitmq.conf lines of a TLS listener on 127.0.0.1:$1 with the files in $2; $3,
# if given, a fourth SASL mechanism.
listener_conf() {
  cat <<EOF
# amqpretry TLS (scripts/tls.sh): AMQPS on loopback, client certificates optional;
# with one, SASL EXTERNAL logs in as its CN (rabbitmq_auth_mechanism_ssl).
listeners.ssl.local = 127.0.0.1:$1
ssl_options.cacertfile = $2/ca.pem
ssl_options.certfile = $2/server.pem
ssl_options.keyfile = $2/server.key
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = false
ssl_cert_login_from = common_name
auth_mechanisms.1 = PLAIN
auth_mechanisms.2 = AMQPLAIN
auth_mechanisms.3 = EXTERNAL
EOF
  # RabbitMQ 4.x's default list has ANONYMOUS too (3.x has no such mechanism).
  if [ -n "${3:-}" ]; then echo "auth_mechanisms.4 = $3"; fi
}

# install_broker_files DIR: the broker's copies (its owner is the caller's to set).
install_broker_files() {
  certs >/dev/null
  mkdir -p "$1"
  local f
  for f in ca.pem server.pem server.key; do
    cmp -s "$DIR/$f" "$1/$f" || install -m 600 "$DIR/$f" "$1/$f"
  done
}

wait310() {
  for _ in $(seq 120); do
    if rabbitmqctl -q await_startup --timeout 5 >/dev/null 2>&1 && check "$PORT310"; then return 0; fi
    sleep 1
  done
  return 1
}

rabbitmq310() {
  [ "$(id -u)" = 0 ] || die "rabbitmq310 needs root"
  command -v rabbitmq-server >/dev/null 2>&1 || die "no rabbitmq-server on this machine"
  certs >/dev/null
  install -d -o rabbitmq -g rabbitmq -m 750 "$TLS310"
  local f changed=""
  for f in ca.pem server.pem server.key; do
    if ! cmp -s "$DIR/$f" "$TLS310/$f"; then
      install -o rabbitmq -g rabbitmq -m 600 "$DIR/$f" "$TLS310/$f"
      changed=1
    fi
  done
  if ! grep -q '^listeners.ssl.local' "$CONF310" 2>/dev/null; then
    log "adding the TLS listener 127.0.0.1:$PORT310 to $CONF310"
    listener_conf "$PORT310" "$TLS310" >>"$CONF310"
    changed=1
  fi
  local plugins=/etc/rabbitmq/enabled_plugins
  if ! grep -q rabbitmq_auth_mechanism_ssl "$plugins" 2>/dev/null; then
    log "enabling rabbitmq_auth_mechanism_ssl"
    rabbitmq-plugins enable --offline rabbitmq_auth_mechanism_ssl >/dev/null
    changed=1
  fi
  if check "$PORT310" && [ -z "$changed" ]; then
    log "RabbitMQ 3.10 answers TLS on 127.0.0.1:$PORT310"; return 0
  fi
  if check "$PORT310"; then
    log "RabbitMQ 3.10 answers TLS on 127.0.0.1:$PORT310 (new files are read at its next restart)"; return 0
  fi
  log "restarting RabbitMQ 3.10 to open its TLS listener (every connection to it drops)"
  rabbitmqctl -q stop >/dev/null 2>&1 || true
  for _ in $(seq 60); do
    rabbitmqctl -q ping >/dev/null 2>&1 || break
    sleep 1
  done
  rabbitmq-server -detached >/dev/null 2>&1 </dev/null || true
  wait310 || die "RabbitMQ 3.10 does not answer TLS on 127.0.0.1:$PORT310 two minutes after its restart; see /var/log/rabbitmq"
  log "RabbitMQ 3.10 answers TLS on 127.0.0.1:$PORT310"
}

case "${1:-}" in
  certs) certs ;;
  dir) echo "$DIR" ;;
  check) check "${2:-}" ;;
  conf) listener_conf "${2:?port}" "${3:?dir}" "${4:-}" ;;
  install) install_broker_files "${2:?dir}" ;;
  rabbitmq310) rabbitmq310 ;;
  *) echo "usage: $0 certs|dir|conf PORT DIR [MECH]|install DIR|check PORT|rabbitmq310" >&2; exit 2 ;;
esac
