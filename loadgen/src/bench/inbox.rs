//! The inbox phase: a receiver-only worker stores a pre-filled topic, then processors apply
//! the stored rows.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::db::{Db, DbCost};
use super::worker::{resends_only, spec, until_applied, until_stored, Worker, PARTITIONS};
use super::{round1, BenchArgs};
use crate::produce::Step;
use crate::{finish_stage, produce_stage, Session, Spec};

/// The processor curve: one pre-filled topic, stored by a fresh consumer for each run, so every
/// run applies the same rows (same payments, keys and resends).
#[derive(Debug, Default, Serialize)]
pub(super) struct InboxRuns {
    /// How the runs were sized against the batch drain.
    pub(super) sizes: String,
    /// Distinct ordering keys (Kafka keys: one per user) among the rows.
    pub(super) keys: u64,
    /// TOML the processors' `[consumer.inbox]` had beside `processors` (`--inbox-processors`).
    pub(super) processors_extra: String,
    /// In the order they ran: [`SHAPES`], [`RUNS_EACH`] times over.
    pub(super) curve: Vec<InboxRun>,
}

impl InboxRuns {
    /// Rows/s of the runs with `workers` x `processors`: the median of its runs.
    pub(super) fn rows_s(&self, workers: usize, processors: usize) -> f64 {
        median(
            (self.curve.iter())
                .filter(|r| r.workers == workers && r.processors == processors)
                .map(|r| r.process.msg_s)
                .collect(),
        )
    }

    /// (slowest, fastest) rows/s of the runs with `workers` x `processors`.
    pub(super) fn range(&self, workers: usize, processors: usize) -> (f64, f64) {
        (self.curve.iter())
            .filter(|r| r.workers == workers && r.processors == processors)
            .map(|r| r.process.msg_s)
            .fold((f64::INFINITY, 0.0), |(lo, hi), x| (lo.min(x), hi.max(x)))
    }

    /// Each step of [`SHAPES`] (2/1, 4/2, 8/4, 2x4/8) within each round of the curve, then
    /// the median over the rounds. The shapes of one round run minutes apart, the rounds tens
    /// of minutes: a drift of the shared machine between rounds (the first round at half the
    /// third's speed, 2026-12-07) moves every shape of a round together, so a ratio within a
    /// round keeps the step and drops the drift, where the medians of the shapes mix both.
    pub(super) fn paired_steps(&self) -> Vec<f64> {
        let rounds: Vec<&[InboxRun]> = self.curve.chunks_exact(SHAPES.len()).collect();
        (1..SHAPES.len())
            .map(|k| {
                median(
                    (rounds.iter())
                        .map(|r| r[k].process.msg_s / r[k - 1].process.msg_s)
                        .filter(|x| x.is_finite())
                        .collect(),
                )
            })
            .collect()
    }

    pub(super) fn verified(&self) -> bool {
        !self.curve.is_empty() && self.curve.iter().all(|r| r.verified)
    }
}

/// The middle value (the mean of the two middle ones for an even count); 0 for none.
fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    match xs.len() {
        0 => 0.0,
        n if n % 2 == 1 => xs[n / 2],
        n => (xs[n / 2 - 1] + xs[n / 2]) / 2.0,
    }
}

/// One run of the curve: a fresh consumer of the curve's topic, a receiver-only worker storing
/// it, then `workers` workers with `processors` processors each applying the rows.
#[derive(Debug, Default, Serialize)]
pub(super) struct InboxRun {
    pub(super) consumer: String,
    pub(super) workers: usize,
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
    /// Per row (process) or record (ingest): index scans and buffer accesses on the `inbox`
    /// partitions, the profile of what the processors' claims cost as they are added.
    pub(super) inbox_index_scans_per_row: f64,
    pub(super) inbox_buffers_per_row: f64,
    /// PostgreSQL's CPU per row (process) or record (ingest).
    pub(super) pg_cpu_us_per_row: f64,
    pub(super) db: DbCost,
    /// The statements PostgreSQL spent the most time on (`pg_stat_statements`), most first.
    pub(super) top_statements: Vec<super::db::Statement>,
}

/// The curve's shapes, `(workers, processors each)`: 1, 2, 4 and 8 processors in one worker,
/// then two workers of 4.
pub(super) const SHAPES: [(usize, usize); 5] = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4)];

/// Each shape runs this many times, the shapes interleaved (all five, then all five again), so
/// a drift of the shared machine spreads over every shape; a shape's rows/s is the median.
pub(super) const RUNS_EACH: usize = 3;

/// The processor curve on one pre-filled topic of `events` payments: for each run of [`SHAPES`], a
/// fresh consumer (fresh rows and a fresh ledger: the cashback effect dedupes by payment, so
/// rows put back to PENDING would do no work). A receiver-only worker (`processors = 0`)
/// stores the topic, measured like the drains; then the workers apply the rows until none is
/// open, and the consumer's ledger is verified exactly-once.
pub(super) async fn curve(bin: &Path, args: &BenchArgs, events: u64) -> anyhow::Result<InboxRuns> {
    let topic = format!("bench-inbox-{:06x}", fastrand::u32(..0xffffff));
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let spec = spec(args, &topic, PARTITIONS, plan, Some(events), resends_only());
    let session = Session::open(&spec).await?;
    let produced = produce_stage(&session, &spec).await?;
    let records = produced.acked();
    let expected = crate::verify::Expected::from_log(&produced.log, spec.rate_bp);
    let unique = expected.payments.len() as u64;
    let keys = (produced.log.iter().map(|s| s.user_id.as_str()))
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    eprintln!("   topic pre-filled: {records} records ({unique} unique payments, {keys} keys)");
    let mut runs = InboxRuns {
        keys,
        processors_extra: args.inbox_processors.clone(),
        ..InboxRuns::default()
    };
    let db = Db::connect(args).await?;
    let order = (0..RUNS_EACH).flat_map(|_| SHAPES);
    for (workers, processors) in order {
        if let Some(last) = runs.curve.last() {
            forget_effects(&db, &last.consumer).await?;
        }
        let mut one = spec.clone();
        one.consumer = format!("{topic}-{workers}x{processors}-{}", runs.curve.len());
        one.report_dir = args.out.join(&one.consumer);
        let run = run(bin, args, &session, &one, &produced, workers, processors).await?;
        runs.curve.push(InboxRun {
            consumer: one.consumer.clone(),
            events,
            unique_payments: unique,
            ..run
        });
    }
    Ok(runs)
}

/// Takes back what `consumer` credited, once its ledger is verified: the cashback effect credits
/// a payment once whatever the consumer (`cashback_credits.payment_id` is unique), so the next
/// run's consumer would find every payment credited and apply nothing. Its credits, its users'
/// wallets and its outbox rows go, so every run of the curve does the same work.
async fn forget_effects(db: &Db, consumer: &str) -> anyhow::Result<()> {
    db.client
        .execute(
            "WITH gone AS (DELETE FROM cashback_credits WHERE consumer = $1 RETURNING user_id),
                  users AS (SELECT DISTINCT user_id FROM gone),
                  wallets AS (DELETE FROM wallets WHERE user_id IN (SELECT user_id FROM users))
             DELETE FROM outbox WHERE event_type = 'CashbackCredited'
               AND aggregate_id IN (SELECT user_id FROM users)",
            &[&consumer],
        )
        .await?;
    Ok(())
}

/// One run of the curve, for `spec.consumer` on the pre-filled `spec.topic`.
async fn run(
    bin: &Path,
    args: &BenchArgs,
    session: &Session,
    spec: &Spec,
    produced: &crate::Produced,
    workers: usize,
    processors: usize,
) -> anyhow::Result<InboxRun> {
    let (name, topic) = (spec.consumer.as_str(), spec.topic.as_str());
    let records = produced.acked();
    let unique = crate::verify::Expected::from_log(&produced.log, spec.rate_bp)
        .payments
        .len() as u64;
    let db = Db::connect(args).await?;

    // The receiver alone: stores every message and moves the offset.
    let mark = db.mark().await?;
    let started = Instant::now();
    let mut receiver = Worker::start_on(
        bin,
        args,
        name,
        topic,
        "inbox",
        "[consumer.inbox]\nprocessors = 0\n",
        &format!("{name}-receiver"),
    )
    .await?;
    let file = format!("{name}-receiver");
    until_stored(session, name, &mut receiver, &file, spec.drain_timeout).await?;
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
        "   {workers} x {processors}: ingest {:.0} msg/s ({records} records into {rows} rows, {pending} PENDING, in {:.1} s, first to last commit), {:.1} µs CPU/msg",
        ingest.msg_s, ingest.seconds, ingest.cpu_us_per_msg
    );

    // The processors, on the same consumer (its receivers find the topic drained).
    let mark = db.mark().await?;
    let started = Instant::now();
    let mut pool = Vec::new();
    for w in 0..workers {
        let file = format!("{name}-processors-{w}");
        let extra = format!(
            "[consumer.inbox]\nprocessors = {processors}\n{}\n",
            args.inbox_processors
        );
        let worker = Worker::start_on(bin, args, name, topic, "inbox", &extra, &file).await?;
        pool.push((worker, file));
    }
    let poll = Duration::from_millis(250);
    until_applied(&db.client, name, &mut pool, spec.drain_timeout, poll).await?;
    let process_wall = started.elapsed().as_secs_f64();
    let (mut rss_mb, mut cpu_s) = (0.0, 0.0);
    for (worker, _) in pool {
        let (rss, cpu) = worker.usage();
        rss_mb = f64::max(rss_mb, rss);
        cpu_s += cpu;
        worker.stop().await?;
    }
    let process_cost = db.cost_since(&mark).await?;
    let top = db.top_statements(&mark, 8).await;
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
    let process = InboxPhase {
        top_statements: top,
        ..phase(
            done,
            span,
            process_wall,
            rss_mb,
            cpu_s,
            records,
            process_cost,
        )
    };
    let ledger = finish_stage(session, spec, produced).await?;
    let verified = ledger.verified
        && rows == unique
        && pending == rows
        && done == rows
        && failed == 0
        && credits == unique;
    let both = cost.plus(&process_cost);
    eprintln!(
        "   {workers} x {processors}: {:.0} rows/s ({done} rows DONE, {failed} FAILED, in {:.1} s, first to last DONE; {:.1} s from the workers' start), {credits} credits for {unique} unique payments, verified: {verified}, {:.1} µs CPU/row, {:.0} WAL bytes/msg, inbox index scans {:.1} and buffers {:.1} per row, PostgreSQL {:.1} µs CPU/row",
        process.msg_s, process.seconds, process.seconds_wall, process.cpu_us_per_msg, process.wal_bytes_per_msg, process.inbox_index_scans_per_row, process.inbox_buffers_per_row, process.pg_cpu_us_per_row
    );
    Ok(InboxRun {
        workers,
        processors,
        records,
        rows,
        ingest,
        process,
        failed,
        credits,
        wal_bytes_per_msg: both.wal_bytes_per(records),
        row_writes_per_msg: both.row_writes_per(records),
        verified,
        ..InboxRun::default()
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
        inbox_index_scans_per_row: round1(db.inbox_index_scans as f64 / count.max(1) as f64),
        inbox_buffers_per_row: round1(db.inbox_buffers as f64 / count.max(1) as f64),
        pg_cpu_us_per_row: db.pg_cpu_us_per(count),
        db,
        top_statements: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(rows_s: &[f64]) -> InboxRuns {
        let curve = (rows_s.iter().zip(SHAPES.iter().cycle()))
            .map(|(&msg_s, &(workers, processors))| InboxRun {
                workers,
                processors,
                process: InboxPhase {
                    msg_s,
                    ..InboxPhase::default()
                },
                ..InboxRun::default()
            })
            .collect();
        InboxRuns {
            curve,
            ..InboxRuns::default()
        }
    }

    #[test]
    fn paired_steps_drop_the_drift_between_rounds() {
        // The full-scale curve of 2026-12-07 (rows/s of 1, 2, 4, 8, 2x4 in three rounds): the
        // third round ran at twice the first's speed, so 8's median (9,226) sat above 4's
        // (5,968) and 2's (6,798), while within every round 4 fell below 2.
        let r = runs(&[
            4528.0, 5066.0, 4347.0, 4870.0, 4339.0, //
            4137.0, 6798.0, 5968.0, 9226.0, 6173.0, //
            5472.0, 10435.0, 8603.0, 11480.0, 7728.0,
        ]);
        let paired: Vec<f64> = (r.paired_steps().iter())
            .map(|x| (x * 1000.0).round() / 1000.0)
            .collect();
        assert_eq!(paired, [1.643, 0.858, 1.334, 0.673]);
        assert_eq!(r.rows_s(1, 4), 5968.0);
    }

    #[test]
    fn a_median_of_none_one_and_two() {
        assert_eq!(median(vec![]), 0.0);
        assert_eq!(median(vec![3.0]), 3.0);
        assert_eq!(median(vec![4.0, 2.0]), 3.0);
    }
}
