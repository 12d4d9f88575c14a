//! `partition_health`: what the owner of a partition sees wrong with it (stuck on a Kafka
//! error, a stalled batch), one row per partition while something is, for the console. The
//! metrics say the same to Prometheus; this table is for an operator without it, and for the
//! console, which runs in a process of its own.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use super::StoreError;

/// The partition a row is about, and the claim (epoch) of the worker that writes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Key<'a> {
    pub consumer: &'a str,
    pub topic: &'a str,
    pub partition: i32,
    pub epoch: i64,
}

/// What is wrong with one partition now; all `None`: nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marks {
    /// Since when its fetches fail (and no record arrived since), and the last error.
    pub stuck: Option<(DateTime<Utc>, String)>,
    /// Since when its current batch has been retrying past `stall_after`.
    pub stalled_since: Option<DateTime<Utc>>,
}

impl Marks {
    pub fn is_clear(&self) -> bool {
        self.stuck.is_none() && self.stalled_since.is_none()
    }
}

/// Writes the marks, unless a newer claim of the partition wrote its own (the row's epoch is
/// above ours: this worker is a zombie for it).
const UPSERT: &str = "\
INSERT INTO partition_health
    (consumer, topic, partition, epoch, stuck_since, stuck_error, stalled_since, updated_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, now())
ON CONFLICT (consumer, topic, partition) DO UPDATE SET
    epoch = EXCLUDED.epoch, stuck_since = EXCLUDED.stuck_since,
    stuck_error = EXCLUDED.stuck_error, stalled_since = EXCLUDED.stalled_since,
    updated_at = now()
WHERE partition_health.epoch <= EXCLUDED.epoch";

/// Nothing wrong any more: the row of this claim goes.
const CLEAR: &str = "\
DELETE FROM partition_health WHERE consumer = $1 AND topic = $2 AND partition = $3 AND epoch <= $4";

/// Records `marks` for the partition (a clear one deletes the row).
pub async fn write<C: GenericClient + Sync>(
    c: &C,
    key: &Key<'_>,
    marks: &Marks,
) -> Result<(), StoreError> {
    if marks.is_clear() {
        c.execute(
            CLEAR,
            &[&key.consumer, &key.topic, &key.partition, &key.epoch],
        )
        .await?;
        return Ok(());
    }
    let (stuck_since, stuck_error) = match &marks.stuck {
        Some((at, e)) => (Some(*at), Some(e.as_str())),
        None => (None, None),
    };
    c.execute(
        UPSERT,
        &[
            &key.consumer,
            &key.topic,
            &key.partition,
            &key.epoch,
            &stuck_since,
            &stuck_error,
            &marks.stalled_since,
        ],
    )
    .await?;
    Ok(())
}

/// One partition's row, as the console reads it.
#[derive(Debug, Clone)]
pub struct Row {
    pub topic: String,
    pub partition: i32,
    pub epoch: i64,
    pub marks: Marks,
}

/// Marks of the current claims only: a row whose epoch is below the offsets row's was left by
/// a worker that died with the partition marked.
const OF_CONSUMER: &str = "\
SELECT h.topic, h.partition, h.epoch, h.stuck_since, h.stuck_error, h.stalled_since
FROM partition_health h
JOIN consumer_offsets o USING (consumer, topic, partition)
WHERE h.consumer = $1 AND h.epoch >= o.epoch
ORDER BY h.topic, h.partition";

/// Every partition of `consumer` whose owner marks something wrong now.
pub async fn of_consumer<C: GenericClient + Sync>(
    c: &C,
    consumer: &str,
) -> Result<Vec<Row>, StoreError> {
    let rows = c.query(OF_CONSUMER, &[&consumer]).await?;
    Ok(rows
        .iter()
        .map(|r| {
            let stuck_since: Option<DateTime<Utc>> = r.get(3);
            let stuck_error: Option<String> = r.get(4);
            Row {
                topic: r.get(0),
                partition: r.get(1),
                epoch: r.get(2),
                marks: Marks {
                    stuck: stuck_since.map(|at| (at, stuck_error.unwrap_or_default())),
                    stalled_since: r.get(5),
                },
            }
        })
        .collect())
}
