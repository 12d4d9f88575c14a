//! One scenario of a fault harness, from its traffic to its verdict, for the harnesses that run
//! two workers through faults and measure recovery (`chaos-cluster`, `chaos-net`, the soak):
//! [`Run::open`] creates the topic, the workers' config and the traffic (`make chaos`'s mix),
//! and starts the watchers; [`Run::during`] produces while the harness's faults run;
//! [`Run::judge`] drains, verifies the ledger and turns the faults' marks into recoveries and
//! stalls. What is particular to a harness (its faults, its extra checks and fields) stays in
//! it.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::marks::{self, ack_gap, round2, Mark};
use super::watch::{self, AheadSampler, CommitWatch};
use super::HarnessArgs;
use crate::chaos::{Db, Proc};
use crate::produce::{Mix, Progress, Step};
use crate::report::Report;
use crate::{finish_stage, produce_stage_with, Produced, Session, Spec};

/// A commit stall this long outside the faults' own windows fails any scenario.
pub(crate) const STALL_LIMIT_S: f64 = 60.0;

/// The ledger's counts, as every harness's report lists them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Counts {
    pub sent: u64,
    pub acked: u64,
    pub effects: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    pub parked: u64,
    /// Samples where Kafka's committed offset was ahead of PostgreSQL's (after a lossy
    /// failover: before it).
    pub kafka_ahead: u64,
}

impl Counts {
    /// The counts of a run: what it produced, what the verifier found, the Kafka-ahead samples.
    pub(crate) fn of(produced: &Produced, report: &Report, kafka_ahead: u64) -> Counts {
        Counts {
            sent: produced.log.len() as u64,
            acked: produced.acked(),
            effects: report.effects,
            lost: report.lost,
            duplicated: report.duplicated,
            unexpected: report.unexpected,
            parked: report.parked,
            kafka_ahead,
        }
    }
}

/// "parked = N dead letters + M FAILED inbox rows": under the inbox, what the parked count of
/// consumer `topic` is made of.
pub(crate) async fn inbox_parked(url: &str, topic: &str, parked: u64) -> anyhow::Result<String> {
    let failed = Db::connect(url).await?.failed(topic).await?;
    Ok(format!(
        "parked = {} dead letters + {failed} FAILED inbox rows",
        parked.saturating_sub(failed)
    ))
}

impl std::fmt::Display for Counts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sent {} acked {} effects {} lost {} duplicated {} unexpected {} parked {} kafka-ahead {}",
            self.sent,
            self.acked,
            self.effects,
            self.lost,
            self.duplicated,
            self.unexpected,
            self.parked,
            self.kafka_ahead
        )
    }
}

/// A scenario under way: its topic, traffic, session and watchers.
pub(crate) struct Run {
    pub topic: String,
    pub partitions: i32,
    pub config: PathBuf,
    pub spec: Spec,
    pub session: Session,
    pub watch: CommitWatch,
    pub ahead: AheadSampler,
    progress: Arc<Progress>,
}

/// What [`Run::judge`] found beyond the counts.
#[derive(Debug, Default)]
pub(crate) struct Judged {
    pub counts: Counts,
    /// The slowest counted recovery (None: one never recovered, or none was counted).
    pub recover_s: Option<f64>,
    /// Each mark's recovery, in the marks' order (None: never).
    pub recoveries: Vec<Option<f64>>,
    pub stall_s: f64,
    /// `stall_s` less what of it fell inside the faults' own windows: the engine's part.
    pub engine_stall_s: f64,
    /// The longest time any partition went without an acknowledged record.
    pub ack_gap_s: f64,
    /// Kafka-ahead samples after [`AheadSampler::lossy`].
    pub ahead_after_loss: u64,
    /// What failed, and what was noticed.
    pub failed: Vec<String>,
    pub notes: Vec<String>,
}

impl Judged {
    /// The notes, led by what failed if anything did.
    pub(crate) fn note(&self) -> String {
        let note = self.notes.join("; ");
        if self.failed.is_empty() {
            note
        } else {
            format!("FAILED: {}; {note}", self.failed.join("; "))
        }
    }
}

/// What [`Run::judge`] measures against.
pub(crate) struct Targets<'a> {
    pub marks: &'a [Mark],
    /// Spans (epoch seconds) in which commits cannot be expected by design.
    pub outages: &'a [(f64, f64)],
    /// The slowest recovery allowed, if any.
    pub recover_s: Option<f64>,
}

impl Run {
    /// Creates `topic` (`partitions`, `replicas`) and writes `config` (the workers' config)
    /// beside the reports; the traffic is `make chaos`'s mix at `rate` over `users`, until
    /// the faults are done ([`Run::during`]), at most 15 minutes.
    pub(crate) async fn open(
        args: &HarnessArgs,
        topic: String,
        (partitions, replicas): (i32, i32),
        config: &str,
        rate: f64,
        users: u64,
        seed: u64,
    ) -> anyhow::Result<Run> {
        let (brokers, url) = (&args.services.brokers, &args.services.database_url);
        crate::create_topic(brokers, &topic, partitions, replicas).await?;
        let config_path = args.out.join(format!("{topic}.toml"));
        std::fs::write(&config_path, config)?;
        let spec = Spec {
            brokers: brokers.clone(),
            database_url: url.clone(),
            topic: topic.clone(),
            partitions,
            consumer: topic.clone(),
            plan: vec![Step {
                rate: Some(rate),
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
            users,
            rate_bp: 200,
            drain_timeout: Duration::from_secs(180),
            report_dir: args.out.join(&topic),
            seed: Some(seed),
            quiet: true,
            compression: Default::default(),
        };
        let session = Session::open(&spec).await?;
        let watch = CommitWatch::start(url, &topic);
        let ahead = AheadSampler::start(brokers, url, &topic, partitions)?;
        Ok(Run {
            topic,
            partitions,
            config: config_path,
            spec,
            session,
            watch,
            ahead,
            progress: Arc::new(Progress::default()),
        })
    }

    /// Produces while `faults` runs, then stops the traffic (what is in flight and the
    /// redrives still due still go out).
    pub(crate) async fn during<F>(
        &self,
        faults: impl Future<Output = anyhow::Result<F>>,
    ) -> (anyhow::Result<Produced>, anyhow::Result<F>) {
        tokio::join!(
            produce_stage_with(&self.session, &self.spec, Arc::clone(&self.progress)),
            async {
                let f = faults.await;
                self.progress.stop.store(true, Relaxed);
                f
            }
        )
    }

    /// After a harness error: the workers killed, the watchers stopped.
    pub(crate) async fn abandon(self, workers: Vec<Proc>) {
        for w in workers {
            w.kill().await;
        }
        self.watch.finish().await;
        self.ahead.finish().await;
    }

    /// Drains and verifies the ledger (on a fresh session: a failover or a crash may have
    /// taken the first one's connection), stops the workers, and measures each mark's
    /// recovery and the longest stall.
    pub(crate) async fn judge(
        self,
        produced: &Produced,
        workers: Vec<Proc>,
        inbox: bool,
        targets: Targets<'_>,
    ) -> anyhow::Result<Judged> {
        let session = Session::open(&self.spec).await?;
        let report = finish_stage(&session, &self.spec, produced).await?;
        let commits = self.watch.finish().await;
        let (kafka_ahead, ahead_after_loss) = self.ahead.finish().await;
        let mut j = Judged {
            counts: Counts::of(produced, &report, kafka_ahead),
            ahead_after_loss,
            ack_gap_s: round2(ack_gap(&produced.log)),
            ..Judged::default()
        };
        for w in workers {
            if let Err(e) = w.stop().await {
                j.failed
                    .push(format!("a worker did not stop cleanly: {e:#}"));
            }
        }
        if !report.verified {
            j.failed.push("the ledger did not verify".into());
        }
        if kafka_ahead > 0 {
            j.failed.push(format!(
                "Kafka's committed offset ahead of PostgreSQL's in {kafka_ahead} samples"
            ));
        }
        let rec = marks::recoveries(targets.marks, &commits, produced);
        j.failed.extend(rec.failed);
        j.notes.push(format!("recovery: {}", rec.each.join("; ")));
        if let (Some(r), Some(t)) = (rec.slowest, targets.recover_s) {
            if r > t {
                j.failed
                    .push(format!("recovery {r:.2} s over the target {t} s"));
            }
        }
        j.recover_s = rec.slowest;
        j.recoveries = rec.seconds;
        let (stall, engine_stall) = watch::longest_stall(&commits, targets.outages);
        if engine_stall >= STALL_LIMIT_S {
            j.failed.push(format!(
                "a commit stall of {engine_stall:.1} s outside the faults"
            ));
        }
        (j.stall_s, j.engine_stall_s) = (round2(stall), round2(engine_stall));
        if inbox {
            let url = &self.spec.database_url;
            j.notes
                .push(inbox_parked(url, &self.topic, report.parked).await?);
        }
        Ok(j)
    }
}
