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
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::chaos::{consumer_config, ClaimArg, Db, Proc, StrategyArg, Worker};
use crate::harness::{watch, HarnessArgs};
use crate::produce::{Mix, Progress, Step};
use crate::{finish_stage, produce_stage_with, Session, Spec};
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

impl ClusterArgs {
    fn label(&self) -> &'static str {
        match self.strategy {
            StrategyArg::Batch => "batch",
            StrategyArg::Inbox => "inbox",
        }
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

/// A commit stall this long fails any scenario.
const STALL_LIMIT_S: f64 = 60.0;

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
    pub sent: u64,
    pub acked: u64,
    pub effects: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    pub parked: u64,
    /// Samples where Kafka's committed offset was ahead of PostgreSQL's (for pg-async-loss:
    /// before the crash).
    pub kafka_ahead: u64,
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
        eprintln!("== {name} [{}] (seed {seed})", args.label());
        let prepared = prepare(&cluster, name).await;
        let outcome = match prepared {
            Ok(()) => scenario(&cluster, &bin, &args, name, seed).await,
            Err(e) => Err(e.context("preparing the cluster")),
        };
        let r = outcome.unwrap_or_else(|e| ClusterResult {
            name: name.into(),
            strategy: args.label().into(),
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
    let path = args.out.join(match args.label() {
        "batch" => "cluster-report.json".to_string(),
        other => format!("cluster-report-{other}.json"),
    });
    std::fs::write(&path, serde_json::to_string_pretty(&results)? + "\n")?;
    let passed = results.iter().filter(|r| r.passed).count();
    println!(
        "chaos-cluster [{}]: {passed} passed, {} failed",
        args.label(),
        results.len() - passed
    );
    eprintln!("report: {}", path.display());
    Ok(passed == results.len())
}

fn print_result(r: &ClusterResult) {
    let secs = |v: Option<f64>| v.map_or("-".into(), |s| format!("{s} s"));
    eprintln!(
        "   {}: sent {} acked {} effects {} lost {} duplicated {} unexpected {} parked {} \
         kafka-ahead {} recover {} (target {}) promotion {} stall {} (engine {}) ack gap {}{} {}",
        if r.passed { "PASS" } else { "FAIL" },
        r.sent,
        r.acked,
        r.effects,
        r.lost,
        r.duplicated,
        r.unexpected,
        r.parked,
        r.kafka_ahead,
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

/// Seconds to two decimals, for the report.
fn round2(s: f64) -> f64 {
    (s * 100.0).round() / 100.0
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
    let partitions = 6;
    crate::create_topic(brokers, &topic, partitions, 3).await?;
    let config = args.out.join(format!("{topic}.toml"));
    std::fs::write(
        &config,
        consumer_config(&topic, 8, 4, args.strategy, ClaimArg::Lock, false),
    )?;
    let spec = Spec {
        brokers: brokers.clone(),
        database_url: url.clone(),
        topic: topic.clone(),
        partitions,
        consumer: topic.clone(),
        // Until the faults are done (Progress::stop), at most 15 minutes.
        plan: vec![Step {
            rate: Some(args.rate.unwrap_or(if args.quick { 200.0 } else { 300.0 })),
            duration: Duration::from_secs(900),
        }],
        limit: None,
        mix: Mix {
            resend: 0.10,
            redrive: 0.02,
            redrive_delay: Duration::from_secs(5),
            double_tap: 0.01,
            poison: 0.002,
        },
        users: args.users,
        rate_bp: 200,
        drain_timeout: Duration::from_secs(180),
        report_dir: args.out.join(&topic),
        seed: Some(seed),
        quiet: true,
        compression: Default::default(),
    };
    let session = Session::open(&spec).await?;
    let worker = Worker {
        bin,
        brokers,
        database_url: url,
    };
    let mut workers: Vec<Proc> = Vec::new();
    for i in 1..=2 {
        let id = format!("{topic}-w{i}");
        workers.push(worker.start(&config, &id, &args.out.join(format!("{id}.log")), None)?);
    }
    let watch = watch::CommitWatch::start(url, &topic);
    let ahead = watch::AheadSampler::start(brokers, url, &topic, partitions)?;
    let progress = Arc::new(Progress::default());
    let mut ctx = faults::Ctx {
        cluster,
        session: &session,
        topic: &topic,
        partitions,
        watch: &watch,
        ahead: &ahead,
        rng: fastrand::Rng::with_seed(rng.u64(..)),
        quick: args.quick,
        inbox,
    };
    let (produced, injected) = tokio::join!(
        produce_stage_with(&session, &spec, Arc::clone(&progress)),
        async {
            let injected = faults::inject(&mut ctx, name).await;
            progress.stop.store(true, Relaxed);
            injected
        }
    );
    let (produced, f) = (produced?, injected?);
    // A fresh session for the verification: a failover took the first one's connection.
    let session = Session::open(&spec).await?;
    let report = finish_stage(&session, &spec, &produced).await?;
    let commits = watch.finish().await;
    let (kafka_ahead, ahead_after_loss) = ahead.finish().await;
    let mut failed = f.failed.clone();
    let mut notes = f.notes.clone();
    for w in workers {
        if let Err(e) = w.stop().await {
            failed.push(format!("a worker did not stop cleanly: {e:#}"));
        }
    }
    if !report.verified {
        failed.push("the ledger did not verify".into());
    }
    if kafka_ahead > 0 {
        failed.push(format!(
            "Kafka's committed offset ahead of PostgreSQL's in {kafka_ahead} samples"
        ));
    }

    // Recovery from each fault, over the partitions that had traffic after it.
    let mut recover: Option<f64> = Some(0.0);
    let mut each = Vec::new();
    for m in &f.marks {
        match m.recovery(&commits, &produced) {
            Ok(s) => {
                each.push(format!("{} {:.2} s", m.label, s));
                if m.counted {
                    recover = recover.map(|r| r.max(s));
                }
            }
            Err(never) => {
                each.push(format!("{} never", m.label));
                if m.counted {
                    recover = None;
                    failed.push(format!(
                        "partitions {never:?} never committed past their end at \"{}\"",
                        m.label
                    ));
                }
            }
        }
    }
    if !f.marks.iter().any(|m| m.counted) {
        recover = None;
        failed.push("no fault to measure a recovery from".into());
    }
    notes.push(format!("recovery: {}", each.join("; ")));
    let target = target_s(name);
    if let (Some(r), Some(t)) = (recover, target) {
        if r > t {
            failed.push(format!("recovery {r:.2} s over the target {t} s"));
        }
    }
    let (stall, engine_stall) = watch::longest_stall(&commits, &f.outages);
    if engine_stall >= STALL_LIMIT_S {
        failed.push(format!(
            "a commit stall of {engine_stall:.1} s (outside the outage by design)"
        ));
    }

    let offset_rollback = f.rollback.clone().map(|partitions| Rollback {
        total: partitions.iter().map(|p| p.rollback).sum(),
        partitions,
    });
    let mut inbox_lacked = None;
    if name == "pg-async-loss" && inbox {
        inbox_lacked = Some(f.lacked.len() as u64);
        let back = rows_back(url, &topic, &f.lacked).await?;
        notes.push(format!(
            "{} inbox rows lost with the old primary, {back} of them stored again from Kafka",
            f.lacked.len()
        ));
        if back != f.lacked.len() as u64 {
            failed.push(format!(
                "{} inbox rows lost with the old primary never came back",
                f.lacked.len() as u64 - back
            ));
        }
    }
    if inbox {
        let failed_rows = Db::connect(url).await?.failed(&topic).await?;
        notes.push(format!(
            "parked = {} dead letters + {failed_rows} FAILED inbox rows",
            report.parked.saturating_sub(failed_rows)
        ));
    }
    if name == "pg-async-loss" {
        notes.push(format!(
            "Kafka ahead in {ahead_after_loss} samples after the promotion (the lost commits \
             had been acknowledged to it)"
        ));
    }
    let mut note = notes.join("; ");
    if !failed.is_empty() {
        note = format!("FAILED: {}; {note}", failed.join("; "));
    }
    Ok(ClusterResult {
        name: name.into(),
        strategy: args.label().into(),
        seed,
        sent: produced.log.len() as u64,
        acked: produced.acked(),
        effects: report.effects,
        lost: report.lost,
        duplicated: report.duplicated,
        unexpected: report.unexpected,
        parked: report.parked,
        kafka_ahead,
        kafka_ahead_after_loss: (name == "pg-async-loss").then_some(ahead_after_loss),
        recover_s: recover.map(round2),
        promotion_s: f.promotion_s.iter().copied().reduce(f64::max).map(round2),
        target_s: target,
        stall_s: Some(round2(stall)),
        engine_stall_s: Some(round2(engine_stall)),
        ack_gap_s: Some(round2(ack_gap(&produced.log))),
        offset_rollback,
        inbox_lacked,
        passed: failed.is_empty(),
        note,
    })
}

/// The longest time between two acknowledgements of one partition.
fn ack_gap(log: &[crate::produce::Sent]) -> f64 {
    let mut acks: std::collections::HashMap<i32, Vec<f64>> = Default::default();
    for s in log.iter().filter(|s| s.acked) {
        if let Some(p) = s.partition {
            acks.entry(p).or_default().push(s.acked_at_s);
        }
    }
    acks.values_mut()
        .flat_map(|t| {
            t.sort_by(f64::total_cmp);
            t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
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
