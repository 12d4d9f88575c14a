//! The dedupe insert: the staged keys go into `processed_messages`, and the ones that were not
//! there yet are the batch's fresh messages.
//!
//! Keys are inserted in `message_id` order so that two partitions' transactions that insert
//! overlapping keys take their locks in the same order and cannot deadlock. When another
//! transaction has inserted the same key and not committed yet, PostgreSQL makes this one wait
//! for it: if it commits, the key is not fresh here; if it rolls back, it is. Exactly one
//! effect either way.

use deadpool_postgres::Transaction;
use uuid::Uuid;

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

const INSERT_ONE: &str = "\
INSERT INTO processed_messages (consumer, message_id, event_date) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING";

/// Inserts every staged key; returns the `seq` of the fresh ones, ascending.
pub async fn insert_staged(tx: &Transaction<'_>, consumer: &str) -> Result<Vec<usize>, StoreError> {
    let stmt = tx.prepare_cached(INSERT_STAGED).await?;
    let rows = tx.query(&stmt, &[&consumer]).await?;
    let mut fresh: Vec<usize> = rows.iter().map(|r| r.get::<_, i32>(0) as usize).collect();
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
