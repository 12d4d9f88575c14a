//! The cluster under test, through `scripts/cluster.sh`: three Kafka brokers (nodes 1 to 3)
//! and a PostgreSQL primary with a standby (nodes 1 and 2). Every fault is one of its
//! subcommands; loadgen never signals a service's process itself.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;

/// The script, relative to the repository's root (where `make` runs loadgen).
const SCRIPT: &str = "scripts/cluster.sh";

/// How long one subcommand may take (a standby rebuilt from a base backup is the longest).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(300);

/// `scripts/cluster.sh` for the `STACK_DIR` this process inherited, checked to be the
/// cluster this run's `KAFKA_BROKERS` and `DATABASE_URL` name.
pub(crate) struct Cluster {
    script: PathBuf,
    env: HashMap<String, String>,
}

/// `KEY=VALUE` lines (optionally `export `ed, the value optionally quoted) of an env file.
pub(crate) fn parse_env(text: &str) -> HashMap<String, String> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("export ").unwrap_or(l);
            let (k, v) = l.split_once('=')?;
            let v = v.trim();
            let unquoted = [('\'', '\''), ('"', '"')]
                .iter()
                .find_map(|(a, b)| v.strip_prefix(*a).and_then(|v| v.strip_suffix(*b)))
                .unwrap_or(v);
            (!k.is_empty() && !k.starts_with('#') && !k.contains(' '))
                .then(|| (k.to_string(), unquoted.to_string()))
        })
        .collect()
}

impl Cluster {
    /// Refuses (before any fault) unless `scripts/cluster.sh env` describes a cluster stack
    /// (`STACK_TOPOLOGY=cluster`) whose brokers and database are the ones this run uses: a
    /// run must never crash the default single-node stack, nor another cluster.
    pub(crate) async fn check(brokers: &str, database_url: &str) -> anyhow::Result<Cluster> {
        let script = PathBuf::from(SCRIPT);
        anyhow::ensure!(
            script.exists(),
            "{SCRIPT} not found: run loadgen chaos-cluster from the repository's root"
        );
        if let Ok(t) = std::env::var("STACK_TOPOLOGY") {
            anyhow::ensure!(
                t == "cluster",
                "STACK_TOPOLOGY={t} in this environment: chaos-cluster crashes brokers and \
                 PostgreSQL servers, and runs only against the cluster stack (source \
                 $STACK_DIR/env of `scripts/cluster.sh up`)"
            );
        }
        let out = tokio::process::Command::new(&script)
            .arg("env")
            .stderr(Stdio::null())
            .output()
            .await?;
        let env = parse_env(&String::from_utf8_lossy(&out.stdout));
        let get = |k: &str| env.get(k).map(String::as_str);
        let dir = std::env::var("STACK_DIR").unwrap_or_else(|_| "(unset)".into());
        anyhow::ensure!(
            out.status.success()
                && get("STACK_TOPOLOGY") == Some("cluster")
                && get("KAFKA_BROKERS") == Some(brokers)
                && get("DATABASE_URL") == Some(database_url),
            "{SCRIPT} env (STACK_DIR={dir}) does not describe the cluster this run uses \
             (KAFKA_BROKERS={brokers}): it must say STACK_TOPOLOGY=cluster and name the same \
             KAFKA_BROKERS and DATABASE_URL. Start it with `{SCRIPT} up` and source its env file"
        );
        anyhow::ensure!(
            brokers.split(',').count() == 3,
            "KAFKA_BROKERS={brokers}: the cluster has three brokers"
        );
        Ok(Cluster { script, env })
    }

    /// Runs a subcommand; its stdout, trimmed. A failure carries the end of its stderr.
    pub(crate) async fn run(&self, args: &[&str]) -> anyhow::Result<String> {
        let started = Instant::now();
        let out = tokio::time::timeout(
            COMMAND_TIMEOUT,
            tokio::process::Command::new(&self.script)
                .args(args)
                .stdin(Stdio::null())
                .output(),
        )
        .await
        .with_context(|| format!("{SCRIPT} {} took over {COMMAND_TIMEOUT:?}", args.join(" ")))??;
        let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
        eprintln!(
            "   {SCRIPT} {} ({:.1} s){}",
            args.join(" "),
            started.elapsed().as_secs_f64(),
            if stdout.is_empty() || stdout.contains('\n') {
                String::new()
            } else {
                format!(": {stdout}")
            }
        );
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            anyhow::bail!(
                "{SCRIPT} {} failed ({}): {}",
                args.join(" "),
                out.status,
                tail.join(" / ")
            );
        }
        Ok(stdout)
    }

    /// A subcommand whose last line of output is a number (a node, seconds).
    async fn number(&self, args: &[&str]) -> anyhow::Result<f64> {
        let out = self.run(args).await?;
        last_number(&out)
            .with_context(|| format!("{SCRIPT} {} printed no number: {out:?}", args.join(" ")))
    }

    /// `kafka-signal N SIG` (TERM, KILL, STOP, CONT).
    pub(crate) async fn kafka_signal(&self, node: u32, sig: &str) -> anyhow::Result<()> {
        self.run(&["kafka-signal", &node.to_string(), sig])
            .await
            .map(drop)
    }

    pub(crate) async fn kafka_start(&self, node: u32) -> anyhow::Result<()> {
        self.run(&["kafka-start", &node.to_string()])
            .await
            .map(drop)
    }

    /// The broker that leads `topic`'s `partition`.
    pub(crate) async fn kafka_leader(&self, topic: &str, partition: i32) -> anyhow::Result<u32> {
        let out = self
            .run(&["kafka-leader", topic, &partition.to_string()])
            .await?;
        match out.lines().last().map(str::trim) {
            Some(n @ ("1" | "2" | "3")) => Ok(n.parse()?),
            _ => anyhow::bail!("partition {partition} of {topic} has no leader: {out:?}"),
        }
    }

    /// Waits until every partition (of `topic`, or of every topic) has all three replicas in
    /// sync.
    pub(crate) async fn kafka_wait_isr(&self, topic: Option<&str>) -> anyhow::Result<()> {
        let mut args = vec!["kafka-wait-isr"];
        args.extend(topic);
        self.run(&args).await.map(drop)
    }

    /// The PostgreSQL node (1 or 2) that is the primary now.
    pub(crate) async fn pg_primary(&self) -> anyhow::Result<u32> {
        Ok(self.number(&["pg-primary"]).await? as u32)
    }

    pub(crate) async fn pg_standby(&self) -> anyhow::Result<u32> {
        Ok(self.number(&["pg-standby"]).await? as u32)
    }

    /// A failover subcommand (`pg-switchover`, `pg-crash-failover`, `pg-fence-failover`):
    /// the promotion's seconds, as the script measured them.
    pub(crate) async fn pg_failover(&self, cmd: &str) -> anyhow::Result<f64> {
        self.number(&[cmd]).await
    }

    /// The URL of PostgreSQL node `node` alone (not the multi-host one).
    pub(crate) fn pg_node_url(&self, node: u32) -> anyhow::Result<&str> {
        self.env
            .get(&format!("PG_NODE{node}_URL"))
            .map(String::as_str)
            .with_context(|| format!("no PG_NODE{node}_URL in the cluster's env"))
    }

    /// The port PostgreSQL node `node` listens on.
    pub(crate) fn pg_node_port(&self, node: u32) -> anyhow::Result<u16> {
        let config: tokio_postgres::Config = self.pg_node_url(node)?.parse()?;
        config
            .get_ports()
            .first()
            .copied()
            .with_context(|| format!("no port in PG_NODE{node}_URL"))
    }

    /// How long a broker that stopped answering stays in the cluster's metadata: its
    /// `broker.session.timeout.ms`, from node 1's `server.properties` under the cluster's
    /// `STACK_DIR`, else Kafka's default (9 s).
    pub(crate) fn broker_session_timeout(&self) -> Duration {
        let file = self
            .env
            .get("STACK_DIR")
            .map(|d| PathBuf::from(d).join("kafka/node1/server.properties"));
        let ms = file
            .and_then(|f| std::fs::read_to_string(f).ok())
            .and_then(|text| {
                text.lines().find_map(|l| {
                    l.trim()
                        .strip_prefix("broker.session.timeout.ms=")
                        .and_then(|v| v.trim().parse().ok())
                })
            })
            .unwrap_or(9000);
        Duration::from_millis(ms)
    }
}

/// The last number in `text`'s last line: `2`, `1.84`, `promoted in 1.84 s`.
fn last_number(text: &str) -> Option<f64> {
    let line = text.lines().last()?;
    line.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .rfind(|w| !w.is_empty() && *w != ".")?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_env_file_is_read_with_or_without_export_and_quotes() {
        let env = parse_env(
            "# the cluster, KEY=VALUE lines\nexport KAFKA_BROKERS=127.0.0.1:1,127.0.0.1:2\n\
             DATABASE_URL='postgres://p@h:1,h:2/e?target_session_attrs=read-write'\n\
             export STACK_TOPOLOGY=\"cluster\"\n",
        );
        assert_eq!(env["KAFKA_BROKERS"], "127.0.0.1:1,127.0.0.1:2");
        assert_eq!(
            env["DATABASE_URL"],
            "postgres://p@h:1,h:2/e?target_session_attrs=read-write"
        );
        assert_eq!(env["STACK_TOPOLOGY"], "cluster");
        assert_eq!(env.len(), 3, "{env:?}");
    }

    #[test]
    fn the_number_is_the_last_one_printed() {
        assert_eq!(last_number("2"), Some(2.0));
        assert_eq!(last_number("stopping\npromoted in 1.84 s"), Some(1.84));
        assert_eq!(last_number("1.5s"), Some(1.5));
        assert_eq!(last_number("nothing"), None);
        assert_eq!(last_number(""), None);
    }
}
