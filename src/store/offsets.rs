//! Partition offsets in PostgreSQL, the source of truth for where a partition resumes, fenced
//! by an ownership epoch.
//!
//! A worker that is assigned a partition *claims* it: the epoch goes up by one and the worker
//! remembers the new value. Every batch transaction then starts by advancing the offset
//! `WHERE epoch = <mine>`. If another worker claimed the partition since, that update matches 0
//! rows and the batch rolls back whole (the worker is a zombie). Because the claim and the
//! advance update the same row, they serialise on its row lock: a claim that arrives while a
//! batch is committing waits for it and then reads the offset that batch stored.

use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;

use super::StoreError;

const CLAIM: &str = "\
INSERT INTO consumer_offsets (consumer, topic, partition, next_offset, epoch, owner)
VALUES ($1, $2, $3, NULL, 1, $4)
ON CONFLICT (consumer, topic, partition) DO UPDATE
SET epoch = consumer_offsets.epoch + 1, owner = EXCLUDED.owner, updated_at = now()
RETURNING epoch, next_offset";

const ADVANCE: &str = "\
UPDATE consumer_offsets SET next_offset = $5, updated_at = now()
WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4";

const LOAD: &str = "\
SELECT partition, next_offset, epoch, owner FROM consumer_offsets
WHERE consumer = $1 AND topic = $2 ORDER BY partition";

/// What a claim returns: the epoch this worker now holds, and where to resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    pub epoch: i64,
    /// `None` when nothing was ever applied for this partition: start from the reset policy.
    pub next_offset: Option<i64>,
}

/// Takes ownership of a partition (bumps its epoch) and reads its stored offset.
pub async fn claim<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    topic: &str,
    partition: i32,
    owner: &str,
) -> Result<Claim, StoreError> {
    let row = client
        .query_one(CLAIM, &[&consumer, &topic, &partition, &owner])
        .await?;
    Ok(Claim {
        epoch: row.get(0),
        next_offset: row.get(1),
    })
}

/// Stores `next_offset` as the partition's resume point if this worker still holds `epoch`.
/// Returns `false` when it does not: the caller is a zombie and must roll back.
pub async fn advance(
    tx: &Transaction<'_>,
    consumer: &str,
    topic: &str,
    partition: i32,
    epoch: i64,
    next_offset: i64,
) -> Result<bool, StoreError> {
    let stmt = tx.prepare_cached(ADVANCE).await?;
    let n = tx
        .execute(
            &stmt,
            &[&consumer, &topic, &partition, &epoch, &next_offset],
        )
        .await?;
    Ok(n == 1)
}

/// One stored offset row, for status output and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub partition: i32,
    pub next_offset: Option<i64>,
    pub epoch: i64,
    pub owner: String,
}

/// Every stored offset of one consumer on one topic, by partition.
pub async fn load<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    topic: &str,
) -> Result<Vec<Stored>, StoreError> {
    let rows = client.query(LOAD, &[&consumer, &topic]).await?;
    Ok(rows
        .iter()
        .map(|r| Stored {
            partition: r.get(0),
            next_offset: r.get(1),
            epoch: r.get(2),
            owner: r.get(3),
        })
        .collect())
}
