//! The soak's processes: two workers of the engine in one consumer group, the outbox relay and
//! the notification sender (the same failpoints build, each its own process), and their one
//! config file. The workers' cashback handler writes, with every credit, a `CashbackCredited`
//! outbox row (the relay publishes it to a topic of the run's own), and on a second, slower
//! stream also an SMS intent on the run's own channel (the sender delivers it to the provider
//! stub): so all four do real work throughout ([`config`] says why two streams). A restarted worker keeps its worker id; every start is a new
//! incarnation, which the sampler and the trends tell apart.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::chaos::{consumer_config, worker_settings, ClaimArg, Proc, StrategyArg, Worker};
use crate::net::Link;

/// The processes sampled, in the report's order.
pub(super) const ROLES: [&str; 4] = ["worker-a", "worker-b", "relay", "sender"];

/// The engine's subcommand of each role.
fn command(role: usize) -> &'static str {
    match role {
        0 | 1 => "run",
        2 => "relay",
        _ => "send",
    }
}

/// A role's current process: its pid, and which start of it this is (unique over the run).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Running {
    pub pid: u32,
    pub incarnation: u32,
}

/// What the run's config names.
pub(super) struct Names<'a> {
    /// The payments topic, its consumer and group (the traffic at `--rate`).
    pub topic: &'a str,
    /// The notifying stream's topic and consumer (at `--notify-rate`).
    pub notify_topic: &'a str,
    /// Where the relay publishes `CashbackCredited`.
    pub credited_topic: &'a str,
    /// The notifications' channel (only this run's are sent).
    pub channel: &'a str,
    /// The provider stub's base URL.
    pub provider: &'a str,
}

/// The config of every process: the chaos workers' settings and two cashback consumers (the
/// second one's handler also notifies on the run's channel), a relay of `CashbackCredited` to
/// the run's topic, and a sender of the run's channel that can look keys up at the provider
/// (so a send interrupted by a PostgreSQL restart is reconciled, not repeated).
///
/// Why two consumers: the sender makes one provider call and one commit per notification, and
/// on two shared cores it delivers some hundreds a second at best, far from 2,000. A
/// notification for every credit would grow its backlog for the whole hour; a stream of its
/// own at a rate it can keep gives it steady work, and the main stream stays at the demo's.
///
/// Why the relay's batch is 5,000: its claim (`store/outbox.rs`, the head of each aggregate)
/// was planned here as a scan of the whole unpublished backlog with a sort of each row's
/// aggregate, whatever the batch: 140 s for one claim over 293,000 rows of 1,000 aggregates
/// (2026-12-07). A broker restart leaves such a backlog, and with 500-row batches the relay
/// never caught up again. Larger batches share each claim's cost among more rows.
pub(super) fn config(names: &Names<'_>, strategy: StrategyArg) -> String {
    let consumer = |topic| consumer_config(topic, 8, 4, strategy, ClaimArg::Lock, false);
    let settings = worker_settings(8);
    let notifying = consumer(names.notify_topic);
    let notifying = notifying
        .strip_prefix(&settings)
        .expect("a consumer's config starts with the worker's settings");
    let plain = "handler = { kind = \"cashback\" }";
    assert!(
        notifying.contains(plain),
        "the consumer's handler line moved"
    );
    let notify = format!(
        "handler = {{ kind = \"cashback\", notify = \"{}\" }}",
        names.channel
    );
    format!(
        "{}{}[relay]\ntopics = {{ CashbackCredited = \"{}\" }}\nbatch = 5000\npoll_interval = \"50ms\"\n\
         [sender]\nbatch = 100\npoll_interval = \"50ms\"\nrequest_timeout = \"5s\"\nsending_timeout = \"20s\"\n\
         [sender.retry]\nmax_attempts = 50\ninitial_backoff = \"100ms\"\nmax_backoff = \"2s\"\n\
         [sender.channels.{}]\nurl = \"{}/v1/messages\"\nlookup = true\n",
        consumer(names.topic),
        notifying.replacen(plain, &notify, 1),
        names.credited_topic,
        names.channel,
        names.provider
    )
}

/// The four processes of a soak.
pub(super) struct Fleet {
    bin: PathBuf,
    brokers: String,
    database_url: String,
    config: PathBuf,
    out: PathBuf,
    topic: String,
    procs: Vec<Option<Proc>>,
    /// Worker a's and b's own networks (the relay and the sender run on the host): the
    /// network fault cuts one of them.
    pub links: [Link; 2],
    starts: u32,
    /// Each role's current process, for the sampler.
    pub running: Arc<Mutex<Vec<Option<Running>>>>,
}

impl Fleet {
    /// Starts all four, of the engine's binary `worker.bin`, the workers in `links`.
    pub(super) fn start(
        worker: &Worker<'_>,
        links: [Link; 2],
        config: PathBuf,
        out: &Path,
        topic: &str,
    ) -> anyhow::Result<Fleet> {
        let mut fleet = Fleet {
            bin: worker.bin.to_path_buf(),
            brokers: worker.brokers.to_string(),
            database_url: worker.database_url.to_string(),
            config,
            out: out.to_path_buf(),
            topic: topic.to_string(),
            procs: (0..ROLES.len()).map(|_| None).collect(),
            links,
            starts: 0,
            running: Arc::new(Mutex::new(vec![None; ROLES.len()])),
        };
        for role in 0..ROLES.len() {
            fleet.launch(role)?;
        }
        Ok(fleet)
    }

    /// Starts `role` (its log appended to: a restart's lines follow the killed one's).
    fn launch(&mut self, role: usize) -> anyhow::Result<()> {
        let id = format!("{}-{}", self.topic, ROLES[role]);
        self.starts += 1;
        let log = self.out.join(format!("{id}.{}.log", self.starts));
        let worker = Worker {
            bin: &self.bin,
            brokers: &self.brokers,
            database_url: &self.database_url,
        };
        let program = match self.links.get(role) {
            Some(link) => link.command(&self.bin),
            None => worker.command(),
        };
        let proc = worker.spawn(program, command(role), &self.config, &id, &log, None)?;
        self.running.lock().unwrap()[role] = proc.pid().map(|pid| Running {
            pid,
            incarnation: self.starts,
        });
        self.procs[role] = Some(proc);
        Ok(())
    }

    /// SIGKILLs `role` and starts it again under the same id.
    pub(super) async fn kill_and_restart(&mut self, role: usize) -> anyhow::Result<()> {
        if let Some(p) = self.procs[role].take() {
            self.running.lock().unwrap()[role] = None;
            p.kill().await;
        }
        self.launch(role)
    }

    /// SIGTERMs every process, then removes the workers' networks; the ones that did not
    /// exit cleanly (a crash during the run shows here too: its exit status).
    pub(super) async fn stop(mut self) -> Vec<String> {
        let mut failed = Vec::new();
        for (role, p) in self.procs.iter_mut().enumerate() {
            if let Some(p) = p.take() {
                if let Err(e) = p.stop().await {
                    failed.push(format!("{} did not stop cleanly: {e:#}", ROLES[role]));
                }
            }
        }
        for link in self.links {
            link.destroy().await;
        }
        failed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_notifies_relays_and_sends_the_runs_own() {
        let names = Names {
            topic: "soak-1",
            notify_topic: "soak-1-n",
            credited_topic: "soak-1-credited",
            channel: "soak-1-sms",
            provider: "http://127.0.0.1:9",
        };
        let text = config(&names, StrategyArg::Batch);
        assert_eq!(text.matches("[[consumer]]").count(), 2);
        assert_eq!(text.matches("[worker]").count(), 1);
        assert_eq!(text.matches("notify = ").count(), 1);
        assert!(text.contains(
            "topics = [\"soak-1-n\"]\nhandler = { kind = \"cashback\", notify = \"soak-1-sms\" }"
        ));
        assert!(text.contains("CashbackCredited = \"soak-1-credited\""));
        assert!(text.contains("[sender.channels.soak-1-sms]"));
        assert!(text.contains("url = \"http://127.0.0.1:9/v1/messages\""));
    }
}
