//! Partition offsets in PostgreSQL, the source of truth for where a partition resumes, fenced
//! by an ownership epoch.
//!
//! A worker that is assigned a partition *claims* it: the epoch goes up by one and the worker
//! remembers the new value. Every batch transaction then starts by advancing the offset
//! `WHERE epoch = <mine> AND next_offset = <where this worker last left it>`. If another worker
//! claimed the partition since, that update matches 0 rows and the batch rolls back whole (the
//! worker is a zombie). Because the claim and the advance update the same row, they serialise
//! on its row lock: a claim that arrives while a batch is committing waits for it and then
//! reads the offset that batch stored.
//!
//! The second condition catches a store that went back: a PostgreSQL failover to a standby that
//! lacked the last commits, or a restore to an earlier point. The claim row survives such a
//! rollback (it is older than the lost commits), so the epoch alone still matches, and an
//! advance from the worker's in-memory position would jump the stored offset over the records
//! whose effects were lost with those commits. With the offset the batch starts from in the
//! condition, the batch is refused instead, [`why_refused`] tells which case it was, and the
//! partition is claimed again and read from the offset PostgreSQL really holds: the lost records
//! come back from Kafka and are applied once.

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
UPDATE consumer_offsets SET next_offset = $6, updated_at = now()
WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch = $4
  AND next_offset IS NOT DISTINCT FROM $5";

const ANY_STORED: &str = "\
SELECT EXISTS (SELECT 1 FROM consumer_offsets WHERE consumer = $1 AND next_offset IS NOT NULL)";

/// Whether `consumer` has applied anything in this database (a stored offset). A worker asks
/// the other databases it uses, to refuse a consumer moved from one of them (its ledger and
/// offsets stay behind).
pub async fn any_stored<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<bool, StoreError> {
    Ok(client.query_one(ANY_STORED, &[&consumer]).await?.get(0))
}

/// Locks a commit group's rows in partition order, so two groups that share a partition (a
/// zombie's and its successor's) wait for each other instead of deadlocking.
const LOCK_MANY: &str = "\
SELECT partition FROM consumer_offsets
WHERE consumer = $1 AND topic = $2 AND partition = ANY($3)
ORDER BY partition FOR UPDATE";

/// [`ADVANCE`] for several partitions of one topic: returns the partitions that moved.
const ADVANCE_MANY: &str = "\
UPDATE consumer_offsets o SET next_offset = m.to_offset, updated_at = now()
FROM unnest($3::int[], $4::bigint[], $5::bigint[], $6::bigint[])
  AS m(partition, epoch, from_offset, to_offset)
WHERE o.consumer = $1 AND o.topic = $2 AND o.partition = m.partition AND o.epoch = m.epoch
  AND o.next_offset IS NOT DISTINCT FROM m.from_offset
RETURNING o.partition";

const READ: &str = "\
SELECT epoch, next_offset FROM consumer_offsets
WHERE consumer = $1 AND topic = $2 AND partition = $3";

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

/// One fenced move of a partition's offset: from where this worker left it to just past the
/// transaction's last record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Move {
    pub epoch: i64,
    /// The stored offset this worker last read (its claim) or wrote (its last commit); `None`
    /// when nothing was ever stored for the partition.
    pub from: Option<i64>,
    pub to: i64,
}

/// Stores `mv.to` as the partition's resume point if this worker still holds `mv.epoch` and
/// the row still says `mv.from`. Returns `false` when not: the caller must roll back and ask
/// [`why_refused`] why.
pub async fn advance(
    tx: &Transaction<'_>,
    consumer: &str,
    topic: &str,
    partition: i32,
    mv: Move,
) -> Result<bool, StoreError> {
    let stmt = tx.prepare_cached(ADVANCE).await?;
    let n = tx
        .execute(
            &stmt,
            &[&consumer, &topic, &partition, &mv.epoch, &mv.from, &mv.to],
        )
        .await?;
    Ok(n == 1)
}

/// [`advance`] for several partitions of `topic` in one transaction (a commit group): locks
/// their rows in partition order, moves each one that still holds its move's epoch and `from`,
/// and returns the partitions that did not move (empty: all moved). With any refused, the caller
/// must roll back.
pub async fn advance_many(
    tx: &Transaction<'_>,
    consumer: &str,
    topic: &str,
    moves: &[(i32, Move)],
) -> Result<Vec<i32>, StoreError> {
    let partitions: Vec<i32> = moves.iter().map(|(p, _)| *p).collect();
    let epochs: Vec<i64> = moves.iter().map(|(_, m)| m.epoch).collect();
    let from: Vec<Option<i64>> = moves.iter().map(|(_, m)| m.from).collect();
    let to: Vec<i64> = moves.iter().map(|(_, m)| m.to).collect();
    let lock = tx.prepare_cached(LOCK_MANY).await?;
    tx.query(&lock, &[&consumer, &topic, &partitions]).await?;
    let stmt = tx.prepare_cached(ADVANCE_MANY).await?;
    let moved: std::collections::HashSet<i32> = tx
        .query(
            &stmt,
            &[&consumer, &topic, &partitions, &epochs, &from, &to],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    Ok(partitions
        .into_iter()
        .filter(|p| !moved.contains(p))
        .collect())
}

/// Which end of the partition's log a stored offset is past ([`crate::source::range`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum End {
    Above,
    Below,
}

impl End {
    /// The `end` label.
    pub fn as_str(&self) -> &'static str {
        match self {
            End::Above => "above",
            End::Below => "below",
        }
    }
}

/// Why an [`advance`] matched no row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Another worker claimed the partition since (a higher epoch): this one is a zombie.
    Fenced { epoch: i64 },
    /// The row already holds the move's target under this worker's epoch: an earlier attempt of
    /// the same transaction committed, and only its answer was lost (the connection dropped
    /// during `COMMIT`). Nothing is left to do for these records.
    Committed,
    /// The store no longer holds what this worker committed: PostgreSQL went back (a failover
    /// to a standby that lacked the last commits, a restore), or someone rewrote the row.
    /// `stored` is where it stands now (`None`: no offset, or no row at all).
    WentBack {
        stored: Option<i64>,
        /// The epoch the row holds now; `None` when the row itself is gone.
        epoch: Option<i64>,
    },
}

/// Reads the row an [`advance`] did not match, outside the refused transaction (which the
/// caller rolls back), and classifies the refusal.
pub async fn why_refused<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    topic: &str,
    partition: i32,
    mv: Move,
) -> Result<Refusal, StoreError> {
    let row = client
        .query_opt(READ, &[&consumer, &topic, &partition])
        .await?;
    let (epoch, stored) = match &row {
        Some(r) => (Some(r.get::<_, i64>(0)), r.get::<_, Option<i64>>(1)),
        None => (None, None),
    };
    Ok(classify(mv, epoch, stored))
}

fn classify(mv: Move, epoch: Option<i64>, stored: Option<i64>) -> Refusal {
    match epoch {
        Some(e) if e > mv.epoch => Refusal::Fenced { epoch: e },
        Some(e) if e == mv.epoch && stored == Some(mv.to) => Refusal::Committed,
        // The same epoch at another offset, a lower epoch (the claim itself was lost), or no
        // row: the store is not where this worker left it.
        _ => Refusal::WentBack { stored, epoch },
    }
}

/// The owner an operator's reset writes (`reset:<actor>`): a worker that finds it on a partition
/// it runs claims the partition again at once, from the new offset
/// ([`crate::source::control`]), instead of waiting for its next commit to be fenced.
pub const RESET_OWNER_PREFIX: &str = "reset:";

const LOCK_ONE: &str = "\
SELECT next_offset, epoch FROM consumer_offsets
WHERE consumer = $1 AND topic = $2 AND partition = $3 FOR UPDATE";

const RESET: &str = "\
INSERT INTO consumer_offsets (consumer, topic, partition, next_offset, epoch, owner)
VALUES ($1, $2, $3, $4, 1, $5)
ON CONFLICT (consumer, topic, partition) DO UPDATE
SET next_offset = EXCLUDED.next_offset, epoch = consumer_offsets.epoch + 1,
    owner = EXCLUDED.owner, updated_at = now()
RETURNING epoch";

/// Locks one partition's row in the caller's transaction: its stored offset and epoch, `None`
/// when there is no row.
pub async fn lock_one(
    tx: &Transaction<'_>,
    consumer: &str,
    topic: &str,
    partition: i32,
) -> Result<Option<(Option<i64>, i64)>, StoreError> {
    Ok(tx
        .query_opt(LOCK_ONE, &[&consumer, &topic, &partition])
        .await?
        .map(|r| (r.get(0), r.get(1))))
}

/// An operator's move: stores `to` as the partition's resume point and bumps its epoch, in the
/// caller's transaction. The worker that holds the partition is fenced by the bump: its next
/// commit matches no row and rolls back, and it claims the partition again, reading `to`.
/// Returns the new epoch.
pub async fn reset(
    tx: &Transaction<'_>,
    consumer: &str,
    topic: &str,
    partition: i32,
    to: i64,
    actor: &str,
) -> Result<i64, StoreError> {
    let owner = format!("{RESET_OWNER_PREFIX}{actor}");
    let row = tx
        .query_one(RESET, &[&consumer, &topic, &partition, &to, &owner])
        .await?;
    Ok(row.get(0))
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

#[cfg(test)]
mod tests {
    use super::*;

    const MV: Move = Move {
        epoch: 7,
        from: Some(100),
        to: 150,
    };

    #[test]
    fn a_higher_epoch_is_a_zombie_whatever_the_offset() {
        assert_eq!(
            classify(MV, Some(8), Some(100)),
            Refusal::Fenced { epoch: 8 }
        );
        assert_eq!(
            classify(MV, Some(9), Some(40)),
            Refusal::Fenced { epoch: 9 }
        );
    }

    #[test]
    fn the_target_under_my_epoch_is_a_commit_whose_answer_was_lost() {
        assert_eq!(classify(MV, Some(7), Some(150)), Refusal::Committed);
    }

    #[test]
    fn anything_else_is_a_store_that_went_back() {
        // Rolled back past this worker's last commits, the claim kept.
        assert_eq!(
            classify(MV, Some(7), Some(60)),
            Refusal::WentBack {
                stored: Some(60),
                epoch: Some(7)
            }
        );
        // Rolled back past the claim too: a lower epoch.
        assert_eq!(
            classify(MV, Some(5), Some(60)),
            Refusal::WentBack {
                stored: Some(60),
                epoch: Some(5)
            }
        );
        // Rolled back past the partition's first claim: no row at all.
        assert_eq!(
            classify(MV, None, None),
            Refusal::WentBack {
                stored: None,
                epoch: None
            }
        );
    }
}
