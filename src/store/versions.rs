//! The last applied version of each aggregate (`aggregate_versions`), read and moved inside
//! the batch's transaction. See `crate::version` for what is applied.
//!
//! Optimistic, like the seed's `UPDATE ... WHERE version = 7`: [`read`] locks the rows that
//! exist (in aggregate order, so two transactions cannot deadlock on them), and [`advance`]
//! moves each aggregate only from the version this transaction read. An aggregate no
//! transaction has stored yet has no row to lock; if another transaction stores it first,
//! [`advance`] finds the version moved and says so, and the caller retries the batch, which then
//! reads and locks the row.

use std::collections::HashMap;

use deadpool_postgres::GenericClient;

use super::StoreError;

const READ: &str = "\
SELECT aggregate, version FROM aggregate_versions
WHERE consumer = $1 AND aggregate = ANY($2::text[])
ORDER BY aggregate
FOR UPDATE";

/// The stored version of each of `aggregates` that has one, locked until the transaction ends.
pub async fn read<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    aggregates: &[&str],
) -> Result<HashMap<String, i64>, StoreError> {
    let stmt = tx.prepare_cached(READ).await?;
    let rows = tx.query(&stmt, &[&consumer, &aggregates]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

// `$3` is the version each aggregate had when read (0: no row). The conflict update applies
// only over that version, so a row another transaction created or moved meanwhile is left
// alone and missing from RETURNING.
const ADVANCE: &str = "\
INSERT INTO aggregate_versions AS v (consumer, aggregate, version)
SELECT $1, a.aggregate, a.version
FROM unnest($2::text[], $4::int8[]) AS a(aggregate, version)
ORDER BY a.aggregate
ON CONFLICT (consumer, aggregate) DO UPDATE
SET version = EXCLUDED.version, updated_at = now()
WHERE v.version = (SELECT f.version FROM unnest($2::text[], $3::int8[]) AS f(aggregate, version)
                   WHERE f.aggregate = EXCLUDED.aggregate)
RETURNING v.aggregate";

/// Another transaction moved an aggregate's version between [`read`] and [`advance`].
#[derive(Debug, thiserror::Error)]
#[error("the version of aggregate {aggregate:?} moved under this transaction; retry the batch")]
pub struct Moved {
    pub aggregate: String,
}

/// Moves each aggregate of `advanced` from the version `read` found (absent: none) to its new
/// one. Fails with [`Moved`] (inside `Ok`) when one had moved meanwhile: the caller must roll
/// back and retry, since the plan was made on a version that is no longer there.
pub async fn advance<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    read: &HashMap<String, i64>,
    advanced: &HashMap<String, i64>,
) -> Result<Result<(), Moved>, StoreError> {
    if advanced.is_empty() {
        return Ok(Ok(()));
    }
    let mut aggregates: Vec<&str> = advanced.keys().map(String::as_str).collect();
    aggregates.sort_unstable();
    let from: Vec<i64> = aggregates
        .iter()
        .map(|a| read.get(*a).copied().unwrap_or(0))
        .collect();
    let to: Vec<i64> = aggregates.iter().map(|a| advanced[*a]).collect();
    let stmt = tx.prepare_cached(ADVANCE).await?;
    let rows = tx
        .query(&stmt, &[&consumer, &aggregates, &from, &to])
        .await?;
    if rows.len() == aggregates.len() {
        return Ok(Ok(()));
    }
    let done: std::collections::HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
    let aggregate = aggregates
        .iter()
        .find(|a| !done.contains(**a))
        .map_or_else(String::new, |a| a.to_string());
    Ok(Err(Moved { aggregate }))
}

/// The advisory-lock class of aggregate locks (the two-key form, a key space apart from the
/// one-key locks of migrations and maintenance): "Eff" + 1.
const AGGREGATE_LOCK_CLASS: i32 = 0x4566_6601;

// Distinct keys in ascending order, so that two transactions lock shared aggregates in one
// order and cannot deadlock on them. The OFFSET 0 keeps the sorted subquery from being
// flattened into the aggregate.
const LOCK: &str = "\
SELECT count(pg_advisory_xact_lock($3, k)) FROM (
    SELECT DISTINCT hashtext($1 || chr(31) || a) AS k FROM unnest($2::text[]) AS a
    ORDER BY 1 OFFSET 0) s";

/// Serialises the transactions that touch `aggregates` of `consumer` until this one ends.
///
/// [`read`]'s row locks cover aggregates that have a version; this covers the rest too, and
/// the held rows: without it, a transaction applying version 1 of a new aggregate and one
/// holding version 2 (a gap, since it saw no version 1) could each miss the other, and 2 would
/// wait for ever. Every versioned transaction takes these locks before it reads versions or
/// held rows. (Hash collisions only serialise two unrelated aggregates.)
pub async fn lock<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    aggregates: &[&str],
) -> Result<(), StoreError> {
    let stmt = tx.prepare_cached(LOCK).await?;
    tx.query_one(&stmt, &[&consumer, &aggregates, &AGGREGATE_LOCK_CLASS])
        .await?;
    Ok(())
}

/// A held event (a gap, in delta mode): an inbox row with status HELD.
#[derive(Debug, Clone)]
pub struct Held {
    pub message_id: uuid::Uuid,
    pub event_date: chrono::NaiveDate,
    pub aggregate: String,
    pub version: i64,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub kafka_ts: Option<chrono::DateTime<chrono::Utc>>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
}

const HELD: &str = "\
SELECT message_id, event_date, aggregate, version, topic, partition, \"offset\", kafka_ts, key,
       payload
FROM inbox
WHERE consumer = $1 AND status = 'HELD' AND aggregate = ANY($2::text[])
ORDER BY aggregate, version
FOR UPDATE";

/// The held events of `aggregates`, locked. Call after [`lock`].
pub async fn held<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    aggregates: &[&str],
) -> Result<Vec<Held>, StoreError> {
    let stmt = tx.prepare_cached(HELD).await?;
    let rows = tx.query(&stmt, &[&consumer, &aggregates]).await?;
    Ok(rows
        .iter()
        .map(|r| Held {
            message_id: r.get(0),
            event_date: r.get(1),
            aggregate: r.get(2),
            version: r.get(3),
            topic: r.get(4),
            partition: r.get(5),
            offset: r.get(6),
            kafka_ts: r.get(7),
            key: r.get(8),
            payload: r.get(9),
        })
        .collect())
}

impl Held {
    pub fn stamp(&self) -> crate::version::Stamp {
        crate::version::Stamp {
            aggregate: self.aggregate.clone(),
            version: self.version,
        }
    }
}

// The rows were copied into `staged_inbox` just before (see `hold`).
const HOLD: &str = "\
INSERT INTO inbox (consumer, message_id, event_date, seq, ordering_key, topic, partition,
                   \"offset\", kafka_ts, key, header_names, header_values, payload, status,
                   aggregate, version)
SELECT $1, s.message_id, s.event_date, nextval('inbox_seq'), s.ordering_key, $2, s.partition,
       s.\"offset\", s.kafka_ts, s.key, s.header_names, s.header_values, s.payload, 'HELD',
       v.aggregate, v.version
FROM staged_inbox s
JOIN unnest($3::uuid[], $4::text[], $5::int8[]) AS v(message_id, aggregate, version)
  USING (message_id)
ORDER BY s.message_id
ON CONFLICT DO NOTHING";

/// Stores gaps found by the batch and per-message strategies as HELD inbox rows, with their
/// raw bytes, in the caller's transaction (which also commits their dedupe keys).
pub async fn hold(
    tx: &deadpool_postgres::Transaction<'_>,
    consumer: &str,
    topic: &str,
    rows: &[(crate::store::inbox::Incoming<'_>, &crate::version::Stamp)],
) -> Result<u64, StoreError> {
    if rows.is_empty() {
        return Ok(0);
    }
    // `staged_inbox` is empty here: the batch and per-message strategies use it for nothing
    // else, call this once per transaction, and it is emptied at every commit.
    let incoming: Vec<&crate::store::inbox::Incoming<'_>> = rows.iter().map(|(i, _)| i).collect();
    crate::store::inbox::stage(tx, &incoming).await?;
    let ids: Vec<uuid::Uuid> = rows.iter().map(|(i, _)| i.env.message_id).collect();
    let aggregates: Vec<&str> = rows.iter().map(|(_, s)| s.aggregate.as_str()).collect();
    let versions: Vec<i64> = rows.iter().map(|(_, s)| s.version).collect();
    let stmt = tx.prepare_cached(HOLD).await?;
    Ok(tx
        .execute(&stmt, &[&consumer, &topic, &ids, &aggregates, &versions])
        .await?)
}

const TO_HELD: &str = "\
UPDATE inbox i
SET status = 'HELD', aggregate = h.aggregate, version = h.version, lease_until = NULL,
    claim_token = NULL, next_attempt_at = now()
FROM unnest($2::uuid[], $3::date[], $4::text[], $5::int8[])
     AS h(message_id, event_date, aggregate, version)
WHERE i.consumer = (SELECT $1::text) AND i.event_date = ANY($3::date[])
  AND i.message_id = h.message_id AND i.event_date = h.event_date";

/// Turns claimed inbox rows (the inbox strategy's gaps) into HELD rows.
pub async fn to_held<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    rows: &[(uuid::Uuid, chrono::NaiveDate, &crate::version::Stamp)],
) -> Result<u64, StoreError> {
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.0).collect();
    let dates: Vec<chrono::NaiveDate> = rows.iter().map(|r| r.1).collect();
    let aggregates: Vec<&str> = rows.iter().map(|r| r.2.aggregate.as_str()).collect();
    let versions: Vec<i64> = rows.iter().map(|r| r.2.version).collect();
    let stmt = tx.prepare_cached(TO_HELD).await?;
    Ok(tx
        .execute(&stmt, &[&consumer, &ids, &dates, &aggregates, &versions])
        .await?)
}

/// Held gaps of one aggregate, as `effectively inbox status` lists them.
#[derive(Debug, Clone, PartialEq)]
pub struct Gap {
    pub aggregate: String,
    /// The aggregate's applied version (`None`: nothing applied yet).
    pub stored: Option<i64>,
    /// The held versions, ascending.
    pub held: Vec<i64>,
    /// Seconds since the oldest held row arrived.
    pub oldest_s: f64,
}

const GAPS: &str = "\
SELECT h.aggregate, v.version, array_agg(h.version ORDER BY h.version),
       extract(epoch FROM now() - min(h.received_at))::float8
FROM inbox h
LEFT JOIN aggregate_versions v ON v.consumer = h.consumer AND v.aggregate = h.aggregate
WHERE h.consumer = $1 AND h.status = 'HELD'
GROUP BY h.aggregate, v.version
ORDER BY min(h.received_at), h.aggregate
LIMIT $2";

/// The aggregates of `consumer` with held gaps, oldest first, at most `limit`.
pub async fn gaps<C: tokio_postgres::GenericClient + Sync>(
    client: &C,
    consumer: &str,
    limit: i64,
) -> Result<Vec<Gap>, StoreError> {
    let rows = client.query(GAPS, &[&consumer, &limit]).await?;
    Ok(rows
        .iter()
        .map(|r| Gap {
            aggregate: r.get(0),
            stored: r.get(1),
            held: r.get(2),
            oldest_s: r.get(3),
        })
        .collect())
}

/// How many aggregates of `consumer` have held gaps.
pub async fn gap_count<C: tokio_postgres::GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<i64, StoreError> {
    Ok(client
        .query_one(
            "SELECT count(DISTINCT aggregate) FROM inbox WHERE consumer = $1 AND status = 'HELD'",
            &[&consumer],
        )
        .await?
        .get(0))
}

const OVERDUE: &str = "\
SELECT count(*), count(DISTINCT aggregate) FILTER (WHERE received_at < now() - $2 * interval '1 millisecond')
FROM inbox WHERE consumer = $1 AND status = 'HELD'";

/// Held rows of `consumer`, and aggregates whose gap is older than `after` (the
/// `effectively_version_gaps_overdue` gauge).
pub async fn held_and_overdue<C: tokio_postgres::GenericClient + Sync>(
    client: &C,
    consumer: &str,
    after: std::time::Duration,
) -> Result<(i64, i64), StoreError> {
    let ms = after.as_millis() as f64;
    let r = client.query_one(OVERDUE, &[&consumer, &ms]).await?;
    Ok((r.get(0), r.get(1)))
}
