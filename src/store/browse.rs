//! The web console's read-only queries: the overview's numbers and the inbox, outbox and
//! notifications lists.
//!
//! A page load must stay fast on tables of millions of rows, so nothing here counts a big
//! table whole. Counts are capped (`count(*)` over a subquery `LIMIT cap + 1`: at most `cap`
//! index entries read, shown as "10,000+"), a table's size is the planner's estimate
//! (`pg_class.reltuples`), the distinct values of a column are found by a loose index scan
//! (one index descent per value, a recursive CTE), and lists are keyset-paginated on an
//! indexed column (`seq`) rather than `OFFSET`, so the thousandth page costs what the first
//! does.

use chrono::{DateTime, NaiveDate, Utc};
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::parked::{self, DeadLetterSummary, FailedSummary, Filter};
use super::StoreError;

/// The most a capped count reads.
pub const CAP: i64 = 10_000;

/// The cap of the parked page's counts under a time window. A window is checked on the heap
/// (no index holds the partition and the time together), so its count reads rows rather than
/// index entries: at 10,000 it cost 15 to 120 ms a count with 1,000,000 rows, which put the
/// page's p99 over 200 ms; at 1,000, a tenth of that. The confirmation step counts exactly.
pub const WINDOW_CAP: i64 = 1_000;

/// A count that stops at a cap.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capped {
    pub count: i64,
    /// More rows exist than `count` (the cap was reached).
    pub more: bool,
}

impl Capped {
    fn of(n: i64, cap: i64) -> Capped {
        Capped {
            count: n.min(cap),
            more: n > cap,
        }
    }
}

/// One stored offset row.
#[derive(Debug, Clone)]
pub struct Offset {
    pub topic: String,
    pub partition: i32,
    pub next_offset: Option<i64>,
    pub owner: String,
    pub updated_at: DateTime<Utc>,
}

const OFFSETS: &str = "\
SELECT topic, partition, next_offset, owner, updated_at FROM consumer_offsets
WHERE consumer = $1 ORDER BY topic, partition";

/// Every partition `consumer` has stored an offset for.
pub async fn offsets<C: GenericClient + Sync>(
    c: &C,
    consumer: &str,
) -> Result<Vec<Offset>, StoreError> {
    let rows = c.query(OFFSETS, &[&consumer]).await?;
    Ok(rows
        .iter()
        .map(|r| Offset {
            topic: r.get(0),
            partition: r.get(1),
            next_offset: r.get(2),
            owner: r.get(3),
            updated_at: r.get(4),
        })
        .collect())
}

/// One consumer's inbox, counted with caps.
#[derive(Debug, Clone, Default)]
pub struct InboxCounts {
    pub pending: Capped,
    pub in_progress: Capped,
    pub failed: Capped,
    pub held: Capped,
    /// When the oldest PENDING row (by arrival) was received.
    pub oldest_pending: Option<DateTime<Utc>>,
}

// Each status's count reads its own partial index (inbox_open, inbox_failed, inbox_held), at
// most `$2` entries. The oldest PENDING row is the first by `seq` (arrival order) on
// inbox_open, rather than min(received_at), which would read every PENDING row.
const INBOX_COUNTS: &str = "\
SELECT (SELECT count(*) FROM (SELECT 1 FROM inbox WHERE consumer = $1 AND status = 'PENDING' LIMIT $2) x),
       (SELECT count(*) FROM (SELECT 1 FROM inbox WHERE consumer = $1 AND status = 'IN_PROGRESS' LIMIT $2) x),
       (SELECT count(*) FROM (SELECT 1 FROM inbox WHERE consumer = $1 AND status = 'FAILED' LIMIT $2) x),
       (SELECT count(*) FROM (SELECT 1 FROM inbox WHERE consumer = $1 AND status = 'HELD' LIMIT $2) x),
       (SELECT received_at FROM inbox WHERE consumer = $1 AND status = 'PENDING' ORDER BY seq LIMIT 1)";

pub async fn inbox_counts<C: GenericClient + Sync>(
    c: &C,
    consumer: &str,
    cap: i64,
) -> Result<InboxCounts, StoreError> {
    let r = c.query_one(INBOX_COUNTS, &[&consumer, &(cap + 1)]).await?;
    Ok(InboxCounts {
        pending: Capped::of(r.get(0), cap),
        in_progress: Capped::of(r.get(1), cap),
        failed: Capped::of(r.get(2), cap),
        held: Capped::of(r.get(3), cap),
        oldest_pending: r.get(4),
    })
}

// Still-parked rows only (`resolution IS NULL`, V8): the reasons by a loose scan of
// dead_letters_parked_consumer (one descent per reason), then a capped count per reason.
const DEAD_LETTERS_BY_REASON: &str = "\
WITH RECURSIVE r AS (
    (SELECT reason FROM dead_letters WHERE consumer = $1 AND resolution IS NULL
     ORDER BY reason LIMIT 1)
    UNION ALL
    SELECT (SELECT d.reason FROM dead_letters d
            WHERE d.consumer = $1 AND d.resolution IS NULL AND d.reason > r.reason
            ORDER BY d.reason LIMIT 1)
    FROM r WHERE r.reason IS NOT NULL
)
SELECT reason,
       (SELECT count(*) FROM (SELECT 1 FROM dead_letters d
                              WHERE d.consumer = $1 AND d.resolution IS NULL
                                AND d.reason = r.reason LIMIT $2) x)
FROM r WHERE reason IS NOT NULL ORDER BY reason";

/// Dead letters of `consumer` still parked, by reason, each count capped.
pub async fn dead_letters_by_reason<C: GenericClient + Sync>(
    c: &C,
    consumer: &str,
    cap: i64,
) -> Result<Vec<(String, Capped)>, StoreError> {
    let rows = c
        .query(DEAD_LETTERS_BY_REASON, &[&consumer, &(cap + 1)])
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), Capped::of(r.get(1), cap)))
        .collect())
}

/// The outbox's unpublished rows of one event type.
#[derive(Debug, Clone)]
pub struct Backlog {
    pub event_type: String,
    pub unpublished: Capped,
    /// When the oldest (first by `seq`) unpublished row was written.
    pub oldest: Option<DateTime<Utc>>,
}

// The event types by a loose scan of outbox_unpublished (event_type, seq), then per type a
// capped count and its first row by seq.
const OUTBOX_BACKLOG: &str = "\
WITH RECURSIVE t AS (
    (SELECT event_type FROM outbox WHERE published_at IS NULL ORDER BY event_type LIMIT 1)
    UNION ALL
    SELECT (SELECT o.event_type FROM outbox o
            WHERE o.published_at IS NULL AND o.event_type > t.event_type
            ORDER BY o.event_type LIMIT 1)
    FROM t WHERE t.event_type IS NOT NULL
)
SELECT event_type,
       (SELECT count(*) FROM (SELECT 1 FROM outbox o
                              WHERE o.published_at IS NULL AND o.event_type = t.event_type
                              LIMIT $1) x),
       (SELECT o.created_at FROM outbox o
        WHERE o.published_at IS NULL AND o.event_type = t.event_type ORDER BY o.seq LIMIT 1)
FROM t WHERE event_type IS NOT NULL ORDER BY event_type";

pub async fn outbox_backlog<C: GenericClient + Sync>(
    c: &C,
    cap: i64,
) -> Result<Vec<Backlog>, StoreError> {
    let rows = c.query(OUTBOX_BACKLOG, &[&(cap + 1)]).await?;
    Ok(rows
        .iter()
        .map(|r| Backlog {
            event_type: r.get(0),
            unpublished: Capped::of(r.get(1), cap),
            oldest: r.get(2),
        })
        .collect())
}

/// The statuses a notification can have, in the order the pages list them.
pub const NOTIFICATION_STATUSES: [&str; 6] = [
    "PENDING",
    "SENDING",
    "FAILED",
    "SENT",
    "SKIPPED",
    "DISCARDED",
];

const NOTIFICATIONS_BY_STATUS: &str = "\
SELECT s, (SELECT count(*) FROM (SELECT 1 FROM notifications n WHERE n.status = s LIMIT $2) x)
FROM unnest($1::text[]) WITH ORDINALITY AS u(s, i) ORDER BY i";

/// Notifications by status, each count capped.
pub async fn notifications_by_status<C: GenericClient + Sync>(
    c: &C,
    cap: i64,
) -> Result<Vec<(String, Capped)>, StoreError> {
    let statuses: Vec<&str> = NOTIFICATION_STATUSES.to_vec();
    let rows = c
        .query(NOTIFICATIONS_BY_STATUS, &[&statuses, &(cap + 1)])
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), Capped::of(r.get(1), cap)))
        .collect())
}

// Partitioned tables (inbox) keep their statistics on the partitions.
const ESTIMATE: &str = "\
SELECT coalesce((SELECT sum(greatest(c.reltuples, 0))::float8 FROM pg_inherits i
                 JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = to_regclass($1)), 0)
     + coalesce((SELECT greatest(reltuples, 0)::float8 FROM pg_class
                 WHERE oid = to_regclass($1) AND relkind = 'r'), 0)";

/// The planner's estimate of a table's rows (as of its last ANALYZE or VACUUM).
pub async fn estimate<C: GenericClient + Sync>(c: &C, table: &str) -> Result<f64, StoreError> {
    Ok(c.query_one(ESTIMATE, &[&table]).await?.get(0))
}

/// One inbox row as the inbox page lists it.
#[derive(Debug, Clone)]
pub struct InboxItem {
    pub message_id: Uuid,
    pub event_date: NaiveDate,
    pub seq: i64,
    pub ordering_key: String,
    pub status: String,
    pub attempts: i32,
    pub next_attempt_at: DateTime<Utc>,
    pub lease_until: Option<DateTime<Utc>>,
    pub last_error: Option<String>,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub received_at: DateTime<Utc>,
    pub aggregate: Option<String>,
    pub version: Option<i64>,
}

const INBOX_ITEM: &str = "message_id, event_date, seq, ordering_key, status, attempts, \
    next_attempt_at, lease_until, last_error, topic, partition, \"offset\", received_at, \
    aggregate, version";

/// The inbox page's statuses. DONE rows are history with no index of their own; they are not
/// listed (a list of them would read the consumer's whole inbox).
pub const INBOX_STATUSES: [&str; 4] = ["PENDING", "IN_PROGRESS", "FAILED", "HELD"];

// Open rows oldest first (what runs next), on inbox_open; FAILED newest first, on inbox_failed;
// HELD by aggregate and version, on inbox_held. `$3` is the cursor: the last row shown.
static INBOX_PAGE: std::sync::LazyLock<[String; 3]> = std::sync::LazyLock::new(|| {
    [
        format!(
            "SELECT {INBOX_ITEM} FROM inbox WHERE consumer = $1 AND status = $2
             AND ($3::bigint IS NULL OR seq > $3) ORDER BY seq LIMIT $4"
        ),
        format!(
            "SELECT {INBOX_ITEM} FROM inbox WHERE consumer = $1 AND status = $2
             AND ($3::bigint IS NULL OR seq < $3) ORDER BY seq DESC LIMIT $4"
        ),
        format!(
            "SELECT {INBOX_ITEM} FROM inbox WHERE consumer = $1 AND status = $2
             AND ($3::text IS NULL OR (aggregate, version) > ($3, $5))
             ORDER BY aggregate, version LIMIT $4"
        ),
    ]
});

/// Where a list page starts: after the last row of the page before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxCursor {
    pub seq: Option<i64>,
    /// HELD rows page by (aggregate, version).
    pub aggregate: Option<String>,
    pub version: Option<i64>,
}

/// Up to `limit` rows of `consumer` in `status` (one of [`INBOX_STATUSES`]) after `cursor`.
pub async fn inbox_page<C: GenericClient + Sync>(
    c: &C,
    consumer: &str,
    status: &str,
    cursor: &InboxCursor,
    limit: i64,
) -> Result<Vec<InboxItem>, StoreError> {
    let rows = match status {
        "HELD" => {
            let version = cursor.version.unwrap_or(0);
            c.query(
                &INBOX_PAGE[2],
                &[&consumer, &status, &cursor.aggregate, &limit, &version],
            )
            .await?
        }
        "FAILED" => (c.query(&INBOX_PAGE[1], &[&consumer, &status, &cursor.seq, &limit])).await?,
        _ => (c.query(&INBOX_PAGE[0], &[&consumer, &status, &cursor.seq, &limit])).await?,
    };
    Ok(rows
        .iter()
        .map(|r| InboxItem {
            message_id: r.get(0),
            event_date: r.get(1),
            seq: r.get(2),
            ordering_key: r.get(3),
            status: r.get(4),
            attempts: r.get(5),
            next_attempt_at: r.get(6),
            lease_until: r.get(7),
            last_error: r.get(8),
            topic: r.get(9),
            partition: r.get(10),
            offset: r.get(11),
            received_at: r.get(12),
            aggregate: r.get(13),
            version: r.get(14),
        })
        .collect())
}

/// One outbox row as the outbox page lists it.
#[derive(Debug, Clone)]
pub struct OutboxItem {
    pub seq: i64,
    pub id: Uuid,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: serde_json::Value,
    pub created_at: DateTime<Utc>,
    pub published_at: Option<DateTime<Utc>>,
}

// Unpublished oldest first (what the relay sends next); published newest first.
const OUTBOX_UNPUBLISHED: &str = "\
SELECT seq, id, aggregate_id, event_type, payload, created_at, published_at FROM outbox
WHERE published_at IS NULL AND ($1::bigint IS NULL OR seq > $1) ORDER BY seq LIMIT $2";
const OUTBOX_PUBLISHED: &str = "\
SELECT seq, id, aggregate_id, event_type, payload, created_at, published_at FROM outbox
WHERE published_at IS NOT NULL AND ($1::bigint IS NULL OR seq < $1) ORDER BY seq DESC LIMIT $2";

pub async fn outbox_page<C: GenericClient + Sync>(
    c: &C,
    published: bool,
    cursor: Option<i64>,
    limit: i64,
) -> Result<Vec<OutboxItem>, StoreError> {
    let sql = if published {
        OUTBOX_PUBLISHED
    } else {
        OUTBOX_UNPUBLISHED
    };
    let rows = c.query(sql, &[&cursor, &limit]).await?;
    Ok(rows
        .iter()
        .map(|r| OutboxItem {
            seq: r.get(0),
            id: r.get(1),
            aggregate_id: r.get(2),
            event_type: r.get(3),
            payload: r.get(4),
            created_at: r.get(5),
            published_at: r.get(6),
        })
        .collect())
}

/// One notification as the notifications page lists it.
#[derive(Debug, Clone)]
pub struct NotificationItem {
    pub event_id: Uuid,
    pub channel: String,
    pub status: String,
    pub payload: serde_json::Value,
    pub attempts: i32,
    pub next_attempt_at: DateTime<Utc>,
    pub provider_id: Option<String>,
    pub last_error: Option<String>,
    pub created_at: DateTime<Utc>,
    pub sent_at: Option<DateTime<Utc>>,
}

/// Where a notifications page starts: after this row (newest first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NotificationCursor {
    pub created_at: Option<DateTime<Utc>>,
    pub event_id: Option<Uuid>,
    pub channel: Option<String>,
}

const NOTIFICATIONS_PAGE: &str = "\
SELECT event_id, channel, status, payload, attempts, next_attempt_at, provider_id, last_error,
       created_at, sent_at
FROM notifications
WHERE status = $1 AND ($2::text IS NULL OR channel = $2)
  AND ($3::timestamptz IS NULL OR (created_at, event_id, channel) < ($3, $4, $5))
ORDER BY created_at DESC, event_id DESC, channel DESC LIMIT $6";

pub async fn notifications_page<C: GenericClient + Sync>(
    c: &C,
    status: &str,
    channel: Option<&str>,
    cursor: &NotificationCursor,
    limit: i64,
) -> Result<Vec<NotificationItem>, StoreError> {
    let event_id = cursor.event_id.unwrap_or_default();
    let cursor_channel = cursor.channel.clone().unwrap_or_default();
    let rows = c
        .query(
            NOTIFICATIONS_PAGE,
            &[
                &status,
                &channel,
                &cursor.created_at,
                &event_id,
                &cursor_channel,
                &limit,
            ],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| NotificationItem {
            event_id: r.get(0),
            channel: r.get(1),
            status: r.get(2),
            payload: r.get(3),
            attempts: r.get(4),
            next_attempt_at: r.get(5),
            provider_id: r.get(6),
            last_error: r.get(7),
            created_at: r.get(8),
            sent_at: r.get(9),
        })
        .collect())
}

/// The channels among the first 10,000 notifications read: the filter's choices, without
/// reading the whole table for them (no index starts with the channel).
const CHANNELS: &str = "\
SELECT DISTINCT channel FROM (SELECT channel FROM notifications LIMIT 10000) x ORDER BY 1";

pub async fn notification_channels<C: GenericClient + Sync>(
    c: &C,
) -> Result<Vec<String>, StoreError> {
    Ok(c.query(CHANNELS, &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

// A time window (`since`/`until`, on a dead letter's `last_seen` and an inbox row's
// `received_at`) pages by that time instead of by id or seq: by id, a window an hour back
// walks every newer row before its first match (260 ms for 1,000,000 rows); by time, the
// partial indexes of V9__console.sql start at the window. `$1..$6` are the filter as in
// `store::parked`, `$7`/`$8` the cursor (the last row shown), `$9` the limit.
static WINDOW_DEAD_LETTERS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {} FROM dead_letters WHERE {}
           AND ($7::timestamptz IS NULL OR (last_seen, id) < ($7, $8))
         ORDER BY last_seen DESC, id DESC LIMIT $9",
        parked::SUMMARY_COLUMNS,
        parked::DEAD_LETTER_WHERE
    )
});
static WINDOW_FAILED: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {} FROM inbox WHERE {}
           AND ($7::timestamptz IS NULL OR (received_at, seq) < ($7, $8))
         ORDER BY received_at DESC, seq DESC LIMIT $9",
        parked::FAILED_COLUMNS,
        parked::INBOX_WHERE
    )
});

/// Where a time-ordered page starts: after this row (its time and id or seq).
pub type TimeCursor = Option<(DateTime<Utc>, i64)>;

/// Parked dead letters matching `f` (which has a time window), newest `last_seen` first.
pub async fn dead_letters_in_window<C: GenericClient + Sync>(
    c: &C,
    f: &Filter,
    after: TimeCursor,
    limit: i64,
) -> Result<Vec<DeadLetterSummary>, StoreError> {
    let (at, id) = (after.map(|a| a.0), after.map_or(0, |a| a.1));
    let rows = c
        .query(WINDOW_DEAD_LETTERS.as_str(), &f.params(&[&at, &id, &limit]))
        .await?;
    Ok(rows.iter().map(parked::summary).collect())
}

/// FAILED inbox rows matching `f` (which has a time window), newest `received_at` first.
pub async fn failed_inbox_in_window<C: GenericClient + Sync>(
    c: &C,
    f: &Filter,
    after: TimeCursor,
    limit: i64,
) -> Result<Vec<FailedSummary>, StoreError> {
    if !f.takes_inbox() {
        return Ok(Vec::new());
    }
    let (at, seq) = (after.map(|a| a.0), after.map_or(0, |a| a.1));
    let rows = c
        .query(WINDOW_FAILED.as_str(), &f.params(&[&at, &seq, &limit]))
        .await?;
    Ok(rows.iter().map(parked::failed).collect())
}
