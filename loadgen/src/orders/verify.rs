//! The verification: what the run should have left ([`Expected`]), what the tables hold
//! ([`observe`]), and the verdict on every order ([`check`]), with the failing ones in full.

use std::collections::{BTreeMap, HashMap};

use anyhow::Context;
use uuid::Uuid;

use super::stream::Record;

/// How many failing orders of each kind the report prints in full, with their rows.
const SHOW: usize = 5;

/// What the engine should have left, from what was produced.
pub(super) struct Expected {
    /// Per order: the newest version acknowledged, and the newest produced (the same unless a
    /// record's acknowledgement was lost; it may have been written all the same).
    pub(super) newest: BTreeMap<String, (i64, i64)>,
    /// The status of every version of every order.
    pub(super) statuses: HashMap<(String, i64), &'static str>,
    /// Every event id produced: its order and version.
    pub(super) ids: HashMap<Uuid, (String, i64)>,
}

impl Expected {
    pub(super) fn from(records: &[Record], acked: &[bool]) -> Expected {
        let mut e = Expected {
            newest: BTreeMap::new(),
            statuses: HashMap::new(),
            ids: HashMap::new(),
        };
        for (r, acked) in records.iter().zip(acked) {
            let newest = e.newest.entry(r.order.clone()).or_insert((0, 0));
            if *acked {
                newest.0 = newest.0.max(r.version);
            }
            newest.1 = newest.1.max(r.version);
            e.statuses.insert((r.order.clone(), r.version), r.status);
            e.ids.insert(r.event_id, (r.order.clone(), r.version));
        }
        e
    }
}

/// One row of `order_status_history`.
#[derive(Debug, Clone)]
pub(super) struct Move {
    pub(super) id: i64,
    pub(super) status: String,
    pub(super) from: Option<i64>,
    pub(super) to: i64,
    pub(super) message_id: Uuid,
}

/// What the engine left for this run.
#[derive(Debug, Default)]
pub(super) struct Observed {
    /// `order_status_view`: status and version per order.
    pub(super) view: HashMap<String, (String, i64)>,
    /// `order_status_history` per order, in apply (id) order.
    pub(super) history: BTreeMap<String, Vec<Move>>,
    /// `aggregate_versions` of the consumer.
    pub(super) stored: HashMap<String, i64>,
    pub(super) dead_letters: i64,
    pub(super) failed: i64,
    pub(super) held: i64,
}

pub(super) async fn observe(
    db: &tokio_postgres::Client,
    consumer: &str,
    prefix: &str,
) -> anyhow::Result<Observed> {
    // The prefix is `o-<hex>-`: no LIKE wildcard in it.
    let like = format!("{prefix}%");
    let mut o = Observed::default();
    for r in db
        .query(
            "SELECT order_id, status, version FROM order_status_view WHERE order_id LIKE $1",
            &[&like],
        )
        .await
        .context("reading order_status_view")?
    {
        o.view.insert(r.get(0), (r.get(1), r.get(2)));
    }
    for r in db
        .query(
            "SELECT order_id, id, status, from_version, to_version, message_id
             FROM order_status_history WHERE order_id LIKE $1 ORDER BY order_id, id",
            &[&like],
        )
        .await
        .context("reading order_status_history")?
    {
        o.history.entry(r.get(0)).or_default().push(Move {
            id: r.get(1),
            status: r.get(2),
            from: r.get(3),
            to: r.get(4),
            message_id: r.get(5),
        });
    }
    for r in db
        .query(
            "SELECT aggregate, version FROM aggregate_versions WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .context("reading aggregate_versions")?
    {
        o.stored.insert(r.get(0), r.get(1));
    }
    o.dead_letters = db
        .query_one(
            "SELECT count(*) FROM dead_letters WHERE consumer = $1",
            &[&consumer],
        )
        .await?
        .get(0);
    let row = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'FAILED'), count(*) FILTER (WHERE status = 'HELD')
             FROM inbox WHERE consumer = $1",
            &[&consumer],
        )
        .await?;
    (o.failed, o.held) = (row.get(0), row.get(1));
    Ok(o)
}

/// What the verifier found, as lists of order ids (with the reason).
#[derive(Debug, Default)]
pub(super) struct Verdict {
    pub(super) at_newest: usize,
    /// Orders without a view row.
    pub(super) missing: Vec<String>,
    /// View rows at another version or status than the order's newest (or of no order produced).
    pub(super) wrong: Vec<String>,
    /// Orders whose stored version (`aggregate_versions`) is not the view's.
    pub(super) stored_off: Vec<String>,
    /// Orders whose history went back or skipped: the chain of versions is broken.
    pub(super) broken: Vec<String>,
    /// Moves with the status or a message id of another version than the one moved to.
    pub(super) bad_moves: Vec<String>,
    /// Orders whose last move does not reach the view's version and status.
    pub(super) view_vs_history: Vec<String>,
    pub(super) moves: usize,
    /// Dead letters and FAILED or HELD inbox rows: full-state mode applies or skips everything.
    pub(super) parked: i64,
}

impl Verdict {
    pub(super) fn verified(&self) -> bool {
        self.missing.is_empty()
            && self.wrong.is_empty()
            && self.stored_off.is_empty()
            && self.broken.is_empty()
            && self.bad_moves.is_empty()
            && self.view_vs_history.is_empty()
            && self.parked == 0
    }

    /// The failing orders, up to `SHOW` of each kind, with their rows in full.
    pub(super) fn details(&self, expected: &Expected, observed: &Observed) -> String {
        let mut out = String::new();
        for (what, list) in [
            ("missing from order_status_view", &self.missing),
            ("wrong in order_status_view", &self.wrong),
            ("stored version off", &self.stored_off),
            ("history going back or broken", &self.broken),
            ("moves with a wrong status or message id", &self.bad_moves),
            ("last move is not the view's row", &self.view_vs_history),
        ] {
            if list.is_empty() {
                continue;
            }
            out.push_str(&format!("{} {what}:\n", list.len()));
            for problem in list.iter().take(SHOW) {
                out.push_str(&format!("  {problem}\n"));
                let order = problem.split(':').next().unwrap_or_default();
                out.push_str(&describe(order, expected, observed));
            }
        }
        if self.parked > 0 {
            out.push_str(&format!(
                "{} records parked (dead letters, FAILED or HELD inbox rows)\n",
                self.parked
            ));
        }
        out
    }
}

/// An order's produced versions, view row, stored version and every move, for the report.
fn describe(order: &str, expected: &Expected, observed: &Observed) -> String {
    let mut out = format!(
        "    produced: newest version {:?}; view: {:?}; stored version: {:?}\n",
        expected.newest.get(order).map(|n| n.1),
        observed.view.get(order),
        observed.stored.get(order)
    );
    for m in observed.history.get(order).into_iter().flatten() {
        let from = m.from.map_or("NULL".to_string(), |v| v.to_string());
        out.push_str(&format!(
            "    history id {} {} from_version {from} to_version {} message_id {} ({})\n",
            m.id,
            m.status,
            m.to,
            m.message_id,
            match expected.ids.get(&m.message_id) {
                Some((o, v)) if o == order => format!("produced as version {v}"),
                Some((o, v)) => format!("produced for order {o} version {v}"),
                None => "not produced by this run".into(),
            }
        ));
    }
    out
}

/// Why an order's moves are not a chain of strictly rising versions (with `delta`: of every
/// version, one at a time), if they are not.
pub(super) fn chain_break(moves: &[Move], delta: bool) -> Option<String> {
    let mut reached: Option<i64> = None;
    for m in moves {
        if m.from != reached {
            return Some(format!(
                "move {} starts from version {:?}, but the order was at {:?}",
                m.id, m.from, reached
            ));
        }
        if reached.is_some_and(|r| m.to <= r) {
            return Some(format!(
                "move {} goes from version {:?} back to {} ({})",
                m.id, m.from, m.to, m.status
            ));
        }
        if delta && m.to != reached.unwrap_or(0) + 1 {
            return Some(format!(
                "move {} skips from version {:?} to {} (delta applies every version)",
                m.id, m.from, m.to
            ));
        }
        reached = Some(m.to);
    }
    None
}

/// `delta`: every version must have been applied, one move each, in order.
pub(super) fn check(expected: &Expected, observed: &Observed, delta: bool) -> Verdict {
    let mut v = Verdict {
        parked: observed.dead_letters + observed.failed + observed.held,
        ..Verdict::default()
    };
    for (order, &(acked, produced)) in &expected.newest {
        let Some((status, version)) = observed.view.get(order) else {
            v.missing.push(format!("{order}: no row"));
            continue;
        };
        // The newest acknowledged version, or a newer one whose acknowledgement was lost.
        let want = expected.statuses.get(&(order.clone(), *version));
        if (acked..=produced).contains(version) && want == Some(&status.as_str()) {
            v.at_newest += 1;
        } else {
            v.wrong.push(format!(
                "{order}: {status} at version {version}, not {} at version {acked}",
                expected.statuses[&(order.clone(), acked.max(1))]
            ));
        }
        if observed.stored.get(order) != Some(version) {
            v.stored_off.push(format!(
                "{order}: stored version {:?}, view at {version}",
                observed.stored.get(order)
            ));
        }
    }
    for order in observed.view.keys() {
        if !expected.newest.contains_key(order) {
            v.wrong
                .push(format!("{order}: a row for an order never produced"));
        }
    }
    for (order, moves) in &observed.history {
        v.moves += moves.len();
        if let Some(why) = chain_break(moves, delta) {
            v.broken.push(format!("{order}: {why}"));
        }
        for m in moves {
            let status = expected.statuses.get(&(order.clone(), m.to));
            let source = expected.ids.get(&m.message_id);
            if status != Some(&m.status.as_str()) || source != Some(&(order.clone(), m.to)) {
                v.bad_moves.push(format!(
                    "{order}: move {} to version {} with status {} and message {}",
                    m.id, m.to, m.status, m.message_id
                ));
            }
        }
        let last = moves.last().map(|m| (m.status.clone(), m.to));
        if last.as_ref() != observed.view.get(order) {
            v.view_vs_history.push(format!(
                "{order}: last move {last:?}, view {:?}",
                observed.view.get(order)
            ));
        }
    }
    for order in observed.view.keys() {
        if !observed.history.contains_key(order) {
            v.view_vs_history
                .push(format!("{order}: a view row without any move"));
        }
    }
    v
}
