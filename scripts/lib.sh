# shellcheck shell=bash
# Helpers shared by scripts/stack.sh (the single-node stack) and scripts/cluster.sh (three Kafka
# nodes, a PostgreSQL primary and its standby). Sourced, not run: the caller sets ROOT,
# STACK_DIR, KAFKA_HOME (the folder whose lib/ holds the jars), POM and PG_DB, and may set
# LOG_TAG (the prefix of messages) and PG_DATA_KEY (see pg_data_dir).

log() { printf '[%s] %s\n' "${LOG_TAG:-stack}" "$*" >&2; }
die() { printf '[%s] error: %s\n' "${LOG_TAG:-stack}" "$*" >&2; exit 1; }

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port_from() {
  local p=$1 n=${2:-2} i busy
  while :; do
    busy=
    for i in $(seq 0 $((n - 1))); do port_busy "$((p + i))" && busy=1; done
    [ -z "$busy" ] && break
    p=$((p + n))
  done
  echo "$p"
}
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# wait_started NAME PIDFILE LOG SECONDS READY_FN: until READY_FN succeeds (every 0.5 s, SECONDS at
# most); fails at once, with the log's tail, if the process behind PIDFILE exits meanwhile.
wait_started() {
  local name=$1 pidfile=$2 logfile=$3 seconds=$4 ready=$5 i
  for i in $(seq 1 $((seconds * 2))); do
    "$ready" && return 0
    if ! pid_alive "$pidfile"; then
      tail -30 "$logfile" >&2 || true
      rm -f "$pidfile"
      die "$name exited during start-up"
    fi
    sleep 0.5
  done
  die "$name was not ready within $seconds s (see $logfile)"
}

# stop_pidfile PIDFILE NAME: SIGTERM, up to 30 s to exit, then SIGKILL.
stop_pidfile() {
  local pidfile=$1 name=$2 pid i
  pid_alive "$pidfile" || { rm -f "$pidfile"; return 0; }
  pid=$(cat "$pidfile")
  log "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  for i in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -0 "$pid" 2>/dev/null && { log "$name did not stop in 30 s; killing it"; kill -KILL "$pid" 2>/dev/null || true; }
  rm -f "$pidfile"
}

# ---------------------------------------------------------------------------------------------
# Kafka
# ---------------------------------------------------------------------------------------------

kafka_version() { sed -n 's#.*<artifactId>kafka_2.13</artifactId><version>\([^<]*\)<.*#\1#p' "$POM"; }
# The hash of $POM and, when POM_SOURCES names a folder (a pom that builds classes of its own),
# of every file under it.
kafka_pom_hash() {
  {
    cat "$POM"
    if [ -n "${POM_SOURCES:-}" ]; then find "$POM_SOURCES" -type f | LC_ALL=C sort | xargs cat; fi
  } | sha256sum | cut -c1-16
}
# kafka_jars_current DIR: DIR holds the jars of the current pom.
kafka_jars_current() { [ "$(kafka_pom_hash)" = "$(cat "$1/.pom-hash" 2>/dev/null || true)" ]; }

# mvn_jars DIR WHAT [BUILT]: the runtime jars of $POM copied into DIR (through DIR.tmp, stamped
# with the pom's hash), unless DIR holds the current pom's already; WHAT names them in messages.
# BUILT: the jar of the pom's own classes, which `mvn package` makes first and DIR gets too.
mvn_jars() {
  local dir=$1 what=$2 built=${3:-}
  kafka_jars_current "$dir" && return 0
  command -v mvn >/dev/null || die "mvn is needed to fetch $what from Maven Central"
  log "fetching $what with mvn (cached in ~/.m2 and $dir)"
  rm -rf "$dir.tmp"
  mvn -B -q -f "$POM" ${built:+package} dependency:copy-dependencies \
    -DoutputDirectory="$dir.tmp" -DincludeScope=runtime >"$STACK_DIR/mvn.log" 2>&1 ||
    { tail -30 "$STACK_DIR/mvn.log" >&2; die "mvn could not fetch $what"; }
  [ -z "$built" ] || cp "$built" "$dir.tmp/"
  kafka_pom_hash >"$dir.tmp/.pom-hash"
  rm -rf "${dir:?}"
  mv "$dir.tmp" "$dir"
}

kafka_jars() { mvn_jars "$KAFKA_HOME/lib" "Apache Kafka $(kafka_version) jars"; }

# KAFKA_CLASSPATH_EXTRA: a folder of classes of the caller's own, after the jars.
kafka_java() {
  java -cp "$KAFKA_HOME/lib/*${KAFKA_CLASSPATH_EXTRA:+:$KAFKA_CLASSPATH_EXTRA}" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" \
    -Dkafka.logs.dir="$KAFKA_HOME/logs" "$@"
}

kafka_answers() {
  kafka_java org.apache.kafka.tools.BrokerApiVersionsCommand --bootstrap-server "$1" >/dev/null 2>&1
}

# kafka_format PROPERTIES CLUSTER_ID LOGFILE: format a node's log dirs (once, before its start).
kafka_format() {
  kafka_java kafka.tools.StorageTool format -t "$2" -c "$1" >"$3" 2>&1 ||
    { cat "$3" >&2; die "kafka storage format failed"; }
}

# kafka_spawn PROPERTIES LOGS PIDFILE HEAP: kafka.Kafka in the background, in a session of its
# own, its output under LOGS and its pid in PIDFILE.
kafka_spawn() {
  setsid nohup java -Xms256m -Xmx"$4" -XX:+UseG1GC -Djava.awt.headless=true \
    -cp "$KAFKA_HOME/lib/*" -Dlog4j2.configurationFile="$ROOT/scripts/kafka/log4j2.properties" \
    -Dkafka.logs.dir="$2" kafka.Kafka "$1" >"$2/stdout.log" 2>&1 </dev/null &
  echo $! >"$3"
}

# kafka_wait PIDFILE LOGS CHECK...: until the command CHECK succeeds (90 s at most); fails at
# once, with the log's tail, if the process exits meanwhile.
kafka_wait() {
  local pidfile=$1 logs=$2 i
  shift 2
  for i in $(seq 1 90); do
    if ! pid_alive "$pidfile"; then
      tail -30 "$logs/stdout.log" "$logs/server.log" >&2 || true
      die "kafka exited during start-up"
    fi
    "$@" && return 0
    sleep 1
  done
  die "kafka did not answer within 90 s (see $logs/server.log)"
}

# ---------------------------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------------------------

pg_bin() {
  local d
  for d in /usr/lib/postgresql/15/bin /usr/lib/postgresql/*/bin; do
    [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  return 1
}

pg_install() {
  pg_bin >/dev/null && return 0
  log "installing Debian's PostgreSQL 15 (apt-get)"
  command -v apt-get >/dev/null || die "no PostgreSQL binaries and no apt-get to install them"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # postgresql-15 alone: the binaries, without Debian's auto-started "main" cluster.
  apt-get install -y -qq postgresql-15 postgresql-client-15 >/dev/null || die "apt-get install postgresql-15 failed"
  pg_bin >/dev/null || die "PostgreSQL installed but initdb not found"
}

pg_answers() { psql "$1" -XtAc 'select 1' >/dev/null 2>&1; }

as_postgres() {
  if [ "$(id -u)" = 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi
}

# pg_data_dir [NAME]: the data folder $STACK_DIR/NAME (default pg), unless the postgres user
# cannot reach it (a clone under /root), in which case it lives under /var/lib/effectively
# (in a folder named after PG_DATA_KEY, default the checkout) and $STACK_DIR/NAME points there.
pg_data_dir() {
  local name=${1:-pg}
  local link=$STACK_DIR/$name
  if [ -L "$link" ]; then readlink "$link"; return 0; fi
  if [ -d "$link" ]; then echo "$link"; return 0; fi
  mkdir -p "$link"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$link"
  if as_postgres test -w "$link"; then echo "$link"; return 0; fi
  rmdir "$link"
  local real
  real=/var/lib/effectively/$(printf '%s' "${PG_DATA_KEY:-$ROOT}" | sha256sum | cut -c1-12)/$name
  mkdir -p "$real"
  chown postgres:postgres "$real" "$(dirname "$real")"
  ln -s "$real" "$link"
  echo "$real"
}

# pg_initdb DATA LOGFILE: a new cluster in DATA (nothing if it has one), trust auth on loopback.
pg_initdb() {
  [ -f "$1/PG_VERSION" ] && return 0
  log "initdb into $1"
  [ "$(id -u)" = 0 ] && chown postgres:postgres "$1"
  as_postgres "$(pg_bin)/initdb" -D "$1" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 \
    >"$2" 2>&1 || { cat "$2" >&2; die "initdb failed"; }
}

# pg_start DATA PORT [OPTIONS]: postgres on 127.0.0.1:PORT only (no Unix socket), its log in
# DATA/server.log. fsync and synchronous_commit stay on: we sell durability, and measure with it.
# max_prepared_transactions: the bench's Flink peer commits through XA (PREPARE TRANSACTION),
# which PostgreSQL refuses at its default of 0; 64 holds its 6 sinks' transactions of two
# checkpoints and a crashed run's leftovers. Set at start-up (it needs a restart to change).
pg_start() {
  as_postgres "$(pg_bin)/pg_ctl" -D "$1" -l "$1/server.log" -w -t 60 start -o \
    "-p $2 -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c max_connections=300 \
     -c shared_buffers=256MB -c max_wal_size=2GB -c fsync=on -c synchronous_commit=on \
     -c shared_preload_libraries=pg_stat_statements -c max_prepared_transactions=64 ${3:-}" \
    >/dev/null || { tail -30 "$1/server.log" >&2; die "postgresql did not start"; }
}

# pg_create_db PORT: the database PG_DB, unless it exists.
pg_create_db() {
  local admin="postgres://postgres@127.0.0.1:$1/postgres"
  if ! psql "$admin" -XtAc "select 1 from pg_database where datname = '$PG_DB'" | grep -q 1; then
    psql "$admin" -Xqc "create database $PG_DB" >/dev/null
  fi
}
