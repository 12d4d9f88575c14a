//! Consumers on two databases against both on one (`BENCH_ONLY=databases`; docs/SCALING.md,
//! "Several databases").
//!
//! Two consumers (the cashback handler, the batch strategy, 6 partitions each, 10% resends)
//! drain two pre-filled topics at once in one worker process, twice per round:
//!
//! - **one database**: both consumers on `[database]` (the stack's PostgreSQL);
//! - **two databases**: consumer `b` on `[database.second]`, the stack's second server
//!   (`scripts/stack.sh pg2-up`, `DATABASE_URL_2`), consumer `a` where it was.
//!
//! Each run reports the records of both topics over the span from the first to the last credit
//! of either (both servers share this machine's clock), and CPU per record: the worker's, and
//! each PostgreSQL server's whole cluster (postmaster, backends, autovacuum, checkpointer, WAL
//! writer, from `/proc`), the idle second server included in the one-database runs. On this
//! 2-core machine both servers and the worker share the same two cores, so two databases
//! cannot add throughput here; what carries over to two machines is the CPU a record costs on
//! each server. Both ledgers are verified exactly-once by the demo's checker, each in its
//! own database. The layouts alternate, `ROUNDS` times each.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::worker::{resends_only, spec, Worker, PARTITIONS};
use super::{pg_cpu_seconds, ratio, round1, settle, BenchArgs};
use crate::produce::Step;
use crate::{finish_stage, produce_stage, Session};

/// The phase's own flags (flattened into `loadgen bench`).
#[derive(Debug, clap::Args)]
pub struct DatabasesArgs {
    /// The second PostgreSQL server's database, for the two-database runs (`scripts/stack.sh
    /// pg2-up` starts one and writes it to the stack's env).
    #[arg(long, env = "DATABASE_URL_2", hide_env_values = true)]
    pub database_url_2: Option<String>,
}

/// Each layout runs this many times, alternating with the other.
const ROUNDS: usize = 2;

/// One drain of both topics.
#[derive(Debug, Default, Clone, Serialize)]
pub(super) struct Run {
    /// `one` (both consumers on `[database]`) or `two` (`b` on `[database.second]`).
    pub(super) layout: String,
    /// Records of both topics.
    pub(super) records: u64,
    /// From the first credit of either consumer to the last of either.
    pub(super) seconds: f64,
    pub(super) msg_s: f64,
    pub(super) worker_cpu_us_per_msg: f64,
    /// The stack's PostgreSQL, and the second server, per record of both topics.
    pub(super) pg1_cpu_us_per_msg: f64,
    pub(super) pg2_cpu_us_per_msg: f64,
    /// The worker and both servers.
    pub(super) total_cpu_us_per_msg: f64,
    /// WAL bytes per record, each server's.
    pub(super) pg1_wal_bytes_per_msg: f64,
    pub(super) pg2_wal_bytes_per_msg: f64,
    pub(super) verified: bool,
}

/// Both layouts, and two over one.
#[derive(Debug, Default, Serialize)]
pub(super) struct Databases {
    /// Payments per topic (two topics per run).
    pub(super) events_per_topic: u64,
    pub(super) runs: Vec<Run>,
    /// The means of each layout's runs.
    pub(super) one: Run,
    pub(super) two: Run,
    /// Two databases over one: msg/s, and CPU per record (all processes).
    pub(super) two_vs_one_msg_s: f64,
    pub(super) two_vs_one_total_cpu: f64,
    pub(super) verified: bool,
}

/// The phase: `ROUNDS` rounds of one database, then two.
pub(super) async fn databases(
    bin: &Path,
    args: &BenchArgs,
    events: u64,
) -> anyhow::Result<Databases> {
    let second = (args.databases.database_url_2.clone()).context(
        "DATABASE_URL_2 is not set: start the second PostgreSQL with `scripts/stack.sh pg2-up` \
         (make bench does) and source the stack's env",
    )?;
    let mut out = Databases {
        events_per_topic: events,
        verified: true,
        ..Databases::default()
    };
    for round in 0..ROUNDS {
        for two in [false, true] {
            let layout = if two { "two" } else { "one" };
            eprintln!(
                "   round {}: {layout} database(s), 2 x {events} payments",
                round + 1
            );
            let r = run(bin, args, &second, two, events).await?;
            eprintln!(
                "   {:.0} msg/s ({} records in {:.1} s); CPU µs/msg: worker {:.1}, PostgreSQL \
                 {:.1} + second {:.1}, all {:.1}; WAL B/msg {:.0} + {:.0}; verified: {}",
                r.msg_s,
                r.records,
                r.seconds,
                r.worker_cpu_us_per_msg,
                r.pg1_cpu_us_per_msg,
                r.pg2_cpu_us_per_msg,
                r.total_cpu_us_per_msg,
                r.pg1_wal_bytes_per_msg,
                r.pg2_wal_bytes_per_msg,
                r.verified
            );
            out.verified &= r.verified;
            out.runs.push(r);
        }
    }
    out.one = mean(&out.runs, "one");
    out.two = mean(&out.runs, "two");
    out.two_vs_one_msg_s = ratio(out.two.msg_s, out.one.msg_s);
    out.two_vs_one_total_cpu = ratio(out.two.total_cpu_us_per_msg, out.one.total_cpu_us_per_msg);
    eprintln!(
        "   two databases over one: {:.2}x the msg/s, {:.2}x the CPU per message (one: {:.1} \
         µs, two: {:.1} µs)",
        out.two_vs_one_msg_s,
        out.two_vs_one_total_cpu,
        out.one.total_cpu_us_per_msg,
        out.two.total_cpu_us_per_msg
    );
    Ok(out)
}

/// A PostgreSQL server's counters at one moment: its cluster's CPU seconds and WAL position.
struct Mark {
    cpu_s: f64,
    lsn: String,
}

async fn connect(url: &str) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .with_context(|| "connecting to PostgreSQL for the databases phase")?;
    tokio::spawn(conn);
    Ok(client)
}

/// Once the engine's sessions are gone (they report their counters as they exit).
async fn mark(db: &tokio_postgres::Client) -> anyhow::Result<Mark> {
    settle(db, Duration::from_secs(10)).await?;
    let lsn: String = (db.query_one("SELECT pg_current_wal_lsn()::text", &[]))
        .await?
        .get(0);
    Ok(Mark {
        cpu_s: pg_cpu_seconds(db).await.unwrap_or(0.0),
        lsn,
    })
}

/// CPU seconds and WAL bytes since `m`.
async fn since(db: &tokio_postgres::Client, m: &Mark) -> anyhow::Result<(f64, i64)> {
    let now = mark(db).await?;
    let wal: i64 = db
        .query_one(
            "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::bigint",
            &[&now.lsn, &m.lsn],
        )
        .await?
        .get(0);
    Ok((now.cpu_s - m.cpu_s, wal))
}

/// First and last credit of `consumer`, as seconds since the epoch.
async fn credits_span(
    db: &tokio_postgres::Client,
    consumer: &str,
) -> anyhow::Result<Option<(f64, f64)>> {
    let r = db
        .query_one(
            "SELECT extract(epoch FROM min(credited_at))::float8,
                    extract(epoch FROM max(credited_at))::float8
             FROM cashback_credits WHERE consumer = $1",
            &[&consumer],
        )
        .await?;
    Ok(r.get::<_, Option<f64>>(0).zip(r.get::<_, Option<f64>>(1)))
}

/// One drain of two fresh topics by two consumers of one worker, `b` on the second server when
/// `two`.
async fn run(
    bin: &Path,
    args: &BenchArgs,
    second: &str,
    two: bool,
    events: u64,
) -> anyhow::Result<Run> {
    let base = format!("bench-dbs-{:06x}", fastrand::u32(..0xffffff));
    let (a, b) = (format!("{base}-a"), format!("{base}-b"));
    let plan = || {
        vec![Step {
            rate: None,
            duration: Duration::from_secs(3600),
        }]
    };
    let on_second = if two { "database = \"second\"\n" } else { "" };
    let toml = format!(
        "[worker]\nid = \"{base}\"\n[database.second]\nurl = \"{second}\"\n\
         [[consumer]]\nname = \"{a}\"\ntopics = [\"{a}\"]\nhandler = {{ kind = \"cashback\" }}\n\
         [[consumer]]\nname = \"{b}\"\ntopics = [\"{b}\"]\nhandler = {{ kind = \"cashback\" }}\n\
         {on_second}"
    );
    // Every database the config names, the second server's too (idempotent), before anything
    // reads its tables.
    let config = args.out.join(format!("{base}.toml"));
    std::fs::write(&config, &toml)?;
    let migrated = tokio::process::Command::new(bin)
        .args(["migrate", "--config"])
        .arg(&config)
        .env("DATABASE_URL", &args.services.database_url)
        .stdout(std::process::Stdio::null())
        .status()
        .await?;
    anyhow::ensure!(
        migrated.success(),
        "effectively migrate -c {config:?} failed"
    );

    let spec_a = spec(args, &a, PARTITIONS, plan(), Some(events), resends_only());
    let mut spec_b = spec(args, &b, PARTITIONS, plan(), Some(events), resends_only());
    if two {
        spec_b.database_url = second.to_string();
    }
    let (session_a, session_b) = (Session::open(&spec_a).await?, Session::open(&spec_b).await?);
    let produced_a = produce_stage(&session_a, &spec_a).await?;
    let produced_b = produce_stage(&session_b, &spec_b).await?;
    let records = produced_a.acked() + produced_b.acked();

    let (db1, db2) = (
        connect(&args.services.database_url).await?,
        connect(second).await?,
    );
    let (m1, m2) = (mark(&db1).await?, mark(&db2).await?);
    let worker = Worker::start_config(bin, args, &toml, &base).await?;
    let report_a = finish_stage(&session_a, &spec_a, &produced_a).await?;
    let report_b = finish_stage(&session_b, &spec_b, &produced_b).await?;
    let (_, worker_cpu_s) = worker.usage();
    worker.stop().await?;
    let ((cpu1, wal1), (cpu2, wal2)) = (since(&db1, &m1).await?, since(&db2, &m2).await?);

    let span_a = credits_span(&db1, &a).await?;
    let span_b = credits_span(if two { &db2 } else { &db1 }, &b).await?;
    let seconds = match (span_a, span_b) {
        (Some(x), Some(y)) => (x.1.max(y.1) - x.0.min(y.0)).max(1e-3),
        _ => f64::INFINITY,
    };
    let per = |x: f64| round1(x * 1e6 / records.max(1) as f64);
    let per_byte = |w: i64| round1(w as f64 / records.max(1) as f64);
    Ok(Run {
        layout: (if two { "two" } else { "one" }).into(),
        records,
        seconds: round1(seconds),
        msg_s: (records as f64 / seconds).round(),
        worker_cpu_us_per_msg: per(worker_cpu_s),
        pg1_cpu_us_per_msg: per(cpu1),
        pg2_cpu_us_per_msg: per(cpu2),
        total_cpu_us_per_msg: per(worker_cpu_s + cpu1 + cpu2),
        pg1_wal_bytes_per_msg: per_byte(wal1),
        pg2_wal_bytes_per_msg: per_byte(wal2),
        verified: report_a.verified && report_b.verified,
    })
}

/// The mean of `layout`'s runs (verified only if each was).
fn mean(runs: &[Run], layout: &str) -> Run {
    let of: Vec<&Run> = runs.iter().filter(|r| r.layout == layout).collect();
    let n = of.len().max(1) as f64;
    let avg = |f: fn(&Run) -> f64| round1(of.iter().map(|r| f(r)).sum::<f64>() / n);
    Run {
        layout: layout.into(),
        records: of.iter().map(|r| r.records).sum::<u64>() / of.len().max(1) as u64,
        seconds: avg(|r| r.seconds),
        msg_s: avg(|r| r.msg_s).round(),
        worker_cpu_us_per_msg: avg(|r| r.worker_cpu_us_per_msg),
        pg1_cpu_us_per_msg: avg(|r| r.pg1_cpu_us_per_msg),
        pg2_cpu_us_per_msg: avg(|r| r.pg2_cpu_us_per_msg),
        total_cpu_us_per_msg: avg(|r| r.total_cpu_us_per_msg),
        pg1_wal_bytes_per_msg: avg(|r| r.pg1_wal_bytes_per_msg),
        pg2_wal_bytes_per_msg: avg(|r| r.pg2_wal_bytes_per_msg),
        verified: !of.is_empty() && of.iter().all(|r| r.verified),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layouts_mean_is_over_its_own_runs() {
        let run = |layout: &str, msg_s: f64, cpu: f64, verified: bool| Run {
            layout: layout.into(),
            records: 1_000,
            msg_s,
            total_cpu_us_per_msg: cpu,
            verified,
            ..Run::default()
        };
        let runs = [
            run("one", 100.0, 50.0, true),
            run("two", 80.0, 60.0, true),
            run("one", 120.0, 70.0, true),
            run("two", 90.0, 40.0, false),
        ];
        let one = mean(&runs, "one");
        assert_eq!(
            (one.msg_s, one.total_cpu_us_per_msg, one.verified),
            (110.0, 60.0, true)
        );
        let two = mean(&runs, "two");
        assert_eq!(
            (two.msg_s, two.total_cpu_us_per_msg, two.verified),
            (85.0, 50.0, false)
        );
        assert!(!mean(&runs, "three").verified, "no run is no verdict");
    }
}
