//! The fuzz targets on stable, in `make test`: the same inputs and properties as `make fuzz`
//! (the files under `fuzz/src/`, compiled in here), driven by proptest's random bytes for a
//! short budget, plus every committed seed (`fuzz/seeds/<target>/`), every crash `make fuzz`
//! ever found (`fuzz/regressions/<target>/`), and the hand-made inputs of each target
//! (`seeds()`: valid records, deep nesting, a 1 MiB string, invalid UTF-8, broken headers).
//!
//! No services: this runs in a few seconds of a debug build (FUZZ_CASES changes the number of
//! random cases per target; 0 leaves only the replays).

#[path = "../fuzz/src/config_load.rs"]
mod config_load;
#[path = "../fuzz/src/console.rs"]
mod console;
#[path = "../fuzz/src/decode_record.rs"]
mod decode_record;
#[path = "../fuzz/src/registry_formats.rs"]
mod registry_formats;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use proptest::prelude::*;

/// Random cases per target: enough to meet each input shape many times, few enough that the
/// whole file stays under half a minute in a debug build.
fn cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512)
}

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: cases(),
        // Shrinking a failure is proptest's job; the failing bytes are printed either way.
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    }
}

/// Every file under `fuzz/<dir>/<target>/`, by name.
fn files(dir: &str, target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz")
        .join(dir)
        .join(target);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return Vec::new();
    };
    let mut out: Vec<(PathBuf, Vec<u8>)> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != ".gitkeep"))
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

/// Runs `run` on every committed seed and regression of `target`; returns how many.
fn replay(target: &str, run: fn(&[u8])) -> usize {
    let all: Vec<_> = ["seeds", "regressions"]
        .iter()
        .flat_map(|d| files(d, target))
        .collect();
    for (path, bytes) in &all {
        let caught = std::panic::catch_unwind(|| run(bytes));
        assert!(caught.is_ok(), "{} fails again", path.display());
    }
    all.len()
}

#[test]
fn decode_record_replays() {
    for input in decode_record::seeds() {
        decode_record::check(&input);
    }
    assert!(replay("decode_record", decode_record::run) > 0, "no seeds");
}

#[test]
fn config_load_replays() {
    for input in config_load::seeds() {
        config_load::check(&input);
    }
    assert!(replay("config_load", config_load::run) > 0, "no seeds");
}

#[test]
fn console_replays() {
    for q in console::query_seeds() {
        console::check_query(&q);
    }
    for f in console::form_seeds() {
        console::check_form(&f);
    }
    assert!(replay("console_query", console::run_query) > 0, "no seeds");
    assert!(replay("console_form", console::run_form) > 0, "no seeds");
}

#[test]
fn registry_formats_replay() {
    for input in registry_formats::seeds() {
        registry_formats::check(&input);
    }
    assert!(
        replay("registry_formats", registry_formats::run) > 0,
        "no seeds"
    );
}

/// The bounds a hostile payload meets, timed: each is refused at once, with a sentence that
/// names the bound, not after the decoder has spent the worker's stack, memory or time.
#[test]
fn deep_and_huge_payloads_are_refused_quickly_and_say_why() {
    use effectively::config::{EventDateSource, MessageIdConfig};
    use effectively::envelope::{Decoder, RawRecord, Reason};

    let decoder = Decoder::new(
        &MessageIdConfig::header("event_id"),
        &EventDateSource::Auto,
        1 << 20,
        true,
    );
    let id = b"0190a5c2-7e1f-7c3a-8b1e-0123456789ab";
    let headers = [("event_id", Some(&id[..]))];
    let decode = |payload: &[u8]| {
        decoder.decode(&RawRecord {
            partition: 0,
            offset: 0,
            timestamp_ms: None,
            key: None,
            payload: Some(payload),
            headers: &headers,
        })
    };
    let deep_array = "[".repeat(100_000).into_bytes();
    let deep_object = "{\"a\":".repeat(100_000).into_bytes();
    let huge = serde_json::json!({"s": "x".repeat(1 << 20)})
        .to_string()
        .into_bytes();
    for (what, payload, reason, words) in [
        (
            "100,000 [",
            &deep_array,
            Reason::UndecodablePayload,
            "nested deeper than 128",
        ),
        (
            "100,000 {\"a\":",
            &deep_object,
            Reason::UndecodablePayload,
            "nested deeper than 128",
        ),
        (
            "a 1 MiB string",
            &huge,
            Reason::OversizedPayload,
            "exceeds the limit of 1048576",
        ),
    ] {
        let start = Instant::now();
        let r = decode(payload).expect_err(what);
        let took = start.elapsed();
        assert_eq!(r.reason, reason, "{what}: {r}");
        assert!(r.detail.contains(words), "{what}: {r}");
        assert!(took < Duration::from_secs(2), "{what} took {took:?}");
    }

    // The registry formats: a recursive schema's value nested 100,000 deep (the bytes say so,
    // 2 or 3 a level) is refused, not followed down the stack.
    for (index, what) in [(1, "Avro list"), (2, "Avro tree"), (4, "Protobuf tree")] {
        let body = registry_formats::deep(index, 100_000);
        let start = Instant::now();
        let e = registry_formats::decode(index, &body).expect_err(what);
        let took = start.elapsed();
        assert!(e.contains("deeper than"), "{what}: {e}");
        assert!(took < Duration::from_secs(2), "{what} took {took:?}");
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn decode_record_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        decode_record::run(&bytes);
    }

    #[test]
    fn config_load_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        config_load::run(&bytes);
    }

    #[test]
    fn console_query_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        console::run_query(&bytes);
    }

    #[test]
    fn console_form_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
        console::run_form(&bytes);
    }

    #[test]
    fn registry_formats_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..2048)) {
        registry_formats::run(&bytes);
    }
}
