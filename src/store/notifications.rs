//! The `notifications` table's SQL for the sender (`crate::sender`): claim due notifications
//! (or ones whose send was interrupted), record each call's outcome, and count them.
//!
//! A claim marks rows SENDING and commits at once: the provider is called outside any
//! transaction (a transaction must not wait on the network), and `sending_since` is the claim's
//! lease. Every outcome is written only over that very claim (`status = 'SENDING' AND
//! sending_since = <the claim's>`), so a sender that outlived `sending_timeout` and lost the row
//! to another cannot overwrite what the other found.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::StoreError;

/// A notification claimed for sending.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub event_id: Uuid,
    pub channel: String,
    pub payload: serde_json::Value,
    pub key_generation: i32,
    /// Attempts including this one.
    pub attempts: i32,
    /// The previous send was interrupted: the row was SENDING past `sending_timeout`.
    pub interrupted: bool,
    /// This claim's lease.
    pub sending_since: DateTime<Utc>,
    /// The W3C trace context of the transaction that recorded it (V14), if it was traced: the
    /// provider call carries it on.
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl Claimed {
    /// The key the provider dedupes on: `channel:event_id`, or `channel:event_id#n` once `n`
    /// keys before it were found to have sent nothing and to be spent (a saved failure).
    pub fn idempotency_key(&self) -> String {
        match self.key_generation {
            0 => format!("{}:{}", self.channel, self.event_id),
            n => format!("{}:{}#{n}", self.channel, self.event_id),
        }
    }
}

const CLAIM: &str = "\
WITH picked AS (
    SELECT event_id, channel, status FROM notifications
    WHERE channel = ANY($1)
      AND ((status = 'PENDING' AND next_attempt_at <= now())
           OR (status = 'SENDING' AND sending_since < now() - $3 * interval '1 millisecond'))
    ORDER BY next_attempt_at LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE notifications n
SET status = 'SENDING', sending_since = clock_timestamp(), attempts = n.attempts + 1
FROM picked p
WHERE n.event_id = p.event_id AND n.channel = p.channel
RETURNING n.event_id, n.channel, n.payload, n.key_generation, n.attempts, p.status = 'SENDING',
          n.sending_since, n.traceparent, n.tracestate";

/// Claims up to `limit` notifications of `channels`: due PENDING ones, and SENDING ones older
/// than `sending_timeout` (interrupted). Commits (autocommit on `client`).
pub async fn claim<C: GenericClient + Sync>(
    client: &C,
    channels: &[String],
    limit: i64,
    sending_timeout: std::time::Duration,
) -> Result<Vec<Claimed>, StoreError> {
    let timeout_ms = sending_timeout.as_millis() as f64;
    let rows = client
        .query(CLAIM, &[&channels, &limit, &timeout_ms])
        .await?;
    Ok(rows
        .iter()
        .map(|r| Claimed {
            event_id: r.get(0),
            channel: r.get(1),
            payload: r.get(2),
            key_generation: r.get(3),
            attempts: r.get(4),
            interrupted: r.get(5),
            sending_since: r.get(6),
            traceparent: r.get(7),
            tracestate: r.get(8),
        })
        .collect())
}

/// How one claim ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    Sent {
        provider_id: String,
    },
    /// Again after `delay_ms`; `new_key`: the current key is spent (the provider saved a
    /// failure under it and sent nothing), so the next attempt uses the next one. `counts`:
    /// the attempt counts against `max_attempts` (not a 409, which says only that the provider
    /// is still at work on the key).
    Retry {
        delay_ms: i64,
        error: String,
        new_key: bool,
        counts: bool,
    },
    Failed {
        error: String,
    },
    Skipped {
        reason: String,
    },
}

const FINISH: &str = "\
UPDATE notifications
SET status = $4,
    provider_id = coalesce($5, provider_id),
    last_error = $6,
    sent_at = CASE WHEN $4 = 'SENT' THEN now() END,
    next_attempt_at = now() + $7 * interval '1 millisecond',
    key_generation = key_generation + $8,
    attempts = attempts - $9,
    sending_since = NULL
WHERE event_id = $1 AND channel = $2 AND status = 'SENDING' AND sending_since = $3";

/// Records how `claim` ended; false when the claim was no longer this sender's (another took
/// the row over after `sending_timeout`).
pub async fn finish<C: GenericClient + Sync>(
    client: &C,
    claim: &Claimed,
    how: &Finish,
) -> Result<bool, StoreError> {
    let (status, provider_id, error, delay_ms, bump, uncount) = match how {
        Finish::Sent { provider_id } => {
            ("SENT", Some(provider_id.as_str()), None, 0i64, 0i32, 0i32)
        }
        Finish::Retry {
            delay_ms,
            error,
            new_key,
            counts,
        } => (
            "PENDING",
            None,
            Some(error.as_str()),
            *delay_ms,
            *new_key as i32,
            !*counts as i32,
        ),
        Finish::Failed { error } => ("FAILED", None, Some(error.as_str()), 0, 0, 0),
        Finish::Skipped { reason } => ("SKIPPED", None, Some(reason.as_str()), 0, 0, 0),
    };
    let delay = delay_ms as f64;
    let n = client
        .execute(
            FINISH,
            &[
                &claim.event_id,
                &claim.channel,
                &claim.sending_since,
                &status,
                &provider_id,
                &error,
                &delay,
                &bump,
                &uncount,
            ],
        )
        .await?;
    Ok(n == 1)
}

/// Per channel: (channel, pending, sending, failed, oldest pending age in seconds).
pub async fn status<C: GenericClient + Sync>(
    client: &C,
    channels: &[String],
) -> Result<Vec<(String, i64, i64, i64, f64)>, StoreError> {
    let rows = client
        .query(
            "SELECT c.channel,
                    count(n.*) FILTER (WHERE n.status = 'PENDING'),
                    count(n.*) FILTER (WHERE n.status = 'SENDING'),
                    count(n.*) FILTER (WHERE n.status = 'FAILED'),
                    coalesce(extract(epoch FROM now() - min(n.created_at)
                                     FILTER (WHERE n.status = 'PENDING')), 0)::float8
             FROM unnest($1::text[]) AS c(channel)
             LEFT JOIN notifications n ON n.channel = c.channel
                                      AND n.status IN ('PENDING', 'SENDING', 'FAILED')
             GROUP BY c.channel ORDER BY c.channel",
            &[&channels],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect())
}
