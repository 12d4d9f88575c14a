//! `loadgen chaos-cluster`: failover scenarios against a real three-broker Kafka and a
//! PostgreSQL primary with a streaming standby (`scripts/cluster.sh`, [`stack`]).
//!
//! Each scenario creates a topic of 6 partitions with 3 replicas, starts two worker processes
//! of the engine (the three brokers, the multi-host `DATABASE_URL`), produces `make chaos`'s
//! traffic (resends, redrives, double taps, poison) while its faults are injected
//! ([`faults`]), lets the engine drain and verifies the ledger with loadgen's checker (lost,
//! duplicated, unexpected, parked = poison only) and "Kafka's committed offset is never
//! ahead of PostgreSQL's" sampled throughout. From PostgreSQL's `consumer_offsets` polled
//! every 50 ms ([`watch`]) it measures `recover_s`, the time from each fault until every
//! partition with traffic has committed past where it ended at the fault, and the longest
//! commit stall. After every PostgreSQL failover the old primary is rebuilt as a synchronous
//! standby, after every Kafka fault all replicas are back in sync, so that every scenario
//! starts from a healthy cluster. Results go to `target/chaos/cluster-report.json`
//! (`cluster-report-inbox.json` under `--strategy inbox`).

mod faults;
mod stack;

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::chaos::{consumer_config, ClaimArg, Proc, StrategyArg, Worker};
use crate::harness::marks::round2;
use crate::harness::run::{Counts, Run, Targets};
use crate::harness::{watch, HarnessArgs};
use stack::Cluster;

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    #[command(flatten)]
    harness: HarnessArgs,
    /// Payments per second while the faults happen (default 300; 200 with --quick).
    #[arg(long)]
    rate: Option<f64>,
    /// Distinct users (the records' keys).
    #[arg(long, default_value_t = 200)]
    users: u64,
}

impl std::ops::Deref for ClusterArgs {
    type Target = HarnessArgs;
    fn deref(&self) -> &HarnessArgs {
        &self.harness
    }
}

const ALL: &[&str] = &[
    "kafka-clean-bounce",
    "kafka-hard-bounce",
    "kafka-pause",
    "kafka-two-down",
    "kafka-rolling",
    "pg-switchover",
    "pg-crash",
    "pg-standby-down",
    "pg-pause-fence",
    "pg-async-loss",
    "both",
];
const QUICK: &[&str] = &["pg-async-loss"];

/// Scenarios after which the old primary is rebuilt as a standby.
const FAILOVERS: &[&str] = &[
    "pg-switchover",
    "pg-crash",
    "pg-pause-fence",
    "pg-async-loss",
    "both",
];

/// The recovery a scenario must meet, in seconds.
fn target_s(name: &str) -> Option<f64> {
    match name {
        "kafka-clean-bounce" | "pg-switchover" => Some(5.0),
        "kafka-hard-bounce" | "pg-crash" | "pg-pause-fence" => Some(20.0),
        _ => None,
    }
}

/// One scenario's result, as `cluster-report.json` lists it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ClusterResult {
    pub name: String,
    pub strategy: String,
    pub seed: u64,
    /// `kafka_ahead`: for pg-async-loss, before the crash.
    #[serde(flatten)]
    pub counts: Counts,
    /// pg-async-loss: such samples after the promotion, where they are expected (the lost
    /// commits had been acknowledged to Kafka) until the engine has read the records again.
    pub kafka_ahead_after_loss: Option<u64>,
    /// The slowest recovery over the scenario's faults (None: it never recovered, or a
    /// harness error).
    pub recover_s: Option<f64>,
    /// The promotion's seconds, as `scripts/cluster.sh` measured them.
    pub promotion_s: Option<f64>,
    pub target_s: Option<f64>,
    /// The longest time any partition went without a commit.
    pub stall_s: Option<f64>,
    /// `stall_s` less what of it fell inside the scenario's outage by design (brokers down,
    /// the synchronous standby down): the engine's part. Must stay under 60 s.
    pub engine_stall_s: Option<f64>,
    /// The longest time any partition went without an acknowledged record (the producer's
    /// side of a stall: no new record, nothing for the engine to commit).
    pub ack_gap_s: Option<f64>,
    /// pg-async-loss: how far each partition's stored offset went back.
    pub offset_rollback: Option<Rollback>,
    /// pg-async-loss under the inbox: rows the old primary held that the promoted one lacked.
    pub inbox_lacked: Option<u64>,
    pub passed: bool,
    pub note: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Rollback {
    pub partitions: Vec<PartitionRollback>,
    pub total: i64,
}

/// A partition's stored offset on the old primary just before the crash and on the promoted
/// server right after (None: no row there); `rollback` = before - after.
#[derive(Debug, Clone, Serialize)]
pub struct PartitionRollback {
    pub partition: i32,
    pub before: i64,
    pub after: Option<i64>,
    pub rollback: i64,
}

pub async fn run(args: ClusterArgs) -> anyhow::Result<bool> {
    let cluster = Cluster::check(&args.services.brokers, &args.services.database_url).await?;
    let bin = Worker::binary(args.effectively.as_deref())?;
    std::fs::create_dir_all(&args.out)?;
    let names = args.names(ALL, QUICK)?;
    // kafka-wait-isr of every topic needs one topic at least: on a fresh cluster, this one.
    crate::create_topic(&args.services.brokers, crate::WARM_UP_TOPIC, 1, 3).await?;
    let mut results: Vec<ClusterResult> = Vec::new();
    for name in names {
        let seed = args.seed();
        eprintln!("== {name} [{}] (seed {seed})", args.strategy_name());
        let prepared = prepare(&cluster, name).await;
        let outcome = match prepared {
            Ok(()) => scenario(&cluster, &bin, &args, name, seed).await,
            Err(e) => Err(e.context("preparing the cluster")),
        };
        let r = outcome.unwrap_or_else(|e| ClusterResult {
            name: name.into(),
            strategy: args.strategy_name().into(),
            seed,
            target_s: target_s(name),
            note: format!("harness error: {e:#}"),
            ..ClusterResult::default()
        });
        print_result(&r);
        let errored = r.note.starts_with("harness error");
        results.push(r);
        if let Err(e) = restore(&cluster, name, errored).await {
            eprintln!("   the cluster could not be restored, stopping: {e:#}");
            break;
        }
    }
    args.write_report("chaos-cluster", "cluster-report", &results, |r| r.passed)
}

fn print_result(r: &ClusterResult) {
    let secs = |v: Option<f64>| v.map_or("-".into(), |s| format!("{s} s"));
    eprintln!(
        "   {}: {} recover {} (target {}) promotion {} stall {} (engine {}) ack gap {}{} {}",
        if r.passed { "PASS" } else { "FAIL" },
        r.counts,
        secs(r.recover_s),
        secs(r.target_s),
        secs(r.promotion_s),
        secs(r.stall_s),
        secs(r.engine_stall_s),
        secs(r.ack_gap_s),
        r.offset_rollback
            .as_ref()
            .map_or(String::new(), |o| format!(" offset rollback {}", o.total)),
        r.note
    );
}

/// A healthy cluster before a scenario: every replica in sync, a primary and a standby, the
/// replication synchronous (asynchronous for pg-async-loss).
async fn prepare(cluster: &Cluster, name: &str) -> anyhow::Result<()> {
    cluster.kafka_wait_isr(None).await?;
    let (primary, standby) = (cluster.pg_primary().await?, cluster.pg_standby().await?);
    anyhow::ensure!(
        primary != standby,
        "PostgreSQL node {primary} is both the primary and the standby"
    );
    let mode = if name == "pg-async-loss" {
        "async"
    } else {
        "sync"
    };
    cluster.run(&["pg-replication", mode]).await.map(drop)
}

/// After a scenario: the old primary rebuilt as a synchronous standby after a failover, the
/// brokers' replicas in sync. After a harness error, whatever the scenario may have left
/// stopped is resumed or started first.
async fn restore(cluster: &Cluster, name: &str, errored: bool) -> anyhow::Result<()> {
    if errored {
        for n in 1..=3 {
            let _ = cluster.kafka_signal(n, "CONT").await;
            let _ = cluster.kafka_start(n).await;
        }
        let _ = cluster.run(&["pg-resume"]).await;
        let _ = cluster.run(&["pg-standby-start"]).await;
    }
    if FAILOVERS.contains(&name) || (errored && name.starts_with("pg-")) {
        cluster.run(&["pg-rebuild-standby"]).await?;
    }
    cluster.run(&["pg-replication", "sync"]).await?;
    cluster.kafka_wait_isr(None).await
}

async fn scenario(
    cluster: &Cluster,
    bin: &Path,
    args: &ClusterArgs,
    name: &str,
    seed: u64,
) -> anyhow::Result<ClusterResult> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let inbox = args.strategy == StrategyArg::Inbox;
    let (brokers, url) = (&args.services.brokers, &args.services.database_url);
    let topic = format!(
        "cluster-{}{name}-{:06x}",
        if inbox { "inbox-" } else { "" },
        rng.u32(..0xffffff)
    );
    let config = consumer_config(&topic, 8, 4, args.strategy, ClaimArg::Lock, false);
    let rate = args.rate.unwrap_or(if args.quick { 200.0 } else { 300.0 });
    let run = Run::open(args, topic, (6, 3), &config, rate, args.users, seed).await?;
    let topic = run.topic.clone();
    let worker = Worker {
        bin,
        brokers,
        database_url: url,
    };
    let mut workers: Vec<Proc> = Vec::new();
    for i in 1..=2 {
        let id = format!("{topic}-w{i}");
        workers.push(worker.start(&run.config, &id, &args.out.join(format!("{id}.log")), None)?);
    }
    let mut ctx = faults::Ctx {
        cluster,
        session: &run.session,
        topic: &topic,
        partitions: run.partitions,
        watch: &run.watch,
        ahead: &run.ahead,
        rng: fastrand::Rng::with_seed(rng.u64(..)),
        quick: args.quick,
        inbox,
    };
    let (produced, injected) = run.during(faults::inject(&mut ctx, name)).await;
    let (produced, f) = match produced.and_then(|p| injected.map(|f| (p, f))) {
        Ok(both) => both,
        Err(e) => {
            run.abandon(workers).await;
            return Err(e);
        }
    };
    let target = target_s(name);
    let targets = Targets {
        marks: &f.marks,
        outages: &f.outages,
        recover_s: target,
    };
    let mut j = run.judge(&produced, workers, inbox, targets).await?;
    j.failed.splice(0..0, f.failed.clone());
    j.notes.splice(0..0, f.notes.clone());

    let offset_rollback = f.rollback.clone().map(|partitions| Rollback {
        total: partitions.iter().map(|p| p.rollback).sum(),
        partitions,
    });
    let mut inbox_lacked = None;
    if name == "pg-async-loss" && inbox {
        inbox_lacked = Some(f.lacked.len() as u64);
        let back = rows_back(url, &topic, &f.lacked).await?;
        j.notes.push(format!(
            "{} inbox rows lost with the old primary, {back} of them stored again from Kafka",
            f.lacked.len()
        ));
        if back != f.lacked.len() as u64 {
            j.failed.push(format!(
                "{} inbox rows lost with the old primary never came back",
                f.lacked.len() as u64 - back
            ));
        }
    }
    if name == "pg-async-loss" {
        j.notes.push(format!(
            "Kafka ahead in {} samples after the promotion (the lost commits had been \
             acknowledged to it)",
            j.ahead_after_loss
        ));
    }
    Ok(ClusterResult {
        name: name.into(),
        strategy: args.strategy_name().into(),
        seed,
        counts: j.counts.clone(),
        kafka_ahead_after_loss: (name == "pg-async-loss").then_some(j.ahead_after_loss),
        recover_s: j.recover_s,
        promotion_s: f.promotion_s.iter().copied().reduce(f64::max).map(round2),
        target_s: target,
        stall_s: Some(j.stall_s),
        engine_stall_s: Some(j.engine_stall_s),
        ack_gap_s: Some(j.ack_gap_s),
        offset_rollback,
        inbox_lacked,
        passed: j.failed.is_empty(),
        note: j.note(),
    })
}

/// How many of the inbox rows `ids` the current primary holds again.
async fn rows_back(url: &str, consumer: &str, ids: &[uuid::Uuid]) -> anyhow::Result<u64> {
    let db = watch::connect(url, Duration::from_secs(5)).await?;
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM inbox WHERE consumer = $1 AND message_id = ANY($2)",
            &[&consumer, &ids],
        )
        .await?
        .get(0);
    Ok(n as u64)
}
