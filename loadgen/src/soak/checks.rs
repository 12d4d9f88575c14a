//! The soak's checks beside the ledger's: every credit's notification delivered once at the
//! provider, and every credit's outbox row published by the relay.
//!
//! What is checked and what is not: the sender's side is exact (the provider stub serves this
//! run alone and injects no failure, so its delivered messages must equal the run's SENT
//! notifications, one per credit; a second delivery would need a second key). The relay's side
//! is counted, not read back: each credit's outbox row (both streams') must be marked published, and the run's
//! `CashbackCredited` topic must hold at least as many records (more: rows published again
//! after a broker restart rolled a batch back, or rows left unpublished by earlier runs on the
//! same database, which the relay publishes too). That no record in it is missing is implied by
//! the marks (a row is marked only after the broker acknowledged it); that none is doubled is
//! the consumer's job, not the relay's (at least once).

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::ClientConfig;
use serde::Serialize;

use crate::harness::watch::connect;

/// The sender's outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Delivery {
    /// The run's notifications (one per credit expected).
    pub notifications: i64,
    pub sent: i64,
    /// Left PENDING or SENDING after the wait.
    pub open: i64,
    pub failed: i64,
    /// Messages the provider delivered (the run's alone).
    pub provider_effects: u64,
    /// Calls answered from a saved response: a retry of a call whose answer was lost.
    pub provider_replays: u64,
    pub provider_lookups: u64,
    pub passed: bool,
}

/// The relay's outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub(super) struct Relayed {
    /// The outbox rows of the run's credits.
    pub rows: i64,
    pub unpublished: i64,
    /// Records in the run's `CashbackCredited` topic.
    pub topic_records: i64,
    pub passed: bool,
}

/// Waits (up to `limit`) for the sender to finish the run's notifications, then counts them
/// against `credits` and the provider's deliveries.
pub(super) async fn delivery(
    url: &str,
    channel: &str,
    stub: &provider_stub::ProviderStub,
    credits: u64,
    limit: Duration,
) -> anyhow::Result<Delivery> {
    let db = connect(url, Duration::from_secs(5)).await?;
    let started = Instant::now();
    loop {
        let row = db
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE status = 'SENT'),
                        count(*) FILTER (WHERE status IN ('PENDING', 'SENDING')),
                        count(*) FILTER (WHERE status = 'FAILED')
                 FROM notifications WHERE channel = $1",
                &[&channel],
            )
            .await?;
        let (notifications, sent, open, failed): (i64, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        if open == 0 || started.elapsed() >= limit {
            let stats = stub.stats();
            let passed = open == 0
                && failed == 0
                && notifications == credits as i64
                && sent == notifications
                && stats.effects as i64 == sent;
            return Ok(Delivery {
                notifications,
                sent,
                open,
                failed,
                provider_effects: stats.effects as u64,
                provider_replays: stats.replays as u64,
                provider_lookups: stats.lookups as u64,
                passed,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Waits (up to `limit`) for the relay to publish the outbox rows of the credits of
/// `consumers` (found by their payment ids, unique), then counts them and the records of `topic`.
pub(super) async fn relayed(
    url: &str,
    brokers: &str,
    consumers: &[&str],
    topic: &str,
    credits: u64,
    limit: Duration,
) -> anyhow::Result<Relayed> {
    let db = connect(url, Duration::from_secs(5)).await?;
    let started = Instant::now();
    let (rows, unpublished) = loop {
        let row = db
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE o.published_at IS NULL)
                 FROM cashback_credits c JOIN outbox o
                   ON o.event_type = 'CashbackCredited' AND o.aggregate_id = c.user_id
                  AND o.payload->>'payment_id' = c.payment_id
                 WHERE c.consumer = ANY($1)",
                &[&consumers],
            )
            .await?;
        let (rows, unpublished): (i64, i64) = (row.get(0), row.get(1));
        if unpublished == 0 || started.elapsed() >= limit {
            break (rows, unpublished);
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    };
    let (brokers, topic) = (brokers.to_string(), topic.to_string());
    let topic_records = tokio::task::spawn_blocking(move || -> anyhow::Result<i64> {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .create()?;
        let meta = client.fetch_metadata(Some(&topic), Duration::from_secs(10))?;
        let mut total = 0;
        for t in meta.topics() {
            for p in t.partitions() {
                let (low, high) =
                    client.fetch_watermarks(&topic, p.id(), Duration::from_secs(10))?;
                total += high - low;
            }
        }
        Ok(total)
    })
    .await??;
    Ok(Relayed {
        rows,
        unpublished,
        topic_records,
        passed: rows == credits as i64 && unpublished == 0 && topic_records >= rows,
    })
}
