//! The Flink peer's JVM (peers/flink-xa on Flink's local MiniCluster) as the phase runs it:
//! started on a topic and a table, watched, stopped, SIGKILLed, and restarted from the newest
//! checkpoint it retained.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tokio::io::{AsyncBufReadExt, BufReader};

use super::super::peer::Jdbc;
use super::super::procfs;

/// The JVM options: a heap like Connect's worker's, and the module openings Flink's own
/// distribution passes to Java 17 (`env.java.opts.all` of its config.yaml) so its Kryo and
/// closure cleaner may reach into the JDK's classes.
const JVM: &[&str] = &[
    "-Xms256M",
    "-Xmx2G",
    "-XX:+UseG1GC",
    "-Djava.awt.headless=true",
    "--add-exports=java.base/sun.net.util=ALL-UNNAMED",
    "--add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED",
    "--add-exports=java.security.jgss/sun.security.krb5=ALL-UNNAMED",
    "--add-opens=java.base/java.lang=ALL-UNNAMED",
    "--add-opens=java.base/java.net=ALL-UNNAMED",
    "--add-opens=java.base/java.io=ALL-UNNAMED",
    "--add-opens=java.base/java.nio=ALL-UNNAMED",
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens=java.base/java.lang.reflect=ALL-UNNAMED",
    "--add-opens=java.base/java.text=ALL-UNNAMED",
    "--add-opens=java.base/java.time=ALL-UNNAMED",
    "--add-opens=java.base/java.util=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED",
    "--add-opens=java.base/java.util.concurrent.locks=ALL-UNNAMED",
];

/// The peer's main class (peers/flink-xa).
const MAIN: &str = "dev.effectively.peer.FlinkXaPeer";

/// How long a JVM may take from its start until its job runs (a loaded two-core machine takes
/// tens of seconds).
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// One start of the peer.
pub(super) struct Launch<'a> {
    pub(super) lib: &'a Path,
    pub(super) brokers: &'a str,
    pub(super) topic: &'a str,
    /// The Kafka consumer group its source commits offsets to, at each completed checkpoint.
    pub(super) group: &'a str,
    pub(super) jdbc: &'a Jdbc,
    pub(super) table: &'a str,
    pub(super) checkpoint_interval: Duration,
    /// Where checkpoints go (`<dir>/<job id>/chk-<n>`), absolute.
    pub(super) checkpoints: &'a Path,
    /// A retained checkpoint to restore from.
    pub(super) restore: Option<&'a Path>,
    pub(super) parallelism: i32,
    /// Its standard error (Flink's log) goes here.
    pub(super) log: &'a Path,
}

/// A running peer whose job has reached RUNNING.
pub(super) struct Job {
    child: tokio::process::Child,
    pub(super) pid: u32,
    /// Flink's job id: its checkpoints are under `<checkpoints>/<id>/`.
    pub(super) id: String,
    /// From the JVM's start until the job ran.
    pub(super) startup_s: f64,
    log: PathBuf,
}

impl Job {
    /// Starts the JVM and waits until it prints `RUNNING <job id>`.
    pub(super) async fn start(l: &Launch<'_>) -> anyhow::Result<Job> {
        let started = Instant::now();
        let interval_ms = l.checkpoint_interval.as_millis().to_string();
        let mut cmd = tokio::process::Command::new("java");
        cmd.args(JVM)
            .arg("-cp")
            .arg(format!("{}/*", l.lib.display()))
            .arg(MAIN)
            .arg(format!("brokers={}", l.brokers))
            .arg(format!("topic={}", l.topic))
            .arg(format!("group={}", l.group))
            .arg(format!("jdbc-url={}", l.jdbc.url))
            .arg(format!("user={}", l.jdbc.user))
            .arg(format!("table={}", l.table))
            .arg(format!("checkpoint-interval-ms={interval_ms}"))
            .arg(format!("checkpoint-dir={}", l.checkpoints.display()))
            .arg(format!("parallelism={}", l.parallelism));
        if let Some(from) = l.restore {
            cmd.arg(format!("restore-from={}", from.display()));
        }
        // The password by the environment, not the command line that `ps` shows.
        let mut child = cmd
            .env("PEER_JDBC_PASSWORD", &l.jdbc.password)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(std::fs::File::create(l.log)?))
            .kill_on_drop(true)
            .spawn()
            .context("starting java (the Flink peer)")?;
        let pid = child.id().context("the Flink peer exited at once")?;
        let stdout = child.stdout.take().context("the Flink peer's stdout")?;
        let mut lines = BufReader::new(stdout).lines();
        let log = l.log.to_path_buf();
        let running = async {
            while let Some(line) = lines.next_line().await? {
                if let Some(id) = line.strip_prefix("RUNNING ") {
                    return anyhow::Ok(Some(id.trim().to_string()));
                }
            }
            Ok(None)
        };
        let id = match tokio::time::timeout(START_TIMEOUT, running).await {
            Ok(Ok(Some(id))) => id,
            Ok(Ok(None)) => {
                let status = child.wait().await?;
                bail!(
                    "the Flink peer exited ({status}) before its job ran (see {})",
                    log.display()
                );
            }
            Ok(Err(e)) => return Err(e).context("reading the Flink peer's stdout"),
            Err(_) => bail!(
                "the Flink peer's job did not run within {START_TIMEOUT:?} (see {})",
                log.display()
            ),
        };
        // Nothing more comes on stdout; keep the pipe drained so the JVM never blocks on it.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(Job {
            child,
            pid,
            id,
            startup_s: started.elapsed().as_secs_f64(),
            log,
        })
    }

    /// (peak RSS in MB, CPU seconds) so far.
    pub(super) fn usage(&self) -> (f64, f64) {
        procfs::usage(self.pid)
    }

    /// An error if the JVM has exited (it runs until it is stopped).
    pub(super) fn alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "the Flink peer exited: {status} (see {})",
                self.log.display()
            );
        }
        Ok(())
    }

    /// SIGTERM, up to 60 s to exit, then SIGKILL.
    pub(super) async fn stop(mut self) -> anyhow::Result<()> {
        signal(self.pid, "-TERM");
        if tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("   the Flink peer did not stop within 60 s of SIGTERM: killed");
            self.child.kill().await?;
        }
        Ok(())
    }

    /// SIGKILL, as a machine's or a container's sudden end would: no shutdown hook runs, and
    /// whatever its sinks had prepared stays prepared in PostgreSQL.
    pub(super) async fn kill(mut self) -> anyhow::Result<()> {
        signal(self.pid, "-KILL");
        self.child.wait().await?;
        Ok(())
    }
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

/// The newest checkpoint a job completed under `dir/<job>/`: the `chk-<n>` of the largest `n`
/// with its `_metadata` (written last, when the checkpoint completes), and `n`.
pub(super) fn latest_checkpoint(dir: &Path, job: &str) -> Option<(PathBuf, u64)> {
    std::fs::read_dir(dir.join(job))
        .ok()?
        .filter_map(|e| {
            let path = e.ok()?.path();
            let n = path
                .file_name()?
                .to_str()?
                .strip_prefix("chk-")?
                .parse()
                .ok()?;
            path.join("_metadata").is_file().then_some((path, n))
        })
        .max_by_key(|(_, n)| *n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_newest_complete_checkpoint_is_chosen() {
        let dir = std::env::temp_dir().join(format!("flink-chk-{}", fastrand::u64(..)));
        for (n, done) in [(3, true), (12, true), (13, false)] {
            let chk = dir.join("job").join(format!("chk-{n}"));
            std::fs::create_dir_all(&chk).unwrap();
            if done {
                std::fs::write(chk.join("_metadata"), b"x").unwrap();
            }
        }
        std::fs::create_dir_all(dir.join("job/shared")).unwrap();
        let (path, n) = latest_checkpoint(&dir, "job").unwrap();
        assert_eq!(n, 12, "chk-13 has no _metadata: not complete");
        assert!(path.ends_with("chk-12"));
        assert!(latest_checkpoint(&dir, "other").is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
