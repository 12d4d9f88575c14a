//! A fault's [`Mark`]: when it was issued and where each partition ended then, and the
//! recovery measured from it ([`Mark::recovery`]). Shared by `chaos-cluster` and `soak`.

use std::collections::BTreeSet;
use std::time::Duration;

use super::watch::{self, now_s, Commit};
use crate::session::LagWatcher;
use crate::Produced;

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
    /// Counted in `recover_s` (else only said in the note).
    pub counted: bool,
}

impl Mark {
    /// A mark at this moment, each partition's high watermark (of the topic `watcher` watches)
    /// taken first (within 5 s).
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

    /// Seconds until every partition that had traffic acknowledged after the mark committed
    /// past where it ended at the mark ([`watch::recovery`]); Err: the partitions that never did.
    pub(crate) fn recovery(
        &self,
        commits: &[Commit],
        produced: &Produced,
    ) -> Result<f64, Vec<i32>> {
        let started = produced.started_at.timestamp_micros() as f64 / 1e6;
        let busy: BTreeSet<i32> = produced
            .log
            .iter()
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
