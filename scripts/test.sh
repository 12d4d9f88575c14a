#!/usr/bin/env bash
# `make test`'s cargo tests: every test binary of the workspace, in shards that run at once.
#
# The integration tests spend much of their time waiting on Kafka and PostgreSQL (a rebalance,
# a session timeout, a drain), so three binaries at a time finish sooner than one at a time,
# even on two cores: 3 min 40 s with TEST_SHARDS=3 (the default), 5 min 38 s with 2, 7 min 56 s
# with 1 (2026-12-07, one run each on a fresh stack). Each binary still runs its own tests in
# parallel, as `cargo test` does, and the binaries share the stack, as they always have: every
# test makes its own topics and consumers. Examples are built by the `--no-run` step below.
#
# Shards: the integration test targets of every workspace member in name order, dealt out in
# turn, the unit tests with the first shard and the doctests after the last. A test that stops
# a shared service for everybody (tests/registry_restart.rs stops the stack's Schema Registry)
# runs alone, after the shards. TEST_SHARDS=1 runs everything one binary at a time.
#
# Each shard writes target/test-shards/shard-N.log, printed whole when the shard ends.
# Arguments are cargo's feature flags (the Makefile's DEBUG_FEATURES).
set -uo pipefail
cd "$(dirname "$0")/.."

features=("$@")
shards=${TEST_SHARDS:-3}
alone=(registry_restart)
out=target/test-shards
mkdir -p "$out"

# Build every test binary first, once: the shards then start together and only run.
cargo test --workspace "${features[@]}" --no-run -q || exit 1

# Every integration test target of every workspace member, by name (jq: make test's
# monitoring-check installs it when missing).
names=()
while read -r n; do
    [[ " ${alone[*]} " == *" $n "* ]] || names+=("$n")
done < <(cargo metadata --no-deps --format-version 1 |
    jq -r '.packages[].targets[] | select(.kind[] == "test") | .name' | sort)

declare -a args
for ((s = 0; s < shards; s++)); do args[s]=""; done
args[0]="--lib --bins"
i=0
for n in "${names[@]}"; do
    s=$((i % shards))
    args[s]+=" --test $n"
    i=$((i + 1))
done

run_shard() {
    local s=$1
    # shellcheck disable=SC2086 # the target flags are words on purpose
    cargo test --workspace "${features[@]}" ${args[s]} >"$out/shard-$s.log" 2>&1 || return 1
    if ((s == shards - 1)); then
        cargo test --workspace "${features[@]}" --doc >>"$out/shard-$s.log" 2>&1 || return 1
    fi
}

pids=()
for ((s = 0; s < shards; s++)); do
    echo "test shard $s:${args[s]}"
    run_shard "$s" &
    pids[s]=$!
done

status=0
for ((s = 0; s < shards; s++)); do
    if wait "${pids[s]}"; then
        echo "== test shard $s passed"
    else
        echo "== test shard $s FAILED"
        status=1
    fi
    cat "$out/shard-$s.log"
done

for n in "${alone[@]}"; do
    echo "== alone: $n"
    cargo test --workspace "${features[@]}" --test "$n" || status=1
done

if ((status != 0)); then
    echo "test: failures above (grep -n 'FAILED\|panicked' $out/shard-*.log)"
fi
exit $status
