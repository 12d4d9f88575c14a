#!/usr/bin/env bash
# `make demo`: the main job end to end, on the local stack.
#
# Two worker processes in one consumer group run the cashback handler; loadgen produces
# PaymentSucceeded events at DEMO_RATE/s for DEMO_SECONDS over 6 partitions with 10% relay
# resends, 1% redrives, 1% double taps and 0.1% poison; half-way one worker is stopped and
# started again (a real rebalance); then loadgen verifies the ledger and prints the latency
# summary. Exits non-zero if anything was lost or doubled.
#
# DEMO_STRATEGY=inbox runs the consumer with `strategy = "inbox"` (each worker stores messages in
# the inbox table and its 4 processors apply them); loadgen then also waits for the inbox to
# have no PENDING or IN_PROGRESS row before it verifies, and counts FAILED inbox rows as parked.
# STACK_DIR picks the stack (default .stack/), as for scripts/stack.sh.
#
#   DEMO_SECONDS=60 DEMO_RATE=2000 DEMO_PROFILE=release DEMO_STRATEGY=batch DEMO_PROMETHEUS=0 scripts/demo.sh
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
SECONDS_=${DEMO_SECONDS:-60}
RATE=${DEMO_RATE:-2000}
PROFILE=${DEMO_PROFILE:-release}
PARTITIONS=${DEMO_PARTITIONS:-6}
STRATEGY=${DEMO_STRATEGY:-batch}
case "$STRATEGY" in
  batch | inbox) ;;
  *) echo "DEMO_STRATEGY must be batch or inbox, not $STRATEGY" >&2; exit 2 ;;
esac
RUN=$(date +%Y%m%d%H%M%S)-$$
TOPIC=demo-payments-$RUN
CONSUMER=rewards-demo-$RUN
OUT=target/demo
mkdir -p "$OUT"

say() { printf '\n==> %s\n' "$*"; }

scripts/stack.sh up >/dev/null
# shellcheck disable=SC1091
source "${STACK_DIR:-$ROOT/.stack}/env"

say "building ($PROFILE)"
if [ "$PROFILE" = release ]; then
  cargo build -q --release --workspace --bins
else
  # The same features as `make test`'s debug build, so nothing is rebuilt.
  cargo build -q --workspace --bins --features effectively/failpoints
fi
BIN=target/$PROFILE
"$BIN/effectively" migrate >/dev/null

say "topic $TOPIC ($PARTITIONS partitions)"
scripts/stack.sh kafka org.apache.kafka.tools.TopicCommand --bootstrap-server "$KAFKA_BROKERS" \
  --create --topic "$TOPIC" --partitions "$PARTITIONS" --replication-factor 1 >/dev/null

cat >"$OUT/effectively.toml" <<TOML
[kafka]
session_timeout = "10s"
[kafka.options]
"heartbeat.interval.ms" = "1000"
[worker]
revoke_deadline = "5s"
[[consumer]]
name = "$CONSUMER"
topics = ["$TOPIC"]
handler = { kind = "cashback", rate_bp = 200 }
strategy = "$STRATEGY"
TOML

declare -A PIDS=()
# Worker a serves metrics on 127.0.0.1:9464, b on 9465 (grafana/prometheus.yml scrapes both);
# DEMO_METRICS_PORT moves the pair (a demo beside another one).
start_worker() {
  local port=${DEMO_METRICS_PORT:-9464}
  [ "$1" = b ] && port=$((port + 1))
  EFFECTIVELY_WORKER_ID="worker-$1" "$BIN/effectively" run --config "$OUT/effectively.toml" \
    --metrics-addr "127.0.0.1:$port" >>"$OUT/worker-$1.log" 2>&1 &
  PIDS[$1]=$!
}
stop_worker() {
  kill -TERM "${PIDS[$1]}" 2>/dev/null || true
  wait "${PIDS[$1]}" || { echo "worker $1 did not exit cleanly" >&2; return 1; }
}
cleanup() {
  for w in "${!PIDS[@]}"; do kill -TERM "${PIDS[$w]}" 2>/dev/null || true; done
  [ -n "${PROM:-}" ] && kill -TERM "$PROM" 2>/dev/null
  wait 2>/dev/null || true
}
trap cleanup EXIT

# DEMO_PROMETHEUS=1: record the workers' metrics with Debian's Prometheus while the demo runs
# (grafana/prometheus.yml scrapes 127.0.0.1:9464 and 9465; data kept in target/demo/prometheus).
if [ "${DEMO_PROMETHEUS:-0}" = 1 ]; then
  command -v prometheus >/dev/null || bash scripts/check-monitoring.sh >/dev/null
  mkdir -p "$OUT/prometheus"
  prometheus --config.file=grafana/prometheus.yml --storage.tsdb.path="$OUT/prometheus" \
    --web.listen-address=127.0.0.1:9090 >"$OUT/prometheus.log" 2>&1 &
  PROM=$!
  say "prometheus on http://127.0.0.1:9090 (data: $OUT/prometheus)"
fi

say "starting workers a and b (logs: $OUT/worker-*.log)"
: >"$OUT/worker-a.log"; : >"$OUT/worker-b.log"
start_worker a
start_worker b
# Let the group form first: both workers have claimed partitions in PostgreSQL.
for _ in $(seq 1 60); do
  owners=$(psql "$DATABASE_URL" -XtAc "SELECT count(DISTINCT owner) FROM consumer_offsets WHERE consumer = '$CONSUMER'")
  [ "$owners" -ge 2 ] && break
  sleep 0.5
done

say "loadgen: $RATE/s for ${SECONDS_}s, 10% resends, 1% redrives, 1% double taps, 0.1% poison ($STRATEGY strategy)"
"$BIN/loadgen" --topic "$TOPIC" --partitions "$PARTITIONS" --consumer "$CONSUMER" \
  --rate "$RATE" --duration "${SECONDS_}s" --resend-rate 0.10 --redrive-rate 0.01 \
  --redrive-delay "$((SECONDS_ / 4 + 1))s" --double-tap-rate 0.01 --poison-rate 0.001 \
  --report-dir target/loadgen ${DEMO_LOADGEN_ARGS:-} &
LOADGEN=$!

sleep "$((SECONDS_ / 2))"
say "rebalance: stopping worker a (SIGTERM) and starting it again"
stop_worker a
start_worker a

set +e
wait "$LOADGEN"
VERIFIED=$?
set -e
stop_worker a
stop_worker b
unset 'PIDS[a]' 'PIDS[b]'

if [ "$VERIFIED" -eq 0 ]; then
  say "verified: every acknowledged payment credited exactly once"
else
  say "NOT verified (loadgen exit $VERIFIED): see target/loadgen/report.html"
fi
echo "HTML report: $ROOT/target/loadgen/report.html"
exit "$VERIFIED"
