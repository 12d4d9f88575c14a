//! Prometheus metrics: every name in one place, with its description and unit, and one
//! function per event that matters (`batch_committed(..)`), so the rest of the code never
//! spells a metric name. Labels are `consumer`, `topic`, `partition`, `reason` and `phase`:
//! all bounded (never an event id). Recorded by `metrics-exporter-prometheus` and served by
//! [`crate::endpoint`] on `--metrics-addr` (default 127.0.0.1:9464) beside `/healthz` and
//! `/readyz`; `docs/OPERATIONS.md` says what each one means.

use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

mod describe;
mod events;
mod prefilter;
mod registry;

// The events are the module's interface: `metrics::batch_committed(..)`, as before the split.
pub use events::*;
pub use prefilter::{PrefilterMetrics, PrefilterOp};
pub use registry::{
    schema_registry_error, schema_registry_series, schema_registry_unavailable,
    SCHEMA_REGISTRY_ERRORS, SCHEMA_REGISTRY_UNAVAILABLE,
};

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
pub const RECORDS_SKIPPED: &str = "effectively_records_skipped_total";
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
pub const CONSUMER_DATABASE: &str = "effectively_consumer_database";
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
pub const PARTITION_ERRORS: &str = "effectively_partition_errors_total";
pub const PARTITION_STUCK: &str = "effectively_partition_stuck";
pub const PARTITION_STALLED: &str = "effectively_partition_stalled";
pub const INBOX_PROCESSOR_STALLED: &str = "effectively_inbox_processor_stalled";
pub const INBOX_ROUND_LIMIT: &str = "effectively_inbox_round_limit";
pub const PARTITION_PAUSED: &str = "effectively_partition_paused";
pub const GROUP_REBALANCES: &str = "effectively_group_rebalances_total";
pub const MAX_RATE: &str = "effectively_consumer_max_rate";

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
    RECORDS_SKIPPED,
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
    CONSUMER_DATABASE,
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
    SCHEMA_REGISTRY_UNAVAILABLE,
    SCHEMA_REGISTRY_ERRORS,
    PARTITION_ERRORS,
    PARTITION_STUCK,
    PARTITION_STALLED,
    INBOX_PROCESSOR_STALLED,
    INBOX_ROUND_LIMIT,
    PARTITION_PAUSED,
    GROUP_REBALANCES,
    MAX_RATE,
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
    describe::describe();
    registry::describe();
    std::thread::Builder::new()
        .name("metrics-upkeep".into())
        .spawn(move || loop {
            std::thread::sleep(UPKEEP_EVERY);
            h.run_upkeep();
        })
        .expect("spawning a thread");
    Ok(h)
}
