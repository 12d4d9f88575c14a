//! The `outbox` table's SQL for the relay (`crate::relay`): claim unpublished rows in order per
//! aggregate, mark them published, and measure the backlog.
//!
//! Order per aggregate lives in one predicate, as the inbox's per-key order does: a row is
//! claimable only if it is the oldest (`seq`) unpublished row of its aggregate among the event
//! types this relay serves. A relay that locked an aggregate's head also takes the rows behind
//! it; another relay finds the head locked (SKIP LOCKED) and the rest not heads, so it takes
//! nothing of that aggregate until the first relay commits.

use chrono::{DateTime, Utc};
use deadpool_postgres::{GenericClient, Transaction};
use uuid::Uuid;

use super::StoreError;

/// An unpublished outbox row, claimed.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: Uuid,
    pub aggregate_id: String,
    pub event_type: String,
    /// The payload as JSON text.
    pub payload: String,
    pub created_at: DateTime<Utc>,
    pub seq: i64,
    /// The W3C trace context of the transaction that wrote the row (migration V14), if it was
    /// traced: the relay's record carries it on.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

const COLUMNS: &str = "o.id, o.aggregate_id, o.event_type, o.payload::text, o.created_at, o.seq, \
                       o.traceparent, o.tracestate";

/// The event-type condition for a row aliased `alias`: the types served (`$1`), or none (a
/// relay with a default topic; `$1` is then NULL and unused). Two statements rather than
/// `($1 IS NULL OR event_type = ANY($1))`: with the OR, a generic plan cannot use the
/// `(event_type, seq)` index and read every unpublished row (1.5 s a claim with 2.5 million
/// unpublished rows of another type; 1 ms with the condition alone).
fn of_types(typed: bool, alias: &str) -> String {
    if typed {
        format!("{alias}.event_type = ANY($1)")
    } else {
        "$1::text[] IS NULL".to_string()
    }
}

// The event types with unpublished rows, by a loose scan of `outbox_unpublished`'s leading
// column (one probe a type): what a relay serving every type serves at this claim.
const TYPES_PRESENT: &str = "\
WITH RECURSIVE t(event_type) AS (
    (SELECT h.event_type FROM outbox h WHERE h.published_at IS NULL ORDER BY h.event_type LIMIT 1)
    UNION ALL
    SELECT (SELECT h.event_type FROM outbox h
            WHERE h.published_at IS NULL AND h.event_type > t.event_type
            ORDER BY h.event_type LIMIT 1)
    FROM t WHERE t.event_type IS NOT NULL)
SELECT event_type FROM t WHERE event_type IS NOT NULL";

// `$1`: the event types served, `$2`: the limit.
// The ids of the oldest `$2` heads (each aggregate's lowest unpublished `seq` of the types
// served), found by skipping through `outbox_unpublished_type_heads` (V16), type by type, from
// one aggregate with unpublished rows of the type to the next (one probe each; PostgreSQL 15
// has no skip scan of its own), taking each one's first row of the type there, and an
// aggregate's head as its first of those across the types. The claim's cost follows the
// aggregates with unpublished rows, not the backlog: a pass over every unpublished row (V15's
// `DISTINCT ON`) sorted the whole backlog at every claim, 1.05 s for 484,773 rows over 900
// aggregates on an idle machine, so a relay behind at 2,000 msg/s fell further behind with
// every round; skipping took 0.15 s there (2026-12-07). A relay serving every type passes the
// types present ([`TYPES_PRESENT`]): one index serves both kinds of relay, and every outbox
// insert pays for one index fewer (V17).
// Reading only: the heads are locked by `LOCK_HEADS_SQL`, by id. One statement that joined the
// heads to `outbox` to lock them let the planner pick the join, and a plan made while the table
// was small (a scan of every unpublished row for each head) held one claim for over 6 minutes
// in the soak.
const HEADS: &str = "\
WITH RECURSIVE aggs(event_type, aggregate_id) AS (
    SELECT t.event_type,
           (SELECT h.aggregate_id FROM outbox h
            WHERE h.published_at IS NULL AND h.event_type = t.event_type
            ORDER BY h.event_type, h.aggregate_id LIMIT 1)
    FROM unnest($1::text[]) AS t(event_type)
    UNION ALL
    SELECT a.event_type,
           (SELECT h.aggregate_id FROM outbox h
            WHERE h.published_at IS NULL AND h.event_type = a.event_type
              AND h.aggregate_id > a.aggregate_id
            ORDER BY h.event_type, h.aggregate_id LIMIT 1)
    FROM aggs a WHERE a.aggregate_id IS NOT NULL),
firsts AS (
    SELECT a.aggregate_id, f.id, f.seq FROM aggs a
    CROSS JOIN LATERAL (
        SELECT h.id, h.seq FROM outbox h
        WHERE h.published_at IS NULL AND h.event_type = a.event_type
          AND h.aggregate_id = a.aggregate_id
        ORDER BY h.event_type, h.aggregate_id, h.seq LIMIT 1) f),
heads AS (
    SELECT DISTINCT ON (aggregate_id) id, seq FROM firsts
    ORDER BY aggregate_id, seq)
SELECT id FROM heads ORDER BY seq LIMIT $2";

// Locks the heads `$1` found (by their ids; in no order: SKIP LOCKED waits for nobody, and
// `claim` sorts what it took). `published_at IS NULL` is checked again on the locked row: a
// head another relay published since is left out, and one another relay holds is skipped.
static LOCK_HEADS_SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS} FROM outbox o
         WHERE o.id = ANY($1) AND o.published_at IS NULL
         FOR UPDATE OF o SKIP LOCKED"
    )
});

// The rows behind the heads this transaction locked (`$2` aggregates, `$3` the heads' ids).
// No SKIP LOCKED: no other relay can hold them (they are not heads), and skipping one would
// publish its successors before it.
static CLAIM_FOLLOWERS: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "SELECT {COLUMNS} FROM outbox o
         WHERE o.published_at IS NULL AND o.event_type = ANY($1)
           AND o.aggregate_id = ANY($2) AND o.id <> ALL($3)
         ORDER BY o.aggregate_id, o.seq LIMIT $4
         FOR UPDATE OF o"
    )
});

fn row(r: &tokio_postgres::Row) -> Row {
    Row {
        id: r.get(0),
        aggregate_id: r.get(1),
        event_type: r.get(2),
        payload: r.get(3),
        created_at: r.get(4),
        seq: r.get(5),
        traceparent: r.get(6),
        tracestate: r.get(7),
    }
}

/// Locks up to `limit` unpublished rows of `types` (`None`: all) in the caller's transaction:
/// the heads of as many aggregates as it can take, then the rows behind them. In `seq` order.
pub async fn claim(
    tx: &Transaction<'_>,
    types: Option<&[String]>,
    limit: i64,
) -> Result<Vec<Row>, StoreError> {
    // Planned at every claim for the outbox as it is now (a plan cached while it was small would
    // outlive the backlog it was not made for), and without sorts: every step here has an index
    // in the order it needs. The planner's estimates of the partial indexes lag the outbox: once
    // a relay caught up, the unpublished rows look like none, and it then looked each head up by
    // reading every unpublished row of the type and sorting them, for every aggregate (a claim of
    // 2,000 heads ran 9 s, and the next ones minutes, in the soak: the backlog then grew while
    // each claim held back vacuum's horizon). Sorts stay off until the claim's end.
    tx.batch_execute("SET LOCAL plan_cache_mode = force_custom_plan; SET LOCAL enable_sort = off")
        .await?;
    let present: Vec<String>;
    let types = match types {
        Some(types) => types,
        None => {
            let stmt = tx.prepare_cached(TYPES_PRESENT).await?;
            present = (tx.query(&stmt, &[]).await?.iter())
                .map(|r| r.get(0))
                .collect();
            &present
        }
    };
    let stmt = tx.prepare_cached(HEADS).await?;
    let found: Vec<Uuid> = (tx.query(&stmt, &[&types, &limit]).await?.iter())
        .map(|r| r.get(0))
        .collect();
    let mut rows = Vec::new();
    if !found.is_empty() {
        let stmt = tx.prepare_cached(&LOCK_HEADS_SQL).await?;
        rows.extend(tx.query(&stmt, &[&found]).await?.iter().map(row));
    }
    let room = limit - rows.len() as i64;
    if !rows.is_empty() && room > 0 {
        let mut aggregates: Vec<&str> = rows.iter().map(|r| r.aggregate_id.as_str()).collect();
        aggregates.sort_unstable();
        aggregates.dedup();
        let heads: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        let stmt = tx.prepare_cached(&CLAIM_FOLLOWERS).await?;
        let more = tx
            .query(&stmt, &[&types, &aggregates, &heads, &room])
            .await?;
        rows.extend(more.iter().map(row));
    }
    tx.batch_execute("SET LOCAL enable_sort = on").await?;
    rows.sort_by_key(|r| r.seq);
    Ok(rows)
}

/// Marks `ids` published (or deletes them, with `delete`) in the caller's transaction.
pub async fn published(
    tx: &Transaction<'_>,
    ids: &[Uuid],
    delete: bool,
) -> Result<u64, StoreError> {
    let sql = if delete {
        "DELETE FROM outbox WHERE id = ANY($1)"
    } else {
        "UPDATE outbox SET published_at = now() WHERE id = ANY($1)"
    };
    let stmt = tx.prepare_cached(sql).await?;
    Ok(tx.execute(&stmt, &[&ids]).await?)
}

/// Unpublished rows of `types` (`None`: all), and the oldest one's age in seconds (0: none).
pub async fn backlog<C: GenericClient + Sync>(
    client: &C,
    types: Option<&[String]>,
) -> Result<(i64, f64), StoreError> {
    let r = client
        .query_one(
            &format!(
                "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8
                 FROM outbox o WHERE o.published_at IS NULL AND {}",
                of_types(types.is_some(), "o")
            ),
            &[&types],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}
