//! `loadgen chaos-net` (`make chaos-net`): network faults between a worker and the stack.
//!
//! Each of two worker processes of the engine runs in a network namespace of its own, joined to
//! the host by a veth pair ([`netns`]); the scenarios ([`scenarios`]) put latency ([`delay`]),
//! loss and silent drops (nftables) on those links while loadgen produces `make
//! chaos`'s traffic (resends, redrives, double taps, poison) to a topic of 6 partitions. Then,
//! as every harness does: the engine drains, loadgen's checker verifies the ledger (lost,
//! duplicated, unexpected, parked = poison only), "Kafka's committed offset is never ahead of
//! PostgreSQL's" is sampled throughout, and from PostgreSQL's stored offsets
//! ([`crate::harness::watch`]) it measures the recovery after each fault ends (every partition
//! with traffic commits past where it was then: within [`TARGET_S`]) and the longest commit
//! stall outside the faults (under [`STALL_LIMIT_S`]). Needs root, iproute2 and nftables.
//! Results go to `target/chaos/net-report.json` (`net-report-inbox.json` under
//! `--strategy inbox`).

mod delay;
mod netns;
mod scenarios;

use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::chaos::{consumer_config, ClaimArg, Db, Proc, Worker};
use crate::harness::marks::{self, round2};
use crate::harness::{watch, HarnessArgs, StrategyArg};
use crate::produce::{Mix, Progress, Step};
use crate::{finish_stage, produce_stage_with, Session, Spec};
pub(crate) use netns::{Fault, Link, Ports, To};

#[derive(Debug, clap::Args)]
pub struct NetArgs {
    #[command(flatten)]
    harness: HarnessArgs,
    /// Payments per second while the faults happen (default 300; 200 with --quick).
    #[arg(long)]
    rate: Option<f64>,
}

impl std::ops::Deref for NetArgs {
    type Target = HarnessArgs;
    fn deref(&self) -> &HarnessArgs {
        &self.harness
    }
}

impl NetArgs {
    fn label(&self) -> &'static str {
        match self.strategy {
            StrategyArg::Batch => "batch",
            StrategyArg::Inbox => "inbox",
        }
    }
}

const ALL: &[&str] = &[
    "latency",
    "loss",
    "pg-cut",
    "kafka-cut",
    "commit-stall",
    "flapping",
];
const QUICK: &[&str] = &["pg-cut"];

/// Every partition with traffic commits again within this many seconds of a link's return.
pub const TARGET_S: f64 = 20.0;
/// A commit stall this long outside the faults' own windows fails any scenario.
pub const STALL_LIMIT_S: f64 = 60.0;

/// One scenario's result, as `net-report.json` lists it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NetResult {
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
    /// Samples where Kafka's committed offset was ahead of PostgreSQL's.
    pub kafka_ahead: u64,
    /// The slowest recovery after a fault ended (None: one never recovered, or a harness
    /// error).
    pub recover_s: Option<f64>,
    pub target_s: f64,
    /// The longest time any partition went without a commit.
    pub stall_s: Option<f64>,
    /// `stall_s` less what of it fell inside a fault by design (a link cut, 30% loss).
    pub engine_stall_s: Option<f64>,
    pub passed: bool,
    pub note: String,
}

pub async fn run(args: NetArgs) -> anyhow::Result<bool> {
    let bin = Worker::binary(args.effectively.as_deref())?;
    std::fs::create_dir_all(&args.out)?;
    let names = args.names(ALL, QUICK)?;
    let ports = Ports::of(&args.services.brokers, &args.services.database_url)?;
    let links = [
        Link::create(1, &ports).await?,
        Link::create(2, &ports).await?,
    ];
    let mut results: Vec<NetResult> = Vec::new();
    for name in names {
        let seed = args.seed();
        eprintln!("== {name} [{}] (seed {seed})", args.label());
        let r = scenario(&links, &bin, &args, name, seed)
            .await
            .unwrap_or_else(|e| NetResult {
                name: name.into(),
                strategy: args.label().into(),
                seed,
                target_s: TARGET_S,
                note: format!("harness error: {e:#}"),
                ..NetResult::default()
            });
        print_result(&r);
        results.push(r);
        for l in &links {
            l.heal().await?;
        }
    }
    for l in links {
        l.destroy().await;
    }
    let path = args.out.join(match args.label() {
        "batch" => "net-report.json".to_string(),
        other => format!("net-report-{other}.json"),
    });
    std::fs::write(&path, serde_json::to_string_pretty(&results)? + "\n")?;
    let passed = results.iter().filter(|r| r.passed).count();
    println!(
        "chaos-net [{}]: {passed} passed, {} failed",
        args.label(),
        results.len() - passed
    );
    eprintln!("report: {}", path.display());
    Ok(passed == results.len())
}

fn print_result(r: &NetResult) {
    let secs = |v: Option<f64>| v.map_or("-".into(), |s| format!("{s} s"));
    eprintln!(
        "   {}: sent {} acked {} effects {} lost {} duplicated {} unexpected {} parked {} \
         kafka-ahead {} recover {} (target {} s) stall {} (engine {}) {}",
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
        r.target_s,
        secs(r.stall_s),
        secs(r.engine_stall_s),
        r.note
    );
}

/// The worker config of the scenarios: `make chaos`'s (a 6 s session timeout, a 5 s idle in
/// transaction timeout) with a 10 s transaction deadline instead of the default 30 s, so that
/// a stalled connection is given up within a scenario's fault (and the answer to a COMMIT is
/// surely lost, not only late).
fn config(topic: &str, strategy: StrategyArg) -> String {
    consumer_config(topic, 8, 4, strategy, ClaimArg::Lock, false).replacen(
        "[database]\n",
        "[database]\ntransaction_deadline = \"10s\"\n",
        1,
    )
}

async fn scenario(
    links: &[Link; 2],
    bin: &Path,
    args: &NetArgs,
    name: &str,
    seed: u64,
) -> anyhow::Result<NetResult> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let inbox = args.inbox();
    let (brokers, url) = (&args.services.brokers, &args.services.database_url);
    let topic = format!(
        "net-{}{name}-{:06x}",
        if inbox { "inbox-" } else { "" },
        rng.u32(..0xffffff)
    );
    let partitions = 6;
    crate::create_topic(brokers, &topic, partitions, 1).await?;
    let config_path = args.out.join(format!("{topic}.toml"));
    std::fs::write(&config_path, config(&topic, args.strategy))?;
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
        users: 200,
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
    let watch = watch::CommitWatch::start(url, &topic);
    let ahead = watch::AheadSampler::start(brokers, url, &topic, partitions)?;
    let progress = Arc::new(Progress::default());
    let mut ctx = scenarios::Ctx {
        links,
        worker: &worker,
        config: &config_path,
        out: &args.out,
        topic: &topic,
        url,
        session: &session,
        watch: &watch,
        partitions,
        rng: fastrand::Rng::with_seed(rng.u64(..)),
        quick: args.quick,
        workers: Vec::new(),
    };
    let (produced, injected) = tokio::join!(
        produce_stage_with(&session, &spec, Arc::clone(&progress)),
        async {
            let injected = scenarios::inject(&mut ctx, name).await;
            // Every link healed before the drain, whatever happened.
            for l in links {
                l.heal().await?;
            }
            progress.stop.store(true, Relaxed);
            injected
        }
    );
    let workers: Vec<Proc> = std::mem::take(&mut ctx.workers);
    let (produced, f) = match produced.and_then(|p| injected.map(|f| (p, f))) {
        Ok(both) => both,
        Err(e) => {
            for w in workers {
                w.kill().await;
            }
            watch.finish().await;
            ahead.finish().await;
            return Err(e);
        }
    };
    let report = finish_stage(&session, &spec, &produced).await?;
    let commits = watch.finish().await;
    let (kafka_ahead, _) = ahead.finish().await;
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
    let started = produced.started_at.timestamp_micros() as f64 / 1e6;
    let rec = marks::recoveries(&f.marks, &commits, &produced.log, started);
    failed.extend(rec.failed);
    notes.push(format!("recovery: {}", rec.each.join("; ")));
    if let Some(r) = rec.slowest.filter(|r| *r > TARGET_S) {
        failed.push(format!("recovery {r:.2} s over the target {TARGET_S} s"));
    }
    let (stall, engine_stall) = watch::longest_stall(&commits, &f.outages);
    if engine_stall >= STALL_LIMIT_S {
        failed.push(format!(
            "a commit stall of {engine_stall:.1} s outside the faults"
        ));
    }
    if inbox {
        let failed_rows = Db::connect(url).await?.failed(&topic).await?;
        notes.push(format!(
            "parked = {} dead letters + {failed_rows} FAILED inbox rows",
            report.parked.saturating_sub(failed_rows)
        ));
    }
    let mut note = notes.join("; ");
    if !failed.is_empty() {
        note = format!("FAILED: {}; {note}", failed.join("; "));
    }
    Ok(NetResult {
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
        recover_s: rec.slowest,
        target_s: TARGET_S,
        stall_s: Some(round2(stall)),
        engine_stall_s: Some(round2(engine_stall)),
        passed: failed.is_empty(),
        note,
    })
}
