//! Faults as moments: each fault a harness injects leaves a [`Mark`] (when it was issued or
//! ended, and each partition's high watermark then), and [`recoveries`] turns the marks and
//! the commits [`CommitWatch`] saw into the seconds each fault took to recover from.

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use super::pause;
use super::watch::{self, now_s, Commit, CommitWatch};
use crate::produce::Sent;
use crate::session::LagWatcher;
use crate::{Produced, Session};

/// A moment recovery is measured from.
#[derive(Debug, Clone)]
pub(crate) struct Mark {
    pub label: String,
    /// Epoch seconds.
    pub from: f64,
    /// Each partition's high watermark just before (None: Kafka did not answer in time).
    pub hw: Option<Vec<i64>>,
    /// Commits begun before this (epoch seconds) do not count as recovered: the fault took
    /// effect only then (a SIGKILLed broker is gone, a primary stopped, once the script
    /// returns; a commit in between still went to the old one).
    pub valid_after: f64,
    /// After a failover, the new primary's port: only its commits count.
    pub server: Option<u16>,
    /// Counted in the recovery (else only said in the note).
    pub counted: bool,
}

impl Mark {
    /// A mark at this moment, each partition's high watermark taken first (within 5 s).
    pub(crate) async fn now(session: &Session, label: impl Into<String>, counted: bool) -> Mark {
        Mark::take(&session.watcher, label, counted).await
    }

    /// [`Mark::now`] with the high watermarks of the topic `watcher` watches.
    pub(crate) async fn take(
        watcher: &LagWatcher,
        label: impl Into<String>,
        counted: bool,
    ) -> Mark {
        let hw = tokio::time::timeout(Duration::from_secs(5), watcher.highs())
            .await
            .ok()
            .and_then(Result::ok);
        let from = now_s();
        Mark {
            label: label.into(),
            from,
            hw,
            valid_after: from,
            server: None,
            counted,
        }
    }

    /// Seconds until every partition with traffic acknowledged after the mark (in
    /// `produced`'s log) committed past where it ended at the mark ([`watch::recovery`]);
    /// Err: the partitions that never did.
    pub(crate) fn recovery(
        &self,
        commits: &[Commit],
        produced: &Produced,
    ) -> Result<f64, Vec<i32>> {
        let started = produced.started_at.timestamp_micros() as f64 / 1e6;
        let busy: BTreeSet<i32> = (produced.log.iter())
            .filter(|s| s.acked && started + s.acked_at_s >= self.from)
            .filter_map(|s| s.partition)
            .collect();
        let since = watch::Since {
            from: self.from,
            valid_after: self.valid_after,
            past: self.hw.as_deref(),
            server: self.server,
        };
        watch::recovery(commits, &busy, since)
    }
}

/// Waits until the workers run: every one of `partitions` has committed (up to 90 s), then a
/// little.
pub(crate) async fn settle(watch: &CommitWatch, partitions: i32) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        let done: HashSet<i32> = watch.commits().iter().map(|c| c.partition).collect();
        if done.len() as i32 >= partitions {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(90),
            "only {} of {partitions} partitions committed within 90 s of the workers' start",
            done.len(),
        );
        pause(200).await;
    }
    pause(2000).await;
    Ok(())
}

/// The recoveries of a run's marks.
#[derive(Debug, Default)]
pub(crate) struct Recoveries {
    /// The slowest counted recovery (None: one never recovered, or no mark was counted).
    pub slowest: Option<f64>,
    /// Each mark's, in words ("<label> 1.23 s", "<label> never").
    pub each: Vec<String>,
    /// Each mark's seconds (None: never), in the marks' order.
    pub seconds: Vec<Option<f64>>,
    /// What failed: a counted mark never recovered, or there was none to measure.
    pub failed: Vec<String>,
}

/// Each mark's recovery ([`Mark::recovery`]), the slowest of the counted ones, and what failed.
pub(crate) fn recoveries(marks: &[Mark], commits: &[Commit], produced: &Produced) -> Recoveries {
    let mut r = Recoveries {
        slowest: Some(0.0),
        ..Recoveries::default()
    };
    for m in marks {
        match m.recovery(commits, produced) {
            Ok(s) => {
                r.each.push(format!("{} {:.2} s", m.label, s));
                r.seconds.push(Some(round2(s)));
                if m.counted {
                    r.slowest = r.slowest.map(|x| x.max(s));
                }
            }
            Err(never) => {
                r.each.push(format!("{} never", m.label));
                r.seconds.push(None);
                if m.counted {
                    r.slowest = None;
                    r.failed.push(format!(
                        "partitions {never:?} never committed past their end at \"{}\"",
                        m.label
                    ));
                }
            }
        }
    }
    if !marks.iter().any(|m| m.counted) {
        r.slowest = None;
        r.failed.push("no fault to measure a recovery from".into());
    }
    r.slowest = r.slowest.map(round2);
    r
}

/// The longest time between two acknowledgements of one partition.
pub(crate) fn ack_gap(log: &[Sent]) -> f64 {
    let mut acks: std::collections::HashMap<i32, Vec<f64>> = Default::default();
    for s in log.iter().filter(|s| s.acked) {
        if let Some(p) = s.partition {
            acks.entry(p).or_default().push(s.acked_at_s);
        }
    }
    acks.values_mut()
        .flat_map(|t| {
            t.sort_by(f64::total_cmp);
            t.windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>()
        })
        .fold(0.0, f64::max)
}

/// Seconds to two decimals, for the reports.
pub(crate) fn round2(s: f64) -> f64 {
    (s * 100.0).round() / 100.0
}
