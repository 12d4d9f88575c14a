//! Versioned writes: which of a batch's events an aggregate can take, and in what order.
//!
//! The dedupe key says a message was seen; it cannot say that version 9 of an order must wait
//! for version 8, or that a copy of version 7 redelivered after version 8 must change nothing
//! (`SET status = 'PAID'` after `REFUNDED`). With `[consumer.version]`, every event names its
//! aggregate and the version it produces, the engine keeps the last applied version of each
//! aggregate, and [`plan`] decides, for a whole batch at once:
//!
//! - **full-state** (each event is the aggregate's whole new state): the newest version above
//!   the stored one is applied, once; every other event of that aggregate is stale (older) or a
//!   duplicate (the same version again).
//! - **delta** (each event is a change, "add 100"): only stored + 1 can be applied, then + 2,
//!   and so on; a later version is a **gap** and is held until the missing ones land. A chain
//!   of several versions of one aggregate in one batch is applied in rounds (the handler is
//!   called once per round, with at most one event per aggregate), so a set-based statement
//!   never sees two versions of one row at once.
//!
//! [`plan`] is pure; the strategies read and write the stored versions and hold the gaps.

use std::collections::HashMap;

use serde_json::Value;

use crate::config::VersionConfig;
use crate::envelope::{Envelope, Reason, Rejection};

pub use crate::config::VersionMode;

/// One event's aggregate and version, as [`read`] found them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp {
    pub aggregate: String,
    pub version: i64,
}

/// Reads the aggregate and version of `env` (a string or integer id; an integer version of at
/// least 1). A message without them cannot be ordered: it is rejected, and parked.
pub fn read(cfg: &VersionConfig, env: &Envelope) -> Result<Stamp, Rejection> {
    let parsed;
    let doc = match &env.json {
        Some(doc) => doc,
        None => {
            parsed = serde_json::from_slice::<Value>(&env.payload).map_err(|e| {
                Rejection::new(Reason::UndecodablePayload, format!("not JSON: {e}"))
            })?;
            &parsed
        }
    };
    let aggregate = match doc.pointer(&cfg.aggregate) {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
        Some(other) => {
            return Err(Rejection::new(
                Reason::MissingField,
                format!(
                    "aggregate at {} must be a non-empty string or an integer, not {other}",
                    cfg.aggregate
                ),
            ))
        }
        None => {
            return Err(Rejection::new(
                Reason::MissingField,
                format!("no aggregate at {}", cfg.aggregate),
            ))
        }
    };
    let version = match doc.pointer(&cfg.version) {
        Some(Value::Number(n)) => n.as_i64().filter(|v| *v >= 1).ok_or_else(|| {
            Rejection::new(
                Reason::MissingField,
                format!(
                    "version at {} must be an integer of at least 1, not {n}",
                    cfg.version
                ),
            )
        })?,
        Some(other) => {
            return Err(Rejection::new(
                Reason::MissingField,
                format!("version at {} must be an integer, not {other}", cfg.version),
            ))
        }
        None => {
            return Err(Rejection::new(
                Reason::MissingField,
                format!("no version at {}", cfg.version),
            ))
        }
    };
    Ok(Stamp { aggregate, version })
}

/// What a handler may know about one event it is given under `[consumer.version]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    pub aggregate: String,
    /// The version this event produces.
    pub version: i64,
    /// The aggregate's version just before this event (`None`: the aggregate has none yet). A
    /// conditional write moves the row only from it: `... WHERE version = stored`.
    pub stored: Option<i64>,
}

/// The [`Versioned`] facts of the events of one handler call, by message id (the helper Rust
/// handlers use: [`crate::handler::BatchContext::version_of`]).
#[derive(Debug, Clone, Default)]
pub struct Versions {
    by_id: HashMap<uuid::Uuid, Versioned>,
}

impl Versions {
    pub fn insert(&mut self, id: uuid::Uuid, v: Versioned) {
        self.by_id.insert(id, v);
    }

    pub fn get(&self, id: &uuid::Uuid) -> Option<&Versioned> {
        self.by_id.get(id)
    }

    /// The facts of the planned events `idx` (of `events`, carried by `envs`) for one round,
    /// given the versions `stored` before the batch.
    pub fn of(
        mode: VersionMode,
        stored: &HashMap<String, i64>,
        events: &[Stamp],
        envs: &[&Envelope],
        idx: &[usize],
    ) -> Versions {
        let mut facts = Versions::default();
        for &i in idx {
            facts.insert(
                envs[i].message_id,
                Versioned {
                    aggregate: events[i].aggregate.clone(),
                    version: events[i].version,
                    stored: before(mode, stored, &events[i]),
                },
            );
        }
        facts
    }
}

/// Counts of the events a batch acked without applying, by [`Verdict::reason`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Skipped {
    pub stale: u64,
    pub duplicate: u64,
    /// Gaps newly held (delta mode).
    pub held: u64,
    /// Held events applied because their missing version arrived.
    pub released: u64,
}

impl Skipped {
    pub fn add(&mut self, o: &Skipped) {
        self.stale += o.stale;
        self.duplicate += o.duplicate;
        self.held += o.held;
        self.released += o.released;
    }

    pub fn count(&mut self, v: Verdict) {
        match v {
            Verdict::Stale => self.stale += 1,
            Verdict::Duplicate => self.duplicate += 1,
            Verdict::Gap => self.held += 1,
            Verdict::Apply { .. } => {}
        }
    }
}

/// The version an aggregate has just before `event` is applied in its round: in delta mode the
/// one before it; in full-state mode the stored one (`stored` as read at the start).
pub fn before(mode: VersionMode, stored: &HashMap<String, i64>, event: &Stamp) -> Option<i64> {
    match mode {
        VersionMode::Delta => Some(event.version - 1).filter(|v| *v >= 1),
        VersionMode::FullState => stored.get(&event.aggregate).copied(),
    }
}

/// What happens to one event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Applied in this round (0 first): the handler sees it with the other events of its round.
    Apply { round: usize },
    /// Older than the aggregate's version (stored, or reached earlier in this batch): acked,
    /// changes nothing.
    Stale,
    /// The very version the aggregate already has (another copy under a new message id):
    /// acked, changes nothing.
    Duplicate,
    /// Delta mode: a version past the next one; held until the missing versions are applied.
    Gap,
}

impl Verdict {
    /// The label of skipped events in metrics and logs.
    pub fn reason(&self) -> &'static str {
        match self {
            Verdict::Apply { .. } => "applied",
            Verdict::Stale => "stale",
            Verdict::Duplicate => "duplicate",
            Verdict::Gap => "gap",
        }
    }
}

/// The decision for a batch.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// One per event, in the order given.
    pub verdicts: Vec<Verdict>,
    /// How many rounds the applied events need (0 when none is applied).
    pub rounds: usize,
    /// The aggregates whose version moves, and to what.
    pub advanced: HashMap<String, i64>,
}

impl Plan {
    /// The positions (into the events given to [`plan`]) applied in `round`, in input order.
    pub fn round(&self, round: usize) -> Vec<usize> {
        (0..self.verdicts.len())
            .filter(|&i| self.verdicts[i] == Verdict::Apply { round })
            .collect()
    }
}

/// Decides every event of a batch at once. `stored` holds each aggregate's applied version
/// (absent: none yet, as if 0, so a delta chain starts at 1). Events of one aggregate may come
/// in any order; ties (the same version twice) go to the first in input order.
pub fn plan(mode: VersionMode, stored: &HashMap<String, i64>, events: &[Stamp]) -> Plan {
    let mut verdicts = vec![Verdict::Stale; events.len()];
    let mut by_aggregate: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, e) in events.iter().enumerate() {
        by_aggregate
            .entry(e.aggregate.as_str())
            .or_default()
            .push(i);
    }
    let mut rounds = 0;
    let mut advanced = HashMap::new();
    for (aggregate, mut idx) in by_aggregate {
        let have = stored.get(aggregate).copied().unwrap_or(0);
        // By version, then by input order (a stable sort keeps it).
        idx.sort_by_key(|&i| events[i].version);
        match mode {
            VersionMode::FullState => {
                let newest = events[*idx.last().expect("a group has an event")].version;
                let mut applied = false;
                for &i in &idx {
                    let v = events[i].version;
                    verdicts[i] = if v == newest && v > have && !applied {
                        applied = true;
                        Verdict::Apply { round: 0 }
                    } else if v == have || (v == newest && newest > have) {
                        // The version the aggregate has, or another copy of the one applied.
                        Verdict::Duplicate
                    } else {
                        Verdict::Stale
                    };
                }
                if applied {
                    rounds = rounds.max(1);
                    advanced.insert(aggregate.to_string(), newest);
                }
            }
            VersionMode::Delta => {
                let mut at = have;
                let mut round = 0;
                for &i in &idx {
                    let v = events[i].version;
                    verdicts[i] = if v == at + 1 {
                        at = v;
                        round += 1;
                        Verdict::Apply { round: round - 1 }
                    } else if v == at {
                        Verdict::Duplicate
                    } else if v < at {
                        Verdict::Stale
                    } else {
                        Verdict::Gap
                    };
                }
                rounds = rounds.max(round);
                if at > have {
                    advanced.insert(aggregate.to_string(), at);
                }
            }
        }
    }
    Plan {
        verdicts,
        rounds,
        advanced,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Verdict::*;

    fn ev(list: &[(&str, i64)]) -> Vec<Stamp> {
        list.iter()
            .map(|(a, v)| Stamp {
                aggregate: a.to_string(),
                version: *v,
            })
            .collect()
    }

    fn stored(list: &[(&str, i64)]) -> HashMap<String, i64> {
        list.iter().map(|(a, v)| (a.to_string(), *v)).collect()
    }

    #[test]
    fn full_state_takes_the_newest_above_the_stored_version_once() {
        // REFUNDED (v8) is stored; a redelivered PAID (v7) changes nothing.
        let p = plan(
            VersionMode::FullState,
            &stored(&[("o1", 8)]),
            &ev(&[("o1", 7)]),
        );
        assert_eq!(p.verdicts, vec![Stale]);
        assert_eq!((p.rounds, p.advanced.len()), (0, 0));

        let p = plan(
            VersionMode::FullState,
            &stored(&[("o1", 3)]),
            &ev(&[
                ("o1", 5),
                ("o2", 1),
                ("o1", 4),
                ("o1", 5),
                ("o1", 3),
                ("o1", 2),
            ]),
        );
        assert_eq!(
            p.verdicts,
            vec![
                Apply { round: 0 },
                Apply { round: 0 },
                Stale,
                Duplicate,
                Duplicate,
                Stale
            ]
        );
        assert_eq!(p.rounds, 1);
        assert_eq!(p.advanced, stored(&[("o1", 5), ("o2", 1)]));
        assert_eq!(p.round(0), vec![0, 1]);
    }

    #[test]
    fn delta_applies_a_chain_in_rounds_and_holds_what_follows_a_gap() {
        // Deltas 1, 2, 4, 3 in one batch: applied 1, 2, 3, 4 over four rounds.
        let p = plan(
            VersionMode::Delta,
            &HashMap::new(),
            &ev(&[("a", 1), ("a", 2), ("a", 4), ("a", 3)]),
        );
        assert_eq!(
            p.verdicts,
            vec![
                Apply { round: 0 },
                Apply { round: 1 },
                Apply { round: 3 },
                Apply { round: 2 }
            ]
        );
        assert_eq!((p.rounds, p.advanced["a"]), (4, 4));

        // Stored 2: 3 applies, 5 and 6 wait for 4, 2 is a duplicate, 1 is stale.
        let p = plan(
            VersionMode::Delta,
            &stored(&[("a", 2)]),
            &ev(&[("a", 5), ("a", 3), ("a", 2), ("a", 1), ("a", 6), ("b", 2)]),
        );
        assert_eq!(
            p.verdicts,
            vec![Gap, Apply { round: 0 }, Duplicate, Stale, Gap, Gap]
        );
        assert_eq!(p.advanced, stored(&[("a", 3)]));

        // The held 5 and 6 come back with the missing 4: 4, 5, 6 in three rounds.
        let p = plan(
            VersionMode::Delta,
            &stored(&[("a", 3)]),
            &ev(&[("a", 5), ("a", 6), ("a", 4)]),
        );
        assert_eq!(
            p.verdicts,
            vec![Apply { round: 1 }, Apply { round: 2 }, Apply { round: 0 }]
        );
        assert_eq!(p.round(0), vec![2]);
    }

    #[test]
    fn a_round_has_at_most_one_event_per_aggregate() {
        let events: Vec<Stamp> = (0..1000)
            .flat_map(|n| {
                let a = format!("agg-{}", n % 100);
                [3, 1, 2].map(|v| Stamp {
                    aggregate: a.clone(),
                    version: v + 3 * (n as i64 / 100),
                })
            })
            .collect();
        let p = plan(VersionMode::Delta, &HashMap::new(), &events);
        assert!(p.verdicts.iter().all(|v| matches!(v, Apply { .. })));
        assert_eq!(p.rounds, 30);
        for r in 0..p.rounds {
            let mut seen = std::collections::HashSet::new();
            for i in p.round(r) {
                assert!(
                    seen.insert(&events[i].aggregate),
                    "two events of one aggregate in round {r}"
                );
                assert_eq!(events[i].version, r as i64 + 1);
            }
        }
    }

    fn env(payload: &str) -> Envelope {
        Envelope {
            partition: 0,
            offset: 0,
            message_id: uuid::Uuid::nil(),
            message_key: None,
            event_date: chrono::NaiveDate::from_ymd_opt(2026, 12, 4).unwrap(),
            kafka_ts: None,
            key: None,
            payload: bytes::Bytes::copy_from_slice(payload.as_bytes()),
            json: serde_json::from_str(payload).ok(),
            cloudevent: None,
            size: payload.len(),
        }
    }

    #[test]
    fn reads_the_stamp_or_says_what_is_missing() {
        let cfg = VersionConfig {
            aggregate: "/order_id".into(),
            version: "/version".into(),
            mode: VersionMode::Delta,
            gap_alert_after: std::time::Duration::from_secs(60),
        };
        let s = read(&cfg, &env(r#"{"order_id":"o1","version":7}"#)).unwrap();
        assert_eq!(
            s,
            Stamp {
                aggregate: "o1".into(),
                version: 7
            }
        );
        let s = read(&cfg, &env(r#"{"order_id":42,"version":1}"#)).unwrap();
        assert_eq!(s.aggregate, "42");
        for bad in [
            r#"{"version":1}"#,
            r#"{"order_id":"o1"}"#,
            r#"{"order_id":"o1","version":0}"#,
            r#"{"order_id":"o1","version":"7"}"#,
            r#"{"order_id":"","version":1}"#,
        ] {
            let r = read(&cfg, &env(bad)).unwrap_err();
            assert_eq!(r.reason, Reason::MissingField, "{bad}");
        }
    }
}
