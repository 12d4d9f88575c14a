//! The seed's walk-through: Rewards credits 2% cashback on every `PaymentSucceeded`.
//!
//! ```json
//! {"event_id": "…uuid…", "payment_id": "pay_42", "user_id": "u_17",
//!  "amount_paise": 120000, "occurred_at": "2026-12-02T10:00:00Z", "rate_bp": 200}
//! ```
//!
//! One transaction (the engine's) holds, for the fresh messages: one `cashback_credits` row per
//! payment under `UNIQUE (payment_id)` (the business key: a double tap with a new event id
//! credits nothing), the wallet credit, and a `CashbackCredited` row in the outbox. The rate is
//! the event's `rate_bp` if it carries one, else the configured rate: never something read at
//! apply time, so a retry decides exactly as the first attempt did. Cashback is rounded down to
//! whole paise.

use async_trait::async_trait;
use deadpool_postgres::Transaction;
use serde_json::Value;
use uuid::Uuid;

use super::{Applied, BatchContext, Handler, HandlerError};
use crate::envelope::{Envelope, Reason, Rejection};

/// Namespace of the outbox ids: `CashbackCredited`'s id is derived from the payment event's id,
/// so a retried batch writes the very same outbox row (see [`outbox_id`]).
const OUTBOX_NAMESPACE: Uuid = Uuid::from_u128(0x6566_6665_6374_6976_656c_7963_6173_6862);

// Rows arrive sorted by payment id, and wallets are credited in user id order: two partitions'
// transactions lock shared rows in the same order and cannot deadlock.
const APPLY: &str = "\
WITH input AS (
    SELECT * FROM unnest($2::text[], $3::uuid[], $4::text[], $5::int8[], $6::int4[], $7::int8[],
                         $8::timestamptz[], $9::timestamptz[], $10::uuid[])
        AS t(payment_id, event_id, user_id, amount_paise, rate_bp, cashback_paise,
             occurred_at, kafka_ts, outbox_id)
), credited AS (
    INSERT INTO cashback_credits (payment_id, event_id, consumer, user_id, amount_paise, rate_bp,
                                  cashback_paise, occurred_at, kafka_ts)
    SELECT payment_id, event_id, $1, user_id, amount_paise, rate_bp, cashback_paise, occurred_at,
           kafka_ts
    FROM input ORDER BY payment_id
    ON CONFLICT (payment_id) DO NOTHING
    RETURNING payment_id, event_id, user_id, cashback_paise
), wallet AS (
    INSERT INTO wallets AS w (user_id, balance_paise)
    SELECT user_id, sum(cashback_paise)::bigint FROM credited GROUP BY user_id ORDER BY user_id
    ON CONFLICT (user_id) DO UPDATE
    SET balance_paise = w.balance_paise + EXCLUDED.balance_paise, updated_at = now()
), outbox AS (
    INSERT INTO outbox (id, aggregate_id, event_type, payload)
    SELECT i.outbox_id, c.user_id, 'CashbackCredited',
           jsonb_build_object('event_id', i.outbox_id, 'cause_event_id', c.event_id,
                              'payment_id', c.payment_id, 'user_id', c.user_id,
                              'cashback_paise', c.cashback_paise)
    FROM credited c JOIN input i ON i.event_id = c.event_id
    ORDER BY i.outbox_id
), notified AS (
    -- With `notify`: the SMS that tells the user, as an intent the sender delivers later. Its
    -- id is the credit's outbox id: unique per consumer, event date and message id, as the
    -- dedupe key is (a message id alone is not, once ids are text: two consumers' order-77).
    INSERT INTO notifications (event_id, channel, payload)
    SELECT i.outbox_id, $11::text,
           jsonb_build_object('to', c.user_id, 'payment_id', c.payment_id,
                              'cashback_paise', c.cashback_paise,
                              'text', 'Cashback of ' || c.cashback_paise || ' paise credited for '
                                      || c.payment_id)
    FROM credited c JOIN input i ON i.event_id = c.event_id WHERE $11::text IS NOT NULL
    ORDER BY i.outbox_id
    ON CONFLICT DO NOTHING
)
-- The credits; under `dedupe = \"business-row\"` ($12), the events not credited too (only
-- when there are some: CASE evaluates the array only then).
SELECT (SELECT count(*) FROM credited),
       CASE WHEN $12::bool AND (SELECT count(*) FROM credited) < cardinality($2::text[])
            THEN ARRAY(SELECT i.event_id FROM input i
                       WHERE NOT EXISTS (SELECT 1 FROM credited c WHERE c.event_id = i.event_id))
       END";

// Under `dedupe = "business-row"`: how many of these events not credited (`$2` their payments,
// `$3` their ids) have a credit of their own (this consumer's, with their event id): copies,
// which the ledger would have stopped; the rest are double taps. A statement of its own, so
// that it sees a credit another transaction committed while the insert waited for it (the
// same event on two partitions at once). One probe of `UNIQUE (payment_id)` each (the lateral
// keeps the planner there: joined, it hashed every credit of the consumer, 120 ms a batch).
const OWN_CREDITS: &str = "\
SELECT count(*) FROM unnest($2::text[], $3::uuid[]) AS m(payment_id, event_id)
CROSS JOIN LATERAL (SELECT c.event_id, c.consumer FROM cashback_credits c
                    WHERE c.payment_id = m.payment_id LIMIT 1) c
WHERE c.event_id = m.event_id AND c.consumer = $1";

/// The built-in cashback handler.
#[derive(Debug, Clone)]
pub struct Cashback {
    rate_bp: u32,
    /// The channel of the notification recorded with each credit, if any.
    notify: Option<String>,
}

/// The fields of one payment, read from the event.
#[derive(Debug, Clone, PartialEq)]
pub struct Payment<'a> {
    pub payment_id: &'a str,
    pub user_id: &'a str,
    pub amount_paise: i64,
    pub rate_bp: i32,
    pub occurred_at: chrono::DateTime<chrono::Utc>,
}

impl Cashback {
    pub fn new(rate_bp: u32) -> Self {
        Self {
            rate_bp,
            notify: None,
        }
    }

    /// Also records a notification on `channel` for every credit, in the credit's transaction
    /// (`notifications`, delivered by `effectively send`).
    pub fn notifying(mut self, channel: Option<String>) -> Self {
        self.notify = channel;
        self
    }

    /// Reads the payment from the event, or says which field is missing or wrong.
    pub fn payment<'a>(&self, msg: &'a Envelope) -> Result<Payment<'a>, Rejection> {
        let doc = msg.json.as_ref().ok_or_else(|| {
            Rejection::new(
                Reason::UndecodablePayload,
                "the payload is not a JSON object",
            )
        })?;
        let text = |name: &str| -> Result<&'a str, Rejection> {
            match doc.get(name) {
                Some(Value::String(s)) if !s.is_empty() => Ok(s.as_str()),
                Some(_) => Err(field(name, "must be a non-empty string")),
                None => Err(field(name, "is missing")),
            }
        };
        let payment_id = text("payment_id")?;
        let user_id = text("user_id")?;
        let amount_paise = match doc.get("amount_paise") {
            Some(v) => v
                .as_i64()
                .filter(|a| *a >= 0)
                .ok_or_else(|| field("amount_paise", "must be a non-negative integer"))?,
            None => return Err(field("amount_paise", "is missing")),
        };
        let rate_bp = match doc.get("rate_bp") {
            None | Some(Value::Null) => self.rate_bp as i64,
            Some(v) => v
                .as_i64()
                .filter(|r| (0..=10_000).contains(r))
                .ok_or_else(|| field("rate_bp", "must be an integer from 0 to 10000"))?,
        };
        let occurred_at = match doc.get("occurred_at") {
            Some(Value::String(s)) => chrono::DateTime::parse_from_rfc3339(s)
                .map_err(|e| field("occurred_at", &format!("is not an RFC 3339 time ({e})")))?
                .with_timezone(&chrono::Utc),
            Some(_) => return Err(field("occurred_at", "must be an RFC 3339 string")),
            None => return Err(field("occurred_at", "is missing")),
        };
        Ok(Payment {
            payment_id,
            user_id,
            amount_paise,
            rate_bp: rate_bp as i32,
            occurred_at,
        })
    }
}

fn field(name: &str, problem: &str) -> Rejection {
    Rejection::new(
        Reason::MissingField,
        format!("PaymentSucceeded field {name:?} {problem}"),
    )
}

/// Cashback in paise, rounded down: `amount × rate_bp / 10,000`.
pub fn cashback_paise(amount_paise: i64, rate_bp: i32) -> i64 {
    (amount_paise as i128 * rate_bp as i128 / 10_000) as i64
}

/// The outbox row's id for the payment event `event_id` of `consumer`, dated `event_date`: a
/// name-based (v5) UUID of the three, the dedupe key's parts, so the same event always yields
/// the same id and two events never share one (a message id alone is unique per consumer and
/// date only once ids can be text: a template's "order-77" on two dates, or in two consumers). When the event id is a UUIDv7, the outbox id keeps its
/// 48-bit millisecond timestamp in front (and is a v7 itself): ids then grow with time, and the
/// outbox's primary key takes each batch's rows near its right edge instead of on random leaf
/// pages all over the index (about 10% of the effect's time, docs/PERFORMANCE.md). The 74 bits
/// after the timestamp are the hash's, so two events of one millisecond still differ.
///
/// The insert needs no `ON CONFLICT`: an event reaches the effect at most once per consumer (the
/// dedupe key), and a payment is credited once across consumers (`UNIQUE (payment_id)`), so an
/// event's outbox row can only be written by the transaction that credits it.
pub fn outbox_id(consumer: &str, event_date: chrono::NaiveDate, event_id: &Uuid) -> Uuid {
    use chrono::Datelike;
    let mut name = Vec::with_capacity(consumer.len() + 1 + 4 + 16);
    name.extend_from_slice(consumer.as_bytes());
    name.push(0);
    name.extend_from_slice(&event_date.num_days_from_ce().to_be_bytes());
    name.extend_from_slice(event_id.as_bytes());
    let hashed = Uuid::new_v5(&OUTBOX_NAMESPACE, &name);
    if event_id.get_version_num() != 7 {
        return hashed;
    }
    let mut bytes = *hashed.as_bytes();
    bytes[..6].copy_from_slice(&event_id.as_bytes()[..6]);
    uuid::Builder::from_bytes(bytes)
        .with_variant(uuid::Variant::RFC4122)
        .with_version(uuid::Version::SortRand)
        .into_uuid()
}

#[async_trait]
impl Handler for Cashback {
    /// One credit a payment, under `UNIQUE (payment_id)`: a copy of an event finds its credit,
    /// with its event id, and a double tap finds another event's.
    fn dedupes_by_row(&self) -> bool {
        true
    }

    fn check(&self, msg: &Envelope) -> Result<(), Rejection> {
        self.payment(msg).map(|_| ())
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        let mut rows = Vec::with_capacity(fresh.len());
        for (i, msg) in fresh.iter().enumerate() {
            match self.payment(msg) {
                Ok(p) => rows.push((p, *msg)),
                // `check` ran before; this only fires if a message changed in between.
                Err(r) => return Err(HandlerError::Reject(vec![(i, r.to_string())])),
            }
        }
        rows.sort_by(|a, b| a.0.payment_id.cmp(b.0.payment_id));
        let payment_ids: Vec<&str> = rows.iter().map(|(p, _)| p.payment_id).collect();
        let event_ids: Vec<Uuid> = rows.iter().map(|(_, m)| m.message_id).collect();
        let user_ids: Vec<&str> = rows.iter().map(|(p, _)| p.user_id).collect();
        let amounts: Vec<i64> = rows.iter().map(|(p, _)| p.amount_paise).collect();
        let rates: Vec<i32> = rows.iter().map(|(p, _)| p.rate_bp).collect();
        let cashback: Vec<i64> = rows
            .iter()
            .map(|(p, _)| cashback_paise(p.amount_paise, p.rate_bp))
            .collect();
        let occurred: Vec<chrono::DateTime<chrono::Utc>> =
            rows.iter().map(|(p, _)| p.occurred_at).collect();
        let kafka_ts: Vec<Option<chrono::DateTime<chrono::Utc>>> =
            rows.iter().map(|(_, m)| m.kafka_ts).collect();
        let outbox_ids: Vec<Uuid> = (rows.iter())
            .map(|(_, m)| outbox_id(ctx.consumer, m.event_date, &m.message_id))
            .collect();
        let stmt = tx.prepare_cached(APPLY).await?;
        let row = tx
            .query_one(
                &stmt,
                &[
                    &ctx.consumer,
                    &payment_ids,
                    &event_ids,
                    &user_ids,
                    &amounts,
                    &rates,
                    &cashback,
                    &occurred,
                    &kafka_ts,
                    &outbox_ids,
                    &self.notify,
                    &ctx.business_row,
                ],
            )
            .await?;
        let credited = row.get::<_, i64>(0) as u64;
        let redelivered = match row.get::<_, Option<Vec<Uuid>>>(1) {
            Some(events) if !events.is_empty() => {
                let payment_of: std::collections::HashMap<Uuid, &str> = (rows.iter())
                    .map(|(p, m)| (m.message_id, p.payment_id))
                    .collect();
                let payments: Vec<&str> = events.iter().map(|e| payment_of[e]).collect();
                let stmt = tx.prepare_cached(OWN_CREDITS).await?;
                (tx.query_one(&stmt, &[&ctx.consumer, &payments, &events]))
                    .await?
                    .get::<_, i64>(0) as u64
            }
            _ => 0,
        };
        Ok(Applied {
            effects: credited,
            business_duplicates: fresh.len() as u64 - credited - redelivered,
            redelivered,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_percent_of_1200_rupees_is_24_rupees() {
        assert_eq!(cashback_paise(120_000, 200), 2_400);
        assert_eq!(cashback_paise(149, 200), 2, "rounded down");
        assert_eq!(cashback_paise(0, 200), 0);
    }

    fn day(d: u32) -> chrono::NaiveDate {
        chrono::NaiveDate::from_ymd_opt(2026, 12, d).unwrap()
    }

    #[test]
    fn outbox_id_is_stable_per_event() {
        let e = Uuid::new_v4();
        let id = |c: &str, d: u32, e: &Uuid| outbox_id(c, day(d), e);
        assert_eq!(id("c", 7, &e), id("c", 7, &e));
        assert_ne!(id("c", 7, &e), id("c", 7, &Uuid::new_v4()));
        assert_eq!(id("c", 7, &e).get_version_num(), 5);
        // A text id's key is unique per consumer and date only: so is the outbox id.
        assert_ne!(id("c", 7, &e), id("d", 7, &e), "another consumer");
        assert_ne!(id("c", 7, &e), id("c", 8, &e), "another date");
    }

    #[test]
    fn outbox_id_of_a_uuid7_event_keeps_its_time() {
        let ts = |ms: u64| {
            uuid::Timestamp::from_unix(uuid::NoContext, ms / 1000, (ms % 1000) as u32 * 1_000_000)
        };
        let early = Uuid::new_v7(ts(1_764_000_000_000));
        let same_ms = Uuid::new_v7(ts(1_764_000_000_000));
        let later = Uuid::new_v7(ts(1_764_000_000_001));
        let id = |e: &Uuid| outbox_id("c", day(7), e);
        let (a, b, c) = (id(&early), id(&same_ms), id(&later));
        assert_eq!(a, id(&early), "stable");
        assert_eq!(a.get_version_num(), 7);
        assert_eq!(a.get_variant(), uuid::Variant::RFC4122);
        assert_eq!(
            a.as_bytes()[..6],
            early.as_bytes()[..6],
            "the event's millisecond"
        );
        assert_ne!(a, b, "two events of one millisecond differ");
        assert!(a < c && b < c, "ids grow with the events' time");
        assert_ne!(a, early, "not the event id itself");
    }
}
