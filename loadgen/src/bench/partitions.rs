//! Many partitions (issue 26, part 3): the same 2,000 msg/s offered to topics of 6, 60 and
//! 300 partitions, with one and with two workers; then 60 and 300 partitions again with commit
//! groups (`batch.group_partitions`: several partitions' batches in one transaction), the
//! design change this phase called for, so before and after sit in one report.
//!
//! The engine commits one PostgreSQL transaction per partition's batch, and a batch is cut as
//! soon as its partition has nothing more waiting. At 300 partitions each one gets about 7
//! records a second, so most batches hold one record: this phase measures what that costs
//! (end-to-end latency, transactions a second, PostgreSQL's and the worker's CPU per record)
//! beside the same rate on 6 and 60 partitions.
//!
//! Counted per run, from just before the first record is produced until the consumer's stored
//! offsets reach the topic's end (the workers are up and hold every partition before that):
//! - commits: the workers' batch transactions (`effectively_transactions_committed_total`,
//!   scraped from each worker's `/metrics`), and the records in them
//!   (`effectively_batch_size_records` sum; its count is the batches);
//! - PostgreSQL's CPU: `utime + stime` from `/proc` of the backends serving the workers' own
//!   connections (matched by client port in `pg_stat_activity`), and of every `postgres`
//!   process of the machine (the cluster is shared, so that one is an upper bound);
//! - `xact_commit` of the database, every session's (loadgen's and other users' too).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::db::Db;
use super::latency::P99_TARGET_MS;
use super::worker::{resends_only, spec, Launch, Worker};
use super::{procfs, round1, round2, BenchArgs};
use crate::produce::{Mix, Step};
use crate::{finish_stage, produce_stage, Session};

/// The offered rate, in total over the topic's partitions.
const RATE: f64 = 2000.0;
/// (partitions, workers, commit groups), in the order they run. The grouped runs are left out
/// when the consumer's section is given (`--partitions-consumer`): that measures its setting.
const SHAPES: [(i32, usize, bool); 12] = [
    (6, 1, false),
    (6, 2, false),
    (60, 1, false),
    (60, 2, false),
    (300, 1, false),
    (300, 2, false),
    (6, 1, true),
    (6, 2, true),
    (60, 1, true),
    (60, 2, true),
    (300, 1, true),
    (300, 2, true),
];
/// The seconds at the start of a run left out of `p99_steady_ms` (see [`PartitionsRun`]).
const WARM_UP_S: f64 = 6.0;
/// What the grouped runs add to the consumer's section.
const GROUPED: &str = "batch = { group_partitions = true }";
/// What the other runs add: groups are the engine's default since issue 35, so one
/// transaction per batch must be asked for. With `--partitions-consumer`, every run takes that
/// section instead, on top of the defaults.
const PLAIN: &str = "batch = { group_partitions = false }";
#[derive(Debug, Default, Serialize)]
pub(super) struct Phases {
    fence: f64,
    stage: f64,
    dedupe: f64,
    effect: f64,
    commit: f64,
}

/// "Commits/s well below records/s": at least this many records per transaction.
const RECORDS_PER_COMMIT_TARGET: f64 = 5.0;

/// The p99 a run at the engine's defaults (commit groups on) must keep, by partitions, with
/// one worker and with two (issue 35): 50 ms at 60 partitions, 100 ms at 300.
fn defaults_target_ms(partitions: i32, grouped: bool) -> Option<f64> {
    match (partitions, grouped) {
        (60, true) => Some(50.0),
        (300, true) => Some(100.0),
        _ => None,
    }
}

#[derive(Debug, Default, Serialize)]
pub(super) struct PartitionsRun {
    partitions: i32,
    workers: usize,
    /// With commit groups (`batch.group_partitions = true`).
    grouped: bool,
    /// Records the broker acknowledged per second of producing: [`RATE`] payments a second
    /// and their 10% resends.
    offered_msg_s: f64,
    /// Records the engine committed over the run, per second of the run.
    achieved_msg_s: f64,
    records: u64,
    seconds: f64,
    /// From the last record produced until the stored offsets reached the topic's end.
    drain_tail_s: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    /// After the first [`WARM_UP_S`] seconds (the first records of hundreds of idle partitions,
    /// which a 20 s quick run weighs three times as much as a 60 s full one): the median and
    /// the worst of the per-second p99s.
    p99_steady_ms: f64,
    p99_worst_second_after_warm_up_ms: f64,
    /// At the defaults (commit groups on), 60 and 300 partitions: the p99 to keep
    /// ([`defaults_target_ms`]), and whether the whole run's p99 and the steady p99 kept it.
    #[serde(skip_serializing_if = "Option::is_none")]
    target_p99_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99_met: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    p99_steady_met: Option<bool>,
    clock_step_s: f64,
    /// The workers' batch transactions committed, per second.
    commits_s: f64,
    records_per_commit: f64,
    /// Batches cut by the partition tasks, per second (above `commits_s` with commit groups).
    batches_s: f64,
    /// Mean wall time of a batch in the worker (`effectively_batch_duration_seconds`): from
    /// asking the pool for a connection (or handing the batch to its group) to `COMMIT`'s
    /// answer.
    batch_ms_mean: f64,
    /// Mean time per batch transaction in each phase (`effectively_batch_phase_seconds`):
    /// `fence` includes waiting for a pool connection, `commit` the WAL flush.
    phase_ms_per_commit: Phases,
    /// Where the tail is, from the workers' histograms (interpolated in their buckets, like
    /// Prometheus's `histogram_quantile`): the p99 over batches of the `arrive` phase (from a
    /// batch's oldest record timestamp to its cut: loadgen's producer, the broker, the fetch,
    /// the partition's queue) and of the batch (from the cut to `COMMIT`'s answer, the commit
    /// group's wait included).
    arrive_p99_ms: f64,
    batch_p99_ms: f64,
    /// The database's `xact_commit` per second: every session's, not only the workers'.
    db_xact_commit_s: f64,
    /// `pg_stat_wal.wal_sync` per second: WAL flushes to disk, the whole cluster's.
    wal_syncs_s: f64,
    /// CPU of the PostgreSQL backends serving the workers' connections, per record.
    pg_cpu_us_per_msg: f64,
    /// CPU of every `postgres` process on the machine (WAL writer, checkpointer, autovacuum,
    /// other users of the shared cluster), per record of this run: an upper bound.
    pg_cluster_cpu_us_per_msg: f64,
    /// The workers' own CPU (`utime + stime`), per record.
    worker_cpu_us_per_msg: f64,
    /// The workers' CPU while they hold every partition and no record arrives (3 s before
    /// the run), in % of one core: what the partitions cost by being there (librdkafka's
    /// fetches, the tasks).
    idle_worker_cpu_pct: f64,
    /// The machine's busy share of its CPUs over the run (`/proc/stat`), everything included.
    machine_busy_pct: f64,
    /// The share of that not spent by PostgreSQL, Kafka, the workers or loadgen: other users
    /// of the machine, whose load moves the latencies (never the CPU per record much).
    others_busy_pct: f64,
    verified: bool,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct PartitionsScale {
    offered_msg_s: f64,
    seconds_each: f64,
    /// `database.pool_size` of each worker: at most this many of its transactions at once.
    pool_size: usize,
    /// What the consumer's section held beyond the defaults.
    consumer_extra: String,
    /// Where a latency starts (`--latency-from`): `append`, the broker's append time; or
    /// `producer`, loadgen's producer's.
    latency_from: String,
    runs: Vec<PartitionsRun>,
    pub(super) target: String,
    /// Every 300-partition run with one transaction per batch met the target.
    pub(super) target_met_at_300: bool,
    /// Every 300-partition run with commit groups met the target (`None`: none ran).
    pub(super) target_met_at_300_grouped: Option<bool>,
    /// The target at the defaults (issue 35): p99 <= 50 ms at 60 partitions and <= 100 ms at
    /// 300, one worker and two, commit groups on.
    pub(super) defaults_target: String,
    /// Every such run kept it over the whole run, and in its steady state (the median of its
    /// per-second p99s after [`WARM_UP_S`]); `None` when none ran.
    pub(super) defaults_target_met: Option<bool>,
    pub(super) defaults_target_met_steady: Option<bool>,
    pub(super) verified: bool,
}

/// Every shape at [`RATE`] for `each`, workers with `pool_size` connections and `extra` in the
/// consumer's section.
pub(super) async fn partitions_scale(
    bin: &Path,
    args: &BenchArgs,
    each: Duration,
    pool_size: usize,
    extra: &str,
) -> anyhow::Result<PartitionsScale> {
    let mut out = PartitionsScale {
        offered_msg_s: RATE,
        seconds_each: each.as_secs_f64(),
        pool_size,
        consumer_extra: extra.to_string(),
        latency_from: args.latency_from.clone(),
        target: format!(
            "at 300 partitions: p99 <= {P99_TARGET_MS} ms, achieved >= 95% of the offered \
             rate, at least {RECORDS_PER_COMMIT_TARGET} records per commit"
        ),
        target_met_at_300: true,
        defaults_target: "commit groups on: p99 <= 50 ms at 60 partitions and <= 100 ms at 300, \
                          one worker and two"
            .to_string(),
        verified: true,
        ..PartitionsScale::default()
    };
    for (partitions, workers, grouped) in SHAPES {
        if grouped && !extra.is_empty() {
            continue;
        }
        let how = if grouped { ", commit groups" } else { "" };
        eprintln!("   {partitions} partitions, {workers} worker(s){how}, {RATE}/s for {each:?}");
        let extra = match (grouped, extra.is_empty()) {
            (true, _) => GROUPED,
            (false, true) => PLAIN,
            (false, false) => extra,
        };
        let run = one(
            bin,
            args,
            (partitions, workers, grouped),
            each,
            pool_size,
            extra,
        )
        .await?;
        eprintln!(
            "     p50 {:.1} ms, p99 {:.1} ms (after {WARM_UP_S} s: per-second p99 median {:.1}, \
             worst {:.1}); {:.0} msg/s, {:.0} commits/s ({:.1} records each); \
             PostgreSQL {:.0} us/msg (cluster {:.0}), worker {:.0} us/msg (idle {:.0}% of a \
             core); batch {:.1} ms; p99 arrive {:.0} ms, batch {:.0} ms; {:.0} WAL syncs/s; \
             machine {:.0}% busy, others {:.0}%; verified: {}",
            run.p50,
            run.p99,
            run.p99_steady_ms,
            run.p99_worst_second_after_warm_up_ms,
            run.achieved_msg_s,
            run.commits_s,
            run.records_per_commit,
            run.pg_cpu_us_per_msg,
            run.pg_cluster_cpu_us_per_msg,
            run.worker_cpu_us_per_msg,
            run.idle_worker_cpu_pct,
            run.batch_ms_mean,
            run.arrive_p99_ms,
            run.batch_p99_ms,
            run.wal_syncs_s,
            run.machine_busy_pct,
            run.others_busy_pct,
            run.verified
        );
        out.verified &= run.verified;
        if let (Some(met), Some(steady)) = (run.p99_met, run.p99_steady_met) {
            out.defaults_target_met = Some(out.defaults_target_met.unwrap_or(true) && met);
            out.defaults_target_met_steady =
                Some(out.defaults_target_met_steady.unwrap_or(true) && steady);
        }
        if partitions == 300 {
            let met = run.p99 <= P99_TARGET_MS
                && run.achieved_msg_s >= 0.95 * run.offered_msg_s
                && run.records_per_commit >= RECORDS_PER_COMMIT_TARGET;
            if grouped {
                out.target_met_at_300_grouped =
                    Some(out.target_met_at_300_grouped.unwrap_or(true) && met);
            } else {
                out.target_met_at_300 &= met;
            }
        }
        out.runs.push(run);
    }
    Ok(out)
}

async fn one(
    bin: &Path,
    args: &BenchArgs,
    (partitions, workers, grouped): (i32, usize, bool),
    each: Duration,
    pool_size: usize,
    extra: &str,
) -> anyhow::Result<PartitionsRun> {
    let name = format!(
        "bench-parts-{partitions}x{workers}{}-{:06x}",
        if grouped { "g" } else { "" },
        fastrand::u32(..0xffffff)
    );
    let s = steady_spec(args, &name, partitions, RATE, each);
    timed_topic(args, &name, partitions).await?;
    let session = Session::open(&s).await?;
    let db = Db::connect(args).await?;
    let mut procs = Vec::new();
    for w in 0..workers {
        let port = free_port()?;
        let (id, file) = (format!("bench-{w}"), format!("{name}-w{w}"));
        let launch = Launch {
            id: &id,
            extra,
            file: &file,
            pool_size: Some(pool_size),
            metrics_addr: Some(format!("127.0.0.1:{port}")),
        };
        procs.push((
            Worker::launch(bin, args, &name, "batch", &launch).await?,
            port,
        ));
    }
    let idle_cpu_s = settle(&mut procs, partitions, &name).await?;

    let before = Mark::take(&procs, &db).await?;
    let started = Instant::now();
    let produced = produce_stage(&session, &s).await?;
    let produced_s = started.elapsed().as_secs_f64();
    let drain = session.drain(&s.consumer, s.drain_timeout).await;
    if let Some(problem) = drain.problem() {
        eprintln!("     {problem}");
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = Mark::take(&procs, &db).await?;
    let r = finish_stage(&session, &s, &produced).await?;
    for (w, _) in procs {
        w.stop().await?;
    }
    // A shared broker should not keep every run's 300 partitions.
    if let Err(e) = delete_topic(&args.services.brokers, &name).await {
        eprintln!("     deleting topic {name}: {e:#}");
    }

    let mut steady: Vec<f64> = (r.series.latency.iter())
        .filter(|p| p.t_s >= WARM_UP_S)
        .map(|p| p.p99)
        .collect();
    steady.sort_by(f64::total_cmp);
    let records = (after.records - before.records).max(0.0);
    let commits = after.commits - before.commits;
    let batches = after.batches - before.batches;
    let per_msg = |s: f64| round1(s * 1e6 / records.max(1.0));
    let per_commit = |s: f64| round2(s * 1e3 / commits.max(1.0));
    let phase = |i: usize| per_commit(after.phases[i] - before.phases[i]);
    let (pg, cluster) = (
        spent(&before.backends, &after.backends),
        spent(&before.cluster, &after.cluster),
    );
    let worker_cpu_s = after.worker_cpu_s - before.worker_cpu_s;
    let ours = cluster
        + worker_cpu_s
        + (after.kafka_cpu_s - before.kafka_cpu_s)
        + (after.loadgen_cpu_s - before.loadgen_cpu_s);
    let total_s = (after.machine.1 - before.machine.1) as f64 / procfs::TICKS;
    let p99_steady_ms = steady.get(steady.len() / 2).copied().unwrap_or_default();
    let target_p99_ms = defaults_target_ms(partitions, grouped);
    Ok(PartitionsRun {
        partitions,
        workers,
        grouped,
        offered_msg_s: round1(r.acked as f64 / r.duration_s.max(1e-9)),
        achieved_msg_s: round1(records / seconds),
        records: records as u64,
        seconds: round1(seconds),
        drain_tail_s: round1(seconds - produced_s),
        p50: r.latency_ms.p50,
        p99: r.latency_ms.p99,
        p999: r.latency_ms.p999,
        p99_steady_ms,
        p99_worst_second_after_warm_up_ms: steady.last().copied().unwrap_or_default(),
        target_p99_ms,
        p99_met: target_p99_ms.map(|t| r.latency_ms.p99 <= t),
        p99_steady_met: target_p99_ms.map(|t| p99_steady_ms <= t),
        clock_step_s: r.clock_step_s,
        commits_s: round1(commits / seconds),
        records_per_commit: round1(records / commits.max(1.0)),
        batches_s: round1(batches / seconds),
        batch_ms_mean: round2(1e3 * (after.batch_s - before.batch_s) / batches.max(1.0)),
        phase_ms_per_commit: Phases {
            fence: phase(0),
            stage: phase(1),
            dedupe: phase(2),
            effect: phase(3),
            commit: phase(4),
        },
        arrive_p99_ms: round1(1e3 * quantile(&before.arrive, &after.arrive, 0.99)),
        batch_p99_ms: round1(1e3 * quantile(&before.batch, &after.batch, 0.99)),
        db_xact_commit_s: round1((after.xact_commit - before.xact_commit) as f64 / seconds),
        wal_syncs_s: round1((after.wal_sync - before.wal_sync) as f64 / seconds),
        pg_cpu_us_per_msg: per_msg(pg),
        pg_cluster_cpu_us_per_msg: per_msg(cluster),
        worker_cpu_us_per_msg: per_msg(worker_cpu_s),
        idle_worker_cpu_pct: round1(idle_cpu_s * 100.0),
        machine_busy_pct: busy_pct(before.machine, after.machine),
        others_busy_pct: round1(
            (busy_pct(before.machine, after.machine) - ours * 100.0 / total_s.max(1e-9)).max(0.0),
        ),
        verified: r.verified && drain.problem().is_none(),
    })
}

/// The run of topic and consumer `name`: `rate` payments a second for `each`, 10% resent,
/// its report in `name`'s folder of the bench's output.
/// Creates the run's topic with the timestamps `--latency-from` asks for (the session then
/// finds it there).
pub(super) async fn timed_topic(
    args: &BenchArgs,
    name: &str,
    partitions: i32,
) -> anyhow::Result<()> {
    let configs: &[(&str, &str)] = match args.latency_from.as_str() {
        "append" => &[("message.timestamp.type", "LogAppendTime")],
        _ => &[],
    };
    crate::topics::create_topic_with(&args.services.brokers, name, partitions, 1, configs).await
}

pub(super) fn steady_spec(
    args: &BenchArgs,
    name: &str,
    partitions: i32,
    rate: f64,
    each: Duration,
) -> crate::Spec {
    let mix = Mix {
        resend: 0.10,
        ..resends_only()
    };
    let plan = vec![Step {
        rate: Some(rate),
        duration: each,
    }];
    let mut s = spec(args, name, partitions, plan, None, mix);
    s.report_dir = args.out.join(name);
    s
}

/// Waits until every worker holds some of the topic's partitions and together all of them,
/// then a little more: the run measures the steady state, not the group's joins and claims.
/// Returns the workers' CPU seconds a second over that little more, with no record arriving.
pub(super) async fn settle(
    procs: &mut [(Worker, u16)],
    partitions: i32,
    name: &str,
) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        for (i, (w, _)) in procs.iter_mut().enumerate() {
            if let Some(why) = w.exited(&format!("{name}-w{i}.log")) {
                anyhow::bail!(why);
            }
        }
        let mut held = Vec::new();
        for (_, port) in procs.iter() {
            let text = scrape(*port).await.unwrap_or_default();
            held.push(metric(&text, "effectively_assigned_partitions"));
        }
        if held.iter().all(|&n| n > 0.0) && held.iter().sum::<f64>() == f64::from(partitions) {
            let cpu = || procs.iter().map(|(w, _)| w.usage().1).sum::<f64>();
            let before = cpu();
            tokio::time::sleep(Duration::from_secs(3)).await;
            return Ok((cpu() - before) / 3.0);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the workers did not take the topic's {partitions} partitions in 90 s (they hold \
             {held:?}); see {name}-w*.log"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The counters at one moment.
struct Mark {
    commits: f64,
    batches: f64,
    records: f64,
    batch_s: f64,
    /// Seconds in each phase, in [`PHASES`] order.
    phases: [f64; 5],
    /// Cumulative bucket counts (upper bound, count) of the `arrive` phase and of the batch
    /// duration, summed over the workers.
    arrive: Vec<(f64, f64)>,
    batch: Vec<(f64, f64)>,
    worker_cpu_s: f64,
    /// CPU seconds of each backend serving a worker's connection, by pid.
    backends: HashMap<u32, f64>,
    /// CPU seconds of every `postgres` process, by pid.
    cluster: HashMap<u32, f64>,
    /// CPU seconds of the broker and of this process.
    kafka_cpu_s: f64,
    loadgen_cpu_s: f64,
    xact_commit: i64,
    wal_sync: i64,
    machine: (u64, u64),
}

const PHASES: [&str; 5] = ["fence", "stage", "dedupe", "effect", "commit"];

/// The CPU a set of processes spent between two marks; a process gone by the second mark
/// is left out, one that started after the first counts whole.
fn spent(before: &HashMap<u32, f64>, after: &HashMap<u32, f64>) -> f64 {
    (after.iter())
        .map(|(pid, t)| t - before.get(pid).unwrap_or(&0.0))
        .filter(|d| *d >= 0.0)
        .sum()
}

impl Mark {
    async fn take(procs: &[(Worker, u16)], db: &Db) -> anyhow::Result<Mark> {
        let mut m = Mark {
            commits: 0.0,
            batches: 0.0,
            records: 0.0,
            batch_s: 0.0,
            phases: [0.0; 5],
            arrive: Vec::new(),
            batch: Vec::new(),
            worker_cpu_s: 0.0,
            backends: HashMap::new(),
            cluster: processes(|comm, _| comm == "postgres"),
            kafka_cpu_s: (processes(|comm, cmd| comm == "java" && cmd.contains("kafka.Kafka")))
                .values()
                .sum(),
            loadgen_cpu_s: cpu_s(std::process::id()).unwrap_or(0.0),
            xact_commit: 0,
            wal_sync: 0,
            machine: machine_ticks(),
        };
        let mut ports = Vec::new();
        for (w, port) in procs {
            let text = scrape(*port).await?;
            m.commits += metric(&text, "effectively_transactions_committed_total");
            m.batches += metric(&text, "effectively_batch_size_records_count");
            m.records += metric(&text, "effectively_batch_size_records_sum");
            m.batch_s += metric(&text, "effectively_batch_duration_seconds_sum");
            for (i, phase) in PHASES.iter().enumerate() {
                let label = format!("phase=\"{phase}\"");
                m.phases[i] += metric_where(&text, "effectively_batch_phase_seconds_sum", &label);
            }
            let arrive = "effectively_batch_phase_seconds_bucket";
            add_buckets(&mut m.arrive, &buckets(&text, arrive, "phase=\"arrive\""));
            let batch = "effectively_batch_duration_seconds_bucket";
            add_buckets(&mut m.batch, &buckets(&text, batch, ""));
            m.worker_cpu_s += w.usage().1;
            if let Some(pid) = w.child.id() {
                ports.extend(client_ports(pid));
            }
        }
        let rows = db
            .client
            .query(
                "SELECT pid FROM pg_stat_activity WHERE client_port = ANY($1)",
                &[&ports],
            )
            .await?;
        for r in rows {
            let pid = r.get::<_, i32>(0) as u32;
            m.backends.insert(pid, cpu_s(pid).unwrap_or(0.0));
        }
        let r = db
            .client
            .query_one(
                "SELECT (SELECT xact_commit FROM pg_stat_database
                         WHERE datname = current_database()),
                        (SELECT wal_sync FROM pg_stat_wal)",
                &[],
            )
            .await?;
        (m.xact_commit, m.wal_sync) = (r.get(0), r.get(1));
        Ok(m)
    }
}

/// `/metrics` of a worker, over plain HTTP/1.0.
async fn scrape(port: u16) -> anyhow::Result<String> {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut text = String::new();
    s.read_to_string(&mut text).await?;
    Ok(text)
}

/// The sum of a metric's series (whatever their labels) in Prometheus' text format.
fn metric(text: &str, name: &str) -> f64 {
    metric_where(text, name, "")
}

/// The sum of a metric's series whose line holds `label` (e.g. `phase="commit"`).
/// The cumulative buckets `(le, count)` of histogram `name` in a scrape, summed over the series
/// whose labels contain `label`, in order of `le` (`+Inf` last).
fn buckets(text: &str, name: &str, label: &str) -> Vec<(f64, f64)> {
    let mut by_le: Vec<(f64, f64)> = Vec::new();
    for l in text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains(label))
    {
        let Some((series, value)) = l.rsplit_once(' ') else {
            continue;
        };
        if series.split('{').next() != Some(name) {
            continue;
        }
        let le = series
            .split("le=\"")
            .nth(1)
            .and_then(|r| r.split('"').next())
            .and_then(|v| match v {
                "+Inf" => Some(f64::INFINITY),
                v => v.parse::<f64>().ok(),
            });
        if let (Some(le), Ok(n)) = (le, value.parse::<f64>()) {
            add_buckets(&mut by_le, &[(le, n)]);
        }
    }
    by_le
}

fn add_buckets(into: &mut Vec<(f64, f64)>, more: &[(f64, f64)]) {
    for &(le, n) in more {
        match into.iter_mut().find(|(l, _)| *l == le) {
            Some((_, c)) => *c += n,
            None => into.push((le, n)),
        }
    }
    into.sort_by(|a, b| a.0.total_cmp(&b.0));
}

/// The `q` quantile of what a histogram counted between two scrapes, interpolated linearly in
/// its bucket as Prometheus's `histogram_quantile` does (the top finite bound when it falls in
/// `+Inf`); 0 when nothing was counted.
fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> f64 {
    let delta: Vec<(f64, f64)> = (after.iter())
        .map(|&(le, n)| {
            let was = before.iter().find(|(l, _)| *l == le).map_or(0.0, |b| b.1);
            (le, n - was)
        })
        .collect();
    let Some(&(_, total)) = delta.last() else {
        return 0.0;
    };
    if total <= 0.0 {
        return 0.0;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, n) in &delta {
        if n >= rank {
            if le.is_infinite() {
                return lower;
            }
            return lower + (le - lower) * (rank - below) / (n - below).max(1e-9);
        }
        (lower, below) = (le, n);
    }
    lower
}

fn metric_where(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.contains(label))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            (series.split('{').next()? == name).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

pub(super) async fn delete_topic(brokers: &str, topic: &str) -> anyhow::Result<()> {
    use rdkafka::admin::{AdminClient, AdminOptions};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    for r in admin.delete_topics(&[topic], &AdminOptions::new()).await? {
        r.map_err(|(t, e)| anyhow::anyhow!("{t}: {e}"))?;
    }
    Ok(())
}

pub(super) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// `utime + stime` of a process, in seconds.
fn cpu_s(pid: u32) -> Option<f64> {
    procfs::stat(pid).map(|s| s.cpu_s)
}

/// CPU seconds of each process whose name and command line pass `pick`, by pid.
fn processes(pick: impl Fn(&str, &str) -> bool) -> HashMap<u32, f64> {
    procfs::pids()
        .filter(|pid| {
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            pick(comm.trim(), &String::from_utf8_lossy(&cmd))
        })
        .filter_map(|pid| Some((pid, cpu_s(pid)?)))
        .collect()
}

/// Local ports of a process's TCP sockets: its end of each PostgreSQL connection is one.
fn client_ports(pid: u32) -> Vec<i32> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|e| {
                let link = std::fs::read_link(e.ok()?.path()).ok()?;
                let l = link.to_str()?;
                Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
            })
            .collect()
        })
        .unwrap_or_default();
    let mut ports = Vec::new();
    for table in ["tcp", "tcp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(inode)) = (f.get(1), f.get(9)) else {
                continue;
            };
            if inodes.iter().any(|i| i == inode) {
                if let Some(port) = local
                    .rsplit_once(':')
                    .and_then(|(_, p)| i32::from_str_radix(p, 16).ok())
                {
                    ports.push(port);
                }
            }
        }
    }
    ports
}

/// (busy, total) ticks of all CPUs so far, from `/proc/stat`.
fn machine_ticks() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = text
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user already)
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).unwrap_or(&0) + v.get(4).unwrap_or(&0);
    (total - idle, total)
}

fn busy_pct(before: (u64, u64), after: (u64, u64)) -> f64 {
    let total = after.1.saturating_sub(before.1).max(1) as f64;
    round1(after.0.saturating_sub(before.0) as f64 * 100.0 / total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_sums_the_series_of_one_name() {
        let text = "# TYPE effectively_batch_size_records summary\n\
            effectively_batch_size_records{consumer=\"c\",topic=\"t\",quantile=\"0.5\"} 1\n\
            effectively_batch_size_records_sum{consumer=\"c\",topic=\"t\"} 120\n\
            effectively_batch_size_records_count{consumer=\"c\",topic=\"t\"} 40\n\
            effectively_batch_size_records_count{consumer=\"c\",topic=\"u\"} 2\n\
            effectively_assigned_partitions 300\n";
        assert_eq!(metric(text, "effectively_batch_size_records_count"), 42.0);
        assert_eq!(metric(text, "effectively_batch_size_records_sum"), 120.0);
        assert_eq!(metric(text, "effectively_assigned_partitions"), 300.0);
        assert_eq!(metric(text, "effectively_batch_size_records"), 1.0);
    }

    #[test]
    fn this_process_has_cpu_time_and_the_machine_ticks() {
        assert!(cpu_s(std::process::id()).is_some());
        let (busy, total) = machine_ticks();
        assert!(busy <= total && total > 0);
    }

    #[test]
    fn a_quantile_of_the_buckets_counted_between_two_scrapes() {
        let text = |n: [u32; 3]| {
            format!(
                "# TYPE h histogram\n\
                 h_bucket{{phase=\"arrive\",le=\"0.1\"}} {}\n\
                 h_bucket{{phase=\"arrive\",le=\"1\"}} {}\n\
                 h_bucket{{phase=\"arrive\",le=\"+Inf\"}} {}\n\
                 h_bucket{{phase=\"fence\",le=\"0.1\"}} 500\n",
                n[0], n[1], n[2]
            )
        };
        let before = buckets(&text([10, 10, 10]), "h_bucket", "phase=\"arrive\"");
        let after = buckets(&text([100, 110, 110]), "h_bucket", "phase=\"arrive\"");
        // 100 new: 90 at most 0.1 s, 10 between 0.1 and 1 s. The 99th is the 9th of those 10.
        let p99 = quantile(&before, &after, 0.99);
        assert!((p99 - 0.91).abs() < 1e-9, "{p99}");
        assert!((quantile(&before, &after, 0.5) - 0.1 * 50.0 / 90.0).abs() < 1e-9);
        assert_eq!(quantile(&after, &after, 0.99), 0.0);
    }
}
