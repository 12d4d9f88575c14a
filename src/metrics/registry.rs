//! The Schema Registry's series ([`crate::envelope::registry`], [`crate::source::schemas`]):
//! a registry that does not answer holds the partitions that meet a new schema id.

use metrics::{counter, describe_counter, describe_gauge, gauge, Unit};

/// 1 while a partition waits for the registry to answer (records in a Schema Registry format
/// with a schema id not looked up yet); nothing is parked meanwhile.
pub const SCHEMA_REGISTRY_UNAVAILABLE: &str = "effectively_schema_registry_unavailable";
/// Requests to the registry that got no usable answer (no connection, a timeout, 5xx, 401/403).
pub const SCHEMA_REGISTRY_ERRORS: &str = "effectively_schema_registry_errors_total";

pub(super) fn describe() {
    describe_gauge!(
        SCHEMA_REGISTRY_UNAVAILABLE,
        Unit::Count,
        "1 while a partition waits for the Schema Registry: a record names a schema id this process has not looked up, and the registry does not answer (no connection, a timeout, 5xx, 429, 401/403). The partition retries with backoff and parks nothing."
    );
    describe_counter!(
        SCHEMA_REGISTRY_ERRORS,
        Unit::Count,
        "Schema lookups the registry did not answer usably (each retry counts once)."
    );
}

/// The partition waits for the registry (`waiting`), or no longer does.
pub fn schema_registry_unavailable(consumer: &str, topic: &str, partition: i32, waiting: bool) {
    gauge!(SCHEMA_REGISTRY_UNAVAILABLE, "consumer" => consumer.to_string(),
        "topic" => topic.to_string(), "partition" => partition.to_string())
    .set(if waiting { 1.0 } else { 0.0 });
}

/// One lookup the registry did not answer.
pub fn schema_registry_error(consumer: &str) {
    counter!(SCHEMA_REGISTRY_ERRORS, "consumer" => consumer.to_string()).increment(1);
}

/// The counter at 0 from a consumer's first partition, so rate() sees the first error.
pub fn schema_registry_series(consumer: &str) {
    counter!(SCHEMA_REGISTRY_ERRORS, "consumer" => consumer.to_string()).increment(0);
}
