//! One function per event that moves a metric (`batch_committed(..)`), and the per-partition
//! counters resolved once; the names are [`super`]'s constants.

use std::time::Duration;

use metrics::{counter, gauge, histogram, Counter, Histogram};

use super::*;
use crate::batch::Outcome;

/// Counters one partition task bumps per record, resolved once.
#[derive(Clone)]
pub struct PartitionMetrics {
    received: Counter,
    below_stored: Counter,
    arrive: Histogram,
}

impl PartitionMetrics {
    pub fn new(consumer: &str, topic: &str, partition: i32) -> Self {
        let labels = [
            ("consumer", consumer.to_string()),
            ("topic", topic.to_string()),
            ("partition", partition.to_string()),
        ];
        // The Schema Registry's series at 0 for every partition (a JSON consumer's stay there),
        // so the alert and the dashboard see the first wait.
        schema_registry_unavailable(consumer, topic, partition, false);
        schema_registry_series(consumer);
        // Zero series from the start, so rate() and increase() see the first parked message
        // of each reason and the first fence.
        for reason in crate::envelope::Reason::ALL {
            counter!(PARKED, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
                "reason" => reason.as_str())
            .increment(0);
        }
        counter!(RECORDS_SKIPPED, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
            "reason" => crate::envelope::Reason::Tombstone.as_str())
        .increment(0);
        counter!(FENCED, &labels).increment(0);
        counter!(OFFSET_STORE_WENT_BACK, &labels).increment(0);
        counter!(OFFSET_STORE_REWOUND, &labels).increment(0);
        PartitionMetrics {
            received: counter!(RECORDS_RECEIVED, &labels),
            below_stored: counter!(DUPLICATES_SKIPPED, "consumer" => consumer.to_string(),
                "topic" => topic.to_string(), "reason" => "below_stored_offset"),
            arrive: histogram!(BATCH_PHASE, "consumer" => consumer.to_string(),
                "topic" => topic.to_string(), "phase" => "arrive"),
        }
    }

    pub fn received(&self) {
        self.received.increment(1);
    }

    pub fn below_stored_offset(&self) {
        self.below_stored.increment(1);
    }

    /// A batch was cut: how long its oldest record took to get here from its Kafka timestamp
    /// (the producer, the broker, the fetch, the partition's queue and the linger), the `arrive`
    /// phase. With the transaction's phases and the batch's duration it says where an
    /// end-to-end latency was spent.
    pub fn batch_cut(&self, oldest_timestamp_ms: i64) {
        let age_ms = (chrono::Utc::now().timestamp_millis() - oldest_timestamp_ms).max(0);
        self.arrive.record(age_ms as f64 / 1e3);
    }
}

/// A batch finished (every transaction of it committed).
pub fn batch_committed(consumer: &str, topic: &str, o: &Outcome, took: Duration) {
    let (c, t) = (consumer.to_string(), topic.to_string());
    histogram!(BATCH_SIZE, "consumer" => c.clone(), "topic" => t.clone()).record(o.records as f64);
    histogram!(BATCH_DURATION, "consumer" => c.clone(), "topic" => t.clone())
        .record(took.as_secs_f64());
    counter!(TRANSACTIONS_COMMITTED, "consumer" => c.clone(), "topic" => t.clone())
        .increment(o.commits);
    // Phases that did not run in this batch (nothing to stage, nothing fresh, or a commit
    // group's batch whose transaction is counted on the group's first batch) are not recorded
    // as zeros.
    let txn = o.commits > 0;
    let candidates = txn && o.fresh + o.duplicates - o.prefilter_hits > 0;
    for (phase, d, ran) in [
        ("fence", o.phases.fence, txn),
        ("stage", o.phases.stage, candidates),
        ("dedupe", o.phases.dedupe, candidates),
        ("effect", o.phases.effect, txn && o.fresh > 0),
        ("commit", o.phases.commit, txn),
    ] {
        if ran {
            histogram!(BATCH_PHASE, "consumer" => c.clone(), "topic" => t.clone(), "phase" => phase)
                .record(d.as_secs_f64());
        }
    }
    if o.fresh > 0 {
        histogram!(HANDLER_DURATION, "consumer" => c.clone()).record(o.phases.effect.as_secs_f64());
    }
    counter!(EFFECTS_APPLIED, "consumer" => c.clone(), "topic" => t.clone()).increment(o.effects);
    counter!(DUPLICATES_SKIPPED, "consumer" => c.clone(), "topic" => t.clone(), "reason" => "dedupe_key")
        .increment(o.duplicates - o.prefilter_hits);
    if o.prefilter_hits > 0 {
        counter!(DUPLICATES_SKIPPED, "consumer" => c.clone(), "topic" => t.clone(), "reason" => "prefilter")
            .increment(o.prefilter_hits);
    }
    counter!(DUPLICATES_SKIPPED, "consumer" => c.clone(), "topic" => t.clone(), "reason" => "business_key")
        .increment(o.business_duplicates);
    counter!(TRANSIENT_RETRIES, "consumer" => c.clone(), "topic" => t.clone()).increment(o.retries);
    for reason in &o.parked {
        counter!(PARKED, "consumer" => c.clone(), "topic" => t.clone(), "reason" => reason.as_str())
            .increment(1);
    }
    for reason in &o.skipped {
        counter!(RECORDS_SKIPPED, "consumer" => c.clone(), "topic" => t.clone(), "reason" => reason.as_str())
            .increment(1);
    }
}

/// Fresh messages just committed: their end-to-end latency from the records' timestamps.
pub fn effects_committed(consumer: &str, topic: &str, record_ts_ms: &[i64]) {
    if record_ts_ms.is_empty() {
        return;
    }
    let h =
        histogram!(E2E_LATENCY, "consumer" => consumer.to_string(), "topic" => topic.to_string());
    let now = chrono::Utc::now().timestamp_millis();
    for ts in record_ts_ms {
        h.record(((now - ts).max(0) as f64) / 1000.0);
    }
}

pub fn fenced(consumer: &str, topic: &str, partition: i32) {
    counter!(FENCED, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
        "partition" => partition.to_string())
    .increment(1);
}

/// The offset store went back from `from` (this worker's last commit) to `stored`.
pub fn offset_store_went_back(
    consumer: &str,
    topic: &str,
    partition: i32,
    from: Option<i64>,
    stored: Option<i64>,
) {
    let labels = [
        ("consumer", consumer.to_string()),
        ("topic", topic.to_string()),
        ("partition", partition.to_string()),
    ];
    counter!(OFFSET_STORE_WENT_BACK, &labels).increment(1);
    if let Some(from) = from {
        let back = from - stored.unwrap_or(0);
        counter!(OFFSET_STORE_REWOUND, &labels).increment(back.max(0) as u64);
    }
}

pub fn partitions_assigned(consumer: &str, n: usize, now_assigned: usize) {
    counter!(REBALANCES, "consumer" => consumer.to_string()).increment(1);
    counter!(PARTITIONS_ASSIGNED, "consumer" => consumer.to_string()).increment(n as u64);
    gauge!(ASSIGNED_PARTITIONS, "consumer" => consumer.to_string()).set(now_assigned as f64);
}

pub fn partitions_revoked(consumer: &str, n: usize, now_assigned: usize) {
    counter!(PARTITIONS_REVOKED, "consumer" => consumer.to_string()).increment(n as u64);
    gauge!(ASSIGNED_PARTITIONS, "consumer" => consumer.to_string()).set(now_assigned as f64);
}

pub fn lag(consumer: &str, topic: &str, partition: i32, records: i64) {
    gauge!(CONSUMER_LAG, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
        "partition" => partition.to_string())
    .set(records.max(0) as f64);
}

pub fn dead_letters_waiting(consumer: &str, rows: i64) {
    gauge!(DEAD_LETTERS_WAITING, "consumer" => consumer.to_string()).set(rows as f64);
}

/// One daily partition of `database`'s ledger (`default` for `[database]`).
pub fn dedupe_partition(database: &str, date: chrono::NaiveDate, rows: f64, bytes: f64) {
    let (db, d) = (database.to_string(), date.format("%Y-%m-%d").to_string());
    gauge!(DEDUPE_PARTITION_ROWS, "database" => db.clone(), "day" => d.clone()).set(rows);
    gauge!(DEDUPE_PARTITION_BYTES, "database" => db, "day" => d).set(bytes);
}

pub fn dedupe_partitions_ahead(database: &str, days: i64) {
    gauge!(DEDUPE_PARTITIONS_AHEAD, "database" => database.to_string()).set(days as f64);
}

/// The pool of `database`, as its sampler last saw it.
pub fn pool(database: &str, in_use: usize, idle: usize) {
    let db = database.to_string();
    gauge!(POOL_CONNECTIONS, "database" => db.clone(), "state" => "in_use").set(in_use as f64);
    gauge!(POOL_CONNECTIONS, "database" => db, "state" => "idle").set(idle as f64);
}

/// Which database holds `consumer`'s ledger: an info series (always 1) to join the
/// per-consumer series with the per-database ones (`* on (consumer) group_left (database)`).
pub fn consumer_database(consumer: &str, database: &str) {
    gauge!(CONSUMER_DATABASE, "consumer" => consumer.to_string(),
        "database" => database.to_string())
    .set(1.0);
}

/// An inbox processor's round committed: `done` rows applied, `retry` rows rescheduled,
/// `failed` rows parked; `claim` is the claim statement's time, `took` the whole round's.
pub fn inbox_round(
    consumer: &str,
    claim: Duration,
    took: Duration,
    done: u64,
    retry: u64,
    failed: u64,
) {
    let c = consumer.to_string();
    histogram!(INBOX_CLAIM_DURATION, "consumer" => c.clone()).record(claim.as_secs_f64());
    if done + retry + failed == 0 {
        return;
    }
    histogram!(INBOX_PROCESS_DURATION, "consumer" => c.clone()).record(took.as_secs_f64());
    for (outcome, n) in [("done", done), ("retry", retry), ("failed", failed)] {
        counter!(INBOX_PROCESSED, "consumer" => c.clone(), "outcome" => outcome).increment(n);
    }
}

/// Effects an inbox processor committed, per topic (the batch strategy counts its own in
/// [`batch_committed`]).
pub fn inbox_effects(consumer: &str, topic: &str, effects: u64, business_duplicates: u64) {
    let (c, t) = (consumer.to_string(), topic.to_string());
    counter!(EFFECTS_APPLIED, "consumer" => c.clone(), "topic" => t.clone()).increment(effects);
    counter!(DUPLICATES_SKIPPED, "consumer" => c, "topic" => t, "reason" => "business_key")
        .increment(business_duplicates);
}

pub fn inbox_lease_lost(consumer: &str, rows: u64) {
    counter!(INBOX_LEASE_LOST, "consumer" => consumer.to_string()).increment(rows);
}

/// Zero series for an inbox consumer, so alerts and rate() see the first event.
pub fn inbox_consumer(consumer: &str) {
    let c = consumer.to_string();
    for outcome in ["done", "retry", "failed"] {
        counter!(INBOX_PROCESSED, "consumer" => c.clone(), "outcome" => outcome).increment(0);
    }
    counter!(INBOX_LEASE_LOST, "consumer" => c.clone()).increment(0);
    gauge!(INBOX_PROCESSOR_STALLED, "consumer" => c).increment(0.0);
}

/// The sampled inbox gauges of one consumer.
pub fn inbox_status(consumer: &str, pending: i64, in_progress: i64, failed: i64, oldest_s: f64) {
    let c = consumer.to_string();
    for (status, n) in [
        ("pending", pending),
        ("in_progress", in_progress),
        ("failed", failed),
    ] {
        gauge!(INBOX_ROWS, "consumer" => c.clone(), "status" => status).set(n as f64);
    }
    gauge!(INBOX_OLDEST_PENDING_AGE, "consumer" => c).set(oldest_s);
}

/// Publishes a versioned consumer's counters at 0, so that `increase()` sees its first events.
pub fn version_consumer(consumer: &str) {
    for reason in ["stale", "duplicate", "held", "released"] {
        counter!(VERSION_SKIPPED, "consumer" => consumer.to_string(), "reason" => reason)
            .increment(0);
    }
}

/// Versioned events of a committed transaction that changed nothing or were held.
pub fn versions_skipped(consumer: &str, s: &crate::version::Skipped) {
    for (reason, n) in [
        ("stale", s.stale),
        ("duplicate", s.duplicate),
        ("held", s.held),
        ("released", s.released),
    ] {
        if n > 0 {
            counter!(VERSION_SKIPPED, "consumer" => consumer.to_string(), "reason" => reason)
                .increment(n);
        }
    }
}

/// The sampled held-gap gauges of one versioned consumer.
pub fn version_gaps(consumer: &str, held: i64, overdue: i64) {
    gauge!(VERSION_HELD, "consumer" => consumer.to_string()).set(held as f64);
    gauge!(VERSION_GAPS_OVERDUE, "consumer" => consumer.to_string()).set(overdue as f64);
}

/// Outbox rows a relay published and marked, with each one's time since it was written.
pub fn outbox_published(latencies: impl Iterator<Item = Duration>) {
    let h = histogram!(OUTBOX_PUBLISH_LATENCY);
    let mut n = 0;
    for l in latencies {
        h.record(l.as_secs_f64());
        n += 1;
    }
    counter!(OUTBOX_PUBLISHED).increment(n);
}

/// The relay's sampled backlog.
pub fn outbox_backlog(rows: i64, oldest_s: f64) {
    gauge!(OUTBOX_UNPUBLISHED).set(rows as f64);
    gauge!(OUTBOX_OLDEST_AGE).set(oldest_s);
}

/// Publishes a sender channel's counters at 0, so that `increase()` sees the first outcome.
pub fn notification_channel(channel: &str) {
    for o in NotificationOutcome::ALL {
        counter!(NOTIFICATIONS, "channel" => channel.to_string(), "outcome" => o.as_str())
            .increment(0);
    }
}

/// One notification's recorded outcome.
pub fn notification(channel: &str, outcome: NotificationOutcome) {
    counter!(NOTIFICATIONS, "channel" => channel.to_string(), "outcome" => outcome.as_str())
        .increment(1);
}

/// A sender's sampled view of one channel.
pub fn notifications_status(channel: &str, pending: i64, sending: i64, failed: i64, oldest_s: f64) {
    for (status, n) in [
        ("pending", pending),
        ("sending", sending),
        ("failed", failed),
    ] {
        gauge!(NOTIFICATION_ROWS, "channel" => channel.to_string(), "status" => status)
            .set(n as f64);
    }
    gauge!(NOTIFICATION_OLDEST_AGE, "channel" => channel.to_string()).set(oldest_s);
}

/// How a notification's delivery went ([`crate::sender`]), as counted in
/// `effectively_notifications_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotificationOutcome {
    /// The provider performed it now.
    Sent,
    /// The provider answered from its record: it had performed it before.
    Replayed,
    /// An interrupted send or an ambiguous failure, found sent by asking the provider.
    Reconciled,
    Retried,
    Failed,
    Skipped,
}

impl NotificationOutcome {
    pub const ALL: [NotificationOutcome; 6] = [
        NotificationOutcome::Sent,
        NotificationOutcome::Replayed,
        NotificationOutcome::Reconciled,
        NotificationOutcome::Retried,
        NotificationOutcome::Failed,
        NotificationOutcome::Skipped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NotificationOutcome::Sent => "sent",
            NotificationOutcome::Replayed => "replayed",
            NotificationOutcome::Reconciled => "reconciled",
            NotificationOutcome::Retried => "retried",
            NotificationOutcome::Failed => "failed",
            NotificationOutcome::Skipped => "skipped",
        }
    }
}

/// Publishes a partition's out-of-range series: the gauge at 1 for the `held` end (`above` or
/// `below`) and 0 for the other (both 0 when `None`), the reset counters at 0 so that
/// `increase()` sees the first reset.
pub fn offset_range(consumer: &str, topic: &str, partition: i32, held: Option<&str>) {
    for end in ["above", "below"] {
        let labels = [
            ("consumer", consumer.to_string()),
            ("topic", topic.to_string()),
            ("partition", partition.to_string()),
            ("end", end.to_string()),
        ];
        gauge!(OFFSET_OUT_OF_RANGE, &labels).set(if held == Some(end) { 1.0 } else { 0.0 });
        counter!(OFFSET_OUT_OF_RANGE_RESETS, &labels).increment(0);
    }
}

/// The policy moved a partition whose offset was outside the log (`end`: above or below).
pub fn offset_range_reset(consumer: &str, topic: &str, partition: i32, end: &str) {
    counter!(OFFSET_OUT_OF_RANGE_RESETS, "consumer" => consumer.to_string(),
        "topic" => topic.to_string(), "partition" => partition.to_string(), "end" => end.to_string())
    .increment(1);
}

fn partition_labels(consumer: &str, topic: &str, partition: i32) -> [(&'static str, String); 3] {
    [
        ("consumer", consumer.to_string()),
        ("topic", topic.to_string()),
        ("partition", partition.to_string()),
    ]
}

/// The codes (librdkafka's names) that stop a partition's fetches which the engine has met,
/// published at 0 from each partition task's start so that `increase()` sees the first error:
/// a codec the client lacks, a topic the user may not read, a batch that fails its CRC or
/// cannot be parsed, a corrupt record. Other codes count too, from their first error.
pub const PARTITION_ERROR_CODES: [&str; 4] = [
    "NotImplemented",
    "TopicAuthorizationFailed",
    "BadMessage",
    "InvalidMessage",
];

/// A partition task started: its stuck and stalled gauges at 0 (and 0 again when it ends),
/// its error counters published.
pub fn partition_watched(consumer: &str, topic: &str, partition: i32) {
    partition_stuck(consumer, topic, partition, false);
    partition_stalled(consumer, topic, partition, false);
    for code in PARTITION_ERROR_CODES {
        counter!(PARTITION_ERRORS, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
            "partition" => partition.to_string(), "code" => code)
        .increment(0);
    }
}

/// A fetch of the partition returned a Kafka error (`code`, librdkafka's name) instead of
/// records.
pub fn partition_fetch_error(consumer: &str, topic: &str, partition: i32, code: &str) {
    counter!(PARTITION_ERRORS, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
        "partition" => partition.to_string(), "code" => code.to_string())
    .increment(1);
}

/// The partition is stuck (its last fetch failed, no record since), or not any more.
/// librdkafka called the rebalance callback: a rebalance of the group this member took part in,
/// whether or not it moved any of this member's partitions.
pub fn group_rebalance(consumer: &str) {
    counter!(GROUP_REBALANCES, "consumer" => consumer.to_string()).increment(1);
}

/// An operator paused (or resumed) the partition.
pub fn partition_paused(consumer: &str, topic: &str, partition: i32, paused: bool) {
    gauge!(
        PARTITION_PAUSED,
        &partition_labels(consumer, topic, partition)
    )
    .set(if paused { 1.0 } else { 0.0 });
}

/// The consumer's rate limit in this worker (0: none).
pub fn max_rate(consumer: &str, rate: Option<f64>) {
    gauge!(MAX_RATE, "consumer" => consumer.to_string()).set(rate.unwrap_or(0.0));
}

pub fn partition_stuck(consumer: &str, topic: &str, partition: i32, stuck: bool) {
    gauge!(
        PARTITION_STUCK,
        &partition_labels(consumer, topic, partition)
    )
    .set(if stuck { 1.0 } else { 0.0 });
}

/// The partition's batch has been retrying past `stall_after`, or it ended.
pub fn partition_stalled(consumer: &str, topic: &str, partition: i32, stalled: bool) {
    gauge!(
        PARTITION_STALLED,
        &partition_labels(consumer, topic, partition)
    )
    .set(if stalled { 1.0 } else { 0.0 });
}

/// An inbox processor's round has not succeeded for `stall_after` (`began`), or the stall ended
/// (a round succeeded, or the processor stopped).
pub fn inbox_processor_stall(consumer: &str, began: bool) {
    let g = gauge!(INBOX_PROCESSOR_STALLED, "consumer" => consumer.to_string());
    match began {
        true => g.increment(1.0),
        false => g.decrement(1.0),
    }
}

/// The rounds this process's inbox processors of `consumer` may run at once changed (or
/// started).
pub fn inbox_round_limit(consumer: &str, limit: usize) {
    gauge!(INBOX_ROUND_LIMIT, "consumer" => consumer.to_string()).set(limit as f64);
}
