//! A stored offset outside the partition's log (issue 24).
//!
//! The offset PostgreSQL stores for a partition can lie outside what Kafka still has: **above
//! the log end** when the topic was deleted and recreated, or an unclean leader election
//! truncated the partition; **below the log start** when retention deleted records this
//! consumer never applied (a consumer stopped for longer than `retention.ms`, or lagging past
//! it). librdkafka's `auto.offset.reset` would then jump, silently re-reading or skipping. The
//! engine sets it to `error` instead and decides itself, by `on_offset_out_of_range`:
//!
//! - `stop` (default): nothing of the partition is consumed (it stays assigned to this worker,
//!   its task only waits), an error names the partition and what happened, and
//!   `effectively_offset_out_of_range{end}` is 1 until an operator acts.
//! - `earliest` / `latest`: the partition moves to the log start / end, the new position is
//!   stored in PostgreSQL (a fenced move, as a batch's), a warning says so and
//!   `effectively_offset_out_of_range_resets_total{end}` counts it. A re-read is harmless: the
//!   dedupe keys skip what was applied.
//!
//! Where: at the **claim** (`at_claim`, before the assignment: the partition is assigned at
//! the position decided here), and **while consuming**, when librdkafka reports
//! `RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET` on the partition's queue (the partition task's
//! `after_reset_error`, in [`super::partition`]: the fetch at the task's position was out of
//! range, and librdkafka stopped fetching the partition). A partition with no stored offset is not checked: `auto_offset_reset` places it
//! (Beginning or End, always inside the log).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use tokio_util::sync::CancellationToken;

use super::context::{RebalanceContext, TopicPartition};
use crate::config::{ConsumerConfig, OutOfRange, RetryConfig};
use crate::stats::Stats;
pub use crate::store::offsets::End;
use crate::store::offsets::{self, Claim, Move, Refusal};
use crate::store::StoreError;

/// The longest one watermark query waits for the partition's leader.
pub const WATERMARKS_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest the fenced move of a reset waits for PostgreSQL, per attempt.
const MOVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A partition's log: its first offset and one past its last (the high watermark).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Log {
    pub low: i64,
    pub high: i64,
}

/// A stored offset outside the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outside {
    pub stored: i64,
    pub end: End,
    pub log: Log,
}

/// Where `stored` lies against `log`: `None` inside it, from the log start to the high
/// watermark included (at the high watermark the consumer is caught up).
pub fn check(stored: i64, log: Log) -> Option<Outside> {
    let end = if stored > log.high {
        End::Above
    } else if stored < log.low {
        End::Below
    } else {
        return None;
    };
    Some(Outside { stored, end, log })
}

impl Outside {
    /// What happened, in one sentence.
    pub fn sentence(&self) -> String {
        match self.end {
            End::Above => format!(
                "stored offset {} is above the log end {}: the topic was recreated or an unclean leader election truncated it",
                self.stored, self.log.high
            ),
            End::Below => format!(
                "stored offset {} is below the log start {}: retention deleted records this consumer never applied",
                self.stored, self.log.low
            ),
        }
    }
}

/// What the policy does with a stored offset outside the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Consume nothing of the partition until an operator acts.
    Stop,
    /// Resume at this offset (the log start or end), stored first.
    Seek(i64),
}

pub fn decide(policy: OutOfRange, out: &Outside) -> Action {
    match policy {
        OutOfRange::Stop => Action::Stop,
        OutOfRange::Earliest => Action::Seek(out.log.low),
        OutOfRange::Latest => Action::Seek(out.log.high),
    }
}

/// What the policy's seek to `to` does to the records, for the warning.
pub fn what_a_seek_does(policy: OutOfRange, out: &Outside, to: i64) -> String {
    let deleted = out.log.low - out.stored;
    let skipped = to - out.log.low;
    match (out.end, policy) {
        (End::Above, OutOfRange::Earliest) => format!(
            "reading the partition again from its start, offset {to}: what this consumer applied already is skipped by its dedupe keys"
        ),
        (End::Above, _) => format!(
            "resuming at the log end, offset {to}: the {skipped} record(s) now in the partition are skipped"
        ),
        (End::Below, OutOfRange::Earliest) => format!(
            "resuming at the log start, offset {to}: the {deleted} deleted record(s) are lost to this consumer"
        ),
        (End::Below, _) => format!(
            "resuming at the log end, offset {to}: the {deleted} deleted record(s) and the {skipped} still in the partition are skipped"
        ),
    }
}

/// What the operator can do about a stopped partition.
pub(super) const STOP_ACTIONS: &str =
    "not consuming the partition (on_offset_out_of_range = \"stop\"): \
     set consumer_offsets.next_offset to an offset inside the log, or set \
     on_offset_out_of_range to \"earliest\" or \"latest\", then restart the worker \
     (docs/OPERATIONS.md#offset-out-of-range)";

/// The partition's watermarks, read on a blocking thread (librdkafka waits for the leader's
/// answer), at most [`WATERMARKS_TIMEOUT`].
pub async fn watermarks(
    consumer: &Arc<StreamConsumer<RebalanceContext>>,
    topic: &str,
    partition: i32,
) -> Result<Log, String> {
    let (consumer, t) = (Arc::clone(consumer), topic.to_string());
    tokio::task::spawn_blocking(move || {
        consumer.fetch_watermarks(&t, partition, WATERMARKS_TIMEOUT)
    })
    .await
    .map_err(|e| format!("the watermark query did not finish: {e}"))?
    .map(|(low, high)| Log { low, high })
    .map_err(|e| e.to_string())
}

/// Stores `to` as the partition's offset if this worker still holds `epoch` and the row still
/// says `from` (the fenced move a batch makes, without records). Retries while PostgreSQL is
/// unavailable; `None` when `cancel` fires first.
pub(super) async fn store_move(
    pool: &deadpool_postgres::Pool,
    retry: &RetryConfig,
    (consumer, topic, partition): (&str, &str, i32),
    mv: Move,
    cancel: &CancellationToken,
) -> Option<Result<(), Refusal>> {
    let attempt = || async {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        if offsets::advance(&tx, consumer, topic, partition, mv).await? {
            tx.commit().await?;
            return Ok(Ok(()));
        }
        tx.rollback().await?;
        match offsets::why_refused(&**client, consumer, topic, partition, mv).await? {
            // An attempt whose answer was lost had moved it.
            Refusal::Committed => Ok(Ok(())),
            refusal => Ok(Err(refusal)),
        }
    };
    let mut attempts = 0;
    loop {
        let result: Result<Result<(), Refusal>, String> =
            match tokio::time::timeout(MOVE_TIMEOUT, attempt()).await {
                Ok(r) => r.map_err(|e: StoreError| e.to_string()),
                Err(_) => Err(format!("PostgreSQL did not answer within {MOVE_TIMEOUT:?}")),
            };
        match result {
            Ok(done) => return Some(done),
            Err(e) => {
                attempts += 1;
                tracing::warn!(%consumer, %topic, partition, error = %e, attempts,
                    "storing the new position of a partition whose offset was outside the log failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return None,
                    _ = tokio::time::sleep(crate::strategy::backoff(retry, attempts)) => {}
                }
            }
        }
    }
}

/// Checks each claimed partition's stored offset against its log before it is assigned, and
/// applies `on_offset_out_of_range` to those outside: `earliest`/`latest` store the new
/// position and return it in the claim (the callback assigns there, the task seeks there);
/// `stop` marks the partition in [`crate::stats::Stats`] for its task, which then consumes
/// nothing. A partition whose watermarks cannot be read starts at its stored offset, as it
/// would without this check (librdkafka then reports an offset outside the log as an error,
/// handled by the partition task, [`super::partition`]).
pub(super) async fn at_claim(
    config: &ConsumerConfig,
    pool: &deadpool_postgres::Pool,
    stats: &Stats,
    consumer: &Arc<StreamConsumer<RebalanceContext>>,
    mut claims: Vec<(TopicPartition, Claim)>,
    shutdown: &CancellationToken,
) -> Vec<(TopicPartition, Claim)> {
    let name = config.name.as_str();
    let policy = config.on_offset_out_of_range;
    let queries = claims
        .iter()
        .filter(|(_, c)| c.next_offset.is_some())
        .map(|(tp, _)| async { (tp.clone(), watermarks(consumer, &tp.0, tp.1).await) });
    let logs: HashMap<TopicPartition, Result<Log, String>> = futures::future::join_all(queries)
        .await
        .into_iter()
        .collect();
    for (tp, claim) in &mut claims {
        let (topic, partition) = (tp.0.as_str(), tp.1);
        stats.out_of_range(topic, partition, None);
        let (Some(stored), Some(log)) = (claim.next_offset, logs.get(tp)) else {
            continue;
        };
        let log = match log {
            Ok(log) => *log,
            Err(e) => {
                tracing::warn!(consumer = %name, topic, partition, error = %e, stored,
                    "could not read the partition's watermarks: starting at the stored offset unchecked");
                continue;
            }
        };
        let Some(out) = check(stored, log) else {
            continue;
        };
        match decide(policy, &out) {
            Action::Stop => {
                tracing::error!(consumer = %name, topic, partition, stored, low = log.low, high = log.high,
                    "consumer {name}, {topic}/{partition}: {}; {STOP_ACTIONS}", out.sentence());
                stats.out_of_range(topic, partition, Some((out.end, claim.epoch)));
            }
            Action::Seek(to) => {
                let mv = Move {
                    epoch: claim.epoch,
                    from: Some(stored),
                    to,
                };
                let key = (name, topic, partition);
                match store_move(pool, &config.retry, key, mv, shutdown).await {
                    None => {}
                    Some(Ok(())) => {
                        tracing::warn!(consumer = %name, topic, partition, stored, low = log.low, high = log.high,
                            "consumer {name}, {topic}/{partition}: {}; on_offset_out_of_range = \"{}\": {}",
                            out.sentence(), policy.as_str(), what_a_seek_does(policy, &out, to));
                        claim.next_offset = Some(to);
                        stats.offset_reset();
                        crate::metrics::offset_range_reset(
                            name,
                            topic,
                            partition,
                            out.end.as_str(),
                        );
                    }
                    // Claimed again by someone else meanwhile, or rewritten: its first batch is
                    // refused the same way and the partition claimed again.
                    Some(Err(refusal)) => {
                        tracing::warn!(consumer = %name, topic, partition, ?refusal,
                            "the stored offset changed before the out-of-range reset could be stored: not moving the partition");
                    }
                }
            }
        }
    }
    claims
}

/// Set by a partition task's queue reader when librdkafka reports the fetch position out of
/// range (`RD_KAFKA_RESP_ERR__AUTO_OFFSET_RESET`, with `auto.offset.reset = error`).
#[derive(Debug, Default)]
pub struct Seen(AtomicBool);

impl Seen {
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    pub(super) fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

/// Whether `e` is librdkafka's report that the fetch position is outside the log.
pub fn is_out_of_range(e: &rdkafka::error::KafkaError) -> bool {
    matches!(
        e,
        rdkafka::error::KafkaError::MessageConsumption(
            rdkafka::types::RDKafkaErrorCode::AutoOffsetReset
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: Log = Log { low: 40, high: 100 };

    #[test]
    fn inside_the_log_from_its_start_to_the_high_watermark() {
        assert_eq!(check(40, LOG), None, "at the log start");
        assert_eq!(check(70, LOG), None);
        assert_eq!(check(100, LOG), None, "at the high watermark: caught up");
        let empty = Log { low: 7, high: 7 };
        assert_eq!(check(7, empty), None, "an empty log, where it ends");
    }

    #[test]
    fn above_the_end_and_below_the_start() {
        let above = check(101, LOG).expect("one past the high watermark");
        assert_eq!(above.end, End::Above);
        assert_eq!(
            above.sentence(),
            "stored offset 101 is above the log end 100: the topic was recreated or an unclean leader election truncated it"
        );
        let below = check(39, LOG).expect("one before the log start");
        assert_eq!(below.end, End::Below);
        assert_eq!(
            below.sentence(),
            "stored offset 39 is below the log start 40: retention deleted records this consumer never applied"
        );
        // A recreated topic: the new log is empty, or shorter than the stored offset.
        let recreated = check(5_000, Log { low: 0, high: 0 }).unwrap();
        assert_eq!((recreated.end, recreated.log.high), (End::Above, 0));
    }

    #[test]
    fn the_policy_stops_or_goes_to_the_start_or_the_end() {
        for stored in [20, 120] {
            let out = check(stored, LOG).unwrap();
            assert_eq!(decide(OutOfRange::Stop, &out), Action::Stop);
            assert_eq!(decide(OutOfRange::Earliest, &out), Action::Seek(40));
            assert_eq!(decide(OutOfRange::Latest, &out), Action::Seek(100));
        }
    }

    #[test]
    fn the_warning_says_what_the_seek_skips_or_reads_again() {
        let (earliest, latest) = (OutOfRange::Earliest, OutOfRange::Latest);
        let above = check(120, LOG).unwrap();
        let says = |policy, out: &Outside, to| what_a_seek_does(policy, out, to);
        assert!(says(earliest, &above, 40).contains("again from its start, offset 40"));
        assert!(says(latest, &above, 100).contains("the 60 record(s) now in the partition"));
        let below = check(10, LOG).unwrap();
        assert!(says(earliest, &below, 40).contains("the 30 deleted record(s) are lost"));
        assert!(says(latest, &below, 100)
            .contains("the 30 deleted record(s) and the 60 still in the partition"));
        // Deleted up to the end: start and end are one offset, the words follow the policy.
        let empty = check(2, Log { low: 41, high: 41 }).unwrap();
        assert!(says(latest, &empty, 41).starts_with("resuming at the log end, offset 41"));
        assert!(says(earliest, &empty, 41).starts_with("resuming at the log start, offset 41"));
    }

    #[test]
    fn only_the_auto_offset_reset_error_is_out_of_range() {
        use rdkafka::error::KafkaError;
        use rdkafka::types::RDKafkaErrorCode;
        assert!(is_out_of_range(&KafkaError::MessageConsumption(
            RDKafkaErrorCode::AutoOffsetReset
        )));
        assert!(!is_out_of_range(&KafkaError::MessageConsumption(
            RDKafkaErrorCode::OffsetOutOfRange
        )));
        assert!(!is_out_of_range(&KafkaError::PartitionEOF(0)));
    }
}
