//! Prometheus metrics: every name in one place, with its description and unit, and one
//! function per event that matters (`batch_committed(..)`), so the rest of the code never
//! spells a metric name. Labels are `consumer`, `topic`, `partition`, `reason` and `phase`:
//! all bounded (never an event id). Recorded by `metrics-exporter-prometheus` and served by
//! [`crate::endpoint`] on `--metrics-addr` (default 127.0.0.1:9464) beside `/healthz` and
//! `/readyz`; `docs/OPERATIONS.md` says what each one means.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics::{
    counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram, Counter, Unit,
};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::batch::Outcome;

pub const E2E_LATENCY: &str = "effectively_e2e_latency_seconds";
pub const BATCH_SIZE: &str = "effectively_batch_size_records";
pub const BATCH_DURATION: &str = "effectively_batch_duration_seconds";
pub const BATCH_PHASE: &str = "effectively_batch_phase_seconds";
pub const HANDLER_DURATION: &str = "effectively_handler_duration_seconds";
pub const RECORDS_RECEIVED: &str = "effectively_records_received_total";
pub const EFFECTS_APPLIED: &str = "effectively_effects_applied_total";
pub const TRANSACTIONS_COMMITTED: &str = "effectively_transactions_committed_total";
pub const DUPLICATES_SKIPPED: &str = "effectively_duplicates_skipped_total";
pub const PARKED: &str = "effectively_parked_total";
pub const TRANSIENT_RETRIES: &str = "effectively_transient_retries_total";
pub const FENCED: &str = "effectively_fenced_transactions_total";
pub const OFFSET_STORE_WENT_BACK: &str = "effectively_offset_store_went_back_total";
pub const OFFSET_STORE_REWOUND: &str = "effectively_offset_store_rewound_records_total";
pub const REBALANCES: &str = "effectively_rebalances_total";
pub const PARTITIONS_ASSIGNED: &str = "effectively_partitions_assigned_total";
pub const PARTITIONS_REVOKED: &str = "effectively_partitions_revoked_total";
pub const CONSUMER_LAG: &str = "effectively_consumer_lag_records";
pub const ASSIGNED_PARTITIONS: &str = "effectively_assigned_partitions";
pub const DEAD_LETTERS_WAITING: &str = "effectively_dead_letters_waiting";
pub const DEDUPE_PARTITION_ROWS: &str = "effectively_dedupe_partition_rows";
pub const DEDUPE_PARTITION_BYTES: &str = "effectively_dedupe_partition_bytes";
pub const DEDUPE_PARTITIONS_AHEAD: &str = "effectively_dedupe_partitions_ahead_days";
pub const POOL_CONNECTIONS: &str = "effectively_pool_connections";
pub const INBOX_ROWS: &str = "effectively_inbox_rows";
pub const INBOX_OLDEST_PENDING_AGE: &str = "effectively_inbox_oldest_pending_age_seconds";
pub const INBOX_CLAIM_DURATION: &str = "effectively_inbox_claim_duration_seconds";
pub const INBOX_PROCESS_DURATION: &str = "effectively_inbox_process_duration_seconds";
pub const INBOX_PROCESSED: &str = "effectively_inbox_processed_total";
pub const INBOX_LEASE_LOST: &str = "effectively_inbox_lease_lost_total";
pub const OUTBOX_UNPUBLISHED: &str = "effectively_outbox_unpublished_rows";
pub const OUTBOX_OLDEST_AGE: &str = "effectively_outbox_oldest_unpublished_age_seconds";
pub const OUTBOX_PUBLISH_LATENCY: &str = "effectively_outbox_publish_latency_seconds";
pub const OUTBOX_PUBLISHED: &str = "effectively_outbox_published_total";
pub const NOTIFICATIONS: &str = "effectively_notifications_total";
pub const NOTIFICATION_ROWS: &str = "effectively_notification_rows";
pub const NOTIFICATION_OLDEST_AGE: &str = "effectively_notification_oldest_pending_age_seconds";
pub const VERSION_SKIPPED: &str = "effectively_version_skipped_total";
pub const VERSION_HELD: &str = "effectively_version_held_events";
pub const VERSION_GAPS_OVERDUE: &str = "effectively_version_gaps_overdue";
pub const PREFILTER_LOOKUPS: &str = "effectively_prefilter_lookups_total";
pub const PREFILTER_SETS: &str = "effectively_prefilter_sets_total";
pub const PREFILTER_ERRORS: &str = "effectively_prefilter_errors_total";
pub const PREFILTER_DURATION: &str = "effectively_prefilter_duration_seconds";
pub const OFFSET_OUT_OF_RANGE: &str = "effectively_offset_out_of_range";
pub const OFFSET_OUT_OF_RANGE_RESETS: &str = "effectively_offset_out_of_range_resets_total";

/// Every metric name, for tests that check dashboards and alert rules against them.
pub const ALL: &[&str] = &[
    E2E_LATENCY,
    BATCH_SIZE,
    BATCH_DURATION,
    BATCH_PHASE,
    HANDLER_DURATION,
    RECORDS_RECEIVED,
    EFFECTS_APPLIED,
    TRANSACTIONS_COMMITTED,
    DUPLICATES_SKIPPED,
    PARKED,
    TRANSIENT_RETRIES,
    FENCED,
    OFFSET_STORE_WENT_BACK,
    OFFSET_STORE_REWOUND,
    REBALANCES,
    PARTITIONS_ASSIGNED,
    PARTITIONS_REVOKED,
    CONSUMER_LAG,
    ASSIGNED_PARTITIONS,
    DEAD_LETTERS_WAITING,
    DEDUPE_PARTITION_ROWS,
    DEDUPE_PARTITION_BYTES,
    DEDUPE_PARTITIONS_AHEAD,
    POOL_CONNECTIONS,
    INBOX_ROWS,
    INBOX_OLDEST_PENDING_AGE,
    INBOX_CLAIM_DURATION,
    INBOX_PROCESS_DURATION,
    INBOX_PROCESSED,
    INBOX_LEASE_LOST,
    OUTBOX_UNPUBLISHED,
    OUTBOX_OLDEST_AGE,
    OUTBOX_PUBLISH_LATENCY,
    OUTBOX_PUBLISHED,
    NOTIFICATIONS,
    NOTIFICATION_ROWS,
    NOTIFICATION_OLDEST_AGE,
    VERSION_SKIPPED,
    VERSION_HELD,
    VERSION_GAPS_OVERDUE,
    PREFILTER_LOOKUPS,
    PREFILTER_SETS,
    PREFILTER_ERRORS,
    PREFILTER_DURATION,
    OFFSET_OUT_OF_RANGE,
    OFFSET_OUT_OF_RANGE_RESETS,
];

/// Where `effectively run` serves `/metrics` unless told otherwise.
pub const DEFAULT_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9464);

/// Where `effectively relay` serves `/metrics` unless told otherwise.
pub const DEFAULT_RELAY_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9474);

/// Where `effectively send` serves `/metrics` unless told otherwise.
pub const DEFAULT_SENDER_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9484);

static RECORDER: OnceLock<PrometheusHandle> = OnceLock::new();

/// How often the recorder's upkeep runs (drains the histograms' buckets so they stay small
/// between scrapes); the exporter's own listener used the same 5 s.
const UPKEEP_EVERY: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    #[error("metrics recorder: {0}")]
    Install(#[from] metrics_exporter_prometheus::BuildError),
}

/// The process's Prometheus recorder, installed at the first call (tests start several
/// workers in one process: they share it). Its handle renders `/metrics`
/// ([`crate::endpoint`]); its upkeep runs on a thread of its own, so that it outlives the
/// runtime of whichever test or command installed it.
pub fn recorder() -> Result<&'static PrometheusHandle, MetricsError> {
    static INSTALLING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _once = INSTALLING.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = RECORDER.get() {
        return Ok(h);
    }
    let seconds = [
        0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    let sizes = [1.0, 10.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &seconds)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), &sizes))
        .and_then(|b| b.install_recorder())?;
    let h = RECORDER.get_or_init(|| handle);
    describe();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            h.run_upkeep();
        })
        .expect("spawning a thread");
    Ok(h)
}

fn describe() {
    describe_histogram!(
        E2E_LATENCY,
        Unit::Seconds,
        "From the record's timestamp to the commit of its transaction, per fresh message (a new dedupe key: its effect, or a business-key duplicate's no-op)."
    );
    describe_histogram!(
        BATCH_SIZE,
        Unit::Count,
        "Records per batch handed to the strategy."
    );
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "Wall time of a batch, all its transactions and retries included."
    );
    describe_histogram!(
        BATCH_PHASE,
        Unit::Seconds,
        "Time in each phase of a batch transaction: fence, stage (COPY), dedupe, effect, commit."
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "Time in the handler's apply, per transaction."
    );
    describe_counter!(RECORDS_RECEIVED, Unit::Count, "Records read from Kafka.");
    describe_counter!(
        EFFECTS_APPLIED,
        Unit::Count,
        "Effects the handler applied (committed)."
    );
    describe_counter!(
        TRANSACTIONS_COMMITTED,
        Unit::Count,
        "Batch transactions committed (a commit group's transaction counts once for its batches)."
    );
    describe_counter!(
        DUPLICATES_SKIPPED,
        Unit::Count,
        "Copies skipped, by reason: dedupe_key, business_key, below_stored_offset."
    );
    describe_counter!(
        PARKED,
        Unit::Count,
        "Messages parked in dead_letters, by reason."
    );
    describe_counter!(
        TRANSIENT_RETRIES,
        Unit::Count,
        "Batch transactions rolled back and tried again."
    );
    describe_counter!(
        FENCED,
        Unit::Count,
        "Transactions rolled back by the epoch fence: this worker was a zombie for the partition."
    );
    describe_counter!(
        OFFSET_STORE_WENT_BACK,
        Unit::Count,
        "Batches refused because PostgreSQL no longer held the partition's last committed offset \
         (a failover that lost commits, a restore); the partition was read again from the offset it holds."
    );
    describe_counter!(
        OFFSET_STORE_REWOUND,
        Unit::Count,
        "Kafka offsets the stored offset went back by (records read and applied again)."
    );
    describe_counter!(
        REBALANCES,
        Unit::Count,
        "Assignments this worker received from the group."
    );
    describe_counter!(
        PARTITIONS_ASSIGNED,
        Unit::Count,
        "Partitions assigned to this worker."
    );
    describe_counter!(
        PARTITIONS_REVOKED,
        Unit::Count,
        "Partitions revoked from this worker."
    );
    describe_gauge!(
        CONSUMER_LAG,
        Unit::Count,
        "Records behind: the partition's high watermark minus the offset stored in PostgreSQL."
    );
    describe_gauge!(
        ASSIGNED_PARTITIONS,
        Unit::Count,
        "Partitions this worker consumes now."
    );
    describe_gauge!(
        DEAD_LETTERS_WAITING,
        Unit::Count,
        "Rows in dead_letters for the consumer (sampled)."
    );
    describe_gauge!(
        DEDUPE_PARTITION_ROWS,
        Unit::Count,
        "Estimated rows of each daily processed_messages partition (sampled)."
    );
    describe_gauge!(
        DEDUPE_PARTITION_BYTES,
        Unit::Bytes,
        "Size of each daily processed_messages partition with its index (sampled)."
    );
    describe_gauge!(
        DEDUPE_PARTITIONS_AHEAD,
        Unit::Count,
        "Days after today that already have a dedupe partition (sampled)."
    );
    describe_gauge!(
        INBOX_ROWS,
        Unit::Count,
        "Inbox rows by status: pending, in_progress, failed (sampled). Alarm on failed > 0."
    );
    describe_gauge!(
        INBOX_OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest PENDING inbox row, 0 when none (sampled). Alarm when it grows."
    );
    describe_histogram!(
        INBOX_CLAIM_DURATION,
        Unit::Seconds,
        "Time of one inbox claim statement (FOR UPDATE SKIP LOCKED)."
    );
    describe_histogram!(
        INBOX_PROCESS_DURATION,
        Unit::Seconds,
        "One inbox processor round, from the claim to the commit of the effects and marks."
    );
    describe_counter!(
        INBOX_PROCESSED,
        Unit::Count,
        "Inbox rows a processor finished an attempt on, by outcome: done, retry, failed."
    );
    describe_gauge!(
        OUTBOX_UNPUBLISHED,
        Unit::Count,
        "Outbox rows of the event types this relay serves that no relay has published yet (sampled every 15 s by each relay)."
    );
    describe_gauge!(
        OUTBOX_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest unpublished outbox row this relay serves, 0 when none (sampled). Alarm when it grows: events are not leaving the database."
    );
    describe_histogram!(
        OUTBOX_PUBLISH_LATENCY,
        Unit::Seconds,
        "From an outbox row's created_at to the commit that marks it published, after the broker acknowledged it."
    );
    describe_counter!(
        OUTBOX_PUBLISHED,
        Unit::Count,
        "Outbox rows this relay published and marked (a row republished after a crash counts again)."
    );
    describe_counter!(
        NOTIFICATIONS,
        Unit::Count,
        "Notification deliveries by channel and outcome: sent, replayed (the provider answered from its record of the key), reconciled (found sent by asking the provider), retried, failed, skipped."
    );
    describe_gauge!(
        NOTIFICATION_ROWS,
        Unit::Count,
        "Notifications by channel and status: pending, sending, failed (sampled every 15 s by each sender). Alarm on failed > 0."
    );
    describe_gauge!(
        NOTIFICATION_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest PENDING notification per channel, 0 when none (sampled)."
    );
    describe_counter!(
        VERSION_SKIPPED,
        Unit::Count,
        "Versioned events acked without applying them, by reason: stale (older than the stored version), duplicate (the stored version again), held (a gap, waiting for a missing version), released (a held event applied once its gap filled)."
    );
    describe_gauge!(
        VERSION_HELD,
        Unit::Count,
        "Events held behind a missing version, HELD inbox rows (sampled)."
    );
    describe_gauge!(
        VERSION_GAPS_OVERDUE,
        Unit::Count,
        "Aggregates whose oldest held event waited longer than version.gap_alert_after (sampled). Alarm when above 0: a version never arrived."
    );
    describe_counter!(
        INBOX_LEASE_LOST,
        Unit::Count,
        "Leased inbox rows a processor skipped because their lease ran out before it locked them and another processor reclaimed them (a stalled process, or a lease too short)."
    );
    describe_counter!(
        PREFILTER_LOOKUPS,
        Unit::Count,
        "Dedupe keys looked up in the Redis pre-filter before a transaction, by result: hit (committed already: skipped), miss (to PostgreSQL), error (Redis did not answer in time, failed, or is away: to PostgreSQL)."
    );
    describe_counter!(
        PREFILTER_SETS,
        Unit::Count,
        "Committed dedupe keys written to the Redis pre-filter after COMMIT, by result: ok, error (not written: only future hits are lost)."
    );
    describe_counter!(
        PREFILTER_ERRORS,
        Unit::Count,
        "Redis round trips of the pre-filter that failed, by op (lookup, set, connect) and kind (timeout, error). Each opens a short circuit during which batches skip Redis."
    );
    describe_histogram!(
        PREFILTER_DURATION,
        Unit::Seconds,
        "Time of one pre-filter round trip to Redis, by op: lookup (one MGET per batch), set (one pipeline per commit)."
    );
    describe_gauge!(
        POOL_CONNECTIONS,
        Unit::Count,
        "PostgreSQL connections of the pool, by state: in_use, idle."
    );
    describe_gauge!(
        OFFSET_OUT_OF_RANGE,
        Unit::Count,
        "1 while a partition is stopped because the offset PostgreSQL stores for it is outside the partition's log, by end: above (past the log end: the topic recreated, an unclean leader election) or below (before the log start: retention deleted records never applied). on_offset_out_of_range = \"stop\"; nothing of the partition is read until an operator acts."
    );
    describe_counter!(
        OFFSET_OUT_OF_RANGE_RESETS,
        Unit::Count,
        "Partitions moved to the log start or end because their offset was outside the log (on_offset_out_of_range = \"earliest\" or \"latest\"), by end: above or below."
    );
}

/// Counters one partition task bumps per record, resolved once.
#[derive(Clone)]
pub struct PartitionMetrics {
    received: Counter,
    below_stored: Counter,
}

impl PartitionMetrics {
    pub fn new(consumer: &str, topic: &str, partition: i32) -> Self {
        let labels = [
            ("consumer", consumer.to_string()),
            ("topic", topic.to_string()),
            ("partition", partition.to_string()),
        ];
        // Zero series from the start, so rate() and increase() see the first parked message
        // of each reason and the first fence.
        for reason in crate::envelope::Reason::ALL {
            counter!(PARKED, "consumer" => consumer.to_string(), "topic" => topic.to_string(),
                "reason" => reason.as_str())
            .increment(0);
        }
        counter!(FENCED, &labels).increment(0);
        counter!(OFFSET_STORE_WENT_BACK, &labels).increment(0);
        counter!(OFFSET_STORE_REWOUND, &labels).increment(0);
        PartitionMetrics {
            received: counter!(RECORDS_RECEIVED, &labels),
            below_stored: counter!(DUPLICATES_SKIPPED, "consumer" => consumer.to_string(),
                "topic" => topic.to_string(), "reason" => "below_stored_offset"),
        }
    }

    pub fn received(&self) {
        self.received.increment(1);
    }

    pub fn below_stored_offset(&self) {
        self.below_stored.increment(1);
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

pub fn dedupe_partition(date: chrono::NaiveDate, rows: f64, bytes: f64) {
    let d = date.format("%Y-%m-%d").to_string();
    gauge!(DEDUPE_PARTITION_ROWS, "day" => d.clone()).set(rows);
    gauge!(DEDUPE_PARTITION_BYTES, "day" => d).set(bytes);
}

pub fn dedupe_partitions_ahead(days: i64) {
    gauge!(DEDUPE_PARTITIONS_AHEAD).set(days as f64);
}

pub fn pool(in_use: usize, idle: usize) {
    gauge!(POOL_CONNECTIONS, "state" => "in_use").set(in_use as f64);
    gauge!(POOL_CONNECTIONS, "state" => "idle").set(idle as f64);
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
    counter!(INBOX_LEASE_LOST, "consumer" => c).increment(0);
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

/// A pre-filter round trip to Redis, or what failed ([`crate::prefilter`]), for the metrics and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefilterOp {
    Lookup,
    Set,
    Connect,
}

impl PrefilterOp {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefilterOp::Lookup => "lookup",
            PrefilterOp::Set => "set",
            PrefilterOp::Connect => "connect",
        }
    }
}

/// The pre-filter's series of one consumer, resolved once (every batch moves them).
pub struct PrefilterMetrics {
    hit: Counter,
    miss: Counter,
    error: Counter,
    set_ok: Counter,
    set_error: Counter,
    lookup_seconds: metrics::Histogram,
    set_seconds: metrics::Histogram,
    consumer: String,
}

impl PrefilterMetrics {
    /// Publishes every series at 0, so that rate() and increase() see the first event.
    pub fn new(consumer: &str) -> Self {
        let c = consumer.to_string();
        let lookups =
            |r: &'static str| counter!(PREFILTER_LOOKUPS, "consumer" => c.clone(), "result" => r);
        let sets =
            |r: &'static str| counter!(PREFILTER_SETS, "consumer" => c.clone(), "result" => r);
        let m = PrefilterMetrics {
            hit: lookups("hit"),
            miss: lookups("miss"),
            error: lookups("error"),
            set_ok: sets("ok"),
            set_error: sets("error"),
            lookup_seconds: histogram!(PREFILTER_DURATION, "consumer" => c.clone(), "op" => "lookup"),
            set_seconds: histogram!(PREFILTER_DURATION, "consumer" => c.clone(), "op" => "set"),
            consumer: c,
        };
        for counter in [&m.hit, &m.miss, &m.error, &m.set_ok, &m.set_error] {
            counter.increment(0);
        }
        for op in ["lookup", "set", "connect"] {
            for kind in ["timeout", "error"] {
                counter!(PREFILTER_ERRORS, "consumer" => m.consumer.clone(), "op" => op, "kind" => kind)
                    .increment(0);
            }
        }
        m
    }

    pub fn looked_up(&self, hits: u64, misses: u64) {
        self.hit.increment(hits);
        self.miss.increment(misses);
    }

    /// Keys that went to PostgreSQL without an answer from Redis.
    pub fn fell_through(&self, keys: u64) {
        self.error.increment(keys);
    }

    pub fn set(&self, keys: u64) {
        self.set_ok.increment(keys);
    }

    pub fn not_set(&self, keys: u64) {
        self.set_error.increment(keys);
    }

    pub fn round_trip(&self, op: PrefilterOp, took: Duration) {
        match op {
            PrefilterOp::Lookup => self.lookup_seconds.record(took.as_secs_f64()),
            PrefilterOp::Set => self.set_seconds.record(took.as_secs_f64()),
            PrefilterOp::Connect => {}
        }
    }

    pub fn failed(&self, op: PrefilterOp, timeout: bool) {
        let kind = if timeout { "timeout" } else { "error" };
        counter!(PREFILTER_ERRORS, "consumer" => self.consumer.clone(), "op" => op.as_str(), "kind" => kind)
            .increment(1);
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
