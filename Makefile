# The two commands a newcomer needs: `make demo` and `make test`. Both start the local stack
# (a real Kafka and PostgreSQL under .stack/) when it is not running yet.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
STACK := scripts/stack.sh
# The stack's folder: .stack/ unless STACK_DIR names another (for example a second stack that
# `make chaos` may crash without disturbing anyone). scripts/stack.sh and demo.sh read it too.
export STACK_DIR ?= $(CURDIR)/.stack
# Every command that talks to the stack reads its addresses from $(STACK_DIR)/env.
WITH_ENV := source $(STACK_DIR)/env &&

.PHONY: up down status build migrate lint test demo bench microbench chaos chaos-cluster chaos-net net-deps \
	cluster-up cluster-down \
	registry-up registry-down jaeger-up jaeger-down pg2-up pg2-down soak fuzz

up:
	@$(STACK) up >/dev/null

# Stops the registry and Redis too, when they run.
down:
	@$(STACK) down

status:
	@$(STACK) status

build:
	cargo build --workspace --all-targets

migrate: up
	$(WITH_ENV) cargo run -q --bin effectively $(DEBUG_FEATURES) -- migrate

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# The crate's documentation, built as docs.rs would, failing on any rustdoc warning (a broken or
# private link). Not in `make test`: it checks every dependency again (about two minutes here).
.PHONY: doc
doc:
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -q -p effectively

# The Prometheus config, alert rules (with their unit tests) and Grafana dashboard under grafana/:
# promtool (Debian's prometheus package, installed if missing) and a JSON check. No service needed.
.PHONY: monitoring-check
monitoring-check:
	bash scripts/check-monitoring.sh

# The deployment examples under deploy/ (Kubernetes manifests, the systemd unit), offline: a Go
# checker (deploy/check: k8s.io/api's typed structs, strict; our probe, grace-period and selector
# rules), systemd-analyze verify, and broken copies that must be refused. No cluster needed.
.PHONY: deploy-check
deploy-check:
	bash scripts/check-deploy.sh

# Debug builds carry the chaos failpoints (inert unless FAILPOINTS is set); release never does.
DEBUG_FEATURES := --features effectively/failpoints

# Every test (the Schema Registry's with the stack's Apicurio, and two consumers on two
# databases with the stack's second PostgreSQL, both started here; tests/fuzz.rs, the
# fuzz targets on stable with proptest: `make fuzz` runs them under libFuzzer), the short chaos
# subset (and its hard bounce under the inbox strategy and with commit groups), chaos-net's quick
# scenario (a worker cut off from PostgreSQL for 15 s), 3 minutes of the soak at 500 msg/s (a
# worker SIGKILL, a PostgreSQL restart, a link cut, a broker restart), a short
# out-of-order order-status stream (versioned writes, full-state and delta), a short demo run
# (10 s at 500 msg/s) that must verify, its outbox walk, and 10 s of it in Avro through the
# registry (loadgen's serializers against the engine's decoding), 10 s of CloudEvents with
# Stripe-like ids (binary and structured copies of one event), and one short failover
# scenario on the cluster stack (an asynchronous standby promoted without the primary's last
# commits: nothing lost), the cluster stopped again.
# To stay well under CI's 30 minutes: the stack starts while clippy runs, the test binaries
# run in shards at once (scripts/test.sh), and the soak runs on a stack of its own
# (.stack-soak, stopped after it) beside the orders runs and the demos, which wait on Kafka
# and PostgreSQL more than they compute (the soak alone took 3 min 40 s of a clean-clone run,
# 2026-12-07). The failover scenario runs last, alone: beside the
# demos it once failed its harness's wait for the standby (2026-12-07), so it keeps the machine.
SOAK_STACK := $(CURDIR)/.stack-soak
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target registry-up jaeger-up pg2-up lint
	$(MAKE) --no-print-directory monitoring-check deploy-check migrate
	cargo build -q --workspace --bins $(DEBUG_FEATURES)
	$(WITH_ENV) scripts/test.sh $(DEBUG_FEATURES)
	$(WITH_ENV) target/debug/loadgen chaos --quick
	$(WITH_ENV) target/debug/loadgen chaos --quick --strategy inbox --scenario hard-bounce
	$(WITH_ENV) target/debug/loadgen chaos --quick --group-partitions --scenario hard-bounce
	$(MAKE) --no-print-directory net-deps
	$(WITH_ENV) target/debug/loadgen chaos-net --quick
	{ export STACK_DIR=$(SOAK_STACK) && $(STACK) up >/dev/null && source $(SOAK_STACK)/env && \
	  target/debug/effectively migrate >/dev/null && \
	  SOAK_DURATION=3m target/debug/loadgen soak --rate 500; } >target/soak-test.log 2>&1 & soak=$$!; \
	echo "soak: 3 minutes at 500 msg/s on $(SOAK_STACK), beside the runs below (log: target/soak-test.log)"; \
	status=0; \
	{ $(WITH_ENV) target/debug/loadgen orders --quick && \
	  $(WITH_ENV) target/debug/loadgen orders --quick --mode delta && \
	  DEMO_SECONDS=10 DEMO_RATE=500 DEMO_PROFILE=debug scripts/demo.sh && \
	  DEMO_SECONDS=10 DEMO_RATE=300 DEMO_PROFILE=debug DEMO_VIA_OUTBOX=1 scripts/demo.sh && \
	  DEMO_SECONDS=10 DEMO_RATE=300 DEMO_PROFILE=debug DEMO_FORMAT=avro scripts/demo.sh && \
	  DEMO_SECONDS=10 DEMO_RATE=300 DEMO_PROFILE=debug DEMO_IDS=stripe DEMO_ENVELOPE=cloudevents scripts/demo.sh; \
	} || status=1; \
	wait $$soak || status=1; \
	echo "== soak (target/soak-test.log)"; cat target/soak-test.log; \
	STACK_DIR=$(SOAK_STACK) $(STACK) down; exit $$status
	$(MAKE) --no-print-directory cluster-up
	status=0; $(WITH_CLUSTER) target/debug/loadgen chaos-cluster --quick || status=1; \
	$(CLUSTER) down; exit $$status

# Two workers, loadgen at 2,000 msg/s for 60 s with duplicates and poison, a rebalance
# half-way, then the verification. DEMO_SECONDS, DEMO_RATE, DEMO_PROFILE, DEMO_VIA_OUTBOX,
# DEMO_IDS=stripe and DEMO_ENVELOPE=cloudevents change it;
# DEMO_FORMAT=avro (protobuf, json-schema) writes Schema Registry payloads, starting the registry.
demo: up
	scripts/demo.sh

# Side by side, one run: the SQL ceiling, the batch and per-message strategies draining a
# pre-filled topic, Kafka Connect with a JDBC sink as their peer (its jars fetched by
# scripts/connect.sh), Flink's exactly-once JDBC sink (XA) as another (peers/flink-xa, built
# with mvn by scripts/flink.sh: drains at two checkpoint intervals, p99 at 2,000 msg/s, a SIGKILL
# and a restart from its checkpoint), the inbox's processor curve and its processors against
# River (the Go job queue: loadgen builds peers/river with Go 1.26 into target/peers/, modules
# from the Go module proxy), latency at 500 and 2,000 msg/s, the pre-filter's replays, 1 to 3
# workers on one topic, RSS and CPU per message, the batch drain in JSON, Avro, Protobuf and
# JSON Schema (the stack's Schema Registry, started if need be), and two consumers on two
# PostgreSQL servers against both on one (the stack's second server, started here). Writes
# target/bench/report.json. BENCH_SCALE=quick takes about 10 minutes; BENCH_ONLY=river,inbox runs
# some phases (BENCH_ONLY=drains,latency,flink gives batch_vs_flink_xa and the p99 ratio).
bench: up pg2-up
	cargo build -q --release --workspace --bins
	scripts/connect.sh fetch
	scripts/flink.sh build
	$(WITH_ENV) target/release/effectively migrate >/dev/null
	$(WITH_ENV) target/release/loadgen bench

# Criterion micro-benchmarks of the per-record hot paths (no services needed).
microbench:
	cargo bench --bench hot_paths

# Fuzzing (scripts/fuzz.sh; docs/RELIABILITY.md, "Fuzzed input"): every cargo-fuzz target of
# fuzz/ (the record decoder, the registry formats' decoders, the config loader, the console's
# queries and forms) under libFuzzer for FUZZ_SECONDS each, on the nightly toolchain
# (cargo-fuzz installed if missing). No services needed. A crash is copied into
# fuzz/regressions/<target>/, which tests/fuzz.rs replays in `make test`.
# Not in `make test`: a cold build of the targets on nightly (the engine and its C libraries
# again, in release) took 33 minutes on this machine. `make test`'s short budget is
# tests/fuzz.rs: the same targets' inputs and properties under proptest on stable.
FUZZ_SECONDS ?= 600
fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) scripts/fuzz.sh $(FUZZ_TARGETS)

# Fault injection: every scenario of docs/RELIABILITY.md against real worker processes (built
# with the failpoints feature), each verified exactly-once, with the batch strategy, then again
# with the inbox strategy (plus inbox-burst), and with commit groups; then the order-status
# stream (versioned writes, out of order, stale copies) with the batch strategy, and with the
# inbox strategy and its worker SIGKILLed mid-stream, in full-state and in delta mode. Writes
# target/chaos/report.json, report-inbox.json and report-batch-grouped.json. It crashes the
# stack's PostgreSQL and Kafka on purpose: run it alone, or on a stack of its own
# (STACK_DIR=$$PWD/.stack-chaos make chaos).
chaos: up migrate
	cargo build -q --workspace --bins $(DEBUG_FEATURES)
	status=0; \
	$(WITH_ENV) target/debug/loadgen chaos || status=1; \
	$(WITH_ENV) target/debug/loadgen chaos --strategy inbox || status=1; \
	$(WITH_ENV) target/debug/loadgen chaos --group-partitions || status=1; \
	$(WITH_ENV) target/debug/loadgen orders || status=1; \
	$(WITH_ENV) target/debug/loadgen orders --strategy inbox --bounce || status=1; \
	$(WITH_ENV) target/debug/loadgen orders --mode delta || status=1; \
	$(WITH_ENV) target/debug/loadgen orders --mode delta --strategy inbox --bounce || status=1; \
	exit $$status

# Network faults (loadgen/src/net/, docs/RELIABILITY.md "Network faults"): each of two workers in
# a network namespace of its own, joined to the host by a veth pair; latency, loss, a link cut to
# PostgreSQL or to Kafka only, a COMMIT stalled mid-flight and a flapping link (nftables;
# latency through a relay: this kernel has no netem), each verified exactly-once with its recovery measured, with the batch strategy, then
# the inbox strategy. Root only; nothing leaves the machine. Writes target/chaos/net-report.json
# and net-report-inbox.json. About 25 minutes. `make test` runs `--quick` (pg-cut, batch).
chaos-net: up migrate net-deps
	cargo build -q --workspace --bins $(DEBUG_FEATURES)
	status=0; \
	$(WITH_ENV) target/debug/loadgen chaos-net || status=1; \
	$(WITH_ENV) target/debug/loadgen chaos-net --strategy inbox || status=1; \
	exit $$status

# chaos-net's tools, from Debian: iproute2 (ip, tc) and nftables, installed if missing.
net-deps:
	@command -v nft >/dev/null && command -v tc >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq iproute2 nftables >/dev/null; }

# The soak (docs/RELIABILITY.md, "Soak"): two workers, the outbox relay and the notification
# sender under the demo's traffic (2,000 msg/s, resends, redrives, double taps, poison) for
# SOAK_DURATION, a fault every few minutes in rotation (a worker SIGKILLed and restarted,
# PostgreSQL restarted, a worker's link to PostgreSQL cut for 20 s in its network namespace, the
# broker restarted), each process's RSS, descriptors and threads, PostgreSQL's connections, lag
# and p99 sampled throughout. Fails on anything lost or doubled, a fault not recovered within
# 60 s, or growth past its threshold. Writes target/soak/report.json and report.svg. It crashes
# the stack's Kafka and PostgreSQL on purpose: run it alone, or on a stack of its own
# (STACK_DIR=$$PWD/.stack-soak make soak). Root only (the network namespaces). `make soak` runs
# the release build, as `make demo` does; `make test` runs 3 minutes of it at 500 msg/s with the
# debug build (at 2,000 debug workers on two shared cores reach no steady state).
SOAK_DURATION ?= 1h
soak: up migrate net-deps
	cargo build -q --release --workspace --bins
	$(WITH_ENV) SOAK_DURATION=$(SOAK_DURATION) target/release/loadgen soak

# The cluster stack (scripts/cluster.sh): three KRaft brokers (replication factor 3, min ISR 2)
# and a PostgreSQL primary with a hot standby, under .stack-cluster/, apart from the default stack.
CLUSTER_DIR := $(CURDIR)/.stack-cluster
CLUSTER := STACK_DIR=$(CLUSTER_DIR) scripts/cluster.sh
WITH_CLUSTER := source $(CLUSTER_DIR)/env &&

cluster-up:
	@$(CLUSTER) up >/dev/null
	$(WITH_CLUSTER) cargo run -q --bin effectively $(DEBUG_FEATURES) -- migrate >/dev/null

cluster-down:
	@$(CLUSTER) down

# The Schema Registry (Apicurio Registry, scripts/registry.sh) on the stack, on demand: the
# registry formats' tests, `DEMO_FORMAT=avro make demo` and the per-format bench start it
# themselves. Loopback, 127.0.0.1:8081; SCHEMA_REGISTRY_URL is in $(STACK_DIR)/env.
registry-up: up
	@$(STACK) registry-up >/dev/null

registry-down:
	@$(STACK) registry-down

# Jaeger v2 (scripts/jaeger.sh), the trace backend, on demand: `make test` starts it beside the
# registry for tests/traces.rs (which, like the bench's tracing phase, also starts it itself).
# Built once from the Go module proxy (about 4 minutes on two cores, cached under
# $(STACK_DIR)/jaeger/). Loopback: OTLP/HTTP on 4318, the query API on 16686.
jaeger-up: up
	@$(STACK) jaeger-up >/dev/null

jaeger-down:
	@$(STACK) jaeger-down

# A second PostgreSQL server (scripts/stack.sh pg2-up), on demand: consumers on two databases
# (tests/databases.rs, which starts it itself too, and the bench's `databases` phase). Its own
# cluster under $(STACK_DIR)/pg2, the next free port from 5433; DATABASE_URL_2 is in
# $(STACK_DIR)/env. `scripts/stack.sh pg2-crash` stops it the hard way.
pg2-up: up
	@$(STACK) pg2-up >/dev/null

pg2-down:
	@$(STACK) pg2-down

# Failover: every scenario of docs/RELIABILITY.md "Failover scenarios" (Kafka leader bounces, a
# paused leader, two brokers down, a rolling restart; PostgreSQL switchover, crash, standby down,
# pause-and-fence, an asynchronous standby that lacks the last commits; both at once) with the
# batch strategy, then the inbox strategy. Writes target/chaos/cluster-report.json and
# cluster-report-inbox.json. About 25 minutes; leaves the cluster running (make cluster-down).
chaos-cluster: cluster-up
	cargo build -q --workspace --bins $(DEBUG_FEATURES)
	status=0; \
	$(WITH_CLUSTER) target/debug/loadgen chaos-cluster || status=1; \
	$(WITH_CLUSTER) target/debug/loadgen chaos-cluster --strategy inbox || status=1; \
	exit $$status
