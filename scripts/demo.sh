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
# DEMO_VIA_OUTBOX=1 runs the seed's outbox walk: loadgen --via-outbox writes every payment as an
# outbox row (committed in batches of 100) and one `effectively relay` beside the workers
# publishes PaymentSucceeded rows to the demo topic. Loadgen makes no resends then (a relay's
# resend is the relay's own); half-way, besides the worker restart, the relay is SIGKILLed and
# started again: rows it published but had not marked are published again, and the consumer
# must still credit each payment once. Loadgen reads the topic back and prints how many records
# the relay published again. Unpublished PaymentSucceeded rows left by an interrupted run are
# published to this run's topic too (credited, not counted: verification goes by run id).
# The web console (`effectively console`, read-only) runs beside the workers on DEMO_CONSOLE_ADDR
# (default 127.0.0.1:9470, or a free port if that one is taken): its address is printed at the
# start, and at the end how many of the run's parked messages (the poison) its parked page lists.
# Run interactively, the demo then keeps the console up until Enter is pressed.
# DEMO_FORMAT=avro (or protobuf, json-schema) writes the payments in that Schema Registry format
# (Confluent's wire format, loadgen --format): the stack's registry is started if it is not
# running (scripts/stack.sh registry-up), loadgen registers the payment schema under
# <topic>-value, and the consumer decodes with `[consumer.payload] format` and the registry's URL.
# Its poison is of the kinds such a topic meets (no magic byte, an unknown schema id, bytes that
# do not fit the schema, a payment without event_id or with a negative amount). Not with
# DEMO_VIA_OUTBOX=1 (outbox rows are JSON).
# DEMO_STATIC=1 turns static group membership on (`kafka.static_membership`, the workers' ids are
# stable): worker a's restart then happens without a rebalance of the group. Either way the demo
# prints how many group rebalances worker b took part in through the restart, and how long the
# restart took (it must stay under the 10 s session timeout for static membership to help).
# STACK_DIR picks the stack (default .stack/), as for scripts/stack.sh.
#
#   DEMO_SECONDS=60 DEMO_RATE=2000 DEMO_PROFILE=release DEMO_STRATEGY=batch DEMO_PROMETHEUS=0 \
#     DEMO_VIA_OUTBOX=0 DEMO_FORMAT=json scripts/demo.sh
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
VIA_OUTBOX=${DEMO_VIA_OUTBOX:-0}
case "$VIA_OUTBOX" in
  0 | 1) ;;
  *) echo "DEMO_VIA_OUTBOX must be 0 or 1, not $VIA_OUTBOX" >&2; exit 2 ;;
esac
FORMAT=${DEMO_FORMAT:-json}
case "$FORMAT" in
  json | avro | protobuf | json-schema) ;;
  *) echo "DEMO_FORMAT must be json, avro, protobuf or json-schema, not $FORMAT" >&2; exit 2 ;;
esac
if [ "$FORMAT" != json ] && [ "$VIA_OUTBOX" = 1 ]; then
  echo "DEMO_VIA_OUTBOX=1 writes JSON outbox rows: it takes DEMO_FORMAT=json only" >&2; exit 2
fi
# Event ids as UUIDv7 (the default) or Stripe-like text; records plain or as CloudEvents
# (docs/CONFIGURATION.md, "Message ids" and "CloudEvents").
IDS=${DEMO_IDS:-uuid}
case "$IDS" in
  uuid | stripe) ;;
  *) echo "DEMO_IDS must be uuid or stripe, not $IDS" >&2; exit 2 ;;
esac
ENVELOPE=${DEMO_ENVELOPE:-plain}
case "$ENVELOPE" in
  plain | cloudevents) ;;
  *) echo "DEMO_ENVELOPE must be plain or cloudevents, not $ENVELOPE" >&2; exit 2 ;;
esac
if { [ "$IDS" != uuid ] || [ "$ENVELOPE" != plain ]; } && { [ "$FORMAT" != json ] || [ "$VIA_OUTBOX" = 1 ]; }; then
  echo "DEMO_IDS=stripe and DEMO_ENVELOPE=cloudevents take DEMO_FORMAT=json without DEMO_VIA_OUTBOX" >&2; exit 2
fi
RUN=$(date +%Y%m%d%H%M%S)-$$
TOPIC=demo-payments-$RUN
CONSUMER=rewards-demo-$RUN
OUT=target/demo
mkdir -p "$OUT"

say() { printf '\n==> %s\n' "$*"; }

scripts/stack.sh up >/dev/null
if [ "$FORMAT" != json ]; then
  say "schema registry (scripts/stack.sh registry-up)"
  scripts/stack.sh registry-up
fi
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

RELAY_TOML=
if [ "$VIA_OUTBOX" = 1 ]; then
  RELAY_TOML="[relay]
topics = { PaymentSucceeded = \"$TOPIC\" }
batch = 500
poll_interval = \"50ms\"
published = \"keep\""
fi
# A registry format: the consumer decodes the Confluent wire format with the registry's schemas.
PAYLOAD_TOML=
if [ "$FORMAT" != json ]; then
  PAYLOAD_TOML="[consumer.payload]
format = \"$FORMAT\"
registry = \"$SCHEMA_REGISTRY_URL\""
fi
# DEMO_ASSIGNOR (e.g. "range,roundrobin", the eager protocol) replaces the engine's
# cooperative-sticky assignment, to compare rebalances side by side.
KEY_TOML=
if [ "$ENVELOPE" = cloudevents ]; then
  KEY_TOML='envelope = "cloudevents"'
elif [ "$IDS" = stripe ]; then
  KEY_TOML='message_id = { header = "event_id", any_string = true }
event_date = "/occurred_at"'
fi
STATIC_TOML=
if [ "${DEMO_STATIC:-0}" = 1 ]; then
  STATIC_TOML="static_membership = true"
fi
ASSIGNOR_TOML=
if [ -n "${DEMO_ASSIGNOR:-}" ]; then
  ASSIGNOR_TOML="\"partition.assignment.strategy\" = \"$DEMO_ASSIGNOR\""
fi
cat >"$OUT/effectively.toml" <<TOML
[kafka]
session_timeout = "10s"
$STATIC_TOML
[kafka.options]
$ASSIGNOR_TOML
[worker]
revoke_deadline = "5s"
$RELAY_TOML
[[consumer]]
name = "$CONSUMER"
topics = ["$TOPIC"]
handler = { kind = "cashback", rate_bp = 200 }
strategy = "$STRATEGY"
$KEY_TOML
$PAYLOAD_TOML
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
# Group rebalances worker $1 took part in so far (its effectively_group_rebalances_total).
group_rebalances() {
  local port=${DEMO_METRICS_PORT:-9464}
  [ "$1" = b ] && port=$((port + 1))
  curl -fsS "http://127.0.0.1:$port/metrics" 2>/dev/null |
    awk '/^effectively_group_rebalances_total/ { s += $NF } END { print s + 0 }'
}
stop_worker() {
  kill -TERM "${PIDS[$1]}" 2>/dev/null || true
  wait "${PIDS[$1]}" || { echo "worker $1 did not exit cleanly" >&2; return 1; }
}
# DEMO_VIA_OUTBOX=1: the relay, metrics on DEMO_METRICS_PORT + 10 (9474, its default).
start_relay() {
  "$BIN/effectively" relay --config "$OUT/effectively.toml" \
    --metrics-addr "127.0.0.1:$((${DEMO_METRICS_PORT:-9464} + 10))" >>"$OUT/relay.log" 2>&1 &
  PIDS[relay]=$!
}
# Crashes the relay between publishing a batch and marking it: the crash its design answers by
# publishing the batch again. A session of ours takes LOCK TABLE outbox IN SHARE MODE, as a
# stalled disk would hold the relay's commit (loadgen's inserts and the workers' outbox rows wait
# too, a few hundred ms): the relay claims and publishes a batch, the broker acknowledges it, and
# the UPDATE that marks its rows waits for the lock. The relay is SIGKILLed there, and the lock
# released: the dead relay's transaction rolls back, its rows stay unpublished for the next
# relay. If no mark is seen waiting within 5 s, the relay is SIGKILLed wherever it is. Sets
# AIMED to yes or no.
crash_relay() {
  local pid=${PIDS[relay]} ports mark locker
  AIMED=no
  # The relay's own connections (ss shows this user's processes), to tell its UPDATE apart.
  ports=$(ss -tnpH 2>/dev/null | awk -v p="pid=$pid," 'index($0, p) { n = split($4, a, ":"); print a[n] }' | paste -sd, -)
  mark="FROM pg_stat_activity WHERE ${ports:+client_port IN ($ports) AND} wait_event_type = 'Lock'
          AND query LIKE 'UPDATE outbox SET published_at%'"
  # Holds the lock until the mark has waited 0.5 s (time for the SIGKILL below), 5 s at most.
  psql "$DATABASE_URL" -Xq -c "BEGIN; LOCK TABLE outbox IN SHARE MODE; DO \$\$
      DECLARE until_ timestamptz := clock_timestamp() + interval '5 s';
      BEGIN
        LOOP
          PERFORM pg_stat_clear_snapshot();
          EXIT WHEN clock_timestamp() > until_
            OR EXISTS (SELECT 1 $mark AND query_start < clock_timestamp() - interval '0.5 s');
          PERFORM pg_sleep(0.01);
        END LOOP;
      END \$\$; COMMIT" &
  locker=$!
  while kill -0 "$locker" 2>/dev/null; do
    if [ "$(psql "$DATABASE_URL" -XtAc "SELECT count(*) $mark")" != 0 ]; then
      AIMED=yes
      break
    fi
    sleep 0.02
  done
  kill -KILL "$pid"
  wait "$pid" 2>/dev/null || true
  wait "$locker" || true
}
# The console on DEMO_CONSOLE_ADDR, or on a free port if that one is taken; sets CONSOLE_URL.
start_console() {
  local addr=${DEMO_CONSOLE_ADDR:-127.0.0.1:9470} url=
  for try in "$addr" 127.0.0.1:0; do
    : >"$OUT/console.log"
    "$BIN/effectively" console --config "$OUT/effectively.toml" --addr "$try" >>"$OUT/console.log" 2>&1 &
    PIDS[console]=$!
    for _ in $(seq 1 50); do
      # `|| true`: until the console has written its line, grep finds nothing (set -e, pipefail).
      url=$(grep -o 'console listening on http://[^ ]*/' "$OUT/console.log" | head -1 | sed 's/.* on //' || true)
      [ -n "$url" ] && break
      kill -0 "${PIDS[console]}" 2>/dev/null || break
      sleep 0.1
    done
    [ -n "$url" ] && break
    kill -TERM "${PIDS[console]}" 2>/dev/null || true
    wait "${PIDS[console]}" 2>/dev/null || true
  done
  CONSOLE_URL=${url%/}
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

start_console
if [ -n "$CONSOLE_URL" ]; then
  say "web console on $CONSOLE_URL/ (parked messages: $CONSOLE_URL/parked?consumer=$CONSUMER)"
else
  say "web console did not start (see $OUT/console.log)"
fi

say "starting workers a and b (logs: $OUT/worker-*.log)"
: >"$OUT/worker-a.log"; : >"$OUT/worker-b.log"
start_worker a
start_worker b
if [ "$VIA_OUTBOX" = 1 ]; then
  say "starting the outbox relay (log: $OUT/relay.log)"
  : >"$OUT/relay.log"
  start_relay
fi
# Let the group form first: both workers have claimed partitions in PostgreSQL.
for _ in $(seq 1 60); do
  owners=$(psql "$DATABASE_URL" -XtAc "SELECT count(DISTINCT owner) FROM consumer_offsets WHERE consumer = '$CONSUMER'")
  [ "$owners" -ge 2 ] && break
  sleep 0.5
done

if [ "$VIA_OUTBOX" = 1 ]; then
  PATH_ARGS=(--via-outbox)
  MIX="outbox rows for the relay, 1% redrives, 1% double taps, 0.1% poison"
else
  PATH_ARGS=(--resend-rate 0.10)
  MIX="10% resends, 1% redrives, 1% double taps, 0.1% poison"
fi
say "loadgen: $RATE/s for ${SECONDS_}s, $MIX ($STRATEGY strategy, $FORMAT payloads)"
"$BIN/loadgen" --topic "$TOPIC" --partitions "$PARTITIONS" --consumer "$CONSUMER" \
  --rate "$RATE" --duration "${SECONDS_}s" "${PATH_ARGS[@]}" --format "$FORMAT" --ids "$IDS" --envelope "$ENVELOPE" --redrive-rate 0.01 \
  --redrive-delay "$((SECONDS_ / 4 + 1))s" --double-tap-rate 0.01 --poison-rate 0.001 \
  --report-dir target/loadgen ${DEMO_LOADGEN_ARGS:-} &
LOADGEN=$!

sleep "$((SECONDS_ / 2))"
say "rebalance: stopping worker a (SIGTERM) and starting it again"
B_REBALANCES=$(group_rebalances b)
RESTART_AT=$(date +%s.%N)
stop_worker a
start_worker a
RESTART_TOOK=$(awk -v a="$RESTART_AT" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
if [ "$VIA_OUTBOX" = 1 ]; then
  say "relay crash: SIGKILL between publishing a batch and marking it, and a new relay"
  crash_relay
  if [ "$AIMED" = yes ]; then
    echo "killed with a batch acknowledged by the broker and not marked"
  else
    echo "no mark seen waiting within 5 s: killed wherever it was"
  fi
  start_relay
fi

set +e
wait "$LOADGEN"
VERIFIED=$?
set -e
say "worker a's restart took ${RESTART_TOOK}s (stop, start); worker b took part in $(( $(group_rebalances b) - B_REBALANCES )) group rebalance(s) since (static membership: $([ "${DEMO_STATIC:-0}" = 1 ] && echo on || echo off))"
stop_worker a
stop_worker b
unset 'PIDS[a]' 'PIDS[b]'
if [ "$VIA_OUTBOX" = 1 ]; then
  kill -TERM "${PIDS[relay]}" 2>/dev/null || true
  wait "${PIDS[relay]}" || { echo "the relay did not exit cleanly" >&2; VERIFIED=1; }
  unset 'PIDS[relay]'
fi

if [ -n "$CONSOLE_URL" ]; then
  # The run's poison, as the console's parked page counts it: dead letters, FAILED inbox rows.
  PAGE=$(curl -fsS "$CONSOLE_URL/parked?consumer=$CONSUMER&refresh=off" || true)
  COUNTS=($(grep -o '<b class="bad">[0-9,+]*</b>' <<<"$PAGE" | sed 's/<[^>]*>//g' || true))
  say "web console: ${COUNTS[0]:-?} dead letter(s) and ${COUNTS[1]:-?} FAILED inbox row(s) of $CONSUMER at $CONSOLE_URL/parked?consumer=$CONSUMER"
  if [ -t 0 ] && [ "${DEMO_CONSOLE_HOLD:-1}" = 1 ]; then
    read -r -p "The console stays up at $CONSOLE_URL/ until you press Enter. " _ || true
  else
    echo "(later: $BIN/effectively console -c $OUT/effectively.toml)"
  fi
fi

if [ "$VERIFIED" -eq 0 ]; then
  say "verified: every acknowledged payment credited exactly once"
else
  say "NOT verified (loadgen exit $VERIFIED): see target/loadgen/report.html"
fi
echo "HTML report: $ROOT/target/loadgen/report.html"
exit "$VERIFIED"
