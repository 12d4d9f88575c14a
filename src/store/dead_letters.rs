//! Parking: a message that cannot be applied goes to `dead_letters` with its raw key, headers
//! and bytes and the reason, in the same transaction that moves the partition's offset past it.
//! Nothing is dropped and nothing is marked done.

use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;

use super::StoreError;

/// One message to park, borrowed from the batch.
#[derive(Debug)]
pub struct Parked<'a> {
    pub topic: &'a str,
    pub partition: i32,
    pub offset: i64,
    pub message_id: Option<uuid::Uuid>,
    /// The text the message id was made from, when it was not a UUID.
    pub message_key: Option<&'a str>,
    pub reason: &'a str,
    pub detail: &'a str,
    pub key: Option<&'a [u8]>,
    pub header_names: Vec<&'a str>,
    pub header_values: Vec<Option<&'a [u8]>>,
    pub payload: Option<&'a [u8]>,
    pub kafka_ts: Option<chrono::DateTime<chrono::Utc>>,
    pub attempts: i32,
}

// A message parked again at the same offset (its batch rolled back after parking it, and was
// retried; or read again after PostgreSQL went back) keeps one row: the attempts add up, the
// latest reason wins, and it is parked again even if an operator had resolved it.
const PARK: &str = "\
INSERT INTO dead_letters (consumer, topic, partition, \"offset\", message_id, reason, detail,
                          key, header_names, header_values, payload, kafka_ts, attempts,
                          message_key)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (consumer, topic, partition, \"offset\") DO UPDATE
SET reason = EXCLUDED.reason, detail = EXCLUDED.detail,
    message_id = coalesce(EXCLUDED.message_id, dead_letters.message_id),
    message_key = coalesce(EXCLUDED.message_key, dead_letters.message_key),
    attempts = dead_letters.attempts + EXCLUDED.attempts, last_seen = now(),
    resolution = NULL, resolved_at = NULL, resolved_by = NULL, resolved_action = NULL,
    redriven_to = NULL";

/// Parks `rows` in the caller's transaction, in offset order.
pub async fn park(
    tx: &Transaction<'_>,
    consumer: &str,
    rows: &[Parked<'_>],
) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let stmt = tx.prepare_cached(PARK).await?;
    for p in rows {
        tx.execute(
            &stmt,
            &[
                &consumer,
                &p.topic,
                &p.partition,
                &p.offset,
                &p.message_id,
                &p.reason,
                &p.detail,
                &p.key,
                &p.header_names,
                &p.header_values,
                &p.payload,
                &p.kafka_ts,
                &p.attempts,
                &p.message_key,
            ],
        )
        .await?;
    }
    Ok(())
}

/// How many messages are parked in `dead_letters` for `consumer` (not yet redriven or
/// discarded), by reason.
pub async fn count_by_reason<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<Vec<(String, i64)>, StoreError> {
    let rows = client
        .query(
            "SELECT reason, count(*) FROM dead_letters WHERE consumer = $1 AND resolution IS NULL
             GROUP BY 1 ORDER BY 1",
            &[&consumer],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Rows parked in `dead_letters` for each of `consumers` (0 included).
pub async fn count_all<C: GenericClient + Sync>(
    client: &C,
    consumers: &[String],
) -> Result<Vec<(String, i64)>, StoreError> {
    let rows = client
        .query(
            "SELECT c, (SELECT count(*) FROM dead_letters d
                        WHERE d.consumer = c AND d.resolution IS NULL)
             FROM unnest($1::text[]) AS c",
            &[&consumers],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
