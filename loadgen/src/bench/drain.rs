//! The drains: one worker of a strategy draining a pre-filled topic (with a daily partition of
//! dedupe keys dropped half-way through, for the batch drain), the SQL ceiling and retention.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::db::{Db, DbCost};
use super::worker::{engine_json, resends_only, spec, Worker, PARTITIONS};
use super::BenchArgs;
use crate::produce::Step;
use crate::session::Compression;
use crate::{finish_stage, produce_stage, Session};

#[derive(Debug, Default, Serialize)]
pub(super) struct Drain {
    pub(super) events: u64,
    pub(super) records: u64,
    pub(super) msg_s: f64,
    pub(super) effects_s: f64,
    pub(super) seconds: f64,
    pub(super) verified: bool,
    pub(super) rss_mb_peak: f64,
    pub(super) cpu_us_per_msg: f64,
    /// WAL bytes (the whole cluster's) per record, from the worker's start to its exit.
    pub(super) wal_bytes_per_msg: f64,
    /// Rows inserted, updated and deleted in the `public` tables per record, same span.
    pub(super) row_writes_per_msg: f64,
    /// PostgreSQL's CPU per record (the whole cluster's processes) from the worker's start to
    /// the last partition's offset stored, after [`Db::maintain`] caught up on what earlier
    /// phases left: the drain's transactions, and what autovacuum happened to do meanwhile.
    pub(super) pg_cpu_us_per_msg: f64,
    /// PostgreSQL's CPU per record in the engine's own sessions, same span
    /// ([`super::db::engine_cpu_seconds`]): the transactions' cost, without the cluster's
    /// background work. The stable one of these numbers, and the one to compare changes by.
    pub(super) pg_engine_us_per_msg: f64,
    pub(super) pg_engine_cpu_s: f64,
    /// PostgreSQL's CPU per record of [`Db::maintain`] right after the drain: the vacuum
    /// and page writes the drain left behind, which autovacuum and the checkpointer do
    /// later (or, in part, during the drain: the sum with `pg_cpu_us_per_msg` is the stable one).
    pub(super) pg_maintenance_us_per_msg: f64,
    /// `pg_engine_us_per_msg` over the workers' `cpu_us_per_msg`, from the same drain: what
    /// PostgreSQL spends per unit of the worker's work. CPU seconds themselves stretch with this
    /// shared machine's load (the run that read 58.2 µs of PostgreSQL a message read 10.1 µs in
    /// the worker; the one that read 27.0, 5), the ratio much less (5.8 and 5.4).
    pub(super) pg_per_worker_cpu: f64,
    /// PostgreSQL's CPU seconds of [`Db::maintain`] before the drain: what earlier phases left
    /// (after the 5 M keys prepared for the drop, seconds of it), which used to fall inside the
    /// drain's window whenever autovacuum and the checkpointer got to it then.
    pub(super) pg_settled_before_cpu_s: f64,
    /// `pg_cpu_us_per_msg + pg_maintenance_us_per_msg`: what one message costs PostgreSQL.
    pub(super) pg_cpu_us_per_msg_all: f64,
    /// The CPU seconds behind the two (for [`Drain::combine`]).
    pub(super) pg_applied_cpu_s: f64,
    pub(super) pg_maintenance_cpu_s: f64,
    /// Worker processes draining the topic together (`cpu_us_per_msg` is theirs summed).
    pub(super) workers: usize,
    /// PostgreSQL's share of the CPU the workers and PostgreSQL used together.
    pub(super) pg_cpu_share: f64,
    pub(super) db: DbCost,
}

impl Drain {
    /// Two drains of the same strategy as one: rates over their summed time, the larger peak.
    pub(super) fn combine(a: &Drain, b: &Drain) -> Drain {
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
            pg_cpu_us_per_msg: per_record(a.pg_applied_cpu_s + b.pg_applied_cpu_s, records),
            pg_maintenance_us_per_msg: per_record(
                a.pg_maintenance_cpu_s + b.pg_maintenance_cpu_s,
                records,
            ),
            pg_cpu_us_per_msg_all: per_record(
                a.pg_applied_cpu_s
                    + b.pg_applied_cpu_s
                    + a.pg_maintenance_cpu_s
                    + b.pg_maintenance_cpu_s,
                records,
            ),
            pg_applied_cpu_s: a.pg_applied_cpu_s + b.pg_applied_cpu_s,
            pg_engine_us_per_msg: per_record(a.pg_engine_cpu_s + b.pg_engine_cpu_s, records),
            pg_engine_cpu_s: a.pg_engine_cpu_s + b.pg_engine_cpu_s,
            pg_maintenance_cpu_s: a.pg_maintenance_cpu_s + b.pg_maintenance_cpu_s,
            pg_settled_before_cpu_s: a.pg_settled_before_cpu_s + b.pg_settled_before_cpu_s,
            pg_per_worker_cpu: super::ratio(a.pg_engine_cpu_s + b.pg_engine_cpu_s, cpu_us / 1e6),
            workers: a.workers.max(b.workers),
            pg_cpu_share: (a.pg_cpu_share + b.pg_cpu_share) / 2.0,
            db: a.db.plus(&b.db),
        }
    }
}

/// Microseconds a record, to a tenth.
fn per_record(cpu_s: f64, records: u64) -> f64 {
    super::round1(cpu_s * 1e6 / records.max(1) as f64)
}

/// The sum of the partitions' stored offsets of the bench consumer `name` (which reads the
/// topic of its name from offset 0): the records applied so far.
async fn applied(db: &tokio_postgres::Client, name: &str) -> i64 {
    db.query_one(
        "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offsets
         WHERE consumer = $1 AND topic = $1",
        &[&name],
    )
    .await
    .map(|r| r.get(0))
    .unwrap_or(0)
}

/// Polls (every 50 ms, up to `limit`) until `n` records of consumer `name` are applied; then
/// PostgreSQL's CPU seconds so far, the whole cluster's and the engine's sessions'. `None` if
/// they were not applied in time.
async fn cpu_when_applied(
    url: String,
    name: String,
    n: u64,
    limit: Duration,
) -> Option<(f64, f64)> {
    let (db, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        if applied(&db, &name).await as u64 >= n {
            let engine = super::db::engine_cpu_seconds(&db).await?;
            return Some((super::pg_cpu_seconds(&db).await?, engine));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    None
}

#[derive(Debug, Default, Serialize)]
pub(super) struct DropDuringDrain {
    pub(super) keys: u64,
    pub(super) drop_seconds: f64,
    pub(super) msg_s_during_drop: f64,
    pub(super) msg_s_median: f64,
    /// The slowest full second without a drop: the drain's own noise, for comparison.
    pub(super) msg_s_min_without_drop: f64,
    pub(super) ratio: f64,
}

pub(super) async fn ceiling(
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

/// Pre-fills a topic, then starts `workers` workers of one consumer (together: they join the
/// group within the broker's initial rebalance delay) and measures them draining the topic.
/// With `drop_keys`, a daily partition of that many dedupe keys is dropped once a third of the
/// topic is applied.
pub(super) async fn drain(
    bin: &Path,
    args: &BenchArgs,
    strategy: &str,
    events: u64,
    drop_keys: u64,
    workers: usize,
) -> anyhow::Result<(Drain, Option<DropDuringDrain>)> {
    drain_with(
        bin,
        args,
        strategy,
        events,
        drop_keys,
        workers,
        Compression::None,
    )
    .await
}

/// [`drain`] of a topic the producer wrote with `compression`.
pub(super) async fn drain_with(
    bin: &Path,
    args: &BenchArgs,
    strategy: &str,
    events: u64,
    drop_keys: u64,
    workers: usize,
    compression: Compression,
) -> anyhow::Result<(Drain, Option<DropDuringDrain>)> {
    let opts = Opts {
        compression,
        ..Opts::default()
    };
    drain_opts(bin, args, strategy, events, drop_keys, workers, &opts).await
}

/// How a drain's topic is written and its workers run, beyond the defaults.
#[derive(Debug, Default)]
pub(super) struct Opts<'a> {
    pub(super) compression: Compression,
    /// Every record with a `traceparent` of its own (the tracing phase).
    pub(super) traced: bool,
    /// TOML appended to each worker's config, after its consumer (e.g. a `[tracing]` table).
    pub(super) worker_extra: &'a str,
}

/// [`drain_with`], with `opts`.
pub(super) async fn drain_opts(
    bin: &Path,
    args: &BenchArgs,
    strategy: &str,
    events: u64,
    drop_keys: u64,
    workers: usize,
    opts: &Opts<'_>,
) -> anyhow::Result<(Drain, Option<DropDuringDrain>)> {
    let name = format!("bench-{strategy}-{:06x}", fastrand::u32(..0xffffff));
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let mut spec = spec(args, &name, PARTITIONS, plan, Some(events), resends_only());
    spec.compression = opts.compression;
    let mut session = Session::open(&spec).await?;
    if opts.traced {
        session = session.traced();
    }
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
    let pg_settled_before_cpu_s = db.maintain().await?;
    let mark = db.mark().await?;
    let applied_cpu = tokio::spawn(cpu_when_applied(
        args.services.database_url.clone(),
        name.clone(),
        records,
        spec.drain_timeout,
    ));
    let mut pool = Vec::new();
    for w in 0..workers {
        let file = format!("{name}-{w}");
        let extra = opts.worker_extra;
        pool.push(Worker::start_on(bin, args, &name, &name, strategy, extra, &file).await?);
    }
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
                    if applied(&db, &name).await as u64 >= records / 3 {
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
    // A worker that exits (a config its binary refuses, a crash) fails the drain at once, not
    // after the drain's timeout.
    let gone = async {
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            for (w, worker) in pool.iter_mut().enumerate() {
                if let Some(why) = worker.exited(&format!("{name}-{w}.log")) {
                    return why;
                }
            }
        }
    };
    let report = tokio::select! {
        report = finish_stage(&session, &spec, &produced) => report?,
        why = gone => anyhow::bail!("{why}"),
    };
    let during = match dropper {
        Some(task) => {
            let (from, to, ok) = task.await?;
            anyhow::ensure!(ok, "dropping the partition during the drain failed");
            Some(drop_effect(&report.series.throughput, from, to, drop_keys))
        }
        None => None,
    };
    let (mut rss_mb, mut cpu_s) = (0.0, 0.0);
    for worker in pool {
        let (rss, cpu) = worker.usage();
        rss_mb = f64::max(rss_mb, rss);
        cpu_s += cpu;
        worker.stop().await?;
    }
    let cost = db.cost_since(&mark).await?;
    // What the transactions cost (not the verification after them), then what they left.
    // The engine's sessions are all new since the mark: their CPU is theirs from the start.
    let (pg_applied_cpu_s, pg_engine_cpu_s) = match applied_cpu.await? {
        Some((at, engine)) => (at - mark.pg_cpu_s, engine),
        None => (cost.pg_cpu_s, 0.0),
    };
    let pg_maintenance_cpu_s = db.maintain().await?;
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
        pg_cpu_us_per_msg: per_record(pg_applied_cpu_s, records),
        pg_maintenance_us_per_msg: per_record(pg_maintenance_cpu_s, records),
        pg_cpu_us_per_msg_all: per_record(pg_applied_cpu_s + pg_maintenance_cpu_s, records),
        pg_applied_cpu_s,
        pg_engine_us_per_msg: per_record(pg_engine_cpu_s, records),
        pg_engine_cpu_s,
        pg_maintenance_cpu_s,
        pg_settled_before_cpu_s,
        pg_per_worker_cpu: super::ratio(pg_engine_cpu_s, cpu_s),
        workers,
        pg_cpu_share: if cpu_s + pg_applied_cpu_s > 0.0 {
            (pg_applied_cpu_s / (cpu_s + pg_applied_cpu_s) * 1000.0).round() / 1000.0
        } else {
            0.0
        },
        db: cost,
    };
    eprintln!(
        "   {workers} worker(s): {:.0} msg/s ({} records in {:.1} s, first to last commit), verified: {}, peak RSS {:.0} MB, {:.1} µs CPU/msg, PostgreSQL {:.1} µs CPU/msg ({:.0}% of the CPU; {:.1} in the engine's sessions) and {:.1} after it (vacuum, checkpoint), {:.0} WAL bytes/msg, {:.2} row writes/msg",
        d.msg_s, records, span, d.verified, d.rss_mb_peak, d.cpu_us_per_msg, d.pg_cpu_us_per_msg, d.pg_cpu_share * 100.0, d.pg_engine_us_per_msg, d.pg_maintenance_us_per_msg, d.wal_bytes_per_msg, d.row_writes_per_msg
    );
    if let Some(x) = &during {
        eprintln!(
            "   during the drop ({:.2} s): {:.0} effects/s against a median second of {:.0} ({:.2}; slowest second without a drop {:.0})",
            x.drop_seconds, x.msg_s_during_drop, x.msg_s_median, x.ratio, x.msg_s_min_without_drop
        );
    }
    Ok((d, during))
}

/// Effects committed per second (the report's throughput, which counts effects; the ratio is
/// what matters) in the second(s) overlapping `[from, to]`, against the median full second.
pub(super) fn drop_effect(
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

pub(super) async fn retention(
    bin: &Path,
    args: &BenchArgs,
    keys: u64,
) -> anyhow::Result<serde_json::Value> {
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
