//! What the fault harnesses share (`loadgen chaos`, `chaos-cluster`, `chaos-net`, `soak`): one
//! flags block ([`HarnessArgs`]), the choice of scenarios from it, the watchers ([`watch`])
//! that measure recovery and stalls from PostgreSQL's stored offsets, a fault's [`marks`] to
//! measure from, one scenario's course from its traffic to its verdict ([`run`]), and the
//! single-node stack's crashes ([`stack`]).

pub(crate) mod marks;
pub(crate) mod run;
pub(crate) mod stack;
pub(crate) mod watch;

use std::path::PathBuf;
use std::time::Duration;

/// The workers' strategy: `batch`, or `inbox` (store first, process later).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    Batch,
    Inbox,
}

/// The flags every fault harness takes, flattened into its own.
#[derive(Debug, clap::Args)]
pub struct HarnessArgs {
    #[command(flatten)]
    pub services: crate::Services,
    /// The engine's binary, built with `--features failpoints` (default: next to this one).
    #[arg(long)]
    pub effectively: Option<PathBuf>,
    /// Run only these scenarios (repeatable); default all.
    #[arg(long = "scenario")]
    pub scenarios: Vec<String>,
    /// The short subset `make test` runs.
    #[arg(long)]
    pub quick: bool,
    /// Replay with this seed (default: random, printed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The workers' strategy: `batch`, or `inbox` (store first, process later).
    #[arg(long, value_enum, default_value_t = StrategyArg::Batch)]
    pub strategy: StrategyArg,
    /// Where the reports, worker configs and logs go.
    #[arg(long, default_value = "target/chaos")]
    pub out: PathBuf,
}

impl HarnessArgs {
    pub fn inbox(&self) -> bool {
        self.strategy == StrategyArg::Inbox
    }

    /// The scenarios to run: those named (each checked against `all`), else `quick` with
    /// `--quick`, else `all`.
    pub fn names<'a>(&'a self, all: &[&'a str], quick: &[&'a str]) -> anyhow::Result<Vec<&'a str>> {
        let names: Vec<&str> = match (self.scenarios.is_empty(), self.quick) {
            (false, _) => self.scenarios.iter().map(String::as_str).collect(),
            (true, true) => quick.to_vec(),
            (true, false) => all.to_vec(),
        };
        if let Some(bad) = names.iter().find(|n| !all.contains(n)) {
            anyhow::bail!("unknown scenario {bad:?}; known: {all:?}");
        }
        Ok(names)
    }

    /// `batch` or `inbox`: the strategy's name in reports and topics.
    pub fn strategy_name(&self) -> &'static str {
        match self.strategy {
            StrategyArg::Batch => "batch",
            StrategyArg::Inbox => "inbox",
        }
    }

    /// Writes `results` to `<out>/<base>.json` (`<base>-inbox.json` under the inbox) and
    /// prints `<command> [strategy]: N passed, M failed`; true if every one passed.
    pub(crate) fn write_report<T: serde::Serialize>(
        &self,
        command: &str,
        base: &str,
        results: &[T],
        passed: impl Fn(&T) -> bool,
    ) -> anyhow::Result<bool> {
        let path = self.out.join(match self.strategy {
            StrategyArg::Batch => format!("{base}.json"),
            StrategyArg::Inbox => format!("{base}-inbox.json"),
        });
        std::fs::write(&path, serde_json::to_string_pretty(results)? + "\n")?;
        let n = results.iter().filter(|r| passed(r)).count();
        println!(
            "{command} [{}]: {n} passed, {} failed",
            self.strategy_name(),
            results.len() - n
        );
        eprintln!("report: {}", path.display());
        Ok(n == results.len())
    }

    /// The seed of the next scenario: `--seed`, or a random one.
    pub fn seed(&self) -> u64 {
        self.seed.unwrap_or_else(|| fastrand::u64(..))
    }
}

/// Sleeps `ms` milliseconds: a scenario's pause between its faults.
pub(crate) fn pause(ms: u64) -> tokio::time::Sleep {
    tokio::time::sleep(Duration::from_millis(ms))
}
