# shellcheck shell=bash
# Jaeger v2, the trace backend of the local stack: the engine's OTLP spans (`[tracing]`) go to it,
# and tests/traces.rs and the bench's tracing phase read them back from its query API. On demand
# only, like Redis and the registry: `scripts/stack.sh jaeger-up`. Sourced by scripts/stack.sh
# after lib.sh (log, die, pid_alive, stop_pidfile, port_busy).
#
# - Built from the Go module proxy in a module of our own under $STACK_DIR/jaeger/build (`go mod
#   init`, `go get -tool github.com/jaegertracing/jaeger/cmd/jaeger@vVERSION`, `go build`):
#   `go install ...@version` refuses the module because its go.mod has a replace directive. The
#   first build takes about 4 minutes on two cores; the binary is cached as
#   $STACK_DIR/jaeger/jaeger-VERSION. JAEGER_BIN names an already built binary instead.
# - The all-in-one: OTLP in (gRPC 4317, HTTP 4318), traces in memory (lost when it stops), the
#   query API on 16686 (`/api/traces/{id}`, `/api/traces?service=...`; this build has no web UI).
#   Our own config ($STACK_DIR/jaeger/config.yaml) binds everything to 127.0.0.1: Jaeger's
#   defaults put the query service on every interface and add listeners we do not need.
# - Ports: JAEGER_OTLP_GRPC_PORT (4317), JAEGER_OTLP_HTTP_PORT (4318), JAEGER_QUERY_PORT (16686),
#   JAEGER_QUERY_GRPC_PORT (16685), JAEGER_HEALTH_PORT (13133). Writes $STACK_DIR/jaeger.env
#   (JAEGER_OTLP_ENDPOINT, JAEGER_QUERY_URL) and the same lines into $STACK_DIR/env.

JAEGER_VERSION=1.75.0
JAEGER_HOME=$STACK_DIR/jaeger

jaeger_otlp_endpoint() { echo "http://127.0.0.1:${JAEGER_OTLP_HTTP_PORT:-4318}"; }
jaeger_query_url() { echo "http://127.0.0.1:${JAEGER_QUERY_PORT:-16686}"; }

jaeger_ready() {
  curl -fsS -m 2 "$(jaeger_query_url)/api/services" >/dev/null 2>&1 &&
    port_busy "${JAEGER_OTLP_HTTP_PORT:-4318}"
}

# jaeger_bin: the path of a Jaeger binary: JAEGER_BIN, else the cached build, else a new build.
jaeger_bin() {
  if [ -n "${JAEGER_BIN:-}" ]; then
    [ -x "$JAEGER_BIN" ] || die "JAEGER_BIN=$JAEGER_BIN is not an executable"
    echo "$JAEGER_BIN"
    return 0
  fi
  local bin=$JAEGER_HOME/jaeger-$JAEGER_VERSION build=$JAEGER_HOME/build
  [ -x "$bin" ] && { echo "$bin"; return 0; }
  command -v go >/dev/null || die "Go 1.24+ is needed to build Jaeger (or set JAEGER_BIN)"
  mkdir -p "$JAEGER_HOME"
  # One build at a time (tests start Jaeger in parallel); the second waits, then finds the binary.
  exec 8>"$JAEGER_HOME/build.lock"
  flock 8
  if [ ! -x "$bin" ]; then
    log "building Jaeger $JAEGER_VERSION from the Go module proxy (about 4 minutes on two cores; log: $JAEGER_HOME/build.log)"
    rm -rf "$build"
    mkdir -p "$build"
    (
      cd "$build"
      go mod init effectively-jaeger-build &&
        go get -tool "github.com/jaegertracing/jaeger/cmd/jaeger@v$JAEGER_VERSION" &&
        nice -n 10 go build -o jaeger github.com/jaegertracing/jaeger/cmd/jaeger
    ) >"$JAEGER_HOME/build.log" 2>&1 || { tail -30 "$JAEGER_HOME/build.log" >&2; flock -u 8; die "building Jaeger failed"; }
    mv "$build/jaeger" "$bin"
  fi
  flock -u 8
  echo "$bin"
}

# jaeger_config: the all-in-one's config, every listener on loopback.
jaeger_config() {
  cat >"$JAEGER_HOME/config.yaml" <<EOF
# Written by scripts/jaeger.sh: Jaeger's all-in-one, on loopback only, traces in memory.
service:
  extensions: [jaeger_storage, jaeger_query, healthcheckv2]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: info

extensions:
  jaeger_storage:
    backends:
      memstore:
        memory:
          max_traces: ${JAEGER_MAX_TRACES:-100000}
  jaeger_query:
    storage:
      traces: memstore
    http:
      endpoint: 127.0.0.1:${JAEGER_QUERY_PORT:-16686}
    grpc:
      endpoint: 127.0.0.1:${JAEGER_QUERY_GRPC_PORT:-16685}
  healthcheckv2:
    use_v2: true
    http:
      endpoint: 127.0.0.1:${JAEGER_HEALTH_PORT:-13133}

receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:${JAEGER_OTLP_GRPC_PORT:-4317}
      http:
        endpoint: 127.0.0.1:${JAEGER_OTLP_HTTP_PORT:-4318}

exporters:
  jaeger_storage_exporter:
    trace_storage: memstore
EOF
}

# jaeger_env_lines: JAEGER_OTLP_ENDPOINT and JAEGER_QUERY_URL in $STACK_DIR/jaeger.env, and in
# $STACK_DIR/env (added or corrected in place, nothing else of it touched).
jaeger_env_lines() {
  local env=$STACK_DIR/env otlp query
  otlp="export JAEGER_OTLP_ENDPOINT=$(jaeger_otlp_endpoint)"
  query="export JAEGER_QUERY_URL=$(jaeger_query_url)"
  printf '%s\n%s\n' "$otlp" "$query" >"$STACK_DIR/jaeger.env"
  [ -f "$env" ] || return 0
  grep -qxF "$otlp" "$env" && grep -qxF "$query" "$env" && return 0
  { grep -v -e '^export JAEGER_OTLP_ENDPOINT=' -e '^export JAEGER_QUERY_URL=' "$env" || true
    echo "$otlp"; echo "$query"; } >"$env.tmp" && mv "$env.tmp" "$env"
}

jaeger_up() {
  mkdir -p "$JAEGER_HOME"
  # One start at a time: a second jaeger-up waits, then finds it running.
  exec 9>"$JAEGER_HOME/up.lock"
  flock 9
  if pid_alive "$JAEGER_HOME/pid"; then
    log "jaeger already running (pid $(cat "$JAEGER_HOME/pid")), OTLP $(jaeger_otlp_endpoint), query $(jaeger_query_url)"
    jaeger_wait
  elif jaeger_ready; then
    log "using the Jaeger that answers at $(jaeger_query_url) (not started by this stack)"
  else
    local port bin
    for port in "${JAEGER_OTLP_GRPC_PORT:-4317}" "${JAEGER_OTLP_HTTP_PORT:-4318}" "${JAEGER_QUERY_PORT:-16686}" \
      "${JAEGER_QUERY_GRPC_PORT:-16685}" "${JAEGER_HEALTH_PORT:-13133}"; do
      port_busy "$port" && die "port $port is taken by another program; see JAEGER_*_PORT in scripts/jaeger.sh"
    done
    bin=$(jaeger_bin)
    jaeger_config
    log "starting Jaeger $JAEGER_VERSION: OTLP $(jaeger_otlp_endpoint), query $(jaeger_query_url) (log: $JAEGER_HOME/jaeger.log)"
    setsid nohup "$bin" --config "$JAEGER_HOME/config.yaml" >"$JAEGER_HOME/jaeger.log" 2>&1 </dev/null &
    echo $! >"$JAEGER_HOME/pid"
    jaeger_wait
  fi
  jaeger_env_lines
  flock -u 9
  cat "$STACK_DIR/jaeger.env"
}

# jaeger_wait: until the query API and the OTLP port answer (60 s at most); fails at once, with the
# log's tail, if the process exits meanwhile.
jaeger_wait() { wait_started jaeger "$JAEGER_HOME/pid" "$JAEGER_HOME/jaeger.log" 60 jaeger_ready; }

jaeger_down() {
  stop_pidfile "$JAEGER_HOME/pid" jaeger
  rm -f "$STACK_DIR/jaeger.env"
}

jaeger_status() {
  if pid_alive "$JAEGER_HOME/pid"; then
    echo "jaeger:     running, pid $(cat "$JAEGER_HOME/pid"), OTLP $(jaeger_otlp_endpoint), query $(jaeger_query_url) (on demand)"
  fi
}
