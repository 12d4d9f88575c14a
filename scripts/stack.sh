#!/usr/bin/env bash
# The local stack: a real Apache Kafka broker (single-node KRaft) and a real PostgreSQL 15,
# on loopback only, under .stack/ (git-ignored). Idempotent: `up` twice starts nothing twice.
#
#   scripts/stack.sh up        start what is not running; writes .stack/env
#   scripts/stack.sh down      stop both; leaves no process of theirs behind
#   scripts/stack.sh status    what runs where
#   scripts/stack.sh logs      paths of the log files
#   scripts/stack.sh env       print the environment (KAFKA_BROKERS, DATABASE_URL)
#   scripts/stack.sh reset     down, then delete data (keeps the cached jars)
#   scripts/stack.sh pg-crash | kafka-crash   stop a service the hard way (then `up` again)
#   scripts/stack.sh pg2-up    a second PostgreSQL server, only on demand (`up` never starts it):
#                              its own cluster in .stack/pg2 on the next free port from 5433, for
#                              consumers on two databases ([database.NAME]); writes
#                              .stack/pg2.env (DATABASE_URL_2), adds it to .stack/env, prints it
#   scripts/stack.sh pg2-down | pg2-crash (an immediate stop; `pg2-up` starts it again)
#   scripts/stack.sh redis-up  Redis for the optional pre-filter, only on demand (`up` never starts
#                              it): Debian's redis-server (installed if missing), loopback, no
#                              persistence; writes .stack/redis.env (REDIS_URL) and prints the URL
#   scripts/stack.sh redis-down | redis-crash (SIGKILL) | redis-install (prints the binary's path)
#   scripts/stack.sh registry-up   the Schema Registry (Apicurio Registry, scripts/registry.sh), only
#                              on demand: loopback, 127.0.0.1:8081, its storage in PostgreSQL; prints
#                              SCHEMA_REGISTRY_URL (.stack/env has it whether or not it runs)
#   scripts/stack.sh registry-down | registry-crash (SIGKILL)
#   scripts/stack.sh jaeger-up     Jaeger v2, the trace backend (scripts/jaeger.sh), only on demand:
#                              built once from the Go module proxy, loopback, OTLP on 4318, the
#                              query API on 16686; writes .stack/jaeger.env and prints it
#   scripts/stack.sh jaeger-down
#   scripts/stack.sh kafka CLASS ARGS...   run a Kafka tool, e.g.
#        scripts/stack.sh kafka org.apache.kafka.tools.TopicCommand --bootstrap-server 127.0.0.1:9092 --list
#   STACK_TOPOLOGY=cluster scripts/stack.sh CMD   the cluster stack instead: three Kafka nodes, a
#        PostgreSQL primary and standby, under .stack-cluster/ (scripts/cluster.sh, its commands)
#
# Existing services: if KAFKA_BROKERS or DATABASE_URL is set and answers, it is used and nothing
# is started for it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [ "${STACK_TOPOLOGY:-single}" = cluster ]; then exec "$ROOT/scripts/cluster.sh" "$@"; fi
STACK_DIR=${STACK_DIR:-$ROOT/.stack}
KAFKA_HOME=$STACK_DIR/kafka
POM=$ROOT/scripts/kafka/pom.xml
PG_DB=${PG_DB:-effectively}
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"
# shellcheck source=scripts/registry.sh
source "$ROOT/scripts/registry.sh"
# shellcheck source=scripts/jaeger.sh
source "$ROOT/scripts/jaeger.sh"


# ---------------------------------------------------------------------------------------------
# Kafka
# ---------------------------------------------------------------------------------------------

kafka_up() {
  mkdir -p "$KAFKA_HOME/logs"
  kafka_jars
  if [ -n "${KAFKA_BROKERS:-}" ] && ! pid_alive "$KAFKA_HOME/pid" && kafka_answers "$KAFKA_BROKERS"; then
    log "using the Kafka that answers at $KAFKA_BROKERS"
    echo "$KAFKA_BROKERS" >"$STACK_DIR/kafka.brokers"
    return 0
  fi
  kafka_tls_material
  if pid_alive "$KAFKA_HOME/pid"; then
    # The update path: a running broker keeps running unless the settings this script writes
    # changed since it started (a static setting such as the authorizer applies at a restart).
    local running_port
    running_port=$(cat "$KAFKA_HOME/port")
    kafka_properties "$running_port" >"$KAFKA_HOME/server.properties.new"
    if cmp -s "$KAFKA_HOME/server.properties.new" "$KAFKA_HOME/server.properties"; then
      rm -f "$KAFKA_HOME/server.properties.new"
      log "kafka already running (pid $(cat "$KAFKA_HOME/pid")) at $(cat "$STACK_DIR/kafka.brokers")"
      return 0
    fi
    log "kafka's settings changed (server.properties): restarting the broker to apply them"
    kafka_down
    rm -f "$KAFKA_HOME/server.properties.new"
  fi
  local port=${KAFKA_PORT:-}
  if [ -z "$port" ]; then
    # Keep the port a formatted log dir was made for; otherwise 9092 or the next free four
    # (plaintext, controller, TLS, SASL over TLS).
    port=$(cat "$KAFKA_HOME/port" 2>/dev/null || echo 9092)
    if port_busy "$port" || port_busy "$((port + 1))" || port_busy "$((port + 2))" ||
      port_busy "$((port + 3))"; then port=$(free_port_from 9092 4); fi
  fi
  echo "$port" >"$KAFKA_HOME/port"
  kafka_properties "$port" >"$KAFKA_HOME/server.properties"
  if [ ! -f "$KAFKA_HOME/data/meta.properties" ]; then
    kafka_format "$KAFKA_HOME/server.properties" "$(kafka_java kafka.tools.StorageTool random-uuid)" \
      "$KAFKA_HOME/logs/format.log"
  fi
  log "starting Apache Kafka $(kafka_version) on 127.0.0.1:$port (logs: $KAFKA_HOME/logs)"
  kafka_spawn "$KAFKA_HOME/server.properties" "$KAFKA_HOME/logs" "$KAFKA_HOME/pid" "${KAFKA_HEAP:-768m}"
  echo "127.0.0.1:$port" >"$STACK_DIR/kafka.brokers"
  kafka_wait "$KAFKA_HOME/pid" "$KAFKA_HOME/logs" kafka_answers "127.0.0.1:$port"
  log "kafka answers metadata requests: $(grep -m1 -o 'Kafka version: [^ ]*' "$KAFKA_HOME/logs/server.log" || true)"
  kafka_scram_user "127.0.0.1:$port"
}

# The broker's server.properties for PORT (plaintext; +1 controller, +2 TLS, +3 SASL over TLS),
# on stdout: written at each start, and compared with the running broker's on `up`.
kafka_properties() {
  local port=$1 tls=$KAFKA_HOME/tls scram="org.apache.kafka.common.security.scram.ScramLoginModule required;"
  cat <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$((port + 1))
# Plaintext for the engine's tests and tools; TLS, and SASL (SCRAM-SHA-256/512, PLAIN) over TLS,
# for the production-connectivity tests (tests/kafka_security.rs), with a CA of the stack's own.
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$((port + 1)),SSL://127.0.0.1:$((port + 2)),SASL_SSL://127.0.0.1:$((port + 3))
advertised.listeners=PLAINTEXT://127.0.0.1:$port,SSL://127.0.0.1:$((port + 2)),SASL_SSL://127.0.0.1:$((port + 3))
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL
ssl.keystore.type=PEM
ssl.keystore.location=$tls/keystore.pem
ssl.client.auth=none
sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512,PLAIN
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=$scram
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=$scram
listener.name.sasl_ssl.plain.sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required user_effectively="$(cat "$tls/sasl.password")";
log.dirs=$KAFKA_HOME/data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=10
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
# Kafka's consumer group protocol (KIP-848, a consumer's "group.protocol" = "consumer"): the
# members' heartbeat is the broker's to set (5 s by default, and no lower than its minimum), and a
# partition that moves waits for the new owner's next heartbeat (docs/PERFORMANCE.md, joins).
group.consumer.min.heartbeat.interval.ms=250
group.consumer.heartbeat.interval.ms=250
log.retention.hours=168
# ACLs, for the test of a partition the engine may not read (tests/stuck.rs): the authorizer
# denies only what an ACL says. The PLAINTEXT and CONTROLLER listeners (no authentication:
# User:ANONYMOUS) are super users, so the controller, the tools and every plaintext test are
# unaffected; the SASL user 'effectively' may do anything on a resource without an ACL.
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:ANONYMOUS
allow.everyone.if.no.acl.found=true
EOF
}

# A CA and a broker certificate (localhost, 127.0.0.1) for the TLS listeners, and the SASL
# password, made once per stack with openssl; the CA file and the password file are what a test
# or a user configures the engine with (KAFKA_CA_FILE, KAFKA_SASL_PASSWORD_FILE in the env).
kafka_tls_material() {
  local tls=$KAFKA_HOME/tls
  [ -f "$tls/keystore.pem" ] && [ -f "$tls/sasl.password" ] && return 0
  command -v openssl >/dev/null || die "openssl is needed to make the stack's test certificates"
  mkdir -p "$tls"
  (
    cd "$tls"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 3650 \
      -subj "/CN=effectively local stack CA" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout broker.key -out broker.csr -subj "/CN=localhost" 2>/dev/null
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >broker.ext
    openssl x509 -req -in broker.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out broker.pem \
      -days 3650 -extfile broker.ext 2>/dev/null
    openssl pkcs8 -topk8 -nocrypt -in broker.key -out broker.pk8
    cat broker.pk8 broker.pem >keystore.pem
    openssl rand -hex 16 >sasl.password
    chmod 600 ca.key broker.key broker.pk8 keystore.pem sasl.password
  ) || die "making the stack's test certificates failed"
}

# The SCRAM user the tests connect as (`effectively`, both SHA-256 and SHA-512), created or
# updated through the plaintext listener: idempotent, so an older stack gets it too.
kafka_scram_user() {
  local pw mechanism
  pw=$(cat "$KAFKA_HOME/tls/sasl.password")
  # One mechanism per request: the broker refuses two credentials of one user in one.
  for mechanism in SCRAM-SHA-256 SCRAM-SHA-512; do
    kafka_java kafka.admin.ConfigCommand --bootstrap-server "$1" --alter --entity-type users \
      --entity-name effectively --add-config "$mechanism=[password=$pw]" \
      >"$KAFKA_HOME/logs/scram-user.log" 2>&1 ||
      { cat "$KAFKA_HOME/logs/scram-user.log" >&2; die "creating the SCRAM user failed"; }
  done
}

kafka_down() { stop_pidfile "$KAFKA_HOME/pid" kafka; }

# ---------------------------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------------------------

pg_own_running() {
  [ -e "$STACK_DIR/pg" ] && pg_bin >/dev/null && as_postgres "$(pg_bin)/pg_ctl" -D "$(pg_data_dir)" status >/dev/null 2>&1
}

pg_up() {
  if [ -n "${DATABASE_URL:-}" ] && ! pg_own_running && pg_answers "$DATABASE_URL"; then
    log "using the PostgreSQL that answers at DATABASE_URL"
    echo "$DATABASE_URL" >"$STACK_DIR/pg.url"
    return 0
  fi
  pg_install
  local bin data port url
  bin=$(pg_bin)
  data=$(pg_data_dir)
  pg_initdb "$data" "$STACK_DIR/initdb.log"
  if pg_own_running; then
    port=$(cat "$STACK_DIR/pg.port")
    log "postgresql already running on 127.0.0.1:$port"
  else
    port=${PG_PORT:-$(cat "$STACK_DIR/pg.port" 2>/dev/null || echo 5432)}
    if port_busy "$port"; then port=$(free_port_from 5432); fi
    echo "$port" >"$STACK_DIR/pg.port"
    log "starting PostgreSQL $("$bin/postgres" --version | awk '{print $3}') on 127.0.0.1:$port (data: $data)"
    pg_start "$data" "$port"
  fi
  url="postgres://postgres@127.0.0.1:$port/$PG_DB"
  pg_create_db "$port"
  echo "$url" >"$STACK_DIR/pg.url"
}

pg_down() {
  [ -e "$STACK_DIR/pg" ] || { rm -f "$STACK_DIR/pg.url"; return 0; }
  local bin data
  bin=$(pg_bin) || return 0
  data=$(pg_data_dir)
  if as_postgres "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    log "stopping postgresql"
    as_postgres "$bin/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null
  fi
  rm -f "$STACK_DIR/pg.url"
}

# ---------------------------------------------------------------------------------------------
# A second PostgreSQL server (on demand only: consumers on two databases, their test and the
# bench's two-database phase). A cluster of its own, so that crashing it leaves the first alone.
# ---------------------------------------------------------------------------------------------

pg2_running() {
  [ -e "$STACK_DIR/pg2" ] && pg_bin >/dev/null && as_postgres "$(pg_bin)/pg_ctl" -D "$(pg_data_dir pg2)" status >/dev/null 2>&1
}

pg2_up() {
  pg_install
  local data port
  data=$(pg_data_dir pg2)
  pg_initdb "$data" "$STACK_DIR/initdb2.log"
  if pg2_running; then
    port=$(cat "$STACK_DIR/pg2.port")
    log "second postgresql already running on 127.0.0.1:$port"
  else
    port=$(cat "$STACK_DIR/pg2.port" 2>/dev/null || echo 5433)
    if port_busy "$port"; then port=$(free_port_from 5433); fi
    echo "$port" >"$STACK_DIR/pg2.port"
    log "starting a second PostgreSQL on 127.0.0.1:$port (data: $data)"
    pg_start "$data" "$port"
  fi
  pg_create_db "$port"
  echo "export DATABASE_URL_2=postgres://postgres@127.0.0.1:$port/$PG_DB" >"$STACK_DIR/pg2.env"
  pg2_env_line
  cat "$STACK_DIR/pg2.env"
}

# pg2_env_line: DATABASE_URL_2 in $STACK_DIR/env as in pg2.env (added, corrected, or removed
# when pg2.env is gone), nothing else of the file touched: the registry and Jaeger start beside
# it and edit their own lines.
pg2_env_line() {
  local env=$STACK_DIR/env line=
  [ -f "$env" ] || return 0
  if [ -f "$STACK_DIR/pg2.env" ]; then line=$(cat "$STACK_DIR/pg2.env"); fi
  if [ -n "$line" ] && grep -qxF "$line" "$env"; then return 0; fi
  { grep -v '^export DATABASE_URL_2=' "$env" || true
    if [ -n "$line" ]; then echo "$line"; fi; } >"$env.tmp.pg2" && mv "$env.tmp.pg2" "$env"
}

# pg2_down [immediate]: a clean stop (fast), or a crash.
pg2_down() {
  [ -e "$STACK_DIR/pg2" ] || return 0
  local bin data
  bin=$(pg_bin) || return 0
  data=$(pg_data_dir pg2)
  if as_postgres "$bin/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    log "stopping the second postgresql${1:+ ($1)}"
    as_postgres "$bin/pg_ctl" -D "$data" -m "${1:-fast}" -w -t 60 stop >/dev/null
  fi
  # A crash keeps DATABASE_URL_2 in the env: the server comes back there with `pg2-up`.
  if [ -z "${1:-}" ]; then
    rm -f "$STACK_DIR/pg2.env"
    pg2_env_line
  fi
}

# ---------------------------------------------------------------------------------------------
# Redis (on demand only: the pre-filter's tests, its benchmark, a user who wants to try it)
# ---------------------------------------------------------------------------------------------

REDIS_HOME=$STACK_DIR/redis

redis_install() {
  command -v redis-server >/dev/null && return 0
  log "installing Debian's redis-server (apt-get)"
  command -v apt-get >/dev/null || die "no redis-server and no apt-get to install it"
  export DEBIAN_FRONTEND=noninteractive
  # The package starts a system-wide Redis on 6379 where it can: forbid that (exit 101, "action
  # forbidden by policy") for the installation; only the binary is wanted.
  local policy=/usr/sbin/policy-rc.d placed=
  if [ ! -e "$policy" ] && [ "$(id -u)" = 0 ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && placed=1
  fi
  local status=0
  { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; } || status=$?
  [ -n "$placed" ] && rm -f "$policy"
  [ "$status" = 0 ] || die "apt-get install redis-server failed"
  command -v redis-server >/dev/null || die "redis-server installed but not on PATH"
}

redis_answers() { redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null | grep -q PONG; }

redis_up() {
  redis_install
  mkdir -p "$REDIS_HOME"
  local port
  if pid_alive "$REDIS_HOME/pid"; then
    port=$(cat "$REDIS_HOME/port")
    log "redis already running (pid $(cat "$REDIS_HOME/pid")) on 127.0.0.1:$port"
  else
    port=${REDIS_PORT:-6379}
    while port_busy "$port"; do port=$((port + 1)); done
    echo "$port" >"$REDIS_HOME/port"
    log "starting $(redis-server --version | awk '{print $1, $3}') on 127.0.0.1:$port (no persistence; log: $REDIS_HOME/redis.log)"
    # A cache, not a store: nothing saved, nothing appended; evicts least recently used keys
    # when REDIS_MAXMEMORY (default none) is reached.
    redis-server --bind 127.0.0.1 --port "$port" --save '' --appendonly no --dir "$REDIS_HOME" \
      --daemonize yes --pidfile "$REDIS_HOME/pid" --logfile "$REDIS_HOME/redis.log" \
      --maxmemory "${REDIS_MAXMEMORY:-0}" --maxmemory-policy allkeys-lru >/dev/null ||
      die "redis-server did not start (see $REDIS_HOME/redis.log)"
    local i
    for i in $(seq 1 50); do redis_answers "$port" && break; sleep 0.1; done
    redis_answers "$port" || die "redis did not answer on 127.0.0.1:$port (see $REDIS_HOME/redis.log)"
  fi
  echo "export REDIS_URL=redis://127.0.0.1:$port" >"$STACK_DIR/redis.env"
  echo "redis://127.0.0.1:$port"
}

redis_down() {
  local sig=${1:-TERM}
  pid_alive "$REDIS_HOME/pid" || { rm -f "$REDIS_HOME/pid" "$STACK_DIR/redis.env"; return 0; }
  local pid i
  pid=$(cat "$REDIS_HOME/pid")
  log "stopping redis (pid $pid, SIG$sig)"
  kill -"$sig" "$pid" 2>/dev/null || true
  for i in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  rm -f "$REDIS_HOME/pid" "$STACK_DIR/redis.env"
}

# ---------------------------------------------------------------------------------------------

write_env() {
  cat >"$STACK_DIR/env" <<EOF
export KAFKA_BROKERS=$(cat "$STACK_DIR/kafka.brokers")
export DATABASE_URL=$(cat "$STACK_DIR/pg.url")
export SCHEMA_REGISTRY_URL=$(registry_url)
EOF
  # The second PostgreSQL, when it was started (`pg2-up`).
  if [ -f "$STACK_DIR/pg2.env" ]; then cat "$STACK_DIR/pg2.env" >>"$STACK_DIR/env"; fi
  # The stack's own broker has TLS and SASL listeners too (not an external one).
  if [ -f "$KAFKA_HOME/port" ] && [ -f "$KAFKA_HOME/tls/ca.pem" ] && pid_alive "$KAFKA_HOME/pid"; then
    local port
    port=$(cat "$KAFKA_HOME/port")
    cat >>"$STACK_DIR/env" <<EOF
export KAFKA_TLS_BROKERS=127.0.0.1:$((port + 2))
export KAFKA_SASL_BROKERS=127.0.0.1:$((port + 3))
export KAFKA_CA_FILE=$KAFKA_HOME/tls/ca.pem
export KAFKA_SASL_PASSWORD_FILE=$KAFKA_HOME/tls/sasl.password
EOF
  fi
}

status() {
  if pid_alive "$KAFKA_HOME/pid"; then
    echo "kafka:      running, pid $(cat "$KAFKA_HOME/pid"), $(cat "$STACK_DIR/kafka.brokers")"
  elif [ -f "$STACK_DIR/kafka.brokers" ] && kafka_answers "$(cat "$STACK_DIR/kafka.brokers")" 2>/dev/null; then
    echo "kafka:      external, $(cat "$STACK_DIR/kafka.brokers")"
  else
    echo "kafka:      stopped"
  fi
  if [ -f "$STACK_DIR/pg.url" ] && pg_answers "$(cat "$STACK_DIR/pg.url")"; then
    echo "postgresql: running, $(cat "$STACK_DIR/pg.url")"
  else
    echo "postgresql: stopped"
  fi
  if [ -f "$STACK_DIR/pg2.env" ]; then
    if pg2_running; then
      echo "postgresql 2: running, $(sed 's/^export DATABASE_URL_2=//' "$STACK_DIR/pg2.env") (on demand)"
    else
      echo "postgresql 2: stopped (crashed? pg2-up starts it)"
    fi
  fi
  if pid_alive "$REDIS_HOME/pid"; then
    echo "redis:      running, pid $(cat "$REDIS_HOME/pid"), redis://127.0.0.1:$(cat "$REDIS_HOME/port") (on demand)"
  fi
  registry_status
  jaeger_status
}

mkdir -p "$STACK_DIR"
case "${1:-}" in
  up)
    kafka_up
    pg_up
    write_env
    cat "$STACK_DIR/env"
    ;;
  down)
    registry_down
    jaeger_down
    kafka_down
    pg_down
    pg2_down
    redis_down
    rm -f "$STACK_DIR/env" "$STACK_DIR/kafka.brokers"
    ;;
  status) status ;;
  env) cat "$STACK_DIR/env" 2>/dev/null || die "stack is not up; run: scripts/stack.sh up" ;;
  logs)
    echo "$KAFKA_HOME/logs/server.log"
    [ -e "$STACK_DIR/pg" ] && echo "$(pg_data_dir)/server.log"
    if [ -e "$STACK_DIR/pg2" ]; then echo "$(pg_data_dir pg2)/server.log"; fi
    if [ -f "$REGISTRY_HOME/registry.log" ]; then echo "$REGISTRY_HOME/registry.log"; fi
    if [ -f "$JAEGER_HOME/jaeger.log" ]; then echo "$JAEGER_HOME/jaeger.log"; fi
    ;;
  reset)
    "$0" down
    rm -rf "$KAFKA_HOME/data" "$KAFKA_HOME/port" "$STACK_DIR/pg.port"
    if [ -e "$STACK_DIR/pg" ]; then rm -rf "$(pg_data_dir)"; rm -rf "$STACK_DIR/pg"; fi
    if [ -e "$STACK_DIR/pg2" ]; then rm -rf "$(pg_data_dir pg2)"; rm -rf "$STACK_DIR/pg2" "$STACK_DIR/pg2.port"; fi
    ;;
  # Fault injection for `make chaos`: crash a service the hard way, and bring it back.
  pg-crash)
    as_postgres "$(pg_bin)/pg_ctl" -D "$(pg_data_dir)" -m immediate stop >/dev/null
    ;;
  kafka-crash)
    pid_alive "$KAFKA_HOME/pid" && kill -KILL "$(cat "$KAFKA_HOME/pid")"
    rm -f "$KAFKA_HOME/pid"
    ;;
  pg2-up) pg2_up ;;
  pg2-down) pg2_down ;;
  pg2-crash) pg2_down immediate ;;
  redis-up) redis_up ;;
  redis-down) redis_down ;;
  redis-crash) redis_down KILL ;;
  registry-up) registry_up ;;
  registry-down) registry_down ;;
  jaeger-up) jaeger_up ;;
  jaeger-down) jaeger_down ;;
  registry-crash)
    pid_alive "$REGISTRY_HOME/pid" && kill -KILL "$(cat "$REGISTRY_HOME/pid")"
    rm -f "$REGISTRY_HOME/pid"
    ;;
  redis-install)
    redis_install
    command -v redis-server
    ;;
  kafka)
    shift
    kafka_jars
    kafka_java "$@"
    ;;
  *)
    sed -n '2,35p' "$0" >&2
    exit 2
    ;;
esac
