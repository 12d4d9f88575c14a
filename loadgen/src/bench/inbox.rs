//! The inbox phase: a receiver-only worker stores a pre-filled topic, then processors apply
//! the stored rows.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::db::{Db, DbCost};
use super::worker::{resends_only, spec, Worker, PARTITIONS};
use super::{round1, BenchArgs};
use crate::produce::Step;
use crate::{finish_stage, produce_stage, Session};

#[derive(Debug, Default, Serialize)]
pub(super) struct InboxRuns {
    /// How the runs were sized against the batch drain.
    pub(super) sizes: String,
    pub(super) processors_4: InboxRun,
    pub(super) processors_1: InboxRun,
}

/// One inbox run: a fresh topic and consumer, a receiver-only worker draining it, then a worker
/// with `processors` processors applying the rows.
#[derive(Debug, Default, Serialize)]
pub(super) struct InboxRun {
    pub(super) processors: usize,
    pub(super) events: u64,
    pub(super) records: u64,
    /// Rows the receiver stored: one per unique message.
    pub(super) rows: u64,
    pub(super) ingest: InboxPhase,
    pub(super) process: InboxPhase,
    /// Rows left FAILED (none expected).
    pub(super) failed: u64,
    /// `cashback_credits` rows of the consumer, against the unique payments sent.
    pub(super) credits: u64,
    pub(super) unique_payments: u64,
    /// Ingest and processing together.
    pub(super) wal_bytes_per_msg: f64,
    pub(super) row_writes_per_msg: f64,
    pub(super) verified: bool,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct InboxPhase {
    /// Records (ingest) or rows (process) per second, first to last commit: `received_at`
    /// (ingest) or `done_at` (process) of the consumer's rows, each its transaction's start.
    pub(super) msg_s: f64,
    pub(super) seconds: f64,
    /// From the worker's start until the topic was drained (ingest) or no row was open
    /// (process), as loadgen saw it: includes the worker's start-up and the poll interval.
    pub(super) seconds_wall: f64,
    pub(super) rss_mb_peak: f64,
    /// Over records (ingest) or rows (process).
    pub(super) cpu_us_per_msg: f64,
    /// Per Kafka record, as for the drains.
    pub(super) wal_bytes_per_msg: f64,
    pub(super) row_writes_per_msg: f64,
    pub(super) db: DbCost,
}

/// One inbox run on a fresh topic and consumer (fresh payments: the cashback effect dedupes
/// by payment, so rows put back to PENDING would do no work). A receiver-only worker
/// (`processors = 0`) drains the pre-filled topic into the inbox, measured like the drains;
/// then a worker of the same consumer with `processors` processors applies the rows, until
/// none is open. The ledger is then verified exactly-once.
pub(super) async fn inbox(
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
    let spec = spec(args, &name, PARTITIONS, plan, Some(events), resends_only());
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
pub(super) fn phase(
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
