//! What waits for an operator: dead letters that are still parked (`resolution IS NULL`) and
//! FAILED inbox rows, read by the same [`Filter`] for `effectively dead-letters list`,
//! `effectively inbox list` and the console's parked view.
//!
//! Pages are keyset pages (newest first, `before` the last id or seq seen), and counts are
//! capped (`count(*)` over at most `cap + 1` rows), so a page costs the same with a million
//! parked rows as with ten.

use chrono::{DateTime, NaiveDate, Utc};
use tokio_postgres::types::ToSql;
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::StoreError;

/// The reason a FAILED inbox row shows in the parked view (its handler's error is its detail).
/// A filter on any other reason leaves inbox rows out.
pub const INBOX_REASON: &str = "inbox_failed";

/// Which parked rows. Every field narrows; `Default` is everything.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Filter {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<i32>,
    /// Parked (a dead letter's `last_seen`, an inbox row's `received_at`) at or after.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<DateTime<Utc>>,
    /// Parked before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub until: Option<DateTime<Utc>>,
}

impl Filter {
    /// Whether FAILED inbox rows can match at all.
    pub fn takes_inbox(&self) -> bool {
        self.reason.as_deref().is_none_or(|r| r == INBOX_REASON)
    }

    /// The filter as SQL parameters `$1..$6`, in the order the `WHERE` fragments below use,
    /// followed by `extra` (`$7..`).
    pub(crate) fn params<'a>(
        &'a self,
        extra: &[&'a (dyn ToSql + Sync)],
    ) -> Vec<&'a (dyn ToSql + Sync)> {
        let mut p: Vec<&'a (dyn ToSql + Sync)> = vec![
            &self.consumer,
            &self.reason,
            &self.topic,
            &self.partition,
            &self.since,
            &self.until,
        ];
        p.extend_from_slice(extra);
        p
    }
}

/// A capped count: `count` rows, or at least `count` when `more`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capped {
    pub count: i64,
    pub more: bool,
}

impl std::fmt::Display for Capped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.more {
            write!(f, "{}+", self.count)
        } else {
            write!(f, "{}", self.count)
        }
    }
}

/// The record as Kafka delivered it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Message {
    pub key: Option<Vec<u8>>,
    pub headers: Vec<(String, Option<Vec<u8>>)>,
    pub payload: Option<Vec<u8>>,
    pub kafka_ts: Option<DateTime<Utc>>,
}

/// A dead letter in a list.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetterSummary {
    pub id: i64,
    pub consumer: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub message_id: Option<Uuid>,
    /// The text the message id was made from, when it was not a UUID (a Stripe-like id, a
    /// template's business key).
    pub message_key: Option<String>,
    pub reason: String,
    pub detail: String,
    pub attempts: i32,
    pub first_seen: DateTime<Utc>,
    pub last_seen: DateTime<Utc>,
}

/// What an operator did with a dead letter.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolution {
    /// `redriven` or `discarded`.
    pub what: String,
    pub at: DateTime<Utc>,
    pub by: String,
    /// The audit action (`operator_actions.action`).
    pub action: Uuid,
    /// Where a redriven copy landed: `topic/partition@offset`.
    pub redriven_to: Option<String>,
}

/// One dead letter, whole.
#[derive(Debug, Clone, PartialEq)]
pub struct DeadLetter {
    pub summary: DeadLetterSummary,
    pub message: Message,
    pub resolution: Option<Resolution>,
}

/// A FAILED inbox row in a list.
#[derive(Debug, Clone, PartialEq)]
pub struct FailedSummary {
    pub consumer: String,
    pub message_id: Uuid,
    pub event_date: NaiveDate,
    pub seq: i64,
    pub ordering_key: String,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub received_at: DateTime<Utc>,
}

/// One inbox row, whole (any status: a replayed or discarded row can still be looked at).
#[derive(Debug, Clone, PartialEq)]
pub struct InboxRow {
    pub summary: FailedSummary,
    pub status: String,
    pub next_attempt_at: DateTime<Utc>,
    pub message: Message,
}

/// The dead-letter filter over `$1..$6`; `resolution IS NULL`: parked only.
pub(crate) const DEAD_LETTER_WHERE: &str = "\
resolution IS NULL
  AND ($1::text IS NULL OR consumer = $1)
  AND ($2::text IS NULL OR reason = $2)
  AND ($3::text IS NULL OR topic = $3)
  AND ($4::int IS NULL OR partition = $4)
  AND ($5::timestamptz IS NULL OR last_seen >= $5)
  AND ($6::timestamptz IS NULL OR last_seen < $6)";

/// The FAILED-inbox filter over `$1..$6` (the caller checks [`Filter::takes_inbox`]).
pub(crate) const INBOX_WHERE: &str = "\
status = 'FAILED'
  AND ($1::text IS NULL OR consumer = $1)
  AND ($2::text IS NULL OR $2 = 'inbox_failed')
  AND ($3::text IS NULL OR topic = $3)
  AND ($4::int IS NULL OR partition = $4)
  AND ($5::timestamptz IS NULL OR received_at >= $5)
  AND ($6::timestamptz IS NULL OR received_at < $6)";

pub(crate) const SUMMARY_COLUMNS: &str =
    "id, consumer, topic, partition, \"offset\", message_id, reason, \
                               detail, attempts, first_seen, last_seen, message_key";

pub(crate) const FAILED_COLUMNS: &str =
    "consumer, message_id, event_date, seq, ordering_key, attempts, \
                              last_error, topic, partition, \"offset\", received_at";

pub(crate) fn summary(r: &tokio_postgres::Row) -> DeadLetterSummary {
    DeadLetterSummary {
        id: r.get(0),
        consumer: r.get(1),
        topic: r.get(2),
        partition: r.get(3),
        offset: r.get(4),
        message_id: r.get(5),
        reason: r.get(6),
        detail: r.get(7),
        attempts: r.get(8),
        first_seen: r.get(9),
        last_seen: r.get(10),
        message_key: r.get(11),
    }
}

pub(crate) fn failed(r: &tokio_postgres::Row) -> FailedSummary {
    FailedSummary {
        consumer: r.get(0),
        message_id: r.get(1),
        event_date: r.get(2),
        seq: r.get(3),
        ordering_key: r.get(4),
        attempts: r.get(5),
        last_error: r.get(6),
        topic: r.get(7),
        partition: r.get(8),
        offset: r.get(9),
        received_at: r.get(10),
    }
}

/// The key, headers, payload and timestamp at columns `at..at + 5`.
fn message(r: &tokio_postgres::Row, at: usize) -> Message {
    let names: Vec<String> = r.get(at + 1);
    let values: Vec<Option<Vec<u8>>> = r.get(at + 2);
    Message {
        key: r.get(at),
        headers: names.into_iter().zip(values).collect(),
        payload: r.get(at + 3),
        kafka_ts: r.get(at + 4),
    }
}

/// Parked dead letters matching `f`, newest first, older than `before` (an id) if given.
pub async fn dead_letters<C: GenericClient + Sync>(
    client: &C,
    f: &Filter,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<DeadLetterSummary>, StoreError> {
    let sql = format!(
        "SELECT {SUMMARY_COLUMNS} FROM dead_letters WHERE {DEAD_LETTER_WHERE}
           AND ($7::int8 IS NULL OR id < $7)
         ORDER BY id DESC LIMIT $8"
    );
    let rows = client.query(&sql, &f.params(&[&before, &limit])).await?;
    Ok(rows.iter().map(summary).collect())
}

/// One dead letter by id, parked or resolved.
pub async fn dead_letter<C: GenericClient + Sync>(
    client: &C,
    id: i64,
) -> Result<Option<DeadLetter>, StoreError> {
    let sql = format!(
        "SELECT {SUMMARY_COLUMNS}, key, header_names, header_values, payload, kafka_ts,
                resolution, resolved_at, resolved_by, resolved_action, redriven_to
         FROM dead_letters WHERE id = $1"
    );
    let Some(r) = client.query_opt(&sql, &[&id]).await? else {
        return Ok(None);
    };
    let what: Option<String> = r.get(17);
    Ok(Some(DeadLetter {
        summary: summary(&r),
        message: message(&r, 12),
        resolution: what.map(|what| Resolution {
            what,
            at: r.get(18),
            by: r.get(19),
            action: r.get(20),
            redriven_to: r.get(21),
        }),
    }))
}

/// How many parked dead letters match `f`, counting at most `cap + 1`.
pub async fn count_dead_letters<C: GenericClient + Sync>(
    client: &C,
    f: &Filter,
    cap: i64,
) -> Result<Capped, StoreError> {
    let sql = format!(
        "SELECT count(*) FROM (SELECT 1 FROM dead_letters WHERE {DEAD_LETTER_WHERE} LIMIT $7) s"
    );
    capped(client, &sql, f, cap).await
}

/// FAILED inbox rows matching `f`, newest first, older than `before` (a seq) if given.
pub async fn failed_inbox<C: GenericClient + Sync>(
    client: &C,
    f: &Filter,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<FailedSummary>, StoreError> {
    if !f.takes_inbox() {
        return Ok(Vec::new());
    }
    let sql = format!(
        "SELECT {FAILED_COLUMNS} FROM inbox WHERE {INBOX_WHERE}
           AND ($7::int8 IS NULL OR seq < $7)
         ORDER BY seq DESC LIMIT $8"
    );
    let rows = client.query(&sql, &f.params(&[&before, &limit])).await?;
    Ok(rows.iter().map(failed).collect())
}

/// One inbox row of `consumer` by message id, whatever its status.
pub async fn inbox_row<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    message_id: Uuid,
) -> Result<Option<InboxRow>, StoreError> {
    let sql = format!(
        "SELECT {FAILED_COLUMNS}, key, header_names, header_values, payload, kafka_ts,
                status, next_attempt_at
         FROM inbox WHERE consumer = $1 AND message_id = $2"
    );
    let Some(r) = client.query_opt(&sql, &[&consumer, &message_id]).await? else {
        return Ok(None);
    };
    Ok(Some(InboxRow {
        summary: failed(&r),
        message: message(&r, 11),
        status: r.get(16),
        next_attempt_at: r.get(17),
    }))
}

/// How many FAILED inbox rows match `f`, counting at most `cap + 1`.
pub async fn count_failed_inbox<C: GenericClient + Sync>(
    client: &C,
    f: &Filter,
    cap: i64,
) -> Result<Capped, StoreError> {
    if !f.takes_inbox() {
        return Ok(Capped {
            count: 0,
            more: false,
        });
    }
    let sql = format!("SELECT count(*) FROM (SELECT 1 FROM inbox WHERE {INBOX_WHERE} LIMIT $7) s");
    capped(client, &sql, f, cap).await
}

async fn capped<C: GenericClient + Sync>(
    client: &C,
    sql: &str,
    f: &Filter,
    cap: i64,
) -> Result<Capped, StoreError> {
    let limit = cap + 1;
    let n: i64 = client.query_one(sql, &f.params(&[&limit])).await?.get(0);
    Ok(Capped {
        count: n.min(cap),
        more: n > cap,
    })
}
