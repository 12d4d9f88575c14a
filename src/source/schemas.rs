//! A partition task's wait for the Schema Registry: before a record in a registry format is
//! decoded, the schemas it names are looked up ([`Decoder::prepare`]). A registry that does not
//! answer is the database-unavailable case: the task waits with backoff (the records collected
//! so far wait with it, uncommitted), raises the unavailable gauge, and decodes once it
//! answers; it never parks a good record for it. Revocation or shutdown ends the wait.

use std::time::Duration;

use rdkafka::message::{BorrowedMessage, Message};
use tokio_util::sync::CancellationToken;

use crate::envelope::Decoder;
use crate::metrics;

/// The longest pause between two asks of a registry that does not answer.
const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Looks up `m`'s schemas, retrying while the registry is unavailable. `false` when `cancel`
/// ended the wait (the record must not be decoded then).
pub async fn ready(
    decoder: &Decoder,
    m: &Result<BorrowedMessage<'_>, rdkafka::error::KafkaError>,
    consumer: &str,
    topic: &str,
    partition: i32,
    cancel: &CancellationToken,
) -> bool {
    let (Some(registry), Ok(m)) = (decoder.registry(), m) else {
        return true;
    };
    let mut attempt: u32 = 0;
    loop {
        match decoder.prepare(m.key(), m.payload()).await {
            Ok(()) => {
                if attempt > 0 {
                    metrics::schema_registry_unavailable(consumer, topic, partition, false);
                    tracing::info!(
                        consumer,
                        topic,
                        partition,
                        registry = registry.url(),
                        attempts = attempt,
                        "the schema registry answers again"
                    );
                }
                return true;
            }
            Err(e) => {
                attempt += 1;
                metrics::schema_registry_error(consumer);
                if attempt == 1 {
                    metrics::schema_registry_unavailable(consumer, topic, partition, true);
                }
                let pause = Duration::from_millis(200)
                    .saturating_mul(1 << attempt.min(10))
                    .min(MAX_BACKOFF);
                tracing::warn!(consumer, topic, partition, offset = m.offset(), attempt,
                    error = %e, "cannot look up the record's schema: waiting {pause:?}, then asking again (nothing parked)");
                tokio::select! {
                    _ = cancel.cancelled() => {
                        metrics::schema_registry_unavailable(consumer, topic, partition, false);
                        return false;
                    }
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}
