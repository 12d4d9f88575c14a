//! The example config `effectively example-config` prints.

/// A complete, commented `effectively.toml`. Every value shown is the default unless its
/// comment says otherwise.
pub const EXAMPLE: &str = r#"# effectively.toml
# Environment overrides: KAFKA_BROKERS, DATABASE_URL, EFFECTIVELY_WORKER_ID, EFFECTIVELY_POOL_SIZE.
# Durations are humantime strings: "5ms", "45s", "5m", "15days".

[kafka]
brokers = "127.0.0.1:9092"
# The group coordinator evicts a member silent this long (librdkafka session.timeout.ms).
session_timeout = "45s"
# The longest gap between polls before librdkafka leaves the group (max.poll.interval.ms).
max_poll_interval = "5m"
# Static membership: a worker restarted within session_timeout gets its partitions back without
# a rebalance. Needs a stable [worker] id (a StatefulSet's pod name). Default off.
# static_membership = true

# TLS to the brokers (security.protocol ssl, or sasl_ssl with [kafka.sasl]); no CA file: the
# system's CAs. Client certificate optional.
# [kafka.tls]
# ca_file = "/etc/effectively/kafka-ca.pem"
# cert_file = "/etc/effectively/client.pem"
# key_file = "/etc/effectively/client.key"
# verify_hostname = true
# SASL: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; the password from a variable or a file, never
# from this file, and never printed.
# [kafka.sasl]
# mechanism = "SCRAM-SHA-512"
# username = "effectively"
# password_env = "KAFKA_PASSWORD"   # or password_file = "/run/secrets/kafka-password"

# Raw librdkafka properties, passed through (they win over the fields above); values of keys
# naming a password or secret are never printed. (Not a default: the default is no options.)
[kafka.options]
"client.id" = "effectively"

[database]
# A password here (or in DATABASE_URL) is never printed.
url = "postgres://postgres@127.0.0.1:5432/effectively"
pool_size = 16
connect_timeout = "5s"
# PostgreSQL ends the session of a zombie worker left inside a transaction after this long.
idle_in_transaction_timeout = "1m"
# A transaction attempt that PostgreSQL has not answered within this (a frozen primary) is
# abandoned on a new connection; keep it above the slowest batch the handler may take.
transaction_deadline = "30s"
# libpq's sslmode: "disable", "prefer" (TLS if offered, nothing verified), "require" (TLS,
# nothing verified), "verify-ca" (the chain must lead to ca_file), "verify-full" (and the
# certificate must name the URL's host: the mode for production). The URL's ?sslmode= and
# &sslrootcert= are read too. Default: the URL's sslmode, else "prefer".
# tls = { mode = "verify-full", ca_file = "/etc/effectively/db-ca.pem" }

# More databases, by name: one per consumer domain (docs/SCALING.md). The same keys as
# [database], each defaulted on its own (not from [database]); the URL's variable is
# DATABASE_URL_<NAME>. A consumer moves to one with `database = "NAME"`: its ledger, offsets,
# inbox, dead letters and effect all live there. `effectively migrate -c` migrates them all.
# [database.orders]
# url = "postgres://postgres@127.0.0.1:5433/effectively"
# pool_size = 16

[worker]
# id = "worker-1"   # default "<hostname>-<pid>"
# Must be less than kafka.session_timeout: revocation must finish before the coordinator
# gives up on this member.
revoke_deadline = "20s"
shutdown_deadline = "30s"
# metrics_addr = "127.0.0.1:9464"   # `effectively run` serves /metrics here by default
#                                   # (--metrics-addr overrides it, or `off`)

# Credits 2% cashback for every payment, a batch of fresh messages per transaction.
[[consumer]]
name = "rewards"            # the dedupe scope, and the Kafka group unless `group` is set
# database = "orders"       # a [database.NAME] for everything this consumer keeps; default [database]
topics = ["payments"]
strategy = "batch"          # or "per-message", or "inbox" (see the last consumer)
handler = { kind = "cashback", rate_bp = 200 }
auto_offset_reset = "earliest"   # only for partitions PostgreSQL has no offset for
on_offset_out_of_range = "stop"  # a stored offset outside the log: "stop", "earliest" or "latest"
message_id = { header = "event_id" }   # or { json_pointer = "/event_id" }; a UUID unless
                            # any_string = true; or "key", or { template = "{/id}:{/status}" }
event_date = "auto"         # "/occurred_at" if present, else the UUIDv7 id's time
on_tombstone = "park"       # a record with a null value: "park" or "skip" (counted, passed over)
max_payload_bytes = 1048576 # bigger payloads are parked as oversized
retention = "15days"        # how long a duplicate is still recognised
future_tolerance = "1day"   # events dated further ahead are parked
partitions_ahead = 3        # daily dedupe partitions created ahead of today
stall_after = "1m"          # a batch retrying this long is a stall (gauge, alert, console)
# Messages a second per worker, for a replay that must not swamp a shared primary (default: no
# limit; `effectively throttle` sets one at run time). The burst: half a second's worth.
# max_rate = 500
# max_rate_burst = 250

# How values (and keys) are encoded: "json" as they are, or "avro", "protobuf", "json-schema" in
# the Confluent wire format, decoded with the writer's schema from a Confluent-compatible Schema
# Registry into the JSON the handlers read. Credentials from a variable or a file, never here.
[consumer.payload]
format = "json"
# registry = "http://127.0.0.1:8081/apis/ccompat/v7"
# key_format = "avro"       # decode the key too (default: its bytes as they are)
# username = "svc"; password_file = "/run/secrets/registry"   # or token_env / token_file
# ca_file = "/etc/effectively/registry-ca.pem"
cache_capacity = 1000       # schemas kept per process (ids never change meaning)
timeout = "10s"             # one registry request
validate = true             # json-schema: check each record against its schema

[consumer.batch]
max_messages = 1000
max_bytes = 4194304
linger = "5ms"              # only while more records are arriving
backlog_max_messages = 1000 # raise to let batches grow while catching up
# Commit groups: the small batches of several partitions share one transaction (fewer COMMITs
# on a topic of many quiet partitions). Unset: on for the batch strategy, except with
# [consumer.version] or [consumer.prefilter]; false gives each batch its own transaction.
# group_partitions = false

[consumer.retry]
max_attempts = 5            # then the batch is split and failing messages are parked
initial_backoff = "100ms"
max_backoff = "10s"

# Copies every payment into a table of your own, one message per transaction. Create it first:
#   CREATE TABLE payment_audit (event_id uuid PRIMARY KEY, amount_paise bigint);
[[consumer]]
name = "audit"
topics = ["payments"]
strategy = "per-message"
message_id = { json_pointer = "/event_id" }
event_date = "/occurred_at"

# `fresh_messages` is a view of the batch's messages this consumer has never applied (columns
# seq, message_id, event_date, partition, offset, kafka_ts, key, payload jsonb); $1 is the
# consumer's name.
[consumer.handler]
kind = "sql"
statement = """
INSERT INTO payment_audit (event_id, amount_paise)
SELECT message_id, (payload->>'amount_paise')::bigint
FROM fresh_messages ORDER BY message_id
"""

# Optional: keys this consumer committed are also set in Redis after each commit, and every
# batch looks its keys up there first (one MGET); hits skip the dedupe insert and the effect.
# A replay of old traffic then costs no transaction per duplicate. Redis is never the
# authority: a miss, an error or a timeout goes to PostgreSQL. (Not a default: off unless set.)
[consumer.prefilter]
redis = "redis://127.0.0.1:6379/0"   # a password here is never printed; a database of its own
ttl = "retention"           # or a shorter duration, e.g. "2days"
timeout = "50ms"            # per lookup (a set: 10x, at most 1s); past it the batch goes on without Redis

# Store first, process later: the receiver stores each batch in the `inbox` table and lets
# Kafka move on at once; processors apply the effect from the table, in order per user, with
# their own retries (the schedule is [consumer.retry]: past max_attempts a row is FAILED).
# `effectively inbox status` and `effectively inbox replay` work on its rows. Create first:
#   CREATE TABLE sms_log (event_id uuid PRIMARY KEY, user_id text);
[[consumer]]
name = "notify"
topics = ["payments"]
strategy = "inbox"
handler = { kind = "sql", statement = """
INSERT INTO sms_log (event_id, user_id)
SELECT message_id, payload->>'user_id' FROM fresh_messages ORDER BY message_id""" }

[consumer.inbox]
processors = 4              # processor tasks in this process (0: receive only)
adaptive = true             # rounds at once adapt (1..processors) to PostgreSQL's CPU
claim_batch = 100           # rows per processor transaction
poll_interval = "100ms"     # an idle processor looks for due rows this often
ordering_key = "kafka_key"  # or { json_pointer = "/user_id" }, or "none"
claim = "lock"              # or "lease": IN_PROGRESS + lease_until, reclaimed after expiry
lease = "5m"                # claim = "lease" only: a dead processor's rows wait this long
done = "keep"               # or "delete"; kept rows go when retention drops their partition

# Versioned writes: each order's last status, moved only forward (out-of-order and stale copies
# change nothing; see docs/CONFIGURATION.md, "Versioned writes").
[[consumer]]
name = "orders"
topics = ["order-status"]
handler = { kind = "order-status" }   # order_status_view (order_id, status, version)

[consumer.version]
aggregate = "/order_id"     # JSON pointers into the payload
version = "/version"
mode = "full-state"         # or "delta": only stored + 1 applies; later versions wait HELD
gap_alert_after = "5m"      # delta: a gap held longer raises EffectivelyVersionGapOverdue

# `effectively relay`: publishes the outbox table's rows to Kafka, in order per aggregate.
[relay]
topics = { CashbackCredited = "cashback-credited" }   # event type -> topic
batch = 500
poll_interval = "100ms"
published = "keep"          # or "delete"
# database = "orders"       # relay a [database.NAME]'s outbox (default [database]; or --database)

# `effectively send`: delivers notifications recorded by handlers (cashback with
# notify = "sms") with idempotency keys.
# [sender]
# request_timeout = "10s"
# sending_timeout = "60s"
# database = "orders"        # a [database.NAME]'s notifications (default [database]; or --database)
# [sender.channels.sms]
# url = "https://sms.example/v1/messages"
# lookup = true              # the provider answers GET url?idempotency_key=K
# on_interrupted = "resend"  # or "skip", when it cannot be asked

# `effectively console`: the web console (lag, parked messages, inbox, outbox, notifications,
# and with writes = true redrive, replay and discard). Without this section: these defaults.
# [console]
# addr = "127.0.0.1:9470"    # any non-loopback address needs a token
# token_env = "EFFECTIVELY_CONSOLE_TOKEN"   # or token_file = "/run/secrets/console-token"
# writes = false             # read-only: every POST is refused
# mask = ["/card/number"]    # JSON pointers shown as *** on every page
# refresh = "5s"             # pages reload themselves (each has a Pause link); "0s": never
# page_size = 50
# database = "orders"        # show a [database.NAME] and its consumers (default [database])

# OpenTelemetry traces over OTLP/HTTP (docs/OPERATIONS.md, "Following one payment through the
# engine"). Off by default: then no header is read and no span is made.
# [tracing]
# enabled = true
# otlp_endpoint = "http://127.0.0.1:4318"   # or OTEL_EXPORTER_OTLP_ENDPOINT; posts /v1/traces
# sampling_ratio = 1.0       # of the traces that start here; a traceparent's decision is kept
# service_name = "effectively"   # the relay and the sender add "-relay" and "-sender"
# export_timeout = "10s"
"#;
