#!/usr/bin/env bash
# `make fuzz`: every cargo-fuzz target of fuzz/ (libFuzzer, nightly) for FUZZ_SECONDS each
# (600 unless set), one after the other. Arguments name targets to run instead of all of them.
#
# Corpus: libFuzzer grows fuzz/corpus/<target>/ (gitignored, kept between runs) and also reads
# the committed seeds, fuzz/seeds/<target>/, which it never writes. A crash, out-of-memory or
# timeout input is copied into fuzz/regressions/<target>/ (committed with its fix:
# tests/fuzz.rs replays every file there in `make test`) and the run fails after the remaining
# targets. Each target's last libFuzzer lines (executions, coverage, corpus) go to
# target/fuzz/<target>.log and a summary line to target/fuzz/summary.txt.
#
# Bounds: -rss_limit_mb=2048 (libFuzzer's default, named here) and -timeout=10 per input, so a
# payload that takes the decoders' memory or time out of bounds is a finding, not a slow run.
#
# No sanitizer (`-s none`): the engine links librdkafka, whose configure step cannot link the
# zstd that AddressSanitizer instruments (undefined __asan_* symbols: the build fails). The
# code fuzzed is safe Rust, where ASan finds little; libFuzzer's coverage guidance and its
# detection of panics, stack overflows, timeouts and RSS beyond the limit work without it.
set -uo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-600}
targets=("$@")
if ((${#targets[@]} == 0)); then
    targets=(decode_record config_load console_query console_form registry_formats)
fi

if ! rustup run nightly rustc --version >/dev/null 2>&1; then
    echo "fuzz: needs the nightly toolchain (rustup toolchain install nightly)" >&2
    exit 1
fi
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    echo "fuzz: installing cargo-fuzz"
    cargo install --locked cargo-fuzz || exit 1
fi

out=target/fuzz
mkdir -p "$out"
: >"$out/summary.txt"
# Built once for all targets (the engine with AddressSanitizer takes a while the first time).
cargo +nightly fuzz build -O -s none || exit 1

status=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t" "fuzz/seeds/$t" "fuzz/artifacts/$t"
    echo "== fuzz $t for ${seconds}s"
    start=$(date +%s)
    cargo +nightly fuzz run -O -s none "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=10 -print_final_stats=1 \
        >"$out/$t.log" 2>&1
    rc=$?
    took=$(($(date +%s) - start))
    runs=$(grep -o 'Done [0-9]* runs' "$out/$t.log" | tail -1 | grep -o '[0-9]*')
    cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$out/$t.log" | tail -1)
    corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
    line="$t: ${runs:-?} runs in ${took}s, ${cov:-cov: ?}, corpus $corpus, exit $rc"
    echo "$line" | tee -a "$out/summary.txt"
    if ((rc != 0)); then
        status=1
        found=0
        for f in fuzz/artifacts/"$t"/{crash,oom,timeout,leak}-*; do
            [[ -f $f ]] || continue
            mkdir -p "fuzz/regressions/$t"
            cp "$f" "fuzz/regressions/$t/"
            echo "fuzz: $t found $(basename "$f"): copied to fuzz/regressions/$t/ (fix it, commit both)"
            found=1
        done
        ((found)) || tail -30 "$out/$t.log"
    fi
done
echo "== fuzz summary (target/fuzz/summary.txt)"
cat "$out/summary.txt"
exit $status
