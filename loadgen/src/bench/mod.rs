//! `loadgen bench` (`make bench`): every number side by side, one run, one machine.
//!
//! 1. the SQL ceiling: the batch transaction straight against PostgreSQL, no Kafka
//!    (`effectively bench-ceiling`), with one and with two connections;
//! 2. the batch strategy draining a pre-filled topic (6 partitions, 10% resends), one worker,
//!    with its PostgreSQL CPU per message; then the same with `dedupe = "business-row"`;
//! 3. the per-message strategy draining the same kind of data;
//! 4. the inbox strategy: one pre-filled topic of the batch drain's kind, stored by a
//!    receiver-only worker into the `inbox` table once per run, then the processor curve on
//!    those same rows (1, 2, 4 and 8 processors, 2 workers x 4, and 1 again);
//! 5. end-to-end latency at offered 500 and 2,000 msg/s;
//! 6. the draining worker's peak RSS and CPU time per message, from `/proc`; WAL bytes and row
//!    writes per message of the drains and of the inbox, from PostgreSQL;
//! 7. a peer: Kafka Connect with Debezium's JDBC sink upserting the same kind of topic by event
//!    id, right after the drains (`connect`);
//! 8. a peer: Flink's exactly-once JDBC sink (XA) upserting the same kind of topic by event id,
//!    at two checkpoint intervals, its latency at 2,000 msg/s and a SIGKILL mid-stream
//!    (`flink/`), after the latency phase;
//! 9. River, the Go job queue on PostgreSQL, working no-op jobs against our inbox processors
//!    applying as many stored rows with a no-op effect (`river.rs`);
//! 10. the pre-filter's replays (`replay`), 1 to 3 workers draining one topic, and
//!     retention (dropping a day against deleting it);
//! 11. many partitions: 2,000 msg/s over 6, 60 and 300 partitions, one and two workers, and
//!     with commit groups (`partitions_scale`);
//! 12. compression codecs: the batch drain of a topic written with none, zstd, gzip, snappy and
//!     lz4, msg/s and worker CPU per message side by side (`codecs`);
//! 13. the registry formats: the batch drain in JSON, Avro, Protobuf and JSON Schema, msg/s and
//!     worker CPU per message side by side (`formats`);
//! 14. traces: the batch drain of records that each carry a `traceparent`, with tracing off, on
//!     at a sampling ratio of 0.1 and on at 1.0 exporting to Jaeger, side by side (`traces`);
//! 15. two consumers on two PostgreSQL servers against both on one: msg/s and CPU per message,
//!     the worker's and both servers' (`databases`).
//!
//! Every drain, inbox and latency run is verified exactly-once by the same checker as the demo.
//! Absolute numbers depend on the machine; the ratios are what to compare.

mod codecs;
mod connect;
mod databases;
mod db;
mod drain;
mod flink;
mod formats;
mod inbox;
mod joins;
mod latency;
mod partitions;
mod peer;
pub(crate) mod procfs;
pub(crate) mod replay;
mod river;
mod traces;
mod worker;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use connect::{connect, ConnectReport};
pub(crate) use db::{pg_cpu_seconds, settle};
use drain::{ceiling, drain, retention, Drain, DropDuringDrain};
use flink::FlinkReport;
use formats::Formats;
use inbox::InboxRuns;
use latency::{latency, LatencyAt, P99_TARGET_MS};
use partitions::{partitions_scale, PartitionsScale};
use river::RiverRuns;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    services: crate::Services,
    /// `full` (1,000,000 events for the batch drain) or `quick` (about 2 minutes in all), or a
    /// number that multiplies the full sizes.
    #[arg(long, env = "BENCH_SCALE", default_value = "full")]
    scale: String,
    /// The engine's binary (default: `effectively` next to this one).
    #[arg(long)]
    effectively: Option<PathBuf>,
    /// Where report.json and the runs' reports and worker logs go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
    /// Run only these phases (comma-separated), for working on one: the others report 0 and
    /// the ratios that need them 0. `make bench` runs them all.
    #[arg(long, env = "BENCH_ONLY", value_delimiter = ',', value_enum)]
    only: Vec<Phase>,
    /// The Kafka Connect and JDBC sink jars (`scripts/connect.sh fetch` puts them there).
    #[arg(long, env = "CONNECT_LIB", default_value = "target/peers/connect/lib")]
    connect_lib: PathBuf,
    /// The Flink peer's jar and its dependencies (`scripts/flink.sh build` puts them there).
    #[arg(long, env = "FLINK_LIB", default_value = "target/peers/flink-xa/lib")]
    flink_lib: PathBuf,
    /// The many-partitions phase: `database.pool_size` of each worker.
    #[arg(long, env = "BENCH_PARTITIONS_POOL_SIZE", default_value_t = 16)]
    partitions_pool_size: usize,
    /// The many-partitions phase: TOML appended to the consumer's section (e.g.
    /// `batch = { linger = "20ms" }`), to measure a setting against the defaults.
    #[arg(long, env = "BENCH_PARTITIONS_CONSUMER", default_value = "")]
    partitions_consumer: String,
    /// The joins phase: TOML appended to each worker's config (after its consumer section,
    /// so it may open another table, e.g. `[kafka.options]` with `"group.protocol" =
    /// "consumer"`), to measure a setting against the defaults.
    #[arg(long, env = "BENCH_JOINS_WORKER", default_value = "")]
    pub(super) joins_worker: String,
    /// The inbox curve: TOML appended to the processors' `[consumer.inbox]` section (e.g.
    /// `adaptive = false`), to measure a setting against the defaults.
    #[arg(long, env = "BENCH_INBOX_PROCESSORS", default_value = "")]
    pub(super) inbox_processors: String,
    /// The partitions and joins phases: where a record's latency starts. `append` (their
    /// topics use `message.timestamp.type = LogAppendTime`): when the broker appended it, the
    /// engine's part. `producer`: when loadgen's producer made it, which adds the producer's
    /// own queueing on a busy machine (docs/PERFORMANCE.md, "Where the tail was").
    #[arg(long, env = "BENCH_LATENCY_FROM", default_value = "append", value_parser = ["append", "producer"])]
    pub(super) latency_from: String,
    /// The databases phase's second server.
    #[command(flatten)]
    pub(super) databases: databases::DatabasesArgs,
}

/// The phases of `loadgen bench`, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Phase {
    Ceiling,
    Drains,
    /// Kafka Connect with a JDBC sink, the peer measured beside the batch drain.
    Connect,
    Inbox,
    Latency,
    /// Flink's exactly-once JDBC sink (XA): drains at two checkpoint intervals, latency at
    /// 2,000 msg/s, a SIGKILL mid-stream. After the latency phase, whose p99 it is held to.
    Flink,
    River,
    Prefilter,
    Retention,
    /// 1, 2 and 3 workers draining one topic (docs/SCALING.md).
    Workers,
    Partitions,
    /// The batch drain of a topic per compression codec (none, zstd, gzip, snappy, lz4).
    Codecs,
    /// The batch drain in JSON, Avro, Protobuf and JSON Schema (the decode's cost).
    Formats,
    /// A second and a third worker joining and leaving under load: the partitions' stalls.
    Joins,
    /// The batch drain with tracing off, on at 0.1 and on at 1.0 (exporting to Jaeger).
    Tracing,
    /// Two consumers on two PostgreSQL servers against both on one (`DATABASE_URL_2`).
    Databases,
}

struct Sizes {
    retention_keys: u64,
    ceiling: u64,
    batch: u64,
    per_message: u64,
    /// Payments of each scale-out drain (1, 2, 3 workers): a third of the batch drain's.
    scale_out: u64,
    /// Payments of the inbox topic every run of the processor curve stores and applies: a
    /// tenth of the batch drain's, at least [`INBOX_MIN`] and at most [`INBOX_MAX`].
    inbox: u64,
    latency: Duration,
    /// The Flink peer's crash run at 2,000 msg/s.
    flink_crash: Duration,
    /// Jobs of each River run, and rows of each of our no-op inbox runs.
    river: u64,
    /// Each run of the many-partitions phase.
    partitions: Duration,
    /// The joins phase's run: long enough that each join or leave has 5 s to itself and more.
    joins: Duration,
    /// Payments of each codec's drain: a quarter of the batch drain's, at least 50,000 (a
    /// drain of a few seconds: shorter ones measure the start more than the codec).
    codecs: u64,
    /// Payments of each format's drain: a tenth of the batch drain's, 50,000 to 100,000 (a
    /// drain of 10,000 lasts half a second, and the worker's start-up is then a fifth of its
    /// CPU per message).
    formats: u64,
    /// Payments of each tracing drain: a quarter of the batch drain's, at least 50,000, as the
    /// codecs' (off and 0.1 in two halves each).
    tracing: u64,
    /// Payments of each topic of the databases phase (two topics a run, four runs): a tenth of
    /// the batch drain's, at least 100,000. At 25,000 (2026-12-07) a run drained both topics in
    /// 1.1 to 1.4 s, where the worker's start and the group's join weigh on the rate.
    databases: u64,
}

/// The inbox curve's size limit: each of its six runs stores the topic and applies every row,
/// at 5,000 to 10,000 rows a second on this machine (2026-12-04), so 100,000 payments keep the
/// curve to a few minutes.
const INBOX_MAX: u64 = 100_000;
/// The inbox curve's least rows: at 10,000 (quick scale until issue 35) each run drained in
/// about a second, inside which the processors' start and their slices settling were a large
/// share, and quick scale contradicted full scale.
const INBOX_MIN: u64 = 30_000;
/// The River phase's least jobs: at 20,000 (quick scale until 2026-12-07) a tuned run lasted
/// about a second, River's two tuned runs differed by 60%, and quick's tuned ratio (0.79)
/// contradicted full scale's (1.99).
const RIVER_MIN: u64 = 100_000;

impl Sizes {
    fn from_scale(scale: &str) -> anyhow::Result<Sizes> {
        let f = match scale {
            "full" => 1.0,
            "quick" => 0.1,
            n => n
                .parse::<f64>()
                .context("BENCH_SCALE must be full, quick or a number")?,
        };
        let batch = ((1_000_000.0 * f) as u64).max(1_000);
        Ok(Sizes {
            retention_keys: ((5_000_000.0 * f) as u64).max(10_000),
            ceiling: ((200_000.0 * f) as u64).max(2_000),
            batch,
            per_message: ((20_000.0 * f) as u64).max(5_000),
            scale_out: (batch / 3).max(10_000),
            inbox: (batch / 10).clamp(INBOX_MIN, INBOX_MAX),
            latency: Duration::from_secs_f64((30.0 * f).max(10.0)),
            flink_crash: Duration::from_secs_f64((60.0 * f).max(20.0)),
            river: ((200_000.0 * f) as u64).max(RIVER_MIN),
            partitions: Duration::from_secs_f64((60.0 * f).max(20.0)),
            joins: Duration::from_secs_f64((100.0 * f).max(40.0)),
            codecs: (batch / 4).max(50_000),
            formats: (batch / 10).clamp(50_000, 100_000),
            tracing: (batch / 4).max(50_000),
            databases: (batch / 10).max(100_000),
        })
    }
}

#[derive(Debug, Default, Serialize)]
struct BenchReport {
    scale: String,
    ceiling_msg_s: f64,
    ceiling_1_connection_msg_s: f64,
    ceiling_2_connections_msg_s: f64,
    ceiling_6_connections_msg_s: f64,
    batch_msg_s: f64,
    per_message_msg_s: f64,
    batch_vs_per_message: f64,
    batch_vs_ceiling: f64,
    /// The inbox receiver (no processors) draining the batch drain's kind and size of topic:
    /// records/s from its first to its last commit.
    inbox_ingest_msg_s: f64,
    inbox_ingest_vs_batch: f64,
    /// Processors applying the stored rows (4, and 1: the mean of the curve's two runs with
    /// 1): rows/s from the first to the last row marked DONE.
    inbox_process_msg_s: f64,
    inbox_process_1_msg_s: f64,
    /// The curve: rows/s by processors in one worker ("1", "2", "4", "8") and "2x4".
    inbox_processors_rows_s: std::collections::BTreeMap<String, f64>,
    /// 4 processors over 1 (target: at least 1.5 with many keys).
    inbox_4_vs_1: f64,
    /// Whether rows/s never fell as processors were added (1, 2, 4, 8, 2x4; the medians, 5%
    /// allowed for noise).
    inbox_curve_never_falls: bool,
    /// The same against the runs' own spread: no shape's best run is below the previous
    /// shape's worst (their ranges overlap), so no step fell by more than the run-to-run noise
    /// of this machine. The medians' ratios are in `inbox_curve_steps`.
    inbox_curve_never_falls_past_noise: bool,
    /// Each step's median over the one before (2/1, 4/2, 8/4, 2x4/8).
    inbox_curve_steps: Vec<f64>,
    /// Each step within each round of the curve (the shapes of a round run one after the
    /// other), the median over the rounds: the step without the machine's drift between rounds.
    inbox_curve_paired_steps: Vec<f64>,
    /// Every paired step at least 0.95: adding processors never cost more than noise.
    inbox_curve_never_falls_paired: bool,
    /// WAL bytes per record: the inbox's ingest and processing together (4-processor run),
    /// against the batch drain.
    inbox_wal_bytes_per_msg: f64,
    batch_wal_bytes_per_msg: f64,
    /// Row inserts, updates and deletes per record, the same way.
    inbox_row_writes_per_msg: f64,
    batch_row_writes_per_msg: f64,
    latency_ms: LatencyAt,
    rss_mb_peak: f64,
    cpu_us_per_msg: f64,
    verified: bool,
    batch: Drain,
    /// PostgreSQL's CPU per message of the batch drain, the whole cluster's from the worker's
    /// start to the last offset stored (`batch.*` has what it left to vacuum and the
    /// checkpointer beside): the cashback effect with its dedupe key in the ledger. Goal: at
    /// most 15 µs.
    batch_pg_cpu_us_per_msg: f64,
    /// The same span in the engine's sessions only: the transactions' own cost.
    batch_pg_engine_us_per_msg: f64,
    /// The same drain with `dedupe = "business-row"`: the key on the credit, no ledger row.
    batch_business_row: Drain,
    batch_business_row_msg_s: f64,
    batch_business_row_pg_cpu_us_per_msg: f64,
    batch_business_row_pg_engine_us_per_msg: f64,
    /// Why the business-row drain could not measure, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    batch_business_row_error: Option<String>,
    /// Both halves together.
    per_message: Drain,
    /// Each half's own rate, before and after the batch drain: how far the machine drifted.
    per_message_halves_msg_s: [f64; 2],
    /// Dropping a daily partition of dedupe keys against deleting the same rows in batches.
    retention: serde_json::Value,
    /// The batch drain's throughput in the second(s) a daily partition was being dropped,
    /// against the drain's median second.
    drop_during_drain: DropDuringDrain,
    /// Each inbox run in detail.
    inbox: InboxRuns,
    /// Why the inbox phase could not measure, if it could not (then its numbers are 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    inbox_error: Option<String>,
    /// Kafka Connect with Debezium's JDBC sink upserting the batch drain's kind and size of
    /// topic by event id: records/s from the first to the last row inserted, best tuning.
    connect_msg_s: f64,
    /// `batch_msg_s` over `connect_msg_s` (0 unless both ran).
    batch_vs_connect: f64,
    /// The runs in detail: tuning, CPU, RSS, what Connect reads.
    connect: ConnectReport,
    /// Why the Connect phase could not measure, if it could not (then its numbers are 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    connect_error: Option<String>,
    /// Flink's exactly-once JDBC sink (XA) upserting the batch drain's kind and size of topic by
    /// event id: records/s after its first commit, first to last commit, better checkpoint
    /// interval.
    flink_msg_s: f64,
    /// `batch_msg_s` over `flink_msg_s` (0 unless both ran). Goal: at least 1.5.
    batch_vs_flink_xa: f64,
    /// The engine (batch strategy) with the peer's upsert as its SQL handler, on the topic of
    /// Flink's drains, between them, over `flink_msg_s`: one write a payment on both sides
    /// (`flink.same_effect`). Goal: at least 1.5, as for `batch_vs_flink_xa`.
    same_effect_vs_flink_xa: f64,
    /// Flink's p99 at 2,000 msg/s (its shorter checkpoint interval), ms.
    flink_p99_ms_at_2000: f64,
    /// Flink's p99 over ours (`latency_ms.at_2000.p99`), at 2,000 msg/s (0 unless both ran).
    /// Goal: at least 10.
    flink_p99_vs_batch: f64,
    /// Its runs in detail: drains, latency, the crash and its check.
    flink: FlinkReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    flink_error: Option<String>,
    /// River's better run (tuned or default): no-op jobs/s, first to last `finalized_at`.
    river_jobs_s: f64,
    /// Our best processor count applying as many stored rows with a no-op effect: rows/s,
    /// first to last `done_at`.
    inbox_noop_rows_s: f64,
    inbox_vs_river: f64,
    /// Both sides of the River phase in detail (`river.rs`).
    river: RiverRuns,
    #[serde(skip_serializing_if = "Option::is_none")]
    river_error: Option<String>,
    /// A 100%-duplicate replay: records/s with the Redis pre-filter over without it.
    prefilter_replay_speedup: f64,
    /// Share of the first drain's keys the pre-filter holds afterwards (beside `verified`,
    /// not in it: a key not set costs a future hit, never a message).
    prefilter_coverage: f64,
    /// The replays in detail (`replay`).
    prefilter_replay: replay::ReplayReport,
    /// The batch strategy draining one topic of 6 partitions with 1, 2 and 3 workers: msg/s,
    /// the workers' and PostgreSQL's CPU per message, and PostgreSQL's share.
    scale_out: Vec<Drain>,
    /// 2,000 msg/s over 6, 60 and 300 partitions, with one and with two workers.
    partitions_scale: PartitionsScale,
    /// Why the many-partitions phase could not measure, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    partitions_error: Option<String>,
    joins: joins::Joins,
    #[serde(skip_serializing_if = "Option::is_none")]
    joins_error: Option<String>,
    /// The batch drain per compression codec, and zstd against none.
    codecs: codecs::Codecs,
    #[serde(skip_serializing_if = "Option::is_none")]
    codecs_error: Option<String>,
    /// The batch drain in each payload format: msg/s and worker CPU per message, against JSON.
    formats: Formats,
    #[serde(skip_serializing_if = "Option::is_none")]
    formats_error: Option<String>,
    /// The batch drain with tracing off, on at 0.1 and on at 1.0: msg/s, worker CPU per
    /// message, and their ratios against off.
    tracing: traces::Tracing,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracing_error: Option<String>,
    /// Two consumers on two PostgreSQL servers against both on one: msg/s and CPU per message.
    databases: databases::Databases,
    #[serde(skip_serializing_if = "Option::is_none")]
    databases_error: Option<String>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<bool> {
    let sizes = Sizes::from_scale(&args.scale)?;
    let bin = match &args.effectively {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("effectively"),
    };
    std::fs::create_dir_all(&args.out)?;
    let mut report = BenchReport {
        scale: args.scale.clone(),
        verified: true,
        ..BenchReport::default()
    };
    let wants = |p: Phase| args.only.is_empty() || args.only.contains(&p);

    if wants(Phase::Ceiling) {
        eprintln!(
            "== SQL ceiling ({} messages, 1, 2 and 6 connections)",
            sizes.ceiling
        );
        report.ceiling_1_connection_msg_s = ceiling(&bin, &args, 1, sizes.ceiling).await?;
        report.ceiling_2_connections_msg_s = ceiling(&bin, &args, 2, sizes.ceiling).await?;
        // The engine drains 6 partitions with up to 6 transactions at once: the like-for-like
        // ceiling has as many connections, and the ratio is taken against the best of the three.
        report.ceiling_6_connections_msg_s = ceiling(&bin, &args, 6, sizes.ceiling).await?;
        report.ceiling_msg_s = report
            .ceiling_1_connection_msg_s
            .max(report.ceiling_2_connections_msg_s)
            .max(report.ceiling_6_connections_msg_s);
    }

    if wants(Phase::Drains) {
        // The per-message strategy is bound by the disk's fsync and the batch strategy by CPU,
        // and on a shared machine either can drift within minutes: the per-message drain runs
        // in two halves, one on each side of the batch drain, so that both see the same stretch
        // of time.
        let first_half = sizes.per_message / 2;
        eprintln!("== per-message strategy draining {first_half} events (first half)");
        let before = drain(&bin, &args, "per-message", first_half, 0, 1).await?.0;
        eprintln!("== batch strategy draining {} events", sizes.batch);
        let (batch, during) =
            drain(&bin, &args, "batch", sizes.batch, sizes.retention_keys, 1).await?;
        report.batch = batch;
        report.drop_during_drain = during.unwrap_or_default();
        let second_half = sizes.per_message - first_half;
        eprintln!("   per-message strategy draining {second_half} events (second half)");
        let after = drain(&bin, &args, "per-message", second_half, 0, 1)
            .await?
            .0;
        eprintln!(
            "== batch strategy draining {} events, dedupe = \"business-row\" (the key on the \
             credit, no ledger row)",
            sizes.batch
        );
        let opts = drain::Opts {
            worker_extra: "dedupe = \"business-row\"",
            ..drain::Opts::default()
        };
        // Like the peers: a failure is reported and fails the run, the other phases still
        // measure (an engine binary from before the option refuses the config).
        match drain::drain_opts(&bin, &args, "batch", sizes.batch, 0, 1, &opts).await {
            Ok((row, _)) => report.batch_business_row = row,
            Err(e) => {
                eprintln!("   the business-row drain failed: {e:#}");
                report.batch_business_row_error = Some(format!("{e:#}"));
            }
        }
        report.batch_business_row_msg_s = report.batch_business_row.msg_s;
        report.batch_business_row_pg_cpu_us_per_msg = report.batch_business_row.pg_cpu_us_per_msg;
        report.batch_business_row_pg_engine_us_per_msg =
            report.batch_business_row.pg_engine_us_per_msg;
        report.batch_pg_cpu_us_per_msg = report.batch.pg_cpu_us_per_msg;
        report.batch_pg_engine_us_per_msg = report.batch.pg_engine_us_per_msg;
        report.per_message = Drain::combine(&before, &after);
        report.per_message_halves_msg_s = [before.msg_s, after.msg_s];
        report.batch_msg_s = report.batch.msg_s;
        report.per_message_msg_s = report.per_message.msg_s;
        report.batch_vs_per_message = ratio(report.batch_msg_s, report.per_message_msg_s);
        report.batch_vs_ceiling = ratio(report.batch_msg_s, report.ceiling_msg_s);
        report.rss_mb_peak = report.batch.rss_mb_peak;
        report.cpu_us_per_msg = report.batch.cpu_us_per_msg;
        report.batch_wal_bytes_per_msg = report.batch.wal_bytes_per_msg;
        report.batch_row_writes_per_msg = report.batch.row_writes_per_msg;
        report.verified &= report.batch.verified
            && report.per_message.verified
            && report.batch_business_row.verified;
    }

    if wants(Phase::Connect) {
        eprintln!(
            "== Kafka Connect, Debezium JDBC sink upserting {} events by event id",
            sizes.batch
        );
        // Like the inbox phase: a failure fails the run, and the other phases still measure.
        match connect(&args, sizes.batch).await {
            Ok(c) => {
                report.connect_msg_s = c.msg_s;
                report.batch_vs_connect = ratio(report.batch_msg_s, c.msg_s);
                report.verified &= c.verified;
                eprintln!(
                    "   Connect {:.0} msg/s ({} tuning); batch {:.0} msg/s: batch_vs_connect {:.2}",
                    c.msg_s, c.best, report.batch_msg_s, report.batch_vs_connect
                );
                report.connect = c;
            }
            Err(e) => {
                eprintln!("   the Connect phase failed: {e:#}");
                report.connect_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Inbox) {
        eprintln!(
            "== inbox strategy: the processor curve on one topic of {} payments, each run \
             storing it afresh (receiver only), then applying it",
            sizes.inbox
        );
        // A failed inbox phase fails the run, but the other phases still measure.
        match inbox::curve(&bin, &args, sizes.inbox).await {
            Ok(runs) => {
                report.verified &= runs.verified();
                report_inbox(&mut report, runs);
            }
            Err(e) => {
                eprintln!("   the inbox phase failed: {e:#}");
                report.inbox_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Latency) {
        eprintln!(
            "== latency at 500 and 2,000 msg/s, {:?} each",
            sizes.latency
        );
        let (l500, l2000, lat_ok) = latency(&bin, &args, sizes.latency).await?;
        report.latency_ms = LatencyAt {
            p99_target: P99_TARGET_MS,
            p99_target_met: l500.p99 <= P99_TARGET_MS && l2000.p99 <= P99_TARGET_MS,
            at_500: l500,
            at_2000: l2000,
        };
        eprintln!(
            "   p99 target {P99_TARGET_MS} ms at both rates: {}",
            if report.latency_ms.p99_target_met {
                "met"
            } else {
                "NOT met"
            }
        );
        report.verified &= lat_ok;
    }

    if wants(Phase::Flink) {
        eprintln!(
            "== Flink, the exactly-once JDBC sink (XA) upserting {} events by event id; latency at \
             2,000 msg/s; a SIGKILL mid-stream",
            sizes.batch
        );
        match flink::flink(&args, &bin, sizes.batch, sizes.latency, sizes.flink_crash).await {
            Ok(f) => {
                report.flink_msg_s = f.msg_s;
                report.batch_vs_flink_xa = ratio(report.batch_msg_s, f.msg_s);
                report.same_effect_vs_flink_xa = f.same_effect_vs_flink_xa;
                report.flink_p99_ms_at_2000 = f.p99_ms_at_2000;
                report.flink_p99_vs_batch = ratio(f.p99_ms_at_2000, report.latency_ms.at_2000.p99);
                report.verified &= f.verified;
                eprintln!(
                    "   Flink {:.0} msg/s ({}); batch {:.0} msg/s: batch_vs_flink_xa {:.2}; p99 at \
                     2,000 msg/s {:.0} ms against ours {:.1} ms: {:.0}x; crash: {} lost, {} doubled",
                    f.msg_s,
                    f.best,
                    report.batch_msg_s,
                    report.batch_vs_flink_xa,
                    f.p99_ms_at_2000,
                    report.latency_ms.at_2000.p99,
                    report.flink_p99_vs_batch,
                    f.crash.check.lost,
                    f.crash.check.doubled
                );
                report.flink = f;
            }
            Err(e) => {
                eprintln!("   the Flink phase failed: {e:#}");
                report.flink_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::River) {
        eprintln!(
            "== River vs the inbox's processors: {} no-op jobs, {} no-op rows",
            sizes.river, sizes.river
        );
        match river::river(&bin, &args, sizes.river).await {
            Ok(runs) => {
                report.verified &= runs.verified;
                report.river_jobs_s = runs.river_tuned.jobs_s.max(runs.river_default.jobs_s);
                report.inbox_noop_rows_s =
                    (runs.inbox.iter()).map(|r| r.rows_s).fold(0.0, f64::max);
                report.inbox_vs_river = runs.inbox_vs_river;
                report.river = runs;
            }
            Err(e) => {
                eprintln!("   the River phase failed: {e:#}");
                report.river_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Prefilter) {
        report.prefilter_replay = replay::phase(
            &bin,
            &args.services.brokers,
            &args.services.database_url,
            &args.out,
            sizes.batch,
        )
        .await;
        report.prefilter_replay_speedup = report.prefilter_replay.speedup;
        report.prefilter_coverage = report.prefilter_replay.coverage;
        report.verified &= report.prefilter_replay.verified;
    }

    if wants(Phase::Workers) {
        for workers in 1..=3 {
            eprintln!(
                "== scale-out: {workers} worker(s) draining {} events",
                sizes.scale_out
            );
            let (d, _) = drain(&bin, &args, "batch", sizes.scale_out, 0, workers).await?;
            report.verified &= d.verified;
            report.scale_out.push(d);
        }
    }

    if wants(Phase::Retention) {
        eprintln!(
            "== retention: drop a daily partition of {} keys vs batched DELETE",
            sizes.retention_keys
        );
        report.retention = retention(&bin, &args, sizes.retention_keys).await?;
    }

    if wants(Phase::Partitions) {
        eprintln!(
            "== many partitions: 2,000 msg/s over 6, 60 and 300 partitions, 1 and 2 workers, \
             {:?} each, pool size {}",
            sizes.partitions, args.partitions_pool_size
        );
        let scale = partitions_scale(
            &bin,
            &args,
            sizes.partitions,
            args.partitions_pool_size,
            &args.partitions_consumer,
        );
        match scale.await {
            Ok(scale) => {
                eprintln!(
                    "   target at 300 partitions ({}): {}",
                    scale.target,
                    if scale.target_met_at_300 {
                        "met"
                    } else {
                        "NOT met"
                    }
                );
                if let Some(met) = scale.target_met_at_300_grouped {
                    let met = if met { "met" } else { "NOT met" };
                    eprintln!("   with commit groups: {met}");
                }
                let said = |m: Option<bool>| match m {
                    Some(true) => "met",
                    Some(false) => "NOT met",
                    None => "not run",
                };
                eprintln!(
                    "   at the defaults ({}): {} over whole runs, {} in the steady state",
                    scale.defaults_target,
                    said(scale.defaults_target_met),
                    said(scale.defaults_target_met_steady)
                );
                report.verified &= scale.verified;
                report.partitions_scale = scale;
            }
            Err(e) => {
                eprintln!("   the many-partitions phase failed: {e:#}");
                report.partitions_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Joins) {
        eprintln!(
            "== joins: 2,000 msg/s over 24 partitions for {:?}, a second and a third worker \
             joining and leaving",
            sizes.joins
        );
        match joins::joins(&bin, &args, sizes.joins).await {
            Ok(j) => {
                for e in &j.events {
                    eprintln!(
                        "   {} at {:.1} s: p99 {:.0} ms, p50 {:.0} ms in the {:.0} s after; \
                         {} partition(s) had their longest stall then, the longest {:.0} ms",
                        e.what,
                        e.at_s,
                        e.p99_ms,
                        e.p50_ms,
                        5.0,
                        e.partitions_stalled,
                        e.longest_stall_ms
                    );
                }
                eprintln!(
                    "   longest stall {:.0} ms (partition {}); p99 during joins {:.0} ms (target \
                     <= {:.0}: {}), steady {:.0} ms; {} partitions moved; verified: {}",
                    j.longest_stall_ms,
                    j.longest_stall_partition,
                    j.p99_during_joins_ms,
                    joins::P99_TARGET_MS,
                    if j.p99_target_met { "met" } else { "NOT met" },
                    j.p99_steady_ms,
                    j.partitions_moved,
                    j.verified
                );
                report.verified &= j.verified;
                report.joins = j;
            }
            Err(e) => {
                eprintln!("   the joins phase failed: {e:#}");
                report.joins_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Codecs) {
        eprintln!(
            "== compression codecs: the batch strategy draining {} events written with none, \
             zstd, gzip, snappy and lz4",
            sizes.codecs
        );
        match codecs::codecs(&bin, &args, sizes.codecs).await {
            Ok(c) => {
                report.verified &= c.verified;
                report.codecs = c;
            }
            Err(e) => {
                eprintln!("   the codecs phase failed: {e:#}");
                report.codecs_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Formats) {
        eprintln!(
            "== payload formats: the batch drain of {} payments in JSON, Avro, Protobuf and \
             JSON Schema",
            sizes.formats
        );
        match formats::formats(&bin, &args, sizes.formats).await {
            Ok(f) => {
                report.verified &= f.verified();
                report.formats = f;
            }
            Err(e) => {
                eprintln!("   the formats phase failed: {e:#}");
                report.formats_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Tracing) {
        eprintln!(
            "== traces: the batch drain of {} payments, each with a traceparent, with tracing \
             off, on at 0.1 and on at 1.0 (exporting to Jaeger)",
            sizes.tracing
        );
        match traces::tracing(&bin, &args, sizes.tracing).await {
            Ok(t) => {
                report.verified &= t.verified;
                report.tracing = t;
            }
            Err(e) => {
                eprintln!("   the tracing phase failed: {e:#}");
                report.tracing_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    if wants(Phase::Databases) {
        eprintln!(
            "== databases: two consumers draining 2 x {} payments in one worker, both on one \
             PostgreSQL, then each on its own",
            sizes.databases
        );
        match databases::databases(&bin, &args, sizes.databases).await {
            Ok(d) => {
                report.verified &= d.verified;
                report.databases = d;
            }
            Err(e) => {
                eprintln!("   the databases phase failed: {e:#}");
                report.databases_error = Some(format!("{e:#}"));
                report.verified = false;
            }
        }
    }

    let path = args.out.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    eprintln!("report: {}", path.display());
    Ok(report.verified)
}

/// The inbox curve's numbers into the report, and a line of them.
fn report_inbox(report: &mut BenchReport, mut runs: InboxRuns) {
    let four = (runs.curve.iter())
        .find(|r| r.workers == 1 && r.processors == 4)
        .expect("the curve has a run with 4 processors");
    report.inbox_ingest_msg_s = four.ingest.msg_s;
    report.inbox_ingest_vs_batch = ratio(four.ingest.msg_s, report.batch_msg_s);
    report.inbox_process_msg_s = runs.rows_s(1, 4).round();
    report.inbox_wal_bytes_per_msg = four.wal_bytes_per_msg;
    report.inbox_row_writes_per_msg = four.row_writes_per_msg;
    report.inbox_process_1_msg_s = runs.rows_s(1, 1).round();
    report.inbox_4_vs_1 = ratio(runs.rows_s(1, 4), runs.rows_s(1, 1));
    // 1, 2, 4, 8 processors in one worker, then 2 workers of 4 (8 processors in all): each at
    // least the one before, 5% allowed for noise.
    let steps: Vec<f64> = (inbox::SHAPES.iter())
        .map(|&(w, p)| runs.rows_s(w, p))
        .collect();
    report.inbox_curve_never_falls = steps.windows(2).all(|w| w[1] >= w[0] * 0.95);
    report.inbox_curve_steps = steps.windows(2).map(|w| ratio(w[1], w[0])).collect();
    let ranges: Vec<(f64, f64)> = (inbox::SHAPES.iter())
        .map(|&(w, p)| runs.range(w, p))
        .collect();
    report.inbox_curve_never_falls_past_noise = ranges.windows(2).all(|r| r[1].1 >= r[0].0);
    report.inbox_curve_paired_steps = runs.paired_steps();
    report.inbox_curve_never_falls_paired = !report.inbox_curve_paired_steps.is_empty()
        && report.inbox_curve_paired_steps.iter().all(|&x| x >= 0.95);
    for (w, p) in inbox::SHAPES {
        let label = if w == 1 {
            p.to_string()
        } else {
            format!("{w}x{p}")
        };
        (report.inbox_processors_rows_s).insert(label, runs.rows_s(w, p).round());
    }
    eprintln!(
        "   inbox ingest {:.0} msg/s ({:.2} of batch); processing rows/s by processors: {:?} \
         (4 over 1: {:.2}; never falls: {}, past noise: {}, paired: {}; steps {:?}, paired {:?}); \
         WAL per message: inbox {:.0} B, batch {:.0} B; row writes per message: inbox {:.2}, \
         batch {:.2}",
        report.inbox_ingest_msg_s,
        report.inbox_ingest_vs_batch,
        report.inbox_processors_rows_s,
        report.inbox_4_vs_1,
        report.inbox_curve_never_falls,
        report.inbox_curve_never_falls_past_noise,
        report.inbox_curve_never_falls_paired,
        report.inbox_curve_steps,
        report.inbox_curve_paired_steps,
        report.inbox_wal_bytes_per_msg,
        report.batch_wal_bytes_per_msg,
        report.inbox_row_writes_per_msg,
        report.batch_row_writes_per_msg
    );
    runs.sizes = format!(
        "{} payments in one topic ({} keys), stored afresh and applied by each run of the curve, \
         each shape run {} times, interleaved (a tenth of the batch drain's, at least \
         {INBOX_MIN}, at most {INBOX_MAX}, or the curve takes many minutes)",
        four.events,
        runs.keys,
        inbox::RUNS_EACH,
    );
    report.inbox = runs;
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        (a / b * 100.0).round() / 100.0
    } else {
        0.0
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(records: u64, seconds: f64, cpu_us_per_msg: f64, rss_mb_peak: f64) -> Drain {
        Drain {
            events: records * 10 / 11,
            records,
            msg_s: records as f64 / seconds,
            effects_s: (records * 10 / 11) as f64 / seconds,
            seconds,
            verified: true,
            rss_mb_peak,
            cpu_us_per_msg,
            ..Drain::default()
        }
    }

    #[test]
    fn halves_combine_over_their_summed_time() {
        let fast = drain(1_100, 1.0, 100.0, 30.0);
        let slow = Drain {
            verified: false,
            ..drain(1_100, 3.0, 300.0, 40.0)
        };
        let both = Drain::combine(&fast, &slow);
        assert_eq!(both.records, 2_200);
        assert_eq!(both.events, 2_000);
        assert_eq!(both.seconds, 4.0);
        // Not the mean of 1,100/s and 367/s: the slow half took three quarters of the time.
        assert_eq!(both.msg_s, 550.0);
        assert_eq!(both.effects_s, 500.0);
        assert_eq!(both.cpu_us_per_msg, 200.0);
        assert_eq!(both.rss_mb_peak, 40.0);
        assert!(!both.verified, "one unverified half fails the whole");
    }
}
