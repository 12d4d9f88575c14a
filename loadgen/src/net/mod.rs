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

use serde::Serialize;

use crate::chaos::{consumer_config, ClaimArg, Worker};
use crate::harness::run::{Counts, Run, Targets};
use crate::harness::{HarnessArgs, StrategyArg};
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

/// One scenario's result, as `net-report.json` lists it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NetResult {
    pub name: String,
    pub strategy: String,
    pub seed: u64,
    #[serde(flatten)]
    pub counts: Counts,
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
        eprintln!("== {name} [{}] (seed {seed})", args.strategy_name());
        let r = scenario(&links, &bin, &args, name, seed)
            .await
            .unwrap_or_else(|e| NetResult {
                name: name.into(),
                strategy: args.strategy_name().into(),
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
    args.write_report("chaos-net", "net-report", &results, |r| r.passed)
}

fn print_result(r: &NetResult) {
    let secs = |v: Option<f64>| v.map_or("-".into(), |s| format!("{s} s"));
    eprintln!(
        "   {}: {} recover {} (target {} s) stall {} (engine {}) {}",
        if r.passed { "PASS" } else { "FAIL" },
        r.counts,
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
    let topic = format!(
        "net-{}{name}-{:06x}",
        if inbox { "inbox-" } else { "" },
        rng.u32(..0xffffff)
    );
    let rate = args.rate.unwrap_or(if args.quick { 200.0 } else { 300.0 });
    let config = config(&topic, args.strategy);
    let run = Run::open(args, topic, (6, 1), &config, rate, 200, seed).await?;
    let worker = Worker {
        bin,
        brokers: &args.services.brokers,
        database_url: &args.services.database_url,
    };
    let mut ctx = scenarios::Ctx {
        links,
        worker: &worker,
        run: &run,
        out: &args.out,
        rng: fastrand::Rng::with_seed(rng.u64(..)),
        quick: args.quick,
        workers: Vec::new(),
    };
    let (produced, injected) = run
        .during(async {
            let injected = scenarios::inject(&mut ctx, name).await;
            // Every link healed before the drain, whatever happened.
            for l in links {
                l.heal().await?;
            }
            injected
        })
        .await;
    let workers = std::mem::take(&mut ctx.workers);
    let (produced, f) = match produced.and_then(|p| injected.map(|f| (p, f))) {
        Ok(both) => both,
        Err(e) => {
            run.abandon(workers).await;
            return Err(e);
        }
    };
    let targets = Targets {
        marks: &f.marks,
        outages: &f.outages,
        recover_s: Some(TARGET_S),
    };
    let mut j = run.judge(&produced, workers, inbox, targets).await?;
    j.notes.splice(0..0, f.notes);
    Ok(NetResult {
        name: name.into(),
        strategy: args.strategy_name().into(),
        seed,
        counts: j.counts.clone(),
        recover_s: j.recover_s,
        target_s: TARGET_S,
        stall_s: Some(j.stall_s),
        engine_stall_s: Some(j.engine_stall_s),
        passed: j.failed.is_empty(),
        note: j.note(),
    })
}
