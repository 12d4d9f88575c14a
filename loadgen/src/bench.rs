//! `loadgen bench` (`make bench`): every number side by side, one run, one machine.
//!
//! 1. the SQL ceiling: the batch transaction straight against PostgreSQL, no Kafka
//!    (`effectively bench-ceiling`), with one and with two connections;
//! 2. the batch strategy draining a pre-filled topic (6 partitions, 10% resends), one worker;
//! 3. the per-message strategy draining the same kind of data;
//! 4. the inbox strategy: a receiver-only worker draining a pre-filled topic of the batch
//!    drain's kind and size into the `inbox` table, then processors (4, then 1 on fresh data)
//!    applying what it stored;
//! 5. end-to-end latency at offered 500 and 2,000 msg/s;
//! 6. the draining worker's peak RSS and CPU time per message, from `/proc`; WAL bytes and row
//!    writes per message of the drains and of the inbox, from PostgreSQL.
//!
//! Every drain, inbox and latency run is verified exactly-once by the same checker as the demo.
//! Absolute numbers depend on the machine; the ratios are what to compare.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::produce::{Mix, Step};
use crate::{finish_stage, produce_stage, Session, Spec};

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
}

struct Sizes {
    retention_keys: u64,
    ceiling: u64,
    batch: u64,
    per_message: u64,
    /// Payments of the inbox run with 4 processors (its receiver-only ingest is the one
    /// compared with the batch drain): the batch drain's, up to [`INBOX_MAX`].
    inbox: u64,
    /// Payments of the inbox run with 1 processor: a tenth of that.
    inbox_1: u64,
    latency: Duration,
}

/// The inbox runs' size limit: the processors apply a few thousand rows a second (2026-12-04,
/// quick scale: 3,542 with 4 processors, 1,297 with 1), so a million rows would add about
/// five minutes to `make bench`.
const INBOX_MAX: u64 = 300_000;

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
            inbox: batch.min(INBOX_MAX),
            inbox_1: (batch.min(INBOX_MAX) / 10).max(1_000),
            latency: Duration::from_secs_f64((30.0 * f).max(10.0)),
        })
    }
}

#[derive(Debug, Default, Serialize)]
struct Percentiles {
    p50: f64,
    p99: f64,
    p999: f64,
    /// Non-zero when the system clock was stepped during the phase (see loadgen's report):
    /// then the percentiles include records whose latency is off by that much.
    clock_step_s: f64,
}

#[derive(Debug, Default, Serialize)]
struct LatencyAt {
    at_500: Percentiles,
    at_2000: Percentiles,
    /// The steady-state target for p99 at both rates (issue 17), and whether both met it.
    p99_target: f64,
    p99_target_met: bool,
}

/// p99 at 500 and at 2,000 msg/s, in steady state, in ms.
const P99_TARGET_MS: f64 = 50.0;

#[derive(Debug, Default, Serialize)]
struct Drain {
    events: u64,
    records: u64,
    msg_s: f64,
    effects_s: f64,
    seconds: f64,
    verified: bool,
    rss_mb_peak: f64,
    cpu_us_per_msg: f64,
    /// WAL bytes (the whole cluster's) per record, from the worker's start to its exit.
    wal_bytes_per_msg: f64,
    /// Rows inserted, updated and deleted in the `public` tables per record, same span.
    row_writes_per_msg: f64,
    db: DbCost,
}

impl Drain {
    /// Two drains of the same strategy as one: rates over their summed time, the larger peak.
    fn combine(a: &Drain, b: &Drain) -> Drain {
        let seconds = a.seconds + b.seconds;
        let records = a.records + b.records;
        let cpu_us = a.cpu_us_per_msg * a.records as f64 + b.cpu_us_per_msg * b.records as f64;
        Drain {
            events: a.events + b.events,
            records,
            msg_s: records as f64 / seconds,
            effects_s: (a.effects_s * a.seconds + b.effects_s * b.seconds) / seconds,
            seconds,
            verified: a.verified && b.verified,
            rss_mb_peak: a.rss_mb_peak.max(b.rss_mb_peak),
            cpu_us_per_msg: (cpu_us / records.max(1) as f64 * 10.0).round() / 10.0,
            wal_bytes_per_msg: a.db.plus(&b.db).wal_bytes_per(records),
            row_writes_per_msg: a.db.plus(&b.db).row_writes_per(records),
            db: a.db.plus(&b.db),
        }
    }
}

/// What PostgreSQL did during a phase, from [`DbMark`]s taken around it.
#[derive(Debug, Default, Clone, Copy, Serialize)]
struct DbCost {
    /// `pg_wal_lsn_diff` of `pg_current_wal_lsn()`: every database of the cluster, and
    /// autovacuum's and the checkpointer's writes too.
    wal_bytes: i64,
    /// Full-page images among them (`pg_stat_wal.wal_fpi`): a page's first change after a
    /// checkpoint is logged whole.
    wal_fpi: i64,
    /// Checkpoints counted in the phase (`pg_stat_bgwriter`, which counts one as it ends).
    checkpoints: i64,
    /// `n_tup_ins + n_tup_upd + n_tup_del` over the `public` tables (each partition counted;
    /// the sessions' temporary staging tables, which write no WAL, are not).
    row_writes: i64,
}

impl DbCost {
    fn plus(&self, o: &DbCost) -> DbCost {
        DbCost {
            wal_bytes: self.wal_bytes + o.wal_bytes,
            wal_fpi: self.wal_fpi + o.wal_fpi,
            checkpoints: self.checkpoints + o.checkpoints,
            row_writes: self.row_writes + o.row_writes,
        }
    }

    fn wal_bytes_per(&self, records: u64) -> f64 {
        round1(self.wal_bytes as f64 / records.max(1) as f64)
    }

    fn row_writes_per(&self, records: u64) -> f64 {
        (self.row_writes as f64 / records.max(1) as f64 * 100.0).round() / 100.0
    }
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
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
    /// Processors applying the stored rows (4, and 1 on fresh data): rows/s from the first
    /// to the last row marked DONE.
    inbox_process_msg_s: f64,
    inbox_process_1_msg_s: f64,
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
    /// A 100%-duplicate replay: records/s with the Redis pre-filter over without it.
    prefilter_replay_speedup: f64,
    /// Share of the first drain's keys the pre-filter holds afterwards (beside `verified`,
    /// not in it: a key not set costs a future hit, never a message).
    prefilter_coverage: f64,
    /// The replays in detail (`crate::replay`).
    prefilter_replay: crate::replay::ReplayReport,
}

#[derive(Debug, Default, Serialize)]
struct InboxRuns {
    /// How the runs were sized against the batch drain.
    sizes: String,
    processors_4: InboxRun,
    processors_1: InboxRun,
}

/// One inbox run: a fresh topic and consumer, a receiver-only worker draining it, then a worker
/// with `processors` processors applying the rows.
#[derive(Debug, Default, Serialize)]
struct InboxRun {
    processors: usize,
    events: u64,
    records: u64,
    /// Rows the receiver stored: one per unique message.
    rows: u64,
    ingest: InboxPhase,
    process: InboxPhase,
    /// Rows left FAILED (none expected).
    failed: u64,
    /// `cashback_credits` rows of the consumer, against the unique payments sent.
    credits: u64,
    unique_payments: u64,
    /// Ingest and processing together.
    wal_bytes_per_msg: f64,
    row_writes_per_msg: f64,
    verified: bool,
}

#[derive(Debug, Default, Serialize)]
struct InboxPhase {
    /// Records (ingest) or rows (process) per second, first to last commit: `received_at`
    /// (ingest) or `done_at` (process) of the consumer's rows, each its transaction's start.
    msg_s: f64,
    seconds: f64,
    /// From the worker's start until the topic was drained (ingest) or no row was open
    /// (process), as loadgen saw it: includes the worker's start-up and the poll interval.
    seconds_wall: f64,
    rss_mb_peak: f64,
    /// Over records (ingest) or rows (process).
    cpu_us_per_msg: f64,
    /// Per Kafka record, as for the drains.
    wal_bytes_per_msg: f64,
    row_writes_per_msg: f64,
    db: DbCost,
}

#[derive(Debug, Default, Serialize)]
struct DropDuringDrain {
    keys: u64,
    drop_seconds: f64,
    msg_s_during_drop: f64,
    msg_s_median: f64,
    /// The slowest full second without a drop: the drain's own noise, for comparison.
    msg_s_min_without_drop: f64,
    ratio: f64,
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
        ..BenchReport::default()
    };

    eprintln!(
        "== 1/5 SQL ceiling ({} messages, 1, 2 and 6 connections)",
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

    // The per-message strategy is bound by the disk's fsync and the batch strategy by CPU, and
    // on a shared machine either can drift within minutes: the per-message drain runs in two
    // halves, one on each side of the batch drain, so that both see the same stretch of time.
    let first_half = sizes.per_message / 2;
    eprintln!("== 2/5 per-message strategy draining {first_half} events (first half)");
    let before = drain(&bin, &args, "per-message", first_half, 0).await?.0;
    eprintln!("== 3/5 batch strategy draining {} events", sizes.batch);
    let (batch, during) = drain(&bin, &args, "batch", sizes.batch, sizes.retention_keys).await?;
    report.batch = batch;
    report.drop_during_drain = during.unwrap_or_default();
    let second_half = sizes.per_message - first_half;
    eprintln!("   per-message strategy draining {second_half} events (second half)");
    let after = drain(&bin, &args, "per-message", second_half, 0).await?.0;
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

    eprintln!(
        "== 4/5 inbox strategy: receiver only, then 4 processors, on {} events",
        sizes.inbox
    );
    // A failed inbox phase fails the run, but the other phases still measure.
    let runs = async {
        let four = inbox(&bin, &args, 4, sizes.inbox).await?;
        eprintln!(
            "   inbox strategy: receiver only, then 1 processor, on {} fresh events",
            sizes.inbox_1
        );
        let one = inbox(&bin, &args, 1, sizes.inbox_1).await?;
        anyhow::Ok((four, one))
    };
    let inbox_ok = match runs.await {
        Ok((four, one)) => {
            let ok = four.verified && one.verified;
            report_inbox(&mut report, four, one);
            ok
        }
        Err(e) => {
            eprintln!("   the inbox phase failed: {e:#}");
            report.inbox_error = Some(format!("{e:#}"));
            false
        }
    };

    eprintln!(
        "== 5/5 latency at 500 and 2,000 msg/s, {:?} each",
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
    report.verified = report.batch.verified && report.per_message.verified && inbox_ok && lat_ok;

    report.prefilter_replay = crate::replay::phase(
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

    eprintln!(
        "== retention: drop a daily partition of {} keys vs batched DELETE",
        sizes.retention_keys
    );
    report.retention = retention(&bin, &args, sizes.retention_keys).await?;

    let path = args.out.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    eprintln!("report: {}", path.display());
    Ok(report.verified)
}

/// The inbox runs' numbers into the report, and a line of them.
fn report_inbox(report: &mut BenchReport, four: InboxRun, one: InboxRun) {
    report.inbox_ingest_msg_s = four.ingest.msg_s;
    report.inbox_ingest_vs_batch = ratio(four.ingest.msg_s, report.batch_msg_s);
    report.inbox_process_msg_s = four.process.msg_s;
    report.inbox_process_1_msg_s = one.process.msg_s;
    report.inbox_wal_bytes_per_msg = four.wal_bytes_per_msg;
    report.inbox_row_writes_per_msg = four.row_writes_per_msg;
    eprintln!(
        "   inbox ingest {:.0} msg/s ({:.2} of batch); processing {:.0} msg/s with 4 processors, \
         {:.0} with 1; WAL per message: inbox {:.0} B, batch {:.0} B; row writes per message: \
         inbox {:.2}, batch {:.2}",
        report.inbox_ingest_msg_s,
        report.inbox_ingest_vs_batch,
        report.inbox_process_msg_s,
        report.inbox_process_1_msg_s,
        report.inbox_wal_bytes_per_msg,
        report.batch_wal_bytes_per_msg,
        report.inbox_row_writes_per_msg,
        report.batch_row_writes_per_msg
    );
    report.inbox = InboxRuns {
        sizes: format!(
            "{} payments with 4 processors ({} the batch drain's {}: at most {INBOX_MAX}, or \
             the processing takes minutes), {} fresh ones with 1 processor",
            four.events,
            if four.events == report.batch.events {
                "as many as"
            } else {
                "fewer than"
            },
            report.batch.events,
            one.events
        ),
        processors_4: four,
        processors_1: one,
    };
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        (a / b * 100.0).round() / 100.0
    } else {
        0.0
    }
}

async fn ceiling(
    bin: &Path,
    args: &BenchArgs,
    connections: usize,
    messages: u64,
) -> anyhow::Result<f64> {
    let c = connections.to_string();
    let m = messages.to_string();
    let v = engine_json(
        bin,
        args,
        &["bench-ceiling", "--connections", &c, "--messages", &m],
    )
    .await?;
    let msg_s = v["msg_s"]
        .as_f64()
        .context("bench-ceiling printed no msg_s")?;
    eprintln!("   {connections} connection(s): {msg_s:.0} msg/s");
    Ok(msg_s)
}

/// A worker process of the engine, for one consumer on one topic.
struct Worker {
    child: tokio::process::Child,
}

impl Worker {
    async fn start(
        bin: &Path,
        args: &BenchArgs,
        name: &str,
        strategy: &str,
    ) -> anyhow::Result<Worker> {
        Worker::start_with(bin, args, name, strategy, "", name).await
    }

    /// With `extra` appended to the consumer's section, and the config and log files named
    /// after `file`.
    async fn start_with(
        bin: &Path,
        args: &BenchArgs,
        name: &str,
        strategy: &str,
        extra: &str,
        file: &str,
    ) -> anyhow::Result<Worker> {
        let config = args.out.join(format!("{file}.toml"));
        std::fs::write(
            &config,
            format!(
                "[worker]\nid = \"bench\"\n[[consumer]]\nname = \"{name}\"\ntopics = [\"{name}\"]\n\
                 strategy = \"{strategy}\"\nhandler = {{ kind = \"cashback\" }}\n{extra}"
            ),
        )?;
        let log = std::fs::File::create(args.out.join(format!("{file}.log")))?;
        let child = tokio::process::Command::new(bin)
            .args(["run", "--config"])
            .arg(&config)
            .env("KAFKA_BROKERS", &args.services.brokers)
            .env("DATABASE_URL", &args.services.database_url)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Worker { child })
    }

    /// (peak RSS in MB, CPU seconds) so far, from /proc.
    fn usage(&self) -> (f64, f64) {
        let Some(pid) = self.child.id() else {
            return (0.0, 0.0);
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let hwm_kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0.0);
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Fields after the command name (which may hold spaces): utime and stime are the
        // 14th and 15th fields, in clock ticks (100 a second on Linux).
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<&str> = after.split_whitespace().collect();
        let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        (hwm_kb / 1024.0, (ticks(11) + ticks(12)) / 100.0)
    }

    /// Why the process is gone, if it exited (it should not before it is stopped).
    fn exited(&mut self, log: &str) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(status)) if status.success() => Some(format!(
                "the worker exited on its own, with status 0, before it was stopped (see {log}); \
                 `effectively run` stops when any of its tasks ends"
            )),
            Ok(Some(status)) => Some(format!("the worker exited: {status} (see {log})")),
            Err(e) => Some(format!("the worker's status is unknown: {e}")),
        }
    }

    async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await??;
        anyhow::ensure!(
            status.success(),
            "the worker did not exit cleanly: {status:?}"
        );
        Ok(())
    }
}

fn spec(args: &BenchArgs, name: &str, plan: Vec<Step>, limit: Option<u64>, mix: Mix) -> Spec {
    Spec {
        brokers: args.services.brokers.clone(),
        database_url: args.services.database_url.clone(),
        topic: name.to_string(),
        partitions: 6,
        consumer: name.to_string(),
        plan,
        limit,
        mix,
        users: 1000,
        rate_bp: 200,
        drain_timeout: Duration::from_secs(900),
        report_dir: args.out.join(name),
        seed: None,
        quiet: true,
    }
}

fn resends_only() -> Mix {
    Mix {
        resend: 0.10,
        redrive: 0.0,
        redrive_delay: Duration::ZERO,
        double_tap: 0.0,
        poison: 0.0,
    }
}

/// Pre-fills a topic, then starts one worker and measures it draining the topic. With
/// `drop_keys`, a daily partition of that many dedupe keys is dropped once a third of the
/// topic is applied.
async fn drain(
    bin: &Path,
    args: &BenchArgs,
    strategy: &str,
    events: u64,
    drop_keys: u64,
) -> anyhow::Result<(Drain, Option<DropDuringDrain>)> {
    let name = format!("bench-{strategy}-{:06x}", fastrand::u32(..0xffffff));
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let spec = spec(args, &name, plan, Some(events), resends_only());
    let session = Session::open(&spec).await?;
    let produced = produce_stage(&session, &spec).await?;
    let records = produced.acked();
    if drop_keys > 0 {
        eprintln!("   preparing a daily partition of {drop_keys} keys to drop during the drain");
        engine_json(
            bin,
            args,
            &[
                "bench-retention",
                "--mode",
                "prepare",
                "--keys",
                &drop_keys.to_string(),
            ],
        )
        .await?;
    }
    eprintln!("   topic pre-filled: {records} records; starting the worker");
    let db = Db::connect(args).await?;
    let mark = db.mark().await?;
    let worker = Worker::start(bin, args, &name, strategy).await?;
    let dropper = (drop_keys > 0).then(|| {
        let (bin, url, started_at) = (
            bin.to_path_buf(),
            args.services.database_url.clone(),
            produced.started_at,
        );
        let name = name.clone();
        tokio::spawn(async move {
            // Drop once a third of the topic is applied: in the middle of the drain.
            if let Ok((db, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                tokio::spawn(conn);
                for _ in 0..1200 {
                    let done: i64 = db
                        .query_one(
                            "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offsets
                             WHERE consumer = $1 AND topic = $1",
                            &[&name],
                        )
                        .await
                        .map(|r| r.get(0))
                        .unwrap_or(0);
                    if done as u64 >= records / 3 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            let from = (chrono::Utc::now() - started_at).as_seconds_f64();
            let out = tokio::process::Command::new(&bin)
                .args(["bench-retention", "--mode", "drop"])
                .env("DATABASE_URL", &url)
                .output()
                .await;
            let to = (chrono::Utc::now() - started_at).as_seconds_f64();
            (from, to, out.map(|o| o.status.success()).unwrap_or(false))
        })
    });
    let report = finish_stage(&session, &spec, &produced).await?;
    let during = match dropper {
        Some(task) => {
            let (from, to, ok) = task.await?;
            anyhow::ensure!(ok, "dropping the partition during the drain failed");
            Some(drop_effect(&report.series.throughput, from, to, drop_keys))
        }
        None => None,
    };
    let (rss_mb, cpu_s) = worker.usage();
    worker.stop().await?;
    let cost = db.cost_since(&mark).await?;
    // From the first to the last commit.
    let span = if report.commit_span_s > 0.0 {
        report.commit_span_s
    } else {
        f64::INFINITY
    };
    let d = Drain {
        events,
        records,
        msg_s: records as f64 / span,
        effects_s: report.effects as f64 / span,
        seconds: span,
        verified: report.verified,
        rss_mb_peak: (rss_mb * 10.0).round() / 10.0,
        cpu_us_per_msg: (cpu_s * 1e6 / records.max(1) as f64 * 10.0).round() / 10.0,
        wal_bytes_per_msg: cost.wal_bytes_per(records),
        row_writes_per_msg: cost.row_writes_per(records),
        db: cost,
    };
    eprintln!(
        "   {:.0} msg/s ({} records in {:.1} s, first to last commit), verified: {}, peak RSS {:.0} MB, {:.1} µs CPU/msg, {:.0} WAL bytes/msg, {:.2} row writes/msg",
        d.msg_s, records, span, d.verified, d.rss_mb_peak, d.cpu_us_per_msg, d.wal_bytes_per_msg, d.row_writes_per_msg
    );
    if let Some(x) = &during {
        eprintln!(
            "   during the drop ({:.2} s): {:.0} effects/s against a median second of {:.0} ({:.2}; slowest second without a drop {:.0})",
            x.drop_seconds, x.msg_s_during_drop, x.msg_s_median, x.ratio, x.msg_s_min_without_drop
        );
    }
    Ok((d, during))
}

/// One inbox run on a fresh topic and consumer (fresh payments: the cashback effect dedupes
/// by payment, so rows put back to PENDING would do no work). A receiver-only worker
/// (`processors = 0`) drains the pre-filled topic into the inbox, measured like the drains;
/// then a worker of the same consumer with `processors` processors applies the rows, until
/// none is open. The ledger is then verified exactly-once.
async fn inbox(
    bin: &Path,
    args: &BenchArgs,
    processors: usize,
    events: u64,
) -> anyhow::Result<InboxRun> {
    let name = format!(
        "bench-inbox-{processors}p-{:06x}",
        fastrand::u32(..0xffffff)
    );
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let spec = spec(args, &name, plan, Some(events), resends_only());
    let session = Session::open(&spec).await?;
    let produced = produce_stage(&session, &spec).await?;
    let records = produced.acked();
    let unique = crate::verify::Expected::from_log(&produced.log, spec.rate_bp)
        .payments
        .len() as u64;
    eprintln!(
        "   topic pre-filled: {records} records ({unique} unique payments); starting the receiver (processors = 0)"
    );
    let db = Db::connect(args).await?;

    // The receiver alone: stores every message and moves the offset.
    let mark = db.mark().await?;
    let started = Instant::now();
    let mut receiver = Worker::start_with(
        bin,
        args,
        &name,
        "inbox",
        "[consumer.inbox]\nprocessors = 0\n",
        &format!("{name}-receiver"),
    )
    .await?;
    loop {
        if let Ok(0) = session.watcher.lag(&session.db, &name).await {
            break;
        }
        if let Some(why) = receiver.exited(&format!("{name}-receiver.log")) {
            anyhow::bail!(
                "the receiver-only worker (processors = 0) did not drain the topic: {why}"
            );
        }
        anyhow::ensure!(
            started.elapsed() < spec.drain_timeout,
            "the inbox receiver did not drain the topic within {:?}",
            spec.drain_timeout
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ingest_wall = started.elapsed().as_secs_f64();
    let (rss_mb, cpu_s) = receiver.usage();
    receiver.stop().await?;
    let cost = db.cost_since(&mark).await?;
    let r = db
        .client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE status = 'PENDING'),
                    coalesce(extract(epoch FROM max(received_at) - min(received_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&name],
        )
        .await?;
    let (rows, pending, span) = (
        r.get::<_, i64>(0) as u64,
        r.get::<_, i64>(1) as u64,
        r.get(2),
    );
    let ingest = phase(records, span, ingest_wall, rss_mb, cpu_s, records, cost);
    eprintln!(
        "   ingest: {:.0} msg/s ({records} records into {rows} rows, {pending} PENDING, in {:.1} s, first to last commit), peak RSS {:.0} MB, {:.1} µs CPU/msg, {:.0} WAL bytes/msg, {:.2} row writes/msg",
        ingest.msg_s, ingest.seconds, ingest.rss_mb_peak, ingest.cpu_us_per_msg, ingest.wal_bytes_per_msg, ingest.row_writes_per_msg
    );

    // The processors, on the same consumer (its receiver finds the topic drained).
    let mark = db.mark().await?;
    let started = Instant::now();
    let mut worker = Worker::start_with(
        bin,
        args,
        &name,
        "inbox",
        &format!("[consumer.inbox]\nprocessors = {processors}\n"),
        &format!("{name}-processors"),
    )
    .await?;
    loop {
        if crate::verify::inbox_open(&db.client, &name).await? == 0 {
            break;
        }
        if let Some(why) = worker.exited(&format!("{name}-processors.log")) {
            anyhow::bail!("the inbox processors did not empty the inbox: {why}");
        }
        anyhow::ensure!(
            started.elapsed() < spec.drain_timeout,
            "the inbox processors did not empty the inbox within {:?}",
            spec.drain_timeout
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let process_wall = started.elapsed().as_secs_f64();
    let (rss_mb, cpu_s) = worker.usage();
    worker.stop().await?;
    let process_cost = db.cost_since(&mark).await?;
    let r = db
        .client
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'DONE'), count(*) FILTER (WHERE status = 'FAILED'),
                    coalesce(extract(epoch FROM max(done_at) - min(done_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&name],
        )
        .await?;
    let (done, failed, span) = (
        r.get::<_, i64>(0) as u64,
        r.get::<_, i64>(1) as u64,
        r.get(2),
    );
    let credits: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM cashback_credits WHERE consumer = $1",
            &[&name],
        )
        .await?
        .get(0);
    let credits = credits as u64;
    let process = phase(
        done,
        span,
        process_wall,
        rss_mb,
        cpu_s,
        records,
        process_cost,
    );
    let ledger = finish_stage(&session, &spec, &produced).await?;
    let verified = ledger.verified
        && rows == unique
        && pending == rows
        && done == rows
        && failed == 0
        && credits == unique;
    let both = cost.plus(&process_cost);
    eprintln!(
        "   {processors} processor(s): {:.0} msg/s ({done} rows DONE, {failed} FAILED, in {:.1} s, first to last DONE; {:.1} s from the worker's start), {credits} credits for {unique} unique payments, verified: {verified}, peak RSS {:.0} MB, {:.1} µs CPU/row, {:.0} WAL bytes/msg, {:.2} row writes/msg",
        process.msg_s, process.seconds, process.seconds_wall, process.rss_mb_peak, process.cpu_us_per_msg, process.wal_bytes_per_msg, process.row_writes_per_msg
    );
    Ok(InboxRun {
        processors,
        events,
        records,
        rows,
        ingest,
        process,
        failed,
        credits,
        unique_payments: unique,
        wal_bytes_per_msg: both.wal_bytes_per(records),
        row_writes_per_msg: both.row_writes_per(records),
        verified,
    })
}

/// An inbox phase's numbers: `count` records or rows in `span` seconds (first to last
/// commit); WAL and row writes per one of the run's `records`.
fn phase(
    count: u64,
    span: f64,
    wall: f64,
    rss_mb: f64,
    cpu_s: f64,
    records: u64,
    db: DbCost,
) -> InboxPhase {
    let span_or_inf = if span > 0.0 { span } else { f64::INFINITY };
    InboxPhase {
        msg_s: (count as f64 / span_or_inf).round(),
        seconds: (span * 1000.0).round() / 1000.0,
        seconds_wall: (wall * 10.0).round() / 10.0,
        rss_mb_peak: round1(rss_mb),
        cpu_us_per_msg: round1(cpu_s * 1e6 / count.max(1) as f64),
        wal_bytes_per_msg: db.wal_bytes_per(records),
        row_writes_per_msg: db.row_writes_per(records),
        db,
    }
}

/// A connection that reads PostgreSQL's counters around a phase.
struct Db {
    client: tokio_postgres::Client,
}

/// The cluster's WAL position and write counters at one moment.
struct DbMark {
    lsn: String,
    wal_fpi: i64,
    checkpoints: i64,
    /// Per table (oid): rows inserted, updated and deleted so far.
    row_writes: HashMap<u32, i64>,
}

impl Db {
    async fn connect(args: &BenchArgs) -> anyhow::Result<Db> {
        let (client, conn) =
            tokio_postgres::connect(&args.services.database_url, tokio_postgres::NoTls)
                .await
                .context("connecting to PostgreSQL")?;
        tokio::spawn(conn);
        Ok(Db { client })
    }

    /// Waits (up to 10 s) until no engine session is connected: a session reports its row
    /// counts and WAL statistics when it exits, and they must fall in the phase they belong to.
    async fn settle(&self) -> anyhow::Result<()> {
        for _ in 0..100 {
            let n: i64 = self
                .client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = 'effectively' AND datname = current_database()",
                    &[],
                )
                .await?
                .get(0);
            if n == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Once the engine's sessions are gone: the counters now.
    async fn mark(&self) -> anyhow::Result<DbMark> {
        self.settle().await?;
        let r = self
            .client
            .query_one(
                "SELECT pg_current_wal_lsn()::text, (SELECT wal_fpi FROM pg_stat_wal),
                        (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)",
                &[],
            )
            .await?;
        let row_writes = self
            .client
            .query(
                "SELECT relid, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables
                 WHERE schemaname = 'public'",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get::<_, u32>(0), r.get::<_, i64>(1)))
            .collect();
        Ok(DbMark {
            lsn: r.get(0),
            wal_fpi: r.get(1),
            checkpoints: r.get(2),
            row_writes,
        })
    }

    /// What was written since `since` (tables dropped since are left out; tables created
    /// since count from zero).
    async fn cost_since(&self, since: &DbMark) -> anyhow::Result<DbCost> {
        let now = self.mark().await?;
        let wal_bytes: i64 = self
            .client
            .query_one(
                "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::bigint",
                &[&now.lsn, &since.lsn],
            )
            .await?
            .get(0);
        let row_writes = (now.row_writes.iter())
            .map(|(rel, n)| n - since.row_writes.get(rel).copied().unwrap_or(0))
            .sum();
        Ok(DbCost {
            wal_bytes,
            wal_fpi: now.wal_fpi - since.wal_fpi,
            checkpoints: now.checkpoints - since.checkpoints,
            row_writes,
        })
    }
}

/// Effects committed per second (the report's throughput, which counts effects; the ratio is
/// what matters) in the second(s) overlapping `[from, to]`, against the median full second.
fn drop_effect(
    series: &[crate::report::RatePoint],
    from: f64,
    to: f64,
    keys: u64,
) -> DropDuringDrain {
    // The first and last seconds of the drain are partial.
    let full: Vec<f64> = series
        .iter()
        .skip(1)
        .take(series.len().saturating_sub(2))
        .map(|p| p.per_s)
        .collect();
    let mut sorted = full.clone();
    sorted.sort_by(|a, b| a.total_cmp(b));
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or(0.0);
    let overlaps = |p: &&crate::report::RatePoint| p.t_s + 1.0 > from && p.t_s <= to;
    let during = series
        .iter()
        .filter(overlaps)
        .map(|p| p.per_s)
        .fold(f64::INFINITY, f64::min);
    let min_without = series
        .iter()
        .skip(1)
        .take(series.len().saturating_sub(2))
        .filter(|p| !overlaps(p))
        .map(|p| p.per_s)
        .fold(f64::INFINITY, f64::min);
    let during = if during.is_finite() { during } else { 0.0 };
    DropDuringDrain {
        keys,
        drop_seconds: to - from,
        msg_s_during_drop: during,
        msg_s_median: median,
        msg_s_min_without_drop: if min_without.is_finite() {
            min_without
        } else {
            0.0
        },
        ratio: if median > 0.0 { during / median } else { 0.0 },
    }
}

/// Runs an `effectively` subcommand that prints one JSON object.
async fn engine_json(
    bin: &Path,
    args: &BenchArgs,
    cmd: &[&str],
) -> anyhow::Result<serde_json::Value> {
    let out = tokio::process::Command::new(bin)
        .args(cmd)
        .env("DATABASE_URL", &args.services.database_url)
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} {cmd:?} failed: {:?}",
        bin.display(),
        out.status
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// One worker (batch strategy) running; loadgen offers 500/s, then 2,000/s.
async fn latency(
    bin: &Path,
    args: &BenchArgs,
    each: Duration,
) -> anyhow::Result<(Percentiles, Percentiles, bool)> {
    let name = format!("bench-latency-{:06x}", fastrand::u32(..0xffffff));
    let mut s = spec(
        args,
        &name,
        Vec::new(),
        None,
        Mix {
            resend: 0.10,
            ..resends_only()
        },
    );
    let session = Session::open(&s).await?;
    let worker = Worker::start(bin, args, &name, "batch").await?;
    // Measure the steady state, not the group's first join.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut out = Vec::new();
    let mut ok = true;
    for rate in [500.0, 2000.0] {
        s.plan = vec![Step {
            rate: Some(rate),
            duration: each,
        }];
        s.report_dir = args.out.join(format!("{name}-{rate}"));
        let produced = produce_stage(&session, &s).await?;
        let r = finish_stage(&session, &s, &produced).await?;
        eprintln!(
            "   at {rate}/s: p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms, verified: {}",
            r.latency_ms.p50, r.latency_ms.p99, r.latency_ms.p999, r.verified
        );
        ok &= r.verified;
        out.push(Percentiles {
            p50: r.latency_ms.p50,
            p99: r.latency_ms.p99,
            p999: r.latency_ms.p999,
            clock_step_s: r.clock_step_s,
        });
    }
    worker.stop().await?;
    let l2000 = out.pop().unwrap_or_default();
    let l500 = out.pop().unwrap_or_default();
    Ok((l500, l2000, ok))
}

async fn retention(bin: &Path, args: &BenchArgs, keys: u64) -> anyhow::Result<serde_json::Value> {
    let k = keys.to_string();
    let v = engine_json(bin, args, &["bench-retention", "--keys", &k]).await?;
    eprintln!(
        "   DELETE {:.2} s and {} WAL bytes; drop {:.3} s and {} WAL bytes: {:.0}x the time, {:.0}x the WAL",
        v["delete_seconds"].as_f64().unwrap_or(0.0),
        v["delete_wal_bytes"],
        v["drop_seconds"].as_f64().unwrap_or(0.0),
        v["drop_wal_bytes"],
        v["time_ratio"].as_f64().unwrap_or(0.0),
        v["wal_ratio"].as_f64().unwrap_or(0.0)
    );
    Ok(v)
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
