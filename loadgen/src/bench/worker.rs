//! An engine worker process and the engine's one-shot subcommands, as the phases start them.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;

use super::BenchArgs;
use crate::produce::{Mix, Step};
use crate::Spec;

/// A worker process of the engine, for one consumer on one topic.
pub(super) struct Worker {
    pub(super) child: tokio::process::Child,
}

/// How [`Worker::launch`] starts a worker beyond its consumer and strategy.
pub(super) struct Launch<'a> {
    /// `worker.id`: two workers of one consumer need two.
    pub(super) id: &'a str,
    /// Appended to the consumer's section.
    pub(super) extra: &'a str,
    /// The config and log files are named after this.
    pub(super) file: &'a str,
    /// `EFFECTIVELY_POOL_SIZE`, if given (else the engine's default).
    pub(super) pool_size: Option<usize>,
    /// `--metrics-addr`, if given (else the engine's default, 127.0.0.1:9464, which two
    /// workers cannot share).
    pub(super) metrics_addr: Option<String>,
}

impl Worker {
    pub(super) async fn start(
        bin: &Path,
        args: &BenchArgs,
        name: &str,
        strategy: &str,
    ) -> anyhow::Result<Worker> {
        Worker::start_with(bin, args, name, strategy, "", name).await
    }

    /// With `extra` appended to the consumer's section, and the config and log files named
    /// after `file`.
    pub(super) async fn start_with(
        bin: &Path,
        args: &BenchArgs,
        name: &str,
        strategy: &str,
        extra: &str,
        file: &str,
    ) -> anyhow::Result<Worker> {
        Worker::start_on(bin, args, name, name, strategy, extra, file).await
    }

    /// Consumer `consumer` on `topic`, with `extra` appended to the consumer's section; the
    /// worker's id and its config and log files named after `file`.
    pub(super) async fn start_on(
        bin: &Path,
        args: &BenchArgs,
        consumer: &str,
        topic: &str,
        strategy: &str,
        extra: &str,
        file: &str,
    ) -> anyhow::Result<Worker> {
        let toml = format!(
            "[worker]\nid = \"{file}\"\n[[consumer]]\nname = \"{consumer}\"\n\
             topics = [\"{topic}\"]\nstrategy = \"{strategy}\"\n\
             handler = {{ kind = \"cashback\" }}\n{extra}"
        );
        Worker::start_config(bin, args, &toml, file).await
    }

    /// With the whole config file `toml`, written to `{file}.toml`; logs to `{file}.log`.
    pub(super) async fn start_config(
        bin: &Path,
        args: &BenchArgs,
        toml: &str,
        file: &str,
    ) -> anyhow::Result<Worker> {
        // A port of its own for each worker's /metrics: the engine's default (9464) is taken by
        // the first worker of a phase that runs several.
        let launch = Launch {
            id: "",
            extra: "",
            file,
            pool_size: None,
            metrics_addr: Some("127.0.0.1:0".to_string()),
        };
        Worker::spawn(bin, args, toml, &launch).await
    }

    /// Consumer `name` on topic `name`, as `l` says.
    pub(super) async fn launch(
        bin: &Path,
        args: &BenchArgs,
        name: &str,
        strategy: &str,
        l: &Launch<'_>,
    ) -> anyhow::Result<Worker> {
        let (id, extra) = (l.id, l.extra);
        let toml = format!(
            "[worker]\nid = \"{id}\"\n[[consumer]]\nname = \"{name}\"\ntopics = [\"{name}\"]\n\
             strategy = \"{strategy}\"\nhandler = {{ kind = \"cashback\" }}\n{extra}"
        );
        Worker::spawn(bin, args, &toml, l).await
    }

    /// The config `toml` written to `{l.file}.toml`, the worker started on it (its `id` and
    /// `extra` are in `toml` already), its log in `{l.file}.log`.
    async fn spawn(
        bin: &Path,
        args: &BenchArgs,
        toml: &str,
        l: &Launch<'_>,
    ) -> anyhow::Result<Worker> {
        let file = l.file;
        let config = args.out.join(format!("{file}.toml"));
        std::fs::write(&config, toml)?;
        let log = std::fs::File::create(args.out.join(format!("{file}.log")))?;
        let mut cmd = tokio::process::Command::new(bin);
        cmd.args(["run", "--config"]).arg(&config);
        if let Some(addr) = &l.metrics_addr {
            cmd.args(["--metrics-addr", addr]);
        }
        if let Some(n) = l.pool_size {
            cmd.env("EFFECTIVELY_POOL_SIZE", n.to_string());
        }
        let child = cmd
            .env("KAFKA_BROKERS", &args.services.brokers)
            .env("DATABASE_URL", &args.services.database_url)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Worker { child })
    }

    /// (peak RSS in MB, CPU seconds) so far, from /proc.
    pub(super) fn usage(&self) -> (f64, f64) {
        self.child.id().map_or((0.0, 0.0), super::procfs::usage)
    }

    /// Why the process is gone, if it exited (it should not before it is stopped).
    pub(super) fn exited(&mut self, log: &str) -> Option<String> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(status)) if status.success() => Some(format!(
                "the worker exited on its own, with status 0, before it was stopped (see {log}); \
                 `effectively run` stops when any of its tasks ends"
            )),
            Ok(Some(status)) => Some(format!("the worker exited: {status} (see {log})")),
            Err(e) => Some(format!("the worker's status is unknown: {e}")),
        }
    }

    pub(super) async fn stop(mut self) -> anyhow::Result<()> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await??;
        anyhow::ensure!(
            status.success(),
            "the worker did not exit cleanly: {status:?}"
        );
        Ok(())
    }
}

/// Waits until `consumer` has stored its topic's end (its lag is 0), failing if `receiver`
/// exits (its log is `{file}.log`) or `timeout` passes.
pub(super) async fn until_stored(
    session: &crate::Session,
    consumer: &str,
    receiver: &mut Worker,
    file: &str,
    timeout: Duration,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    while !matches!(session.watcher.lag(&session.db, consumer).await, Ok(0)) {
        if let Some(why) = receiver.exited(&format!("{file}.log")) {
            anyhow::bail!(
                "the receiver-only worker (processors = 0) did not drain the topic: {why}"
            );
        }
        anyhow::ensure!(
            started.elapsed() < timeout,
            "the inbox receiver did not drain the topic within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Waits until no inbox row of `consumer` is open, polling every `poll`, failing if one of
/// `workers` (with its file name) exits or `timeout` passes.
pub(super) async fn until_applied(
    db: &tokio_postgres::Client,
    consumer: &str,
    workers: &mut [(Worker, String)],
    timeout: Duration,
    poll: Duration,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    while crate::verify::inbox_any_open(db, consumer).await? {
        for (worker, file) in workers.iter_mut() {
            if let Some(why) = worker.exited(&format!("{file}.log")) {
                anyhow::bail!("the inbox processors did not empty the inbox: {why}");
            }
        }
        anyhow::ensure!(
            started.elapsed() < timeout,
            "the inbox processors did not empty the inbox within {timeout:?}"
        );
        tokio::time::sleep(poll).await;
    }
    Ok(())
}

/// The partitions of every phase's topic but the many-partitions one.
pub(super) const PARTITIONS: i32 = 6;

pub(super) fn spec(
    args: &BenchArgs,
    name: &str,
    partitions: i32,
    plan: Vec<Step>,
    limit: Option<u64>,
    mix: Mix,
) -> Spec {
    Spec {
        brokers: args.services.brokers.clone(),
        database_url: args.services.database_url.clone(),
        topic: name.to_string(),
        partitions,
        consumer: name.to_string(),
        plan,
        limit,
        mix,
        users: 1000,
        rate_bp: 200,
        drain_timeout: Duration::from_secs(900),
        report_dir: args.out.join(name),
        seed: None,
        quiet: true,
        compression: Default::default(),
    }
}

pub(super) fn resends_only() -> Mix {
    Mix {
        resend: 0.10,
        redrive: 0.0,
        redrive_delay: Duration::ZERO,
        double_tap: 0.0,
        poison: 0.0,
    }
}

/// Runs an `effectively` subcommand that prints one JSON object.
pub(super) async fn engine_json(
    bin: &Path,
    args: &BenchArgs,
    cmd: &[&str],
) -> anyhow::Result<serde_json::Value> {
    let out = tokio::process::Command::new(bin)
        .args(cmd)
        .env("DATABASE_URL", &args.services.database_url)
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("running {}", bin.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} {cmd:?} failed: {:?}",
        bin.display(),
        out.status
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}
