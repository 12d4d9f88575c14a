# The two commands a newcomer needs: `make demo` and `make test`. Both start the local stack
# (a real Kafka and PostgreSQL under .stack/) when it is not running yet.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
STACK := scripts/stack.sh
# Every command that talks to the stack reads its addresses from .stack/env.
WITH_ENV := source .stack/env &&

.PHONY: up down status build migrate lint test demo

up:
	@$(STACK) up >/dev/null

down:
	@$(STACK) down

status:
	@$(STACK) status

build:
	cargo build --workspace --all-targets

migrate: up
	$(WITH_ENV) cargo run -q --bin effectively -- migrate

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

# Every test, then a short demo run (10 s at 500 msg/s, debug build) that must verify.
test: up lint migrate
	$(WITH_ENV) cargo test --workspace
	DEMO_SECONDS=10 DEMO_RATE=500 DEMO_PROFILE=debug scripts/demo.sh

# Two workers, loadgen at 2,000 msg/s for 60 s with duplicates and poison, a rebalance
# half-way, then the verification. DEMO_SECONDS, DEMO_RATE, DEMO_PROFILE change it.
demo: up
	scripts/demo.sh
