//! Shared by the integration tests: where the real Kafka and PostgreSQL are, unique names so
//! tests run in parallel, and small helpers to create topics and produce.
#![allow(dead_code)] // each test binary uses a different subset

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

/// `KAFKA_BROKERS` / `DATABASE_URL` from the environment, else from `.stack/env` (written by
/// `scripts/stack.sh up`), else the stack's defaults.
fn setting(name: &str, default: &str) -> String {
    if let Ok(v) = std::env::var(name) {
        return v;
    }
    let env_file = concat!(env!("CARGO_MANIFEST_DIR"), "/.stack/env");
    if let Ok(text) = std::fs::read_to_string(env_file) {
        for line in text.lines() {
            if let Some(v) = line
                .strip_prefix("export ")
                .and_then(|l| l.strip_prefix(name))
                .and_then(|l| l.strip_prefix('='))
            {
                return v.to_string();
            }
        }
    }
    default.to_string()
}

pub fn kafka_brokers() -> String {
    setting("KAFKA_BROKERS", "127.0.0.1:9092")
}

pub fn database_url() -> String {
    setting(
        "DATABASE_URL",
        "postgres://postgres@127.0.0.1:5432/effectively",
    )
}

/// `prefix` plus a random suffix: every test gets its own topic and consumer name.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

pub async fn create_topic(name: &str, partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .create()
        .expect("admin client");
    let results = admin
        .create_topics(
            &[NewTopic::new(name, partitions, TopicReplication::Fixed(1))],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create_topics");
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("creating topic {t}: {e}"));
    }
}

pub fn producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .expect("producer")
}

/// Produces `(key, payload)` records to one partition (or by key hash when `None`) and waits
/// for every acknowledgement.
pub async fn produce(
    producer: &FutureProducer,
    topic: &str,
    partition: Option<i32>,
    records: &[(String, Vec<u8>)],
) {
    let futures: Vec<_> = records
        .iter()
        .map(|(k, v)| {
            let mut rec = FutureRecord::to(topic).key(k.as_bytes()).payload(v);
            if let Some(p) = partition {
                rec = rec.partition(p);
            }
            producer.send(rec, Duration::from_secs(30))
        })
        .collect();
    for f in futures {
        f.await.expect("delivery");
    }
}

pub async fn pg() -> tokio_postgres::Client {
    effectively::store::pool::connect(&database_url())
        .await
        .expect("connect to PostgreSQL")
}
