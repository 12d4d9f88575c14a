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

test: up lint migrate
	$(WITH_ENV) cargo test --workspace

# Until the demo with loadgen lands: the smoke pipeline against the real services.
demo: up migrate
	$(WITH_ENV) cargo test --test smoke -- --nocapture
