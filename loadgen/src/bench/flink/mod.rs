//! Flink's exactly-once JDBC sink, the peer of the batch drain and of the latency phase
//! (`--only flink`): `peers/flink-xa`, one Java class on Flink 1.20's local MiniCluster
//! (`scripts/flink.sh build` makes its jars), reads the payments topic with a `KafkaSource` and
//! upserts each payment by event id, like the Connect peer, through `JdbcSink.exactlyOnceSink`:
//! XA transactions from `PGXADataSource`, one connection each (PostgreSQL allows one XA
//! transaction per connection), `maxRetries = 0`, prepared at each checkpoint and committed when
//! the checkpoint completes. So an effect is visible one checkpoint after it is written, and
//! PostgreSQL needs `max_prepared_transactions` above 0 (the stack sets it, scripts/lib.sh).
//!
//! Its table is Connect's plus two columns: the record's Kafka timestamp, and `applied`, how many
//! of the event's records were applied (a resend makes 2). A record applied twice, the failure
//! exactly-once is about, shows as one too many; a record lost, as one too few.
//!
//! Measurements, each on a table of its own:
//! 1. drains: the batch drain's kind and size of pre-filled topic, once per checkpoint interval
//!    ([`INTERVALS`]): records/s, the JVM's and PostgreSQL's CPU per record; between the two,
//!    the engine on the same topic with the peer's upsert as its SQL handler ([`engine`]);
//! 2. latency at 2,000 msg/s, once per interval: each row's commit time ([`commits`]) minus its
//!    record's timestamp;
//! 3. a crash: the JVM SIGKILLed mid-stream at 2,000 msg/s, restarted from its newest retained
//!    checkpoint, then the table checked for records lost and applied twice;
//! 4. redelivery: the batch drain's topic with its copies, to see whether the peer stalls on
//!    them ([`redelivery`]).
//!
//! Running the JVM is in [`job`]; reading commit times from PostgreSQL's snapshots in
//! [`commits`]; this file measures.

mod commits;
mod engine;
mod job;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use serde::Serialize;
use uuid::Uuid;

use super::db::{Db, DbCost};
use super::peer::{self, check_table, create_table, delete_topics, group_reader, lag, Jdbc};
use super::worker::{resends_only, spec, PARTITIONS};
use super::{round1, round2, BenchArgs};
use crate::produce::{Mix, Step};
use crate::{produce_stage, Session};
use commits::{CommitClock, Commits};
use job::{latest_checkpoint, Job, Launch};

const RUNTIME: &str = "Apache Flink 1.20.3, local MiniCluster in one JVM (Java 17), \
                       KafkaSource of flink-connector-kafka 3.4.0-1.20";
const SINK: &str = "flink-connector-jdbc 3.3.0-1.20, JdbcSink.exactlyOnceSink: XA through \
                    PGXADataSource (PostgreSQL JDBC 42.7.8), a connection per transaction, \
                    maxRetries 0, JDBC batches of up to 5,000 (the connector's default)";
/// The database of the peer's tables, next to the engine's (created if missing).
const DATABASE: &str = "flink_bench";
/// The checkpoint intervals each drain and latency run is tried at: a second (the shortest that
/// leaves the checkpoints' own work small beside the records') and five.
const INTERVALS: [Duration; 2] = [Duration::from_secs(1), Duration::from_secs(5)];
/// The latency and crash runs' offered rate, the latency phase's higher one.
const RATE: f64 = 2000.0;
/// Connect's columns and these: the record's timestamp and the records applied.
const MORE_COLUMNS: &str = ", kafka_ts timestamptz NOT NULL, applied int4 NOT NULL DEFAULT 1";

/// The measured runs' topics hold no copies: Flink's XA sink stalls for good on a record whose
/// key its own previous checkpoint's transaction still holds, prepared (the upsert waits for
/// that transaction's lock on the task's thread, and only that thread commits it, once the
/// checkpoint completes: the full-scale drain of 2026-12-07, with the engine's 10% resends,
/// stopped at its 6th checkpoint). The redelivery run looks for it ([`redelivery`]).
fn no_copies() -> Mix {
    Mix {
        resend: 0.0,
        ..resends_only()
    }
}

/// `flink.redelivery` in report.json: the batch drain's topic, copies included, drained with
/// checkpoints every second ([`redelivery`]).
#[derive(Debug, Default, Serialize)]
pub(super) struct RedeliveryRun {
    pub(super) checkpoint_interval_ms: u64,
    pub(super) events: u64,
    pub(super) records: u64,
    /// Records that are copies of an earlier one (resends).
    pub(super) copies: u64,
    /// From the JVM's start until the run went through or was called stalled.
    pub(super) seconds: f64,
    /// No checkpoint moved the group for [`STALL`] while records waited.
    pub(super) stalled: bool,
    /// The group's lag when the run stopped (0: everything committed).
    pub(super) lag_at_end: i64,
    /// Sessions of the peer's database waiting for a lock that a prepared transaction holds,
    /// when the run stopped.
    pub(super) waiting_on_prepared: i64,
    pub(super) prepared: u64,
    /// The table against the topic, when the run went through (a copy is applied again, as
    /// an upsert: `applied` counts it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) check: Option<peer::TableCheck>,
}

/// How long the group's lag may stand still, records waiting, before a run is called stalled.
const STALL: Duration = Duration::from_secs(60);

/// `flink` in report.json.
#[derive(Debug, Default, Serialize)]
pub(super) struct FlinkReport {
    /// The better drain's records/s (see `span`).
    pub(super) msg_s: f64,
    /// Its checkpoint interval.
    pub(super) best: String,
    /// p99 at 2,000 msg/s with the shorter checkpoint interval, ms.
    pub(super) p99_ms_at_2000: f64,
    pub(super) verified: bool,
    pub(super) runtime: String,
    pub(super) sink: String,
    /// Source and sink subtasks (one per partition, as Connect's `tasks.max`), chained.
    pub(super) parallelism: i32,
    pub(super) span: String,
    pub(super) latency_from: String,
    pub(super) drains: Vec<DrainRun>,
    pub(super) latency: Vec<LatencyRun>,
    pub(super) crash: CrashRun,
    pub(super) redelivery: RedeliveryRun,
    /// The engine on the peer's effect ([`engine`]): the batch strategy, an SQL handler whose
    /// statement is the peer's upsert, on the same topic, between Flink's two drains, measured
    /// the same way (`checkpoint_interval_ms` 0).
    pub(super) same_effect: DrainRun,
    /// Its handler's statement (`{t}`: the run's table).
    pub(super) same_effect_statement: String,
    /// `same_effect.msg_s` over `msg_s`: one write against one write.
    pub(super) same_effect_vs_flink_xa: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) same_effect_error: Option<String>,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct DrainRun {
    pub(super) checkpoint_interval_ms: u64,
    pub(super) events: u64,
    pub(super) records: u64,
    /// Every record over the first row written to the last commit: the wait for the last
    /// checkpoint included, as an XA sink's reader sees it.
    pub(super) msg_s: f64,
    /// Records after the first commit over the first to the last commit: the steady rate, but
    /// meaningless when one checkpoint holds most of the drain (a quick-scale drain at 5 s).
    pub(super) msg_s_after_first_commit: f64,
    pub(super) seconds: f64,
    /// Distinct transactions that wrote the table (rows' `xmin`).
    pub(super) transactions: u64,
    /// From the JVM's start until its job ran.
    pub(super) startup_s: f64,
    /// The JVM's CPU after its job ran, per record.
    pub(super) cpu_us_per_msg: f64,
    /// PostgreSQL's, the same span (the commit clock's own session left out).
    pub(super) pg_cpu_us_per_msg: f64,
    pub(super) wal_bytes_per_msg: f64,
    pub(super) rss_mb_peak: f64,
    pub(super) check: peer::TableCheck,
    /// Prepared transactions left in PostgreSQL after the JVM stopped (rolled back then).
    pub(super) prepared_left: u64,
}

impl DrainRun {
    /// A drain of `topic` whose rows' commit times are `rows`: `cpu_s` the process's CPU over
    /// it, `cost` PostgreSQL's, less `clock_cpu_s` (the commit clock's own session). The
    /// interval, start-up and prepared transactions left are the caller's to set.
    fn measured(
        topic: &Topic,
        rows: &[Row],
        (rss_mb, cpu_s): (f64, f64),
        cost: &DbCost,
        clock_cpu_s: f64,
        check: peer::TableCheck,
    ) -> DrainRun {
        let records = topic.records;
        let span = Span::of(rows);
        DrainRun {
            events: topic.expected.len() as u64,
            records,
            msg_s: span.rate_from_first_write(records),
            msg_s_after_first_commit: span.rate(records),
            seconds: round2(span.last - span.first),
            transactions: span.transactions,
            cpu_us_per_msg: round1(cpu_s * 1e6 / records.max(1) as f64),
            pg_cpu_us_per_msg: round1(
                (cost.pg_cpu_s - clock_cpu_s).max(0.0) * 1e6 / records.max(1) as f64,
            ),
            wal_bytes_per_msg: cost.wal_bytes_per(records),
            rss_mb_peak: round1(rss_mb),
            check,
            ..DrainRun::default()
        }
    }

    /// What a drain's line says after its rate.
    fn summary(&self) -> String {
        format!(
            "{} records, {:.1} s first to last commit, {} transactions; {:.1} µs CPU/msg, \
             PostgreSQL {:.1} µs CPU/msg, {:.0} WAL bytes/msg, peak RSS {:.0} MB, verified: {}",
            self.records,
            self.seconds,
            self.transactions,
            self.cpu_us_per_msg,
            self.pg_cpu_us_per_msg,
            self.wal_bytes_per_msg,
            self.rss_mb_peak,
            self.check.verified
        )
    }
}

#[derive(Debug, Default, Serialize)]
pub(super) struct LatencyRun {
    pub(super) checkpoint_interval_ms: u64,
    pub(super) rate: f64,
    pub(super) seconds: f64,
    /// Rows with a commit time (one per event: a resend's row holds its later record).
    pub(super) samples: u64,
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) p999: f64,
    pub(super) max: f64,
    pub(super) check: peer::TableCheck,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct CrashRun {
    pub(super) checkpoint_interval_ms: u64,
    pub(super) rate: f64,
    pub(super) seconds: f64,
    pub(super) events: u64,
    pub(super) records: u64,
    /// When the JVM was SIGKILLed, seconds after producing started.
    pub(super) killed_at_s: f64,
    /// Prepared transactions in PostgreSQL at the kill: written, not yet committed.
    pub(super) prepared_at_kill: u64,
    /// The checkpoint restored (`chk-<n>`).
    pub(super) restored_checkpoint: u64,
    /// From the restarted JVM's start until its job ran.
    pub(super) restart_s: f64,
    /// Lost and doubled are the check's.
    pub(super) check: peer::TableCheck,
    pub(super) prepared_left: u64,
}

/// The peer's database, its JDBC address, and what every run needs.
struct Ctx<'a> {
    args: &'a BenchArgs,
    db: tokio_postgres::Client,
    jdbc: Jdbc,
}

/// What a topic holds, for a run to check its table against.
struct Topic {
    name: String,
    highs: Vec<i64>,
    expected: HashMap<Uuid, i64>,
    copies: HashMap<Uuid, u32>,
    records: u64,
}

pub(super) async fn flink(
    args: &BenchArgs,
    bin: &Path,
    events: u64,
    latency_each: Duration,
    crash_for: Duration,
) -> anyhow::Result<FlinkReport> {
    ensure!(
        args.flink_lib.join("peer-flink-xa.jar").exists(),
        "no Flink peer in {}: run `scripts/flink.sh build` first",
        args.flink_lib.display()
    );
    let (db, pg) = peer::database(&args.services.database_url, DATABASE).await?;
    let prepared: String = (db.query_one("SHOW max_prepared_transactions", &[]).await?).get(0);
    if prepared.parse::<u32>().unwrap_or(0) < 2 * PARTITIONS as u32 {
        bail!(
            "PostgreSQL's max_prepared_transactions is {prepared}: Flink's XA sink prepares a \
             transaction per sink subtask and checkpoint. The stack starts PostgreSQL with 64 \
             (scripts/lib.sh); a server started before that needs a restart \
             (scripts/stack.sh down, then up)"
        );
    }
    let ctx = Ctx {
        args,
        jdbc: Jdbc::new(&pg, DATABASE)?,
        db,
    };
    // A run killed before it cleaned up leaves prepared transactions holding locks.
    roll_back_prepared(&ctx.db).await?;
    let out = runs(&ctx, bin, events, latency_each, crash_for).await;
    // On an error too: a JVM killed mid-run leaves its prepared transactions, holding their
    // rows' locks and the cluster's vacuum horizon through the phases after this one.
    if let Err(e) = roll_back_prepared(&ctx.db).await {
        eprintln!("   rolling back the Flink peer's prepared transactions: {e:#}");
    }
    out
}

/// Every run of the phase, in order ([`flink`] cleans up after them).
async fn runs(
    ctx: &Ctx<'_>,
    bin: &Path,
    events: u64,
    latency_each: Duration,
    crash_for: Duration,
) -> anyhow::Result<FlinkReport> {
    let args = ctx.args;
    let mut report = FlinkReport {
        verified: true,
        runtime: RUNTIME.into(),
        sink: SINK.into(),
        parallelism: PARTITIONS,
        span: "drains: records over the span from the first row written to the last commit \
               (commit times from PostgreSQL's snapshots, every 20 ms); \
               msg_s_after_first_commit beside it"
            .into(),
        latency_from: "each row's commit (its transaction's first snapshot as ended) minus its \
                       record's Kafka timestamp, one per event"
            .into(),
        ..FlinkReport::default()
    };

    let name = format!("bench-flink-{:06x}", fastrand::u32(..0xffffff));
    let topic = prefill(args, &name, events, no_copies()).await?;
    eprintln!(
        "   topic pre-filled: {} records ({} payments)",
        topic.records,
        topic.expected.len()
    );
    for (i, interval) in INTERVALS.into_iter().enumerate() {
        if i == 1 {
            // Between Flink's two drains, so that both sides see the same stretch of time.
            same_effect(ctx, bin, &topic, &mut report).await;
        }
        let run = drain(ctx, &topic, interval).await?;
        eprintln!(
            "   checkpoints every {interval:?}: {:.0} msg/s, first write to last commit ({:.0} \
             after the first commit), JVM start {:.1} s; {}",
            run.msg_s,
            run.msg_s_after_first_commit,
            run.startup_s,
            run.summary()
        );
        report.verified &= run.check.verified;
        if run.msg_s > report.msg_s {
            report.msg_s = run.msg_s;
            report.best = format!("checkpoint interval {interval:?}");
        }
        report.drains.push(run);
    }
    delete_topics(&args.services.brokers, &[&topic.name]).await;
    report.same_effect_vs_flink_xa = super::ratio(report.same_effect.msg_s, report.msg_s);
    if report.same_effect_error.is_none() {
        eprintln!(
            "   the engine on the peer's effect against Flink's better drain: {:.2}",
            report.same_effect_vs_flink_xa
        );
    }

    for interval in INTERVALS {
        let run = latency(ctx, interval, latency_each).await?;
        eprintln!(
            "   at {RATE}/s, checkpoints every {interval:?}: p50 {:.0} ms, p99 {:.0} ms, p99.9 \
             {:.0} ms ({} rows), verified: {}",
            run.p50, run.p99, run.p999, run.samples, run.check.verified
        );
        report.verified &= run.check.verified;
        report.latency.push(run);
    }
    report.p99_ms_at_2000 = report.latency.first().map_or(0.0, |r| r.p99);

    let crash = crash(ctx, INTERVALS[0], crash_for).await?;
    eprintln!(
        "   crash: SIGKILL at {:.1} s with {} transactions prepared, restarted from chk-{} (job \
         running {:.1} s after the JVM's start): {} lost, {} doubled, {} unexpected, {} prepared \
         left; verified: {}",
        crash.killed_at_s,
        crash.prepared_at_kill,
        crash.restored_checkpoint,
        crash.restart_s,
        crash.check.lost,
        crash.check.doubled,
        crash.check.unexpected,
        crash.prepared_left,
        crash.check.verified
    );
    report.verified &= crash.check.verified;
    report.crash = crash;

    let redelivery = redelivery(ctx, INTERVALS[0], events).await?;
    eprintln!(
        "   the batch drain's topic with its copies ({} of {} records), checkpoints every {:?}: \
         {} after {:.0} s (lag {} at the end, {} sessions waiting for a prepared transaction's \
         lock, {} prepared)",
        redelivery.copies,
        redelivery.records,
        INTERVALS[0],
        if redelivery.stalled {
            "STALLED"
        } else {
            "went through"
        },
        redelivery.seconds,
        redelivery.lag_at_end,
        redelivery.waiting_on_prepared,
        redelivery.prepared
    );
    report.redelivery = redelivery;
    Ok(report)
}

/// The engine's drain on the peer's effect into `report`; a failure is reported there and fails
/// the phase's check, and Flink's runs still measure.
async fn same_effect(ctx: &Ctx<'_>, bin: &Path, topic: &Topic, report: &mut FlinkReport) {
    report.same_effect_statement = engine::statement().into();
    match engine::drain(ctx, bin, topic).await {
        Ok(run) => {
            eprintln!(
                "   the engine, batch strategy, the peer's upsert as its SQL handler: {:.0} \
                 msg/s, first write to last commit; {}",
                run.msg_s,
                run.summary()
            );
            report.verified &= run.check.verified;
            report.same_effect = run;
        }
        Err(e) => {
            eprintln!("   the engine's drain on the peer's effect failed: {e:#}");
            report.same_effect_error = Some(format!("{e:#}"));
            report.verified = false;
        }
    }
}

/// A pre-filled payments topic `name` like the batch drain's (6 partitions), `events` payments
/// written with `mix`.
async fn prefill(args: &BenchArgs, name: &str, events: u64, mix: Mix) -> anyhow::Result<Topic> {
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let spec = spec(args, name, PARTITIONS, plan, Some(events), mix);
    let session = Session::open(&spec).await?;
    let produced = produce_stage(&session, &spec).await?;
    produced.stop_sampling();
    topic(args, name.to_string(), &produced)
}

fn topic(args: &BenchArgs, name: String, produced: &crate::Produced) -> anyhow::Result<Topic> {
    let highs = peer::highs(&args.services.brokers, &name)?;
    let records = produced.acked();
    ensure!(
        highs.iter().sum::<i64>() as u64 == records,
        "{name}: {records} records acknowledged, {} in the topic",
        highs.iter().sum::<i64>()
    );
    Ok(Topic {
        name,
        highs,
        expected: produced.amounts_by_event(),
        copies: produced.copies_by_event(),
        records,
    })
}

/// What each run sets up: a fresh table, a folder for the JVM's log and checkpoints.
struct Setup {
    table: String,
    dir: PathBuf,
    checkpoints: PathBuf,
}

impl Setup {
    async fn new(ctx: &Ctx<'_>, name: &str) -> anyhow::Result<Setup> {
        let table = name.replace('-', "_");
        create_table(&ctx.db, &table, MORE_COLUMNS).await?;
        let dir = std::path::absolute(ctx.args.out.join(name))?;
        let checkpoints = dir.join("checkpoints");
        std::fs::create_dir_all(&checkpoints)?;
        Ok(Setup {
            table,
            dir,
            checkpoints,
        })
    }

    fn launch<'a>(
        &'a self,
        ctx: &'a Ctx<'_>,
        topic: &'a str,
        interval: Duration,
        restore: Option<&'a Path>,
        log: &'a Path,
    ) -> Launch<'a> {
        Launch {
            lib: &ctx.args.flink_lib,
            brokers: &ctx.args.services.brokers,
            topic,
            group: &self.table,
            jdbc: &ctx.jdbc,
            table: &self.table,
            checkpoint_interval: interval,
            checkpoints: &self.checkpoints,
            restore,
            parallelism: PARTITIONS,
            log,
        }
    }
}

/// The peer draining the pre-filled topic with checkpoints every `interval`.
async fn drain(ctx: &Ctx<'_>, topic: &Topic, interval: Duration) -> anyhow::Result<DrainRun> {
    let name = format!("{}-drain-{}ms", topic.name, interval.as_millis());
    let setup = Setup::new(ctx, &name).await?;
    let clock = CommitClock::start(&ctx.args.services.database_url).await?;
    let log = setup.dir.join("flink.log");
    let mut job = Job::start(&setup.launch(ctx, &topic.name, interval, None, &log)).await?;
    let cpu_s_startup = job.usage().1;
    let pg = Db::connect(ctx.args).await?;
    let mark = pg.mark().await?;
    let clock_cpu = clock.cpu_s();
    until_applied(ctx, &mut job, &setup.table, topic, interval).await?;
    let (rss_mb, cpu_s) = job.usage();
    let cost = pg.cost_since(&mark).await?;
    let clock_cpu = clock.cpu_s() - clock_cpu;
    let startup_s = job.startup_s;
    job.stop().await?;
    let commits = clock.stop();
    let prepared_left = roll_back_prepared(&ctx.db).await?;
    let check = check_table(&ctx.db, &setup.table, &topic.expected, Some(&topic.copies)).await?;
    let rows = committed_rows(&ctx.db, &setup.table, &commits).await?;
    ctx.db
        .batch_execute(&format!("DROP TABLE {}", setup.table))
        .await?;
    Ok(DrainRun {
        checkpoint_interval_ms: interval.as_millis() as u64,
        startup_s: round1(startup_s),
        prepared_left,
        ..DrainRun::measured(
            topic,
            &rows,
            (rss_mb, cpu_s - cpu_s_startup),
            &cost,
            clock_cpu,
            check,
        )
    })
}

/// The peer on a fresh topic while loadgen offers [`RATE`] for `each`.
async fn latency(ctx: &Ctx<'_>, interval: Duration, each: Duration) -> anyhow::Result<LatencyRun> {
    let name = format!(
        "bench-flink-latency-{}ms-{:06x}",
        interval.as_millis(),
        fastrand::u32(..0xffffff)
    );
    let (session, spec) = rated(ctx.args, &name, each, no_copies()).await?;
    let setup = Setup::new(ctx, &name).await?;
    let clock = CommitClock::start(&ctx.args.services.database_url).await?;
    let log = setup.dir.join("flink.log");
    let mut job = Job::start(&setup.launch(ctx, &name, interval, None, &log)).await?;
    // The steady state, as the engine's latency phase measures it (after the first checkpoints).
    tokio::time::sleep(Duration::from_secs(5).max(interval * 2)).await;
    let produced = produce_stage(&session, &spec).await?;
    produced.stop_sampling();
    let topic = topic(ctx.args, name.clone(), &produced)?;
    until_applied(ctx, &mut job, &setup.table, &topic, interval).await?;
    job.stop().await?;
    let commits = clock.stop();
    roll_back_prepared(&ctx.db).await?;
    let check = check_table(&ctx.db, &setup.table, &topic.expected, Some(&topic.copies)).await?;
    let rows = committed_rows(&ctx.db, &setup.table, &commits).await?;
    ctx.db
        .batch_execute(&format!("DROP TABLE {}", setup.table))
        .await?;
    delete_topics(&ctx.args.services.brokers, &[&name]).await;
    let ms = rows
        .iter()
        .filter_map(|r| Some((r.committed? - r.kafka_ts) * 1000.0));
    let l = crate::measure::latency_of(ms.map(|ms| ms.max(0.0)));
    Ok(LatencyRun {
        checkpoint_interval_ms: interval.as_millis() as u64,
        rate: RATE,
        seconds: each.as_secs_f64(),
        samples: rows.iter().filter(|r| r.committed.is_some()).count() as u64,
        p50: round1(l.p50),
        p99: round1(l.p99),
        p999: round1(l.p999),
        max: round1(l.max),
        check,
    })
}

/// Sessions of this database waiting for a transaction id's lock that a prepared transaction
/// holds.
async fn waiting_on_prepared(db: &tokio_postgres::Client) -> anyhow::Result<i64> {
    Ok(db
        .query_one(
            "SELECT count(*) FROM pg_locks w JOIN pg_prepared_xacts p
               ON w.locktype = 'transactionid' AND NOT w.granted
              AND w.transactionid = p.transaction
             WHERE p.database = current_database()",
            &[],
        )
        .await?
        .get(0))
}

/// A pre-filled topic like the batch drain's, copies included (10% resends, each a moment after
/// its original in its partition), drained with checkpoints every `interval`: whether the peer
/// gets through copies of records its previous checkpoint's transaction holds, prepared, or
/// stalls waiting for its own lock. At full speed a JDBC batch (5,000 records) fills and runs
/// between checkpoints, so a copy's upsert can meet its original's prepared row; at a low rate
/// the batch runs at the checkpoint, after the previous one committed. The table is checked
/// only when the run went through (a stalled run holds what its committed checkpoints wrote).
async fn redelivery(
    ctx: &Ctx<'_>,
    interval: Duration,
    events: u64,
) -> anyhow::Result<RedeliveryRun> {
    let name = format!("bench-flink-redelivery-{:06x}", fastrand::u32(..0xffffff));
    let topic = prefill(ctx.args, &name, events, resends_only()).await?;
    let setup = Setup::new(ctx, &name).await?;
    let log = setup.dir.join("flink.log");
    let started = Instant::now();
    let mut job = Job::start(&setup.launch(ctx, &name, interval, None, &log)).await?;
    let outcome = until_applied(ctx, &mut job, &setup.table, &topic, interval).await;
    let group = group_reader(&ctx.args.services.brokers, &setup.table)?;
    let mut run = RedeliveryRun {
        checkpoint_interval_ms: interval.as_millis() as u64,
        events: topic.expected.len() as u64,
        records: topic.records,
        copies: topic.records - topic.expected.len() as u64,
        seconds: round1(started.elapsed().as_secs_f64()),
        stalled: outcome.is_err(),
        lag_at_end: lag(&group, &topic.name, &topic.highs)?,
        waiting_on_prepared: waiting_on_prepared(&ctx.db).await?,
        prepared: prepared(&ctx.db).await?,
        check: None,
    };
    if let Err(e) = outcome {
        eprintln!("   {e:#}");
    }
    job.stop().await?;
    roll_back_prepared(&ctx.db).await?;
    if !run.stalled {
        run.check =
            Some(check_table(&ctx.db, &setup.table, &topic.expected, Some(&topic.copies)).await?);
    }
    ctx.db
        .batch_execute(&format!("DROP TABLE {}", setup.table))
        .await?;
    delete_topics(&ctx.args.services.brokers, &[&name]).await;
    Ok(run)
}

/// The peer on a fresh topic at [`RATE`] for `duration`, SIGKILLed 40% of the way through (once
/// it has retained a checkpoint), restarted from its newest one; then its table checked.
async fn crash(ctx: &Ctx<'_>, interval: Duration, duration: Duration) -> anyhow::Result<CrashRun> {
    let name = format!("bench-flink-crash-{:06x}", fastrand::u32(..0xffffff));
    let (session, spec) = rated(ctx.args, &name, duration, no_copies()).await?;
    let setup = Setup::new(ctx, &name).await?;
    let log = setup.dir.join("flink.log");
    let job = Job::start(&setup.launch(ctx, &name, interval, None, &log)).await?;
    let checkpoints = &setup.checkpoints;
    let restart_log = setup.dir.join("flink-restarted.log");
    let started = Instant::now();
    let kill_and_restart = async {
        tokio::time::sleep(duration.mul_f64(0.4)).await;
        let mut job = job;
        let deadline = Instant::now() + Duration::from_secs(60);
        while latest_checkpoint(checkpoints, &job.id).is_none() {
            job.alive()?;
            ensure!(
                Instant::now() < deadline,
                "the Flink peer retained no checkpoint within 60 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let prepared_at_kill = prepared(&ctx.db).await?;
        let killed_at_s = started.elapsed().as_secs_f64();
        let id = job.id.clone();
        job.kill().await?;
        let (from, n) = latest_checkpoint(checkpoints, &id).context("no checkpoint")?;
        eprintln!(
            "   crash: killed the Flink peer at {killed_at_s:.1} s ({prepared_at_kill} \
             transactions prepared); restarting from chk-{n}"
        );
        let launch = setup.launch(ctx, &name, interval, Some(&from), &restart_log);
        let job = Job::start(&launch).await?;
        anyhow::Ok((job, killed_at_s, prepared_at_kill, n))
    };
    let (produced, restarted) = tokio::join!(produce_stage(&session, &spec), kill_and_restart);
    let produced = produced?;
    produced.stop_sampling();
    let (mut job, killed_at_s, prepared_at_kill, restored_checkpoint) = restarted?;
    let topic = topic(ctx.args, name.clone(), &produced)?;
    until_applied(ctx, &mut job, &setup.table, &topic, interval).await?;
    let restart_s = job.startup_s;
    job.stop().await?;
    let prepared_left = roll_back_prepared(&ctx.db).await?;
    let check = check_table(&ctx.db, &setup.table, &topic.expected, Some(&topic.copies)).await?;
    ctx.db
        .batch_execute(&format!("DROP TABLE {}", setup.table))
        .await?;
    delete_topics(&ctx.args.services.brokers, &[&name]).await;
    Ok(CrashRun {
        checkpoint_interval_ms: interval.as_millis() as u64,
        rate: RATE,
        seconds: duration.as_secs_f64(),
        events: topic.expected.len() as u64,
        records: topic.records,
        killed_at_s: round1(killed_at_s),
        prepared_at_kill,
        restored_checkpoint,
        restart_s: round1(restart_s),
        check,
        prepared_left,
    })
}

/// A fresh topic and a spec offering [`RATE`] for `duration`, with `mix`.
async fn rated(
    args: &BenchArgs,
    name: &str,
    duration: Duration,
    mix: Mix,
) -> anyhow::Result<(Session, crate::Spec)> {
    let plan = vec![Step {
        rate: Some(RATE),
        duration,
    }];
    let mut s = spec(args, name, PARTITIONS, plan, None, mix);
    s.report_dir = args.out.join(name);
    Ok((Session::open(&s).await?, s))
}

/// Waits until the peer's source has committed the topic's ends to its group (at a completed
/// checkpoint, when its sink commits too) and the table holds every event and record; gives the
/// table a few checkpoints more than that, then returns whatever it holds (the check says what
/// is missing or doubled). Fails if the JVM exits.
async fn until_applied(
    ctx: &Ctx<'_>,
    job: &mut Job,
    table: &str,
    topic: &Topic,
    interval: Duration,
) -> anyhow::Result<()> {
    let group = group_reader(&ctx.args.services.brokers, table)?;
    let timeout = Duration::from_secs(1800);
    let started = Instant::now();
    let (mut last, mut moved) = (i64::MAX, Instant::now());
    loop {
        let now = lag(&group, &topic.name, &topic.highs)?;
        if now == 0 {
            break;
        }
        if now != last {
            (last, moved) = (now, Instant::now());
        }
        job.alive()?;
        ensure!(
            moved.elapsed() < STALL,
            "the Flink peer stalled: its group's lag stood at {now} for {STALL:?} ({} sessions \
             waiting for a prepared transaction's lock)",
            waiting_on_prepared(&ctx.db).await.unwrap_or(-1)
        );
        ensure!(
            started.elapsed() < timeout,
            "the Flink peer did not consume {} within {timeout:?}",
            topic.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let settle = Instant::now();
    let query = format!("SELECT count(*), coalesce(sum(applied), 0)::int8 FROM {table}");
    loop {
        let r = ctx.db.query_one(&query, &[]).await?;
        let (rows, applied): (i64, i64) = (r.get(0), r.get(1));
        if rows as usize == topic.expected.len() && applied as u64 == topic.records {
            return Ok(());
        }
        if settle.elapsed() > (interval * 5).max(Duration::from_secs(30)) {
            eprintln!(
                "   the peer's group is at the topic's end, but {table} holds {rows} rows and {applied} \
                 applied records of {} and {}",
                topic.expected.len(),
                topic.records
            );
            return Ok(());
        }
        job.alive()?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One row of the peer's table with its commit time.
struct Row {
    /// Seconds since the epoch, PostgreSQL's clock; None if no snapshot saw it committed.
    committed: Option<f64>,
    kafka_ts: f64,
    loaded_at: f64,
    xid: u32,
}

async fn committed_rows(
    db: &tokio_postgres::Client,
    table: &str,
    commits: &Commits,
) -> anyhow::Result<Vec<Row>> {
    let rows = db
        .query(
            &format!(
                "SELECT xmin::text::int8, extract(epoch FROM kafka_ts)::float8, \
                 extract(epoch FROM loaded_at)::float8 FROM {table}"
            ),
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            let xid = r.get::<_, i64>(0) as u32;
            Row {
                committed: commits.committed_at(xid),
                kafka_ts: r.get(1),
                loaded_at: r.get(2),
                xid,
            }
        })
        .collect())
}

/// A drain's commits: the first and last commit, the first row written, the rows the first
/// commit made visible.
#[derive(Debug, Default)]
struct Span {
    first: f64,
    last: f64,
    first_write: f64,
    rows: u64,
    rows_at_first: u64,
    transactions: u64,
}

impl Span {
    fn of(rows: &[Row]) -> Span {
        let times: Vec<f64> = rows.iter().filter_map(|r| r.committed).collect();
        let first = times.iter().copied().fold(f64::INFINITY, f64::min);
        let last = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut xids: Vec<u32> = rows.iter().map(|r| r.xid).collect();
        xids.sort_unstable();
        xids.dedup();
        Span {
            first,
            last,
            first_write: rows
                .iter()
                .map(|r| r.loaded_at)
                .fold(f64::INFINITY, f64::min),
            rows: rows.len() as u64,
            rows_at_first: times.iter().filter(|&&t| t <= first).count() as u64,
            transactions: xids.len() as u64,
        }
    }

    /// `records` over the span, less the share the first commit made visible: those were
    /// written before the span began (at a checkpoint interval of 5 s, a fifth of a 25-second
    /// drain).
    fn rate(&self, records: u64) -> f64 {
        let span = self.last - self.first;
        if span.is_nan() || span <= 0.0 || self.rows == 0 {
            return 0.0;
        }
        let after_first = 1.0 - self.rows_at_first as f64 / self.rows as f64;
        (records as f64 * after_first / span).round()
    }

    fn rate_from_first_write(&self, records: u64) -> f64 {
        let span = self.last - self.first_write;
        if span > 0.0 {
            (records as f64 / span).round()
        } else {
            0.0
        }
    }
}

async fn prepared(db: &tokio_postgres::Client) -> anyhow::Result<u64> {
    let n: i64 = (db
        .query_one(
            "SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await?)
        .get(0);
    Ok(n as u64)
}

/// Rolls back the prepared transactions left in the peer's database (each holds its rows'
/// locks until it ends, and a `DROP TABLE` would wait for it); how many there were.
async fn roll_back_prepared(db: &tokio_postgres::Client) -> anyhow::Result<u64> {
    let gids = db
        .query(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()",
            &[],
        )
        .await?;
    for r in &gids {
        let gid: String = r.get(0);
        db.batch_execute(&format!("ROLLBACK PREPARED '{}'", gid.replace('\'', "''")))
            .await
            .with_context(|| format!("rolling back the prepared transaction {gid}"))?;
    }
    Ok(gids.len() as u64)
}
