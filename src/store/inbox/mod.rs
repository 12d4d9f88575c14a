//! The `inbox` table's SQL: the receiver's deduplicating insert, the processors' claims and
//! marks, and the operator's status and replay. Every statement is set-based over a batch.
//!
//! Per-key order lives in one predicate shared by both claims: a row is claimable only if no
//! open (PENDING or IN_PROGRESS) row of the same consumer and ordering key has a smaller `seq`.
//! The head of a key that is waiting out a backoff, or is locked or leased by another processor,
//! therefore holds back the rest of its key, and only its key. FAILED rows are parked: they no
//! longer hold their key back (docs/DESIGN.md, "Inbox").
//!
//! The receiver's staging and insert are in `receive.rs`, the claims (head of key, slices, the
//! window, locks and leases) in `claim.rs`; this file has the marks after processing (finish,
//! fail), the operator's replay and the status.

mod claim;
pub mod members;
mod receive;

pub use claim::{claim_leased, claim_locked, hold_leased, release_leased, Claimed, Slice};
pub use receive::{receive, stage, Incoming};

use chrono::{DateTime, NaiveDate, Utc};
use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::StoreError;

// The statements on open rows (here and in `claim.rs`) name the consumer as `(SELECT $1::text)`, a value the planner
// cannot see, so it estimates the consumer's rows as an average consumer's rather than from
// statistics that may predate it (a burst into a new consumer: "1 row"). On that estimate it
// hash-joined a batch's `(message_id, event_date)` pairs against every row of the consumer,
// 94 ms to mark 100 rows DONE in a 100,000-row backlog; hidden, it looks each pair up by
// primary key, 1.7 ms.

const MARK_DONE: &str = "\
UPDATE inbox i SET status = 'DONE', done_at = now(), attempts = i.attempts + $4,
                   lease_until = NULL, claim_token = NULL, last_error = NULL
FROM unnest($2::uuid[], $3::date[]) AS d(message_id, event_date)
WHERE i.consumer = (SELECT $1::text) AND i.event_date = ANY($3::date[])
  AND i.message_id = d.message_id AND i.event_date = d.event_date";

const DELETE_DONE: &str = "\
DELETE FROM inbox i
USING unnest($2::uuid[], $3::date[]) AS d(message_id, event_date)
WHERE i.consumer = (SELECT $1::text) AND i.event_date = ANY($3::date[])
  AND i.message_id = d.message_id AND i.event_date = d.event_date";

/// Finishes applied rows in the caller's transaction: DONE (counting this attempt when
/// `count_attempt`), or deleted.
pub async fn finish(
    tx: &Transaction<'_>,
    consumer: &str,
    keys: &[(Uuid, NaiveDate)],
    delete: bool,
    count_attempt: bool,
) -> Result<u64, StoreError> {
    if keys.is_empty() {
        return Ok(0);
    }
    let (ids, dates) = split(keys);
    if delete {
        let stmt = tx.prepare_cached(DELETE_DONE).await?;
        return Ok(tx.execute(&stmt, &[&consumer, &ids, &dates]).await?);
    }
    let stmt = tx.prepare_cached(MARK_DONE).await?;
    let inc = count_attempt as i32;
    Ok(tx.execute(&stmt, &[&consumer, &ids, &dates, &inc]).await?)
}

/// A row whose attempt failed.
#[derive(Debug, Clone)]
pub struct Failure {
    pub message_id: Uuid,
    pub event_date: NaiveDate,
    /// Parked as FAILED (permanent, or out of attempts); else retried after `delay_ms`.
    pub failed: bool,
    pub delay_ms: i64,
    pub error: String,
}

const FAIL: &str = "\
UPDATE inbox i
SET attempts = i.attempts + $7,
    status = CASE WHEN f.failed THEN 'FAILED' ELSE 'PENDING' END,
    next_attempt_at = now() + f.delay_ms * interval '1 millisecond',
    last_error = f.error, lease_until = NULL, claim_token = NULL
FROM unnest($2::uuid[], $3::date[], $4::bool[], $5::int8[], $6::text[])
     AS f(message_id, event_date, failed, delay_ms, error)
WHERE i.consumer = (SELECT $1::text) AND i.event_date = ANY($3::date[])
  AND i.message_id = f.message_id AND i.event_date = f.event_date";

/// Records failed attempts in the caller's transaction (`count_attempt`: lock claims, whose
/// claim did not count it yet).
pub async fn fail(
    tx: &Transaction<'_>,
    consumer: &str,
    rows: &[Failure],
    count_attempt: bool,
) -> Result<u64, StoreError> {
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<Uuid> = rows.iter().map(|f| f.message_id).collect();
    let dates: Vec<NaiveDate> = rows.iter().map(|f| f.event_date).collect();
    let failed: Vec<bool> = rows.iter().map(|f| f.failed).collect();
    let delays: Vec<i64> = rows.iter().map(|f| f.delay_ms).collect();
    let errors: Vec<&str> = rows.iter().map(|f| f.error.as_str()).collect();
    let inc = count_attempt as i32;
    let stmt = tx.prepare_cached(FAIL).await?;
    Ok(tx
        .execute(
            &stmt,
            &[&consumer, &ids, &dates, &failed, &delays, &errors, &inc],
        )
        .await?)
}

fn split(keys: &[(Uuid, NaiveDate)]) -> (Vec<Uuid>, Vec<NaiveDate>) {
    keys.iter().copied().unzip()
}

/// Which rows `effectively inbox replay` puts back.
#[derive(Debug, Clone, Default)]
pub struct ReplayFilter {
    /// Only FAILED rows; otherwise FAILED and DONE ones.
    pub failed_only: bool,
    /// Only rows received at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Only rows of this ordering key.
    pub key: Option<String>,
}

const REPLAY_WHERE: &str = "\
consumer = $1 AND status = ANY($2::text[])
  AND ($3::timestamptz IS NULL OR received_at >= $3)
  AND ($4::text IS NULL OR ordering_key = $4)";

const REPLAY_SET: &str = "\
UPDATE inbox
SET status = 'PENDING', attempts = 0, next_attempt_at = now(), lease_until = NULL,
    claim_token = NULL, done_at = NULL
WHERE ";

impl ReplayFilter {
    fn statuses(&self) -> Vec<&'static str> {
        if self.failed_only {
            vec!["FAILED"]
        } else {
            vec!["FAILED", "DONE"]
        }
    }
}

/// Puts matching rows back to PENDING; returns how many. The effect is then applied again, so
/// replaying DONE rows is safe only for an effect that keeps its own business key.
pub async fn replay<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    filter: &ReplayFilter,
) -> Result<u64, StoreError> {
    let sql = format!("{REPLAY_SET}{REPLAY_WHERE}");
    let statuses = filter.statuses();
    Ok(client
        .execute(&sql, &[&consumer, &statuses, &filter.since, &filter.key])
        .await?)
}

/// How many rows [`replay`] would put back (`--dry-run`).
pub async fn replay_count<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    filter: &ReplayFilter,
) -> Result<i64, StoreError> {
    let sql = format!("SELECT count(*) FROM inbox WHERE {REPLAY_WHERE}");
    let statuses = filter.statuses();
    Ok(client
        .query_one(&sql, &[&consumer, &statuses, &filter.since, &filter.key])
        .await?
        .get(0))
}

/// One consumer's inbox at a glance.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Status {
    pub consumer: String,
    pub pending: i64,
    /// PENDING rows whose next attempt is due now (the rest wait out a backoff).
    pub due: i64,
    pub in_progress: i64,
    pub failed: i64,
    /// Events held behind a missing version (`[consumer.version]`, delta mode).
    pub held: i64,
    /// Age of the oldest PENDING row, in seconds (0 when there is none).
    pub oldest_pending_s: f64,
}

const STATUS: &str = "\
SELECT c.consumer,
       count(i.*) FILTER (WHERE i.status = 'PENDING'),
       count(i.*) FILTER (WHERE i.status = 'PENDING' AND i.next_attempt_at <= now()),
       count(i.*) FILTER (WHERE i.status = 'IN_PROGRESS'),
       count(i.*) FILTER (WHERE i.status = 'FAILED'),
       count(i.*) FILTER (WHERE i.status = 'HELD'),
       coalesce(extract(epoch FROM now() - min(i.received_at)
                        FILTER (WHERE i.status = 'PENDING')), 0)::float8
FROM unnest($1::text[]) AS c(consumer)
LEFT JOIN inbox i ON i.consumer = c.consumer
                 AND i.status IN ('PENDING', 'IN_PROGRESS', 'FAILED', 'HELD')
GROUP BY c.consumer ORDER BY c.consumer";

/// The inbox status of each of `consumers` (a consumer with no rows shows zeros).
pub async fn status<C: GenericClient + Sync>(
    client: &C,
    consumers: &[String],
) -> Result<Vec<Status>, StoreError> {
    let rows = client.query(STATUS, &[&consumers]).await?;
    Ok(rows
        .iter()
        .map(|r| Status {
            consumer: r.get(0),
            pending: r.get(1),
            due: r.get(2),
            in_progress: r.get(3),
            failed: r.get(4),
            held: r.get(5),
            oldest_pending_s: r.get(6),
        })
        .collect())
}
