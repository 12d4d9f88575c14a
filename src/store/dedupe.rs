//! The dedupe insert: the staged keys go into `processed_messages`, and the ones that were not
//! there yet are the batch's fresh messages.
//!
//! Keys are inserted in `message_id` order so that two partitions' transactions that insert
//! overlapping keys take their locks in the same order and cannot deadlock. When another
//! transaction has inserted the same key and not committed yet, PostgreSQL makes this one wait
//! for it: if it commits, the key is not fresh here; if it rolls back, it is. Exactly one
//! effect either way.

use std::collections::HashMap;

use deadpool_postgres::Transaction;
use uuid::Uuid;

use crate::envelope::Envelope;

use super::StoreError;

const INSERT_STAGED: &str = "\
WITH ins AS (
    INSERT INTO processed_messages (consumer, message_id, event_date)
    SELECT $1, message_id, event_date FROM staged_messages ORDER BY message_id
    ON CONFLICT DO NOTHING
    RETURNING message_id)
UPDATE staged_messages s SET fresh = true FROM ins
WHERE s.message_id = ins.message_id
RETURNING s.seq";

// The batch's keys as arrays, for handlers that read no SQL view: nothing staged, nothing to
// truncate at commit. `$2` sorted.
const INSERT_KEYS: &str = "\
INSERT INTO processed_messages (consumer, message_id, event_date)
SELECT $1, k.message_id, k.event_date FROM unnest($2::uuid[], $3::date[]) AS k(message_id, event_date)
ON CONFLICT DO NOTHING
RETURNING message_id, event_date";

const INSERT_ONE: &str = "\
INSERT INTO processed_messages (consumer, message_id, event_date) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING";

/// Inserts every staged key and marks the fresh rows in `staged_messages`, for the
/// `fresh_messages` view; returns the indexes into `staged` (the rows as copied, whose `seq` is
/// their index) of the fresh ones, ascending.
pub async fn insert_staged(tx: &Transaction<'_>, consumer: &str) -> Result<Vec<usize>, StoreError> {
    let stmt = tx.prepare_cached(INSERT_STAGED).await?;
    let rows = tx.query(&stmt, &[&consumer]).await?;
    let mut fresh: Vec<usize> = rows.iter().map(|r| r.get::<_, i32>(0) as usize).collect();
    fresh.sort_unstable();
    Ok(fresh)
}

/// Inserts the keys of `candidates` (first copies: no key twice) straight from arrays, without
/// staging them; returns the indexes into `candidates` of the fresh ones, ascending. For
/// handlers that read no SQL view, where staging served the dedupe insert alone: the batch drain
/// spent 1.5 µs of PostgreSQL's CPU a message on the `COPY` and the read back
/// (docs/PERFORMANCE.md, "PostgreSQL's CPU per message").
pub async fn insert_keys(
    tx: &Transaction<'_>,
    consumer: &str,
    candidates: &[&Envelope],
) -> Result<Vec<usize>, StoreError> {
    // In key order (see the module's note on locks).
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_unstable_by_key(|&i| (candidates[i].message_id, candidates[i].event_date));
    let ids: Vec<Uuid> = order.iter().map(|&i| candidates[i].message_id).collect();
    let dates: Vec<chrono::NaiveDate> = order.iter().map(|&i| candidates[i].event_date).collect();
    let stmt = tx.prepare_cached(INSERT_KEYS).await?;
    let rows = tx.query(&stmt, &[&consumer, &ids, &dates]).await?;
    let by_key: HashMap<(Uuid, chrono::NaiveDate), usize> = (candidates.iter().enumerate())
        .map(|(i, e)| ((e.message_id, e.event_date), i))
        .collect();
    let mut fresh: Vec<usize> = rows
        .iter()
        .filter_map(|r| by_key.get(&(r.get(0), r.get(1))).copied())
        .collect();
    fresh.sort_unstable();
    Ok(fresh)
}

/// The seed's key-first insert for one message: `true` if the key is new (apply the effect),
/// `false` for a duplicate (the command tag said `INSERT 0 0`).
pub async fn insert_one(
    tx: &Transaction<'_>,
    consumer: &str,
    message_id: &Uuid,
    event_date: &chrono::NaiveDate,
) -> Result<bool, StoreError> {
    let stmt = tx.prepare_cached(INSERT_ONE).await?;
    Ok(tx
        .execute(&stmt, &[&consumer, message_id, event_date])
        .await?
        == 1)
}
