//! Inbox processors under `[consumer.version]`: a round's claimed rows are planned with the
//! events held for their aggregates (see `crate::version`), like the batch strategy does in
//! `crate::strategy::versioned`, but a failing row fails alone:
//!
//! - a claimed gap (delta mode) becomes HELD: it leaves the open rows, so it neither retries
//!   nor holds its ordering key, and waits for the missing version;
//! - stale and duplicate rows are finished (DONE or deleted) without an effect, counted;
//! - the applicable rows go to the handler round by round (one version per aggregate a round),
//!   with the held rows the round releases;
//! - a row that fails blocks its aggregate for the rest of the round: its later claimed
//!   versions become HELD, its held ones stay HELD, and the failed row is retried (a held row
//!   that fails goes back to PENDING) until it applies and releases them, or is parked FAILED
//!   and the gap alert shows the aggregate.

use std::collections::{HashMap, HashSet};

use deadpool_postgres::Transaction;
use uuid::Uuid;

use super::processor::{Processors, Round, RoundError};
use crate::config::VersionConfig;
use crate::envelope::Envelope;
use crate::store::inbox::{Claimed, Failure};
use crate::store::versions;
use crate::strategy::backoff;
use crate::strategy::versioned::{held_envelopes, load};
use crate::version::{self, Stamp, Verdict, Versions};

/// What a versioned round did with its claimed rows.
pub(super) struct Outcome {
    /// Claimed rows applied, stale or duplicate, and held rows released or stale: to finish.
    pub done: Vec<(Uuid, chrono::NaiveDate)>,
    /// Claimed rows (indexes) that failed: whether no retry can fix it, and the error.
    pub failed: Vec<(usize, bool, String)>,
    /// Held rows that failed or no longer read.
    pub held_failures: Vec<Failure>,
}

impl Processors {
    pub(super) async fn apply_versioned(
        &self,
        cfg: &VersionConfig,
        tx: &Transaction<'_>,
        rows: &[(Claimed, Envelope)],
        round: &mut Round,
    ) -> Result<Outcome, RoundError> {
        let consumer: &str = &self.consumer;
        let mut out = Outcome {
            done: Vec::new(),
            failed: Vec::new(),
            held_failures: Vec::new(),
        };
        // Claimed rows that carry a stamp (index into `rows`, stamp).
        let mut claimed: Vec<(usize, Stamp)> = Vec::with_capacity(rows.len());
        for (i, (_, env)) in rows.iter().enumerate() {
            match version::read(cfg, env) {
                Ok(s) => claimed.push((i, s)),
                Err(r) => out.failed.push((i, true, r.to_string())),
            }
        }
        if claimed.is_empty() {
            return Ok(out);
        }
        let (stored, held) = load(tx, consumer, cfg.mode, claimed.iter().map(|(_, s)| s)).await?;
        let (held_envs, unusable) = held_envelopes(self.handler.as_ref(), &held);
        out.held_failures.extend(unusable);

        // Events: the claimed rows first (`k < n`), then the held ones.
        let n = claimed.len();
        let mut events: Vec<Stamp> = claimed.iter().map(|(_, s)| s.clone()).collect();
        events.extend(held_envs.iter().map(|(h, _)| h.stamp()));
        let envs: Vec<&Envelope> = claimed
            .iter()
            .map(|(i, _)| &rows[*i].1)
            .chain(held_envs.iter().map(|(_, e)| e))
            .collect();
        let topics: Vec<&str> = claimed
            .iter()
            .map(|(i, _)| rows[*i].0.topic.as_str())
            .chain(held_envs.iter().map(|(h, _)| h.topic.as_str()))
            .collect();
        let key = |k: usize| -> (Uuid, chrono::NaiveDate) {
            if k < n {
                let c = &rows[claimed[k].0].0;
                (c.message_id, c.event_date)
            } else {
                let h = held_envs[k - n].0;
                (h.message_id, h.event_date)
            }
        };
        let plan = version::plan(cfg.mode, &stored, &events);

        let mut skipped = version::Skipped::default();
        let mut gaps: Vec<usize> = Vec::new();
        for (k, v) in plan.verdicts.iter().enumerate() {
            match (v, k < n) {
                (Verdict::Apply { .. }, _) | (Verdict::Gap, false) => {}
                (Verdict::Gap, true) => {
                    skipped.count(*v);
                    gaps.push(k);
                }
                (Verdict::Stale | Verdict::Duplicate, _) => {
                    skipped.count(*v);
                    out.done.push(key(k));
                }
            }
        }

        let mut blocked: HashSet<&str> = HashSet::new();
        let mut advanced: HashMap<String, i64> = HashMap::new();
        for r in 0..plan.rounds {
            let mut items = Vec::new();
            for k in plan.round(r) {
                if blocked.contains(events[k].aggregate.as_str()) {
                    // Behind a version that failed: a claimed row waits as HELD.
                    if k < n {
                        gaps.push(k);
                    }
                } else {
                    items.push(k);
                }
            }
            if items.is_empty() {
                continue;
            }
            let facts = Versions::of(cfg.mode, &stored, &events, &envs, &items);
            let groups = self
                .apply_groups(tx, &envs, &topics, &items, Some(&facts), round)
                .await?;
            for k in groups.applied {
                let e = &events[k];
                let at = advanced.entry(e.aggregate.clone()).or_insert(e.version);
                *at = (*at).max(e.version);
                if k >= n {
                    skipped.released += 1;
                }
                out.done.push(key(k));
            }
            for (k, permanent, why) in groups.failed {
                blocked.insert(events[k].aggregate.as_str());
                if k < n {
                    out.failed.push((claimed[k].0, permanent, why));
                } else {
                    let (message_id, event_date) = key(k);
                    out.held_failures.push(Failure {
                        message_id,
                        event_date,
                        failed: permanent,
                        delay_ms: backoff(&self.config.retry, 1).as_millis() as i64,
                        error: format!("held version {} failed: {why}", events[k].version),
                    });
                }
            }
        }

        let to_hold: Vec<(Uuid, chrono::NaiveDate, &Stamp)> = gaps
            .iter()
            .map(|&k| {
                let (id, date) = key(k);
                (id, date, &events[k])
            })
            .collect();
        versions::to_held(tx, consumer, &to_hold).await?;
        if let Err(moved) = versions::advance(tx, consumer, &stored, &advanced).await? {
            return Err(RoundError::Unavailable(moved.to_string()));
        }
        round.versions.add(&skipped);
        Ok(out)
    }
}
