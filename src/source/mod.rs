//! The Kafka side: group membership and rebalances ([`consumer`], the coordinator, and
//! [`context`], librdkafka's callbacks that hand it the rebalances), one task per assigned
//! partition that batches records and hands them to the strategy ([`partition`]), a stored
//! offset outside the partition's log ([`range`]), and a partition that cannot progress, stuck
//! on a Kafka error or stalled in a batch ([`watch`]).
//!
//! Each file uses only the ones listed after it: `consumer` → `partition` → `schemas` →
//! `range` → `context`; `partition` → `watch` ([`schemas`]: the wait for a Schema Registry
//! before decoding; [`watch`]: a partition that cannot progress).

pub mod consumer;
pub mod context;
pub mod control;
pub mod partition;
pub mod range;
pub mod schemas;
pub mod watch;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};

/// Connects to the brokers with `kafka`'s settings (TLS, SASL, options) and reads the cluster's
/// metadata: the brokers it names. An error says what failed (a refused TLS handshake, a failed
/// SASL authentication, no broker reachable within `timeout`), as librdkafka reported it.
pub fn probe(kafka: &crate::config::KafkaConfig, timeout: Duration) -> Result<usize, String> {
    let errors = Arc::new(Mutex::new(Vec::new()));
    let context = ProbeContext {
        errors: Arc::clone(&errors),
    };
    let client: BaseConsumer<ProbeContext> = kafka
        .client_config(&[])?
        .create_with_context(context)
        .map_err(|e| format!("kafka: {e}"))?;
    match client.fetch_metadata(None, timeout) {
        Ok(m) => Ok(m.brokers().len()),
        Err(e) => {
            // librdkafka hands its error reports (the reason) to the context when polled.
            for _ in 0..10 {
                let _ = client.poll(Duration::from_millis(20));
            }
            let mut seen = errors.lock().expect("not poisoned").clone();
            seen.dedup();
            Err(match seen.is_empty() {
                false => format!("kafka: {e}: {}", seen.join("; ")),
                true => format!("kafka: {e}"),
            })
        }
    }
}

/// Keeps librdkafka's error reports (the reason a handshake or an authentication failed).
struct ProbeContext {
    errors: Arc<Mutex<Vec<String>>>,
}

impl rdkafka::ClientContext for ProbeContext {
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        self.errors
            .lock()
            .expect("not poisoned")
            .push(format!("{error}: {reason}"));
    }
}

impl rdkafka::consumer::ConsumerContext for ProbeContext {}
