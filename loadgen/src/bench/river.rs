//! The River phase (`--only river`): the inbox strategy's processors against River, the Go job
//! queue on PostgreSQL, each applying the same number of stored no-op items.
//!
//! - River: `peers/river` (Go, built here into `target/peers/river-bench`) makes its own
//!   database on the same server, bulk-inserts the jobs (untimed) and times a client whose
//!   worker returns nil, once with River's default settings and once as River's own benchmark
//!   tunes it.
//! - Ours: a receiver-only worker (`processors = 0`) stores a pre-filled topic of as many
//!   messages (untimed), then a worker with `processors` processors applies the rows with a
//!   `kind = "sql"` handler whose statement writes nothing; at 1, 4, 8 and 16 processors with
//!   the default claim of 100 rows, then 4 and 8 with claims of 1,000 (tuned, as River's tuned
//!   run is), each on fresh rows, and the best is compared against River's better run. `ordering_key = "none"`: River's jobs are
//!   independent, and one key would serialize ours.
//!
//! Both rates are first to last completion: River's `finalized_at` (stamped in its client when
//! the job returned; the completer's batched UPDATE commits it up to 250 ms later), our rows'
//! `done_at` (their round's transaction start). Wall times from each one's start are reported
//! beside them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::db::Db;
use super::worker::{spec, until_applied, until_stored, Worker, PARTITIONS};
use super::{ratio, round1, BenchArgs};
use crate::produce::{Mix, Step};
use crate::{produce_stage, Session};

/// (processors, `inbox.claim_batch`) of our runs; the best is the one compared. The default
/// claim (100 rows a round) at each count, then claims of 1,000 rows: River tuned as its own
/// benchmark does fetches up to 2,000 jobs a statement, so ours are tuned too.
const RUNS: [(usize, usize); 6] = [
    (1, DEFAULT_CLAIM),
    (4, DEFAULT_CLAIM),
    (8, DEFAULT_CLAIM),
    (16, DEFAULT_CLAIM),
    (4, 1000),
    (8, 1000),
];
/// The engine's default `inbox.claim_batch`.
const DEFAULT_CLAIM: usize = 100;
/// The engine's default `inbox.processors`.
const DEFAULT_PROCESSORS: usize = 4;

/// The no-op effect: a statement that reads the staged messages and writes nothing. The SQL
/// handler is the only one that needs no business table, but it stages every round's payloads
/// first (a COPY into the session's `staged_messages`, emptied per group): a cost River's no-op
/// does not pay, kept here rather than adding a handler kind only a benchmark would use.
const NOOP_STATEMENT: &str = "SELECT count(*) FROM fresh_messages";

/// `river` in report.json.
#[derive(Debug, Default, Serialize)]
pub(super) struct RiverRuns {
    /// Jobs of each River run, and rows of each of ours.
    pub(super) jobs: u64,
    /// What our side's no-op is and what it costs beyond River's.
    pub(super) noop: String,
    pub(super) river_default: RiverRun,
    /// The better of two tuned runs, one before ours and one after.
    pub(super) river_tuned: RiverRun,
    /// Both tuned runs' jobs/s: before ours, after ours.
    pub(super) river_tuned_jobs_s_each: [f64; 2],
    /// Our runs, one per (processors, claim_batch).
    pub(super) inbox: Vec<NoopRun>,
    /// The processor count and claim size of our best run, the one compared.
    pub(super) best_processors: usize,
    pub(super) best_claim_batch: usize,
    /// Our best rows/s over River's better jobs/s, both first to last completion, and the
    /// same with wall times.
    pub(super) inbox_vs_river: f64,
    pub(super) inbox_vs_river_wall: f64,
    /// Our best against River's default and tuned runs, one by one.
    pub(super) inbox_vs_river_default: f64,
    pub(super) inbox_vs_river_tuned: f64,
    /// Our best with the default claim (100 rows) over River's better run.
    pub(super) inbox_default_claim_vs_river: f64,
    /// Both at their defaults: ours as the engine ships (4 processors, claims of 100) over
    /// River's defaults. Target >= 1.0.
    pub(super) both_default: f64,
    /// Both tuned: our best run over River tuned's better run. Target >= 1.0.
    pub(super) both_tuned: f64,
    pub(super) verified: bool,
}

/// One River run, as `river-bench` printed it.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct RiverRun {
    pub(super) jobs: u64,
    pub(super) completed: u64,
    /// First to last `finalized_at`.
    pub(super) seconds: f64,
    pub(super) jobs_s: f64,
    /// From the client's Start until every job was seen completed.
    pub(super) seconds_wall: f64,
    pub(super) jobs_s_wall: f64,
    pub(super) insert_seconds: f64,
    /// MaxWorkers, FetchCooldown, FetchPollInterval, pool size, completer.
    pub(super) tuning: serde_json::Value,
    pub(super) river: String,
    pub(super) gomaxprocs: u32,
}

/// One of our runs: fresh topic, consumer and rows.
#[derive(Debug, Default, Serialize)]
pub(super) struct NoopRun {
    pub(super) processors: usize,
    pub(super) claim_batch: usize,
    pub(super) records: u64,
    pub(super) rows: u64,
    pub(super) done: u64,
    pub(super) failed: u64,
    /// First to last `done_at`.
    pub(super) seconds: f64,
    pub(super) rows_s: f64,
    /// From the processors' worker's start (process start-up included) until loadgen saw no
    /// open row (polled every 50 ms).
    pub(super) seconds_wall: f64,
    pub(super) rows_s_wall: f64,
    /// From the worker's start to the first row's `done_at` (its round's transaction start):
    /// start-up and the first claim, which the first-to-last span leaves out.
    pub(super) first_done_after_s: f64,
    /// Untimed: the receiver storing the topic.
    pub(super) ingest_seconds: f64,
    pub(super) rss_mb_peak: f64,
    pub(super) cpu_us_per_row: f64,
    pub(super) wal_bytes_per_row: f64,
    pub(super) row_writes_per_row: f64,
    /// Every record stored once and every row DONE, none FAILED.
    pub(super) verified: bool,
}

/// Both sides on `n` items each, back to back: River tuned, ours at each of [`PROCESSORS`],
/// River tuned again, River default.
pub(super) async fn river(bin: &Path, args: &BenchArgs, n: u64) -> anyhow::Result<RiverRuns> {
    let harness = build_harness().await?;
    // River tuned before and after ours, the better run compared: on a shared machine the
    // load drifts within minutes, and ours take several.
    eprintln!("   River, tuned, {n} no-op jobs (before ours)");
    let tuned_before = run_harness(&harness, args, "tuned", n).await?;
    let mut inbox = Vec::new();
    for (p, claim) in RUNS {
        eprintln!("   inbox, {p} processor(s), claims of {claim}, no-op sql handler, {n} rows");
        inbox.push(noop_inbox(bin, args, p, claim, n).await?);
    }
    eprintln!("   River, tuned, {n} no-op jobs (after ours)");
    let tuned_after = run_harness(&harness, args, "tuned", n).await?;
    let river_tuned_jobs_s_each = [tuned_before.jobs_s, tuned_after.jobs_s];
    let river_tuned = if tuned_after.jobs_s > tuned_before.jobs_s {
        tuned_after
    } else {
        tuned_before
    };
    eprintln!("   River, default, {n} no-op jobs");
    let river_default = run_harness(&harness, args, "default", n).await?;

    let best = inbox
        .iter()
        .max_by(|a, b| a.rows_s.total_cmp(&b.rows_s))
        .expect("at least one processor count");
    let best_rows_s = best.rows_s;
    let best_default_claim = (inbox.iter())
        .filter(|r| r.claim_batch == DEFAULT_CLAIM)
        .map(|r| r.rows_s)
        .fold(0.0, f64::max);
    let ours_default = (inbox.iter())
        .filter(|r| r.claim_batch == DEFAULT_CLAIM && r.processors == DEFAULT_PROCESSORS)
        .map(|r| r.rows_s)
        .fold(0.0, f64::max);
    let river_best = river_tuned.jobs_s.max(river_default.jobs_s);
    let river_best_wall = river_tuned.jobs_s_wall.max(river_default.jobs_s_wall);
    let best_wall = inbox.iter().map(|r| r.rows_s_wall).fold(0.0, f64::max);
    let runs = RiverRuns {
        jobs: n,
        noop: format!(
            "our processors apply a kind = \"sql\" handler whose statement is `{NOOP_STATEMENT}` \
             (writes nothing); the handler stages each round's payloads by COPY first, which \
             River's no-op worker does not pay for; ordering_key = \"none\" (every row its own \
             key); claim_batch 100 (the default) and 1000 (tuned)"
        ),
        best_processors: best.processors,
        best_claim_batch: best.claim_batch,
        inbox_default_claim_vs_river: ratio(best_default_claim, river_best),
        inbox_vs_river: ratio(best.rows_s, river_best),
        inbox_vs_river_wall: ratio(best_wall, river_best_wall),
        inbox_vs_river_default: ratio(best.rows_s, river_default.jobs_s),
        inbox_vs_river_tuned: ratio(best.rows_s, river_tuned.jobs_s),
        both_default: ratio(ours_default, river_default.jobs_s),
        both_tuned: ratio(best.rows_s, river_tuned.jobs_s),
        verified: inbox.iter().all(|r| r.verified)
            && river_tuned.completed == n
            && river_default.completed == n,
        river_default,
        river_tuned,
        river_tuned_jobs_s_each,
        inbox,
    };
    eprintln!(
        "   inbox (no-op, best at {} processors, claims of {}) {:.0} rows/s; River tuned {:.0} \
         jobs/s, default {:.0}; inbox_vs_river {:.2} (wall: {:.2}); with the default claim {:.2}; \
         both at their defaults {:.2}, both tuned {:.2}",
        runs.best_processors,
        runs.best_claim_batch,
        best_rows_s,
        runs.river_tuned.jobs_s,
        runs.river_default.jobs_s,
        runs.inbox_vs_river,
        runs.inbox_vs_river_wall,
        runs.inbox_default_claim_vs_river,
        runs.both_default,
        runs.both_tuned
    );
    Ok(runs)
}

/// `rows` rows stored by a receiver-only worker, then applied by `processors` processors.
async fn noop_inbox(
    bin: &Path,
    args: &BenchArgs,
    processors: usize,
    claim_batch: usize,
    rows: u64,
) -> anyhow::Result<NoopRun> {
    let name = format!(
        "bench-noop-{processors}p{claim_batch}-{:06x}",
        fastrand::u32(..0xffffff)
    );
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    // No resends: one record, one row, as one job is one job.
    let mix = Mix {
        resend: 0.0,
        redrive: 0.0,
        redrive_delay: Duration::ZERO,
        double_tap: 0.0,
        poison: 0.0,
    };
    let spec = spec(args, &name, PARTITIONS, plan, Some(rows), mix);
    let session = Session::open(&spec).await?;
    let records = produce_stage(&session, &spec).await?.acked();
    let db = Db::connect(args).await?;
    let config = |p: usize| {
        format!(
            "[worker]\nid = \"bench\"\n[database]\npool_size = {}\n[[consumer]]\nname = \"{name}\"\n\
             topics = [\"{name}\"]\nstrategy = \"inbox\"\n\
             handler = {{ kind = \"sql\", statement = \"{NOOP_STATEMENT}\" }}\n\
             [consumer.inbox]\nprocessors = {p}\nclaim_batch = {claim_batch}\n\
             ordering_key = \"none\"\n",
            p + 4
        )
    };

    // Untimed: the receiver stores the topic.
    let started = Instant::now();
    let receiver = format!("{name}-receiver");
    let mut worker = Worker::start_config(bin, args, &config(0), &receiver).await?;
    until_stored(&session, &name, &mut worker, &receiver, spec.drain_timeout).await?;
    let ingest_seconds = started.elapsed().as_secs_f64();
    worker.stop().await?;
    let pending: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = 'PENDING'",
            &[&name],
        )
        .await?
        .get(0);

    // Timed: the processors.
    let mark = db.mark().await?;
    let started = Instant::now();
    let started_at = std::time::SystemTime::now();
    let file = format!("{name}-processors");
    let worker = Worker::start_config(bin, args, &config(processors), &file).await?;
    let mut workers = [(worker, file)];
    let poll = Duration::from_millis(50);
    until_applied(&db.client, &name, &mut workers, spec.drain_timeout, poll).await?;
    let [(worker, _)] = workers;
    let wall = started.elapsed().as_secs_f64();
    let (rss_mb, cpu_s) = worker.usage();
    worker.stop().await?;
    let cost = db.cost_since(&mark).await?;
    let r = db
        .client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE status = 'DONE'),
                    count(*) FILTER (WHERE status = 'FAILED'),
                    coalesce(extract(epoch FROM max(done_at) - min(done_at)), 0)::float8,
                    coalesce(extract(epoch FROM min(done_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&name],
        )
        .await?;
    let (stored, done, failed, span, first): (i64, i64, i64, f64, f64) =
        (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
    // Same machine, same clock: the worker's start against PostgreSQL's first done_at.
    let start_epoch = started_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    // The rows are ours alone and measured: out of the shared inbox, so later runs (and other
    // phases) do not work beside them.
    db.client
        .execute("DELETE FROM inbox WHERE consumer = $1", &[&name])
        .await?;
    let (stored, done, failed) = (stored as u64, done as u64, failed as u64);
    let run = NoopRun {
        processors,
        claim_batch,
        records,
        rows: stored,
        done,
        failed,
        seconds: (span * 1000.0).round() / 1000.0,
        rows_s: per_second(done, span),
        seconds_wall: (wall * 1000.0).round() / 1000.0,
        rows_s_wall: per_second(done, wall),
        first_done_after_s: ((first - start_epoch) * 1000.0).round() / 1000.0,
        ingest_seconds: round1(ingest_seconds),
        rss_mb_peak: round1(rss_mb),
        cpu_us_per_row: round1(cpu_s * 1e6 / done.max(1) as f64),
        wal_bytes_per_row: cost.wal_bytes_per(done),
        row_writes_per_row: cost.row_writes_per(done),
        verified: records == rows
            && stored == rows
            && pending as u64 == rows
            && done == rows
            && failed == 0,
    };
    eprintln!(
        "   {processors} processor(s): {:.0} rows/s ({done} DONE, {failed} FAILED, {:.2} s first \
         to last DONE; {:.0} rows/s over {:.2} s from the worker's start, the first DONE {:.2} s \
         after it), {:.1} µs CPU/row, {:.0} WAL bytes/row, verified: {}",
        run.rows_s,
        run.seconds,
        run.rows_s_wall,
        run.seconds_wall,
        run.first_done_after_s,
        run.cpu_us_per_row,
        run.wal_bytes_per_row,
        run.verified
    );
    Ok(run)
}

/// Where the harness's module is and where its binary goes: `peers/river` and
/// `target/peers/river-bench` of this repository.
fn harness_paths() -> (PathBuf, PathBuf) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("loadgen lives in the repository's root")
        .to_path_buf();
    (
        root.join("peers/river"),
        root.join("target/peers/river-bench"),
    )
}

/// Builds `peers/river` with the Go toolchain (`$GO`, else `go` on the PATH, else
/// /usr/local/go/bin/go); its modules come from the module proxy into Go's own cache, checked
/// against the committed go.sum.
async fn build_harness() -> anyhow::Result<PathBuf> {
    let (module, out) = harness_paths();
    let go = std::env::var_os("GO")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("PATH").and_then(|paths| {
                std::env::split_paths(&paths)
                    .map(|d| d.join("go"))
                    .find(|p| p.is_file())
            })
        })
        .unwrap_or_else(|| PathBuf::from("/usr/local/go/bin/go"));
    let status = tokio::process::Command::new(&go)
        .args(["build", "-o"])
        .arg(&out)
        .arg(".")
        .current_dir(&module)
        .stdout(Stdio::null())
        .status()
        .await
        .with_context(|| {
            format!(
                "running {} to build {} (Go 1.26 is needed; set GO to its go binary)",
                go.display(),
                module.display()
            )
        })?;
    anyhow::ensure!(
        status.success(),
        "go build of {} failed: {status}",
        module.display()
    );
    Ok(out)
}

/// One River run with `tuning` (`default` or `tuned`) on `jobs` jobs.
async fn run_harness(
    harness: &Path,
    args: &BenchArgs,
    tuning: &str,
    jobs: u64,
) -> anyhow::Result<RiverRun> {
    let out = tokio::process::Command::new(harness)
        .args(["-tuning", tuning, "-jobs", &jobs.to_string()])
        .env("DATABASE_URL", &args.services.database_url)
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running {}", harness.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} -tuning {tuning} failed: {}",
        harness.display(),
        out.status
    );
    let run: RiverRun = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("reading {}'s JSON", harness.display()))?;
    std::fs::write(args.out.join(format!("river-{tuning}.json")), &out.stdout)?;
    eprintln!(
        "   River {tuning}: {:.0} jobs/s ({} completed, {:.2} s first to last finalized_at; {:.0} \
         jobs/s over {:.2} s from the client's start)",
        run.jobs_s, run.completed, run.seconds, run.jobs_s_wall, run.seconds_wall
    );
    Ok(run)
}

fn per_second(n: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        (n as f64 / seconds).round()
    } else {
        0.0
    }
}
