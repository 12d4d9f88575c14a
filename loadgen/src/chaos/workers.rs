//! The engine's worker processes in a scenario: their configs, starting them (with failpoints
//! armed, if any), signalling, stopping and killing them.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;

use super::{ChaosArgs, ClaimArg, StrategyArg};

/// A worker process.
pub(crate) struct Proc {
    child: tokio::process::Child,
}

impl Proc {
    /// Its process id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    pub(super) fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let _ = std::process::Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status();
        }
    }

    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        self.signal("TERM");
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("the worker did not exit within 60 s of SIGTERM")??;
        anyhow::ensure!(
            status.success(),
            "worker exited with {status:?} after SIGTERM"
        );
        Ok(())
    }

    pub(crate) async fn kill(mut self) {
        self.signal("KILL");
        let _ = self.child.wait().await;
    }

    /// Waits for the process to die on its own (a failpoint), up to `secs`.
    pub(crate) async fn exited(&mut self, secs: u64) -> bool {
        tokio::time::timeout(Duration::from_secs(secs), self.child.wait())
            .await
            .is_ok()
    }
}

/// What a scenario shares: names, config, the worker binary.
pub(super) struct Env<'a> {
    pub(super) bin: &'a Path,
    pub(super) args: &'a ChaosArgs,
    pub(super) name: String,
    pub(super) config: PathBuf,
    pub(super) database_url: String,
    pub(super) workers: u32,
}

impl Env<'_> {
    pub(super) fn start(&mut self, failpoints: Option<&str>) -> anyhow::Result<Proc> {
        let config = self.config.clone();
        self.start_with(&config, failpoints)
    }

    /// The worker id the next [`Env::start`] gives its process.
    pub(super) fn next_id(&self) -> String {
        format!("{}-w{}", self.name, self.workers + 1)
    }

    pub(super) fn start_with(
        &mut self,
        config: &Path,
        failpoints: Option<&str>,
    ) -> anyhow::Result<Proc> {
        self.workers += 1;
        let id = format!("{}-w{}", self.name, self.workers);
        let worker = Worker {
            bin: self.bin,
            brokers: &self.args.services.brokers,
            database_url: &self.database_url,
        };
        worker.start(
            config,
            &id,
            &self.args.out.join(format!("{id}.log")),
            failpoints,
        )
    }
}

/// How to start worker processes of the engine: its binary and the stack they connect to.
pub(crate) struct Worker<'a> {
    pub bin: &'a Path,
    pub brokers: &'a str,
    pub database_url: &'a str,
}

impl Worker<'_> {
    /// The engine's binary: `explicit`, or the one next to this one.
    pub(crate) fn binary(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
        Ok(match explicit {
            Some(p) => p.to_path_buf(),
            None => std::env::current_exe()?.with_file_name("effectively"),
        })
    }

    /// `effectively run --config <config>` as worker `id` (its stderr in `log`), with these
    /// failpoints armed if any.
    pub(crate) fn start(
        &self,
        config: &Path,
        id: &str,
        log: &Path,
        failpoints: Option<&str>,
    ) -> anyhow::Result<Proc> {
        self.spawn(self.command(), "run", config, id, log, failpoints)
    }

    /// The engine's binary as a command to [`Worker::spawn`].
    pub(crate) fn command(&self) -> tokio::process::Command {
        tokio::process::Command::new(self.bin)
    }

    /// `effectively <command> --config <config>` (`run`, `relay`, `send`) with no metrics
    /// server, as `id` (its stderr in `log`), with these failpoints armed if any, through
    /// `cmd`: the binary itself ([`Worker::command`]) or a wrapper that ends with it (`ip
    /// netns exec <ns> <bin>`, which execs it: the child's pid is the engine's).
    pub(crate) fn spawn(
        &self,
        mut cmd: tokio::process::Command,
        command: &str,
        config: &Path,
        id: &str,
        log: &Path,
        failpoints: Option<&str>,
    ) -> anyhow::Result<Proc> {
        let log = std::fs::File::create(log)?;
        cmd.args([command, "--metrics-addr", "off", "--config"])
            .arg(config)
            .env("KAFKA_BROKERS", self.brokers)
            .env("DATABASE_URL", self.database_url)
            .env("EFFECTIVELY_WORKER_ID", id)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        Ok(Proc {
            child: cmd
                .spawn()
                .with_context(|| format!("starting {}", self.bin.display()))?,
        })
    }
}

/// The worker-wide part of a worker config, before its `[[consumer]]`: a short session timeout
/// (6 s) and revoke deadline (3 s), so that a killed worker's partitions move on quickly.
pub(crate) fn worker_settings(pool_size: usize) -> String {
    format!(
        "[kafka]\nsession_timeout = \"6s\"\n[kafka.options]\n\"heartbeat.interval.ms\" = \"500\"\n\
         [database]\npool_size = {pool_size}\nidle_in_transaction_timeout = \"5s\"\n\
         [worker]\nrevoke_deadline = \"3s\"\n"
    )
}

/// The worker config of a scenario: `processors` only matters under `--strategy inbox`.
pub(super) fn worker_config(
    args: &ChaosArgs,
    topic: &str,
    pool_size: usize,
    processors: usize,
) -> String {
    consumer_config(
        topic,
        pool_size,
        processors,
        args.strategy,
        args.inbox_claim,
        args.group_partitions,
    )
}

/// A worker config with one cashback consumer named `topic` reading `topic`, of `strategy`
/// (`processors` and `claim` only matter for the inbox, `grouped` for the batch strategy).
pub(crate) fn consumer_config(
    topic: &str,
    pool_size: usize,
    processors: usize,
    strategy: StrategyArg,
    claim: ClaimArg,
    grouped: bool,
) -> String {
    let mut text = worker_settings(pool_size);
    // Explicit both ways: groups are the engine's default for the batch strategy, and the
    // plain batch scenarios keep the one-transaction-per-batch path under faults too.
    let group = match (strategy, grouped) {
        (StrategyArg::Batch, true) => ", group_partitions = true",
        (StrategyArg::Batch, false) => ", group_partitions = false",
        _ => "",
    };
    text.push_str(&format!(
        "[[consumer]]\nname = \"{topic}\"\ntopics = [\"{topic}\"]\nhandler = {{ kind = \"cashback\" }}\n\
         batch = {{ max_messages = 200{group} }}\nretry = {{ initial_backoff = \"50ms\", max_backoff = \"1s\" }}\n"
    ));
    if strategy == StrategyArg::Inbox {
        text.push_str(&format!(
            "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = {processors}\n"
        ));
        if claim == ClaimArg::Lease {
            // Short enough that a killed or stopped processor's rows come back within the
            // drain timeout; far longer than a round of the cashback handler.
            text.push_str("claim = \"lease\"\nlease = \"10s\"\n");
        }
    }
    text
}
