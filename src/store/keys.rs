//! `consumer_keys`: how each consumer makes its dedupe keys, so that a change is noticed.
//!
//! A ledger's keys are the message id (a UUID, or a v5 UUID made from text) and the event
//! date. A consumer whose `message_id` or `event_date` settings change makes other keys for the
//! same events: a copy of an event applied before the change does not meet its key and is
//! applied again, until the old keys pass retention. Nothing can tell from a key how it was
//! made, so the settings that made them are recorded (migration V12): a worker records its own
//! at start and warns when they differ from the row, and `check-config --connect` compares the
//! file with the row before a deploy.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

use super::StoreError;

/// What the ledger of one consumer says about its keys.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    pub made_by: String,
    pub since: DateTime<Utc>,
}

/// The settings that made `consumer`'s keys, if a worker ever recorded them.
pub async fn recorded<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<Option<Recorded>, StoreError> {
    let row = client
        .query_opt(
            "SELECT made_by, since FROM consumer_keys WHERE consumer = $1",
            &[&consumer],
        )
        .await?;
    Ok(row.map(|r| Recorded {
        made_by: r.get(0),
        since: r.get(1),
    }))
}

/// Records that `made_by` makes `consumer`'s keys from now on. Returns what made them before,
/// when that was something else. One statement: two workers starting with the same new settings
/// record the change once (the second finds the row already changed, and the condition skips it).
pub async fn record<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    made_by: &str,
) -> Result<Option<String>, StoreError> {
    let row = client
        .query_opt(
            "INSERT INTO consumer_keys AS k (consumer, made_by) VALUES ($1, $2)
             ON CONFLICT (consumer) DO UPDATE
             SET previous = k.made_by, made_by = EXCLUDED.made_by, since = now()
             WHERE k.made_by IS DISTINCT FROM EXCLUDED.made_by
             RETURNING previous",
            &[&consumer, &made_by],
        )
        .await?;
    Ok(row.and_then(|r| r.get(0)))
}
