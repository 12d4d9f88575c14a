//! The exactly-once checker, in the manner of Jepsen's total-queue checker: compare what the
//! broker acknowledged with what the database shows, and name every anomaly.
//!
//! - `lost`: an acknowledged payment with no effect, and not parked;
//! - `duplicated`: a payment with more than one effect;
//! - `unexpected`: an effect for a payment this run never sent;
//! - `parked`: dead letters of this run, and its `FAILED` rows in the consumer's inbox (the
//!   inbox strategy parks there what it stored but cannot apply); every one must be a poison
//!   record we sent;
//! - wallets: every user's balance must equal 2% (the rate) of their unique payments.
//!
//! [`check`] is a pure function so that it can be tested on ledgers with known faults: a
//! checker that cannot fail proves nothing.

use std::collections::{BTreeMap, HashMap};

use crate::produce::{Kind, Run, Sent};

/// What the run sent and the broker acknowledged.
#[derive(Debug, Default, Clone)]
pub struct Expected {
    /// payment id -> (user, amount), for every payment with at least one acknowledged record.
    pub payments: BTreeMap<String, (String, i64)>,
    /// Acknowledged poison records.
    pub poison: u64,
    pub rate_bp: i64,
}

impl Expected {
    pub fn from_log(log: &[Sent], rate_bp: i64) -> Expected {
        let mut e = Expected {
            rate_bp,
            ..Expected::default()
        };
        for s in log.iter().filter(|s| s.acked) {
            if s.kind.is_poison() {
                e.poison += 1;
            } else if let Some(p) = &s.payment_id {
                e.payments
                    .entry(p.clone())
                    .or_insert_with(|| (s.user_id.clone(), s.amount_paise));
            }
        }
        e
    }
}

/// One dead letter of this run, or one of its FAILED inbox rows.
#[derive(Debug, Clone)]
pub struct ParkedRow {
    /// The dead letter's reason, or `inbox_failed: ` and the row's last error.
    pub reason: String,
    /// The payment id inside the payload, when it is a payment.
    pub payment_id: Option<String>,
    pub poison: bool,
}

/// What the database shows for the run.
#[derive(Debug, Default, Clone)]
pub struct Observed {
    /// One entry per effect: (payment id, user, cashback paise).
    pub credits: Vec<(String, String, i64)>,
    /// When each credit was written: (payment id, seconds since the run started).
    pub credited_s: Vec<(String, f64)>,
    pub wallets: HashMap<String, i64>,
    pub parked: Vec<ParkedRow>,
}

#[derive(Debug, Default, Clone)]
pub struct Verdict {
    pub effects: u64,
    pub lost: Vec<String>,
    pub duplicated: Vec<String>,
    pub unexpected: Vec<String>,
    pub wallet_mismatches: Vec<String>,
    pub parked: u64,
    pub parked_not_poison: Vec<String>,
    pub verified: bool,
}

pub fn cashback(amount_paise: i64, rate_bp: i64) -> i64 {
    amount_paise * rate_bp / 10_000
}

pub fn check(expected: &Expected, observed: &Observed) -> Verdict {
    let mut v = Verdict {
        effects: observed.credits.len() as u64,
        ..Verdict::default()
    };
    let mut effects: HashMap<&str, u64> = HashMap::new();
    for (payment, _, _) in &observed.credits {
        *effects.entry(payment.as_str()).or_default() += 1;
    }
    let parked_payments: HashMap<&str, &ParkedRow> = observed
        .parked
        .iter()
        .filter_map(|p| p.payment_id.as_deref().map(|id| (id, p)))
        .collect();
    for payment in expected.payments.keys() {
        match effects.get(payment.as_str()) {
            None if !parked_payments.contains_key(payment.as_str()) => v.lost.push(payment.clone()),
            Some(n) if *n > 1 => v.duplicated.push(payment.clone()),
            _ => {}
        }
    }
    for payment in effects.keys() {
        if !expected.payments.contains_key(*payment) {
            v.unexpected.push(payment.to_string());
        }
    }
    v.unexpected.sort();
    v.parked = observed.parked.len() as u64;
    for p in observed.parked.iter().filter(|p| !p.poison) {
        v.parked_not_poison.push(format!(
            "{} ({})",
            p.payment_id.as_deref().unwrap_or("no payment id"),
            p.reason
        ));
    }
    // Wallets: 2% of each user's unique payments that were not parked.
    let mut want: BTreeMap<&str, i64> = BTreeMap::new();
    for (payment, (user, amount)) in &expected.payments {
        if !parked_payments.contains_key(payment.as_str()) {
            *want.entry(user.as_str()).or_default() += cashback(*amount, expected.rate_bp);
        }
    }
    for (user, expect) in &want {
        let got = observed.wallets.get(*user).copied().unwrap_or(0);
        if got != *expect {
            v.wallet_mismatches
                .push(format!("{user}: {got} paise, expected {expect}"));
        }
    }
    for (user, got) in &observed.wallets {
        if !want.contains_key(user.as_str()) && *got != 0 {
            v.wallet_mismatches
                .push(format!("{user}: {got} paise, expected 0"));
        }
    }
    v.verified = v.lost.is_empty()
        && v.duplicated.is_empty()
        && v.unexpected.is_empty()
        && v.wallet_mismatches.is_empty()
        && v.parked_not_poison.is_empty()
        && v.parked == expected.poison;
    v
}

/// Where an effect's latency starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyFrom {
    /// The Kafka record's timestamp: when loadgen produced it.
    Record,
    /// The payment's `occurred_at`: when loadgen made it. Via the outbox the record's timestamp
    /// is the relay's publish time, and would hide the time a row waited in the outbox.
    OccurredAt,
}

/// Reads this run's effects, wallets and dead letters, and the e2e latencies (`credited_at`
/// minus `from`, in ms, with the commit time in seconds since the run started).
pub async fn observe(
    db: &tokio_postgres::Client,
    consumer: &str,
    run: &Run,
    run_started_at: chrono::DateTime<chrono::Utc>,
    from: LatencyFrom,
) -> Result<(Observed, Vec<(f64, f64)>), tokio_postgres::Error> {
    let prefix = format!("{}%", run.payment_prefix());
    let occurred = from == LatencyFrom::OccurredAt;
    let rows = db
        .query(
            "SELECT payment_id, user_id, cashback_paise,
                    extract(epoch FROM credited_at - $3::timestamptz)::float8,
                    (extract(epoch FROM credited_at
                        - CASE WHEN $4 THEN occurred_at ELSE kafka_ts END) * 1000)::float8
             FROM cashback_credits WHERE consumer = $1 AND payment_id LIKE $2",
            &[&consumer, &prefix, &run_started_at, &occurred],
        )
        .await?;
    let mut observed = Observed::default();
    let mut latencies = Vec::with_capacity(rows.len());
    for r in &rows {
        observed.credits.push((r.get(0), r.get(1), r.get(2)));
        let t = r.get::<_, Option<f64>>(3);
        if let Some(t) = t {
            observed.credited_s.push((r.get(0), t));
        }
        if let (Some(t), Some(ms)) = (t, r.get::<_, Option<f64>>(4)) {
            latencies.push((t, ms.max(0.0)));
        }
    }
    let user_prefix = format!("u_{}_%", run.id);
    for r in db
        .query(
            "SELECT user_id, balance_paise FROM wallets WHERE user_id LIKE $1",
            &[&user_prefix],
        )
        .await?
    {
        observed.wallets.insert(r.get(0), r.get(1));
    }
    let marker = run.id.as_bytes().to_vec();
    let mut parked = db
        .query(
            "SELECT reason, payload FROM dead_letters
             WHERE consumer = $1 AND topic = $2 AND position($3::bytea IN coalesce(payload, '')) > 0",
            &[&consumer, &run.topic, &marker],
        )
        .await?;
    // The inbox strategy parks a stored message it cannot apply as a FAILED row (a database
    // migrated before the inbox existed has no such table, and no such rows).
    if has_inbox(db).await? {
        parked.extend(
            db.query(
                "SELECT 'inbox_failed: ' || coalesce(last_error, ''), payload FROM inbox
                 WHERE consumer = $1 AND topic = $2 AND status = 'FAILED'
                   AND position($3::bytea IN payload) > 0",
                &[&consumer, &run.topic, &marker],
            )
            .await?,
        );
    }
    for r in parked {
        let payload: Option<Vec<u8>> = r.get(1);
        let doc: Option<serde_json::Value> = payload
            .as_deref()
            .and_then(|p| serde_json::from_slice(p).ok());
        let payment_id = doc
            .as_ref()
            .and_then(|d| d.get("payment_id"))
            .and_then(|v| v.as_str())
            .map(str::to_string);
        // A registry format's poison payment is named by its payment id (produce::records).
        let poison = doc.as_ref().is_none_or(|d| d.get("loadgen_run").is_some())
            || payment_id
                .as_ref()
                .is_some_and(|p| p.starts_with("poison_"));
        observed.parked.push(ParkedRow {
            reason: r.get(0),
            payment_id,
            poison,
        });
    }
    Ok((observed, latencies))
}

async fn has_inbox(db: &tokio_postgres::Client) -> Result<bool, tokio_postgres::Error> {
    Ok(db
        .query_one("SELECT to_regclass('inbox') IS NOT NULL", &[])
        .await?
        .get(0))
}

/// Rows of `consumer` its inbox processors have yet to finish (PENDING, including those
/// waiting out a retry backoff, and IN_PROGRESS). 0 for a consumer of another strategy, whose
/// messages never enter the inbox.
/// Whether `consumer` has any open inbox row: what a wait for the processors to finish polls,
/// without counting a 100,000-row backlog four times a second (the count was a tenth of
/// PostgreSQL's time in the inbox curve at full scale).
pub async fn inbox_any_open(
    db: &tokio_postgres::Client,
    consumer: &str,
) -> Result<bool, tokio_postgres::Error> {
    if !has_inbox(db).await? {
        return Ok(false);
    }
    Ok(db
        .query_one(
            "SELECT EXISTS (SELECT FROM inbox
                            WHERE consumer = $1 AND status IN ('PENDING', 'IN_PROGRESS'))",
            &[&consumer],
        )
        .await?
        .get(0))
}

pub async fn inbox_open(
    db: &tokio_postgres::Client,
    consumer: &str,
) -> Result<i64, tokio_postgres::Error> {
    if !has_inbox(db).await? {
        return Ok(0);
    }
    Ok(db
        .query_one(
            "SELECT count(*) FROM inbox
             WHERE consumer = $1 AND status IN ('PENDING', 'IN_PROGRESS')",
            &[&consumer],
        )
        .await?
        .get(0))
}

/// How many of the log's acknowledged records were duplicates of each kind.
pub fn count_kind(log: &[Sent], kind: Kind) -> u64 {
    log.iter().filter(|s| s.kind == kind).count() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expected() -> Expected {
        let mut e = Expected {
            rate_bp: 200,
            poison: 1,
            ..Expected::default()
        };
        e.payments.insert("p1".into(), ("u1".into(), 10_000));
        e.payments.insert("p2".into(), ("u1".into(), 20_000));
        e.payments.insert("p3".into(), ("u2".into(), 5_000));
        e
    }

    fn poison() -> ParkedRow {
        ParkedRow {
            reason: "undecodable_payload".into(),
            payment_id: None,
            poison: true,
        }
    }

    #[test]
    fn an_exact_ledger_verifies() {
        let o = Observed {
            credits: vec![
                ("p1".into(), "u1".into(), 200),
                ("p2".into(), "u1".into(), 400),
                ("p3".into(), "u2".into(), 100),
            ],
            wallets: HashMap::from([("u1".into(), 600), ("u2".into(), 100)]),
            parked: vec![poison()],
            ..Observed::default()
        };
        let v = check(&expected(), &o);
        assert!(v.verified, "{v:?}");
        assert_eq!(v.effects, 3);
    }

    #[test]
    fn one_lost_and_one_doubled_effect_are_reported() {
        let o = Observed {
            // p2 lost, p3 applied twice (and its wallet credited twice).
            credits: vec![
                ("p1".into(), "u1".into(), 200),
                ("p3".into(), "u2".into(), 100),
                ("p3".into(), "u2".into(), 100),
            ],
            wallets: HashMap::from([("u1".into(), 200), ("u2".into(), 200)]),
            parked: vec![poison()],
            ..Observed::default()
        };
        let v = check(&expected(), &o);
        assert!(!v.verified);
        assert_eq!(v.lost, vec!["p2".to_string()]);
        assert_eq!(v.duplicated, vec!["p3".to_string()]);
        assert_eq!(v.wallet_mismatches.len(), 2, "{:?}", v.wallet_mismatches);
    }

    #[test]
    fn an_effect_nobody_sent_and_a_parked_good_message_are_reported() {
        let o = Observed {
            credits: vec![
                ("p1".into(), "u1".into(), 200),
                ("p2".into(), "u1".into(), 400),
                ("zz".into(), "u9".into(), 5),
            ],
            wallets: HashMap::from([("u1".into(), 600), ("u9".into(), 5)]),
            parked: vec![
                poison(),
                ParkedRow {
                    reason: "missing_field".into(),
                    payment_id: Some("p3".into()),
                    poison: false,
                },
            ],
            ..Observed::default()
        };
        let v = check(&expected(), &o);
        assert!(!v.verified);
        assert!(v.lost.is_empty(), "a parked payment is not lost");
        assert_eq!(v.unexpected, vec!["zz".to_string()]);
        assert_eq!(v.parked_not_poison.len(), 1);
        assert_eq!(v.parked, 2);
    }

    #[test]
    fn missing_poison_fails_verification() {
        let o = Observed {
            credits: vec![
                ("p1".into(), "u1".into(), 200),
                ("p2".into(), "u1".into(), 400),
                ("p3".into(), "u2".into(), 100),
            ],
            wallets: HashMap::from([("u1".into(), 600), ("u2".into(), 100)]),
            parked: vec![],
            ..Observed::default()
        };
        assert!(
            !check(&expected(), &o).verified,
            "a poison record that vanished is an anomaly"
        );
    }
}
