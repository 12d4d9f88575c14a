//! `loadgen chaos` (`make chaos`): exactly-once is a claim about failures, so inject them.
//!
//! Each scenario runs real worker processes of the engine (built with the `failpoints`
//! feature) against the local Kafka and PostgreSQL while loadgen produces, injects its fault,
//! then lets the engine drain and checks the ledger with loadgen's verifier (lost, duplicated,
//! unexpected, parked = poison), plus "Kafka's committed offset <= PostgreSQL's stored offset"
//! sampled throughout. Scenarios are seeded: `--seed` replays one. Results go to
//! `target/chaos/report.json`; the exit status is non-zero if any scenario fails.
//!
//! `--strategy inbox` runs the workers with `strategy = "inbox"`: the receiver stores each
//! message in the `inbox` table and moves the offset at once, processors apply the effects
//! later. The verifier then also waits for the consumer's inbox to have no PENDING or
//! IN_PROGRESS row, and counts its FAILED rows as parked. `inbox-burst` runs only under it.
//!
//! This file holds the flags, the list of scenarios and the loop over them; [`scenario`] runs
//! one (its setup, its faults while loadgen produces, the verification), [`workers`] starts the
//! engine's processes, and [`checks`] holds the checks beside the verifier's. The faults, by
//! family: [`bounces`] (a worker's process), [`outages`] (Kafka's or PostgreSQL's) and [`inbox`]
//! (`inbox-burst`). `pool-exhaustion`, `poison-storm` and `offsets-reset` are settings and a
//! step of [`scenario`] itself.

mod bounces;
mod checks;
mod inbox;
mod outages;
mod scenario;
mod workers;

use serde::Serialize;

use crate::harness::HarnessArgs;
pub(crate) use crate::harness::StrategyArg;

pub(crate) use checks::{partitions_ahead, Db};
use scenario::scenario;
pub(crate) use workers::{consumer_config, worker_settings, Proc, Worker};

#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    #[command(flatten)]
    harness: HarnessArgs,
    /// With `--strategy inbox`: how processors claim rows (`lease`: a 10 s lease).
    #[arg(long, value_enum, default_value_t = ClaimArg::Lock)]
    inbox_claim: ClaimArg,
    /// With `--strategy batch`: commit groups (`batch.group_partitions = true`), several
    /// partitions' batches in one transaction.
    #[arg(long)]
    group_partitions: bool,
    /// Distinct users (the records' keys, and the inbox's ordering keys) of every scenario;
    /// default 200, and 10,000 for inbox-burst (10 payments each).
    #[arg(long)]
    users: Option<u64>,
}

impl std::ops::Deref for ChaosArgs {
    type Target = HarnessArgs;
    fn deref(&self) -> &HarnessArgs {
        &self.harness
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClaimArg {
    Lock,
    Lease,
}

impl ChaosArgs {
    /// `batch`, `inbox` or `inbox-lease`: in the report, its file name and the topics' names.
    fn label(&self) -> &'static str {
        match (self.strategy, self.inbox_claim) {
            (StrategyArg::Batch, _) if self.group_partitions => "batch-grouped",
            (StrategyArg::Batch, _) => "batch",
            (StrategyArg::Inbox, ClaimArg::Lock) => "inbox",
            (StrategyArg::Inbox, ClaimArg::Lease) => "inbox-lease",
        }
    }
}

/// One scenario's result, as `report.json` lists it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScenarioResult {
    pub name: String,
    /// The workers' strategy: `batch`, `inbox`, or `inbox-lease` (`--inbox-claim lease`).
    pub strategy: String,
    pub seed: u64,
    #[serde(flatten)]
    pub counts: crate::harness::run::Counts,
    pub passed: bool,
    pub note: String,
}

const ALL: &[&str] = &[
    "hard-bounce",
    "clean-bounce",
    "rebalance-storm",
    "zombie",
    "postgres-crash",
    "postgres-unreachable",
    "broker-crash",
    "pool-exhaustion",
    "poison-storm",
    "offsets-reset",
    "inbox-burst",
];
const QUICK: &[&str] = &["hard-bounce", "poison-storm"];

/// Why `name` does not apply to the strategy of `args` (it is skipped), if it does not.
fn not_applicable(name: &str, args: &ChaosArgs) -> Option<&'static str> {
    match name {
        "inbox-burst" if !args.inbox() => Some("only under --strategy inbox"),
        _ => None,
    }
}

pub async fn run(args: ChaosArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        !(args.group_partitions && args.inbox()),
        "--group-partitions works with --strategy batch only"
    );
    let bin = Worker::binary(args.effectively.as_deref())?;
    std::fs::create_dir_all(&args.out)?;
    let explicit = !args.scenarios.is_empty();
    let names = args.names(ALL, QUICK)?;
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    for name in names {
        if let Some(why) = not_applicable(name, &args) {
            // Named on the command line: say so. Left out of the default list: quietly.
            if explicit {
                eprintln!(
                    "== {name}: skipped under --strategy {}: {why}",
                    args.label()
                );
            }
            skipped.push(name);
            continue;
        }
        let seed = args.seed();
        eprintln!("== {name} [{}] (seed {seed})", args.label());
        let r = match scenario(&bin, &args, name, seed).await {
            Ok(r) => r,
            Err(e) => ScenarioResult {
                name: name.into(),
                strategy: args.label().into(),
                seed,
                note: format!("harness error: {e:#}"),
                ..ScenarioResult::default()
            },
        };
        eprintln!(
            "   {}: {} {}",
            if r.passed { "PASS" } else { "FAIL" },
            r.counts,
            r.note
        );
        results.push(r);
    }
    // One report per strategy, so that `make chaos` keeps both runs.
    let path = args.out.join(match args.label() {
        "batch" => "report.json".to_string(),
        other => format!("report-{other}.json"),
    });
    std::fs::write(&path, serde_json::to_string_pretty(&results)? + "\n")?;
    let passed = results.iter().filter(|r| r.passed).count();
    let skipped = if skipped.is_empty() {
        String::new()
    } else {
        format!(
            ", {} skipped ({}: not under --strategy {})",
            skipped.len(),
            skipped.join(", "),
            args.label()
        )
    };
    println!(
        "chaos [{}]: {passed} passed, {} failed{skipped}",
        args.label(),
        results.len() - passed
    );
    eprintln!("report: {}", path.display());
    Ok(passed == results.len())
}
