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

// When nothing reads `fresh_messages` (the handler takes the fresh rows from Rust), the
// staged rows need no mark: the keys come back and are matched to the batch in memory, which
// saves a second write of every staged row.
const INSERT_STAGED_UNMARKED: &str = "\
INSERT INTO processed_messages (consumer, message_id, event_date)
SELECT $1, message_id, event_date FROM staged_messages ORDER BY message_id
ON CONFLICT DO NOTHING
RETURNING message_id";

const INSERT_ONE: &str = "\
INSERT INTO processed_messages (consumer, message_id, event_date) VALUES ($1, $2, $3)
ON CONFLICT DO NOTHING";

/// Inserts every staged key; returns the indexes into `staged` (the rows as copied, whose
/// `seq` is their index) of the fresh ones, ascending. With `mark`, the fresh rows are also
/// marked in `staged_messages`, for the `fresh_messages` view.
pub async fn insert_staged(
    tx: &Transaction<'_>,
    consumer: &str,
    staged: &[&Envelope],
    mark: bool,
) -> Result<Vec<usize>, StoreError> {
    let mut fresh: Vec<usize> = if mark {
        let stmt = tx.prepare_cached(INSERT_STAGED).await?;
        let rows = tx.query(&stmt, &[&consumer]).await?;
        rows.iter().map(|r| r.get::<_, i32>(0) as usize).collect()
    } else {
        let stmt = tx.prepare_cached(INSERT_STAGED_UNMARKED).await?;
        let rows = tx.query(&stmt, &[&consumer]).await?;
        let by_id: HashMap<Uuid, usize> = staged
            .iter()
            .enumerate()
            .map(|(i, e)| (e.message_id, i))
            .collect();
        rows.iter()
            .filter_map(|r| by_id.get(&r.get::<_, Uuid>(0)).copied())
            .collect()
    };
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
