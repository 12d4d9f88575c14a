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

// ---------------------------------------------------------------------------------------------
// The engine, in-process.
// ---------------------------------------------------------------------------------------------

use effectively::config::Config;
use effectively::handler::Registry;
use effectively::worker::Worker;
use rdkafka::message::{Header, OwnedHeaders};

/// A config for one consumer named `consumer` on `topic`, pointed at the local stack.
/// `extra` is TOML appended inside the `[[consumer]]` table (e.g. `strategy = "per-message"`).
pub fn config(consumer: &str, topic: &str, handler: &str, extra: &str) -> Config {
    let text = format!(
        r#"
[kafka]
brokers = "{brokers}"
session_timeout = "10s"
[kafka.options]
"heartbeat.interval.ms" = "500"
"topic.metadata.refresh.interval.ms" = "1000"
[database]
url = "{db}"
pool_size = 8
[worker]
revoke_deadline = "5s"
[[consumer]]
name = "{consumer}"
topics = ["{topic}"]
handler = {handler}
{extra}
"#,
        brokers = kafka_brokers(),
        db = database_url(),
    );
    Config::from_toml_str(&text).expect("test config")
}

pub async fn start(config: Config) -> Worker {
    start_with(config, Registry::new()).await
}

pub async fn start_with(config: Config, registry: Registry) -> Worker {
    Worker::start(config, registry)
        .await
        .expect("worker starts")
}

/// A `PaymentSucceeded` event as loadgen would produce it.
#[derive(Debug, Clone)]
pub struct Payment {
    pub event_id: uuid::Uuid,
    pub payment_id: String,
    pub user_id: String,
    pub amount_paise: i64,
    pub occurred_at: chrono::DateTime<chrono::Utc>,
}

impl Payment {
    pub fn new(user_id: &str, amount_paise: i64) -> Payment {
        let event_id = uuid::Uuid::now_v7();
        Payment {
            event_id,
            payment_id: format!("pay_{}", event_id.simple()),
            user_id: user_id.to_string(),
            amount_paise,
            occurred_at: chrono::Utc::now(),
        }
    }

    pub fn json(&self) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "event_id": self.event_id,
            "payment_id": self.payment_id,
            "user_id": self.user_id,
            "amount_paise": self.amount_paise,
            "occurred_at": self.occurred_at.to_rfc3339(),
        }))
        .unwrap()
    }
}

/// Sends raw payloads with an optional `event_id` header, to a given partition (or by key),
/// in order, waiting for each acknowledgement so their offsets follow the slice's order.
pub async fn send_raw(
    producer: &FutureProducer,
    topic: &str,
    partition: Option<i32>,
    records: &[(Option<String>, Vec<u8>)],
) {
    for (event_id, payload) in records {
        let mut headers = OwnedHeaders::new();
        if let Some(id) = event_id {
            headers = headers.insert(Header {
                key: "event_id",
                value: Some(id.as_bytes()),
            });
        }
        let mut rec = FutureRecord::<[u8], [u8]>::to(topic)
            .payload(payload.as_slice())
            .headers(headers);
        if let Some(p) = partition {
            rec = rec.partition(p);
        }
        producer
            .send(rec, Duration::from_secs(30))
            .await
            .expect("delivery");
    }
}

/// Sends payments (with their `event_id` header) in order.
pub async fn send_payments(
    producer: &FutureProducer,
    topic: &str,
    partition: Option<i32>,
    payments: &[Payment],
) {
    let records: Vec<(Option<String>, Vec<u8>)> = payments
        .iter()
        .map(|p| (Some(p.event_id.to_string()), p.json()))
        .collect();
    send_raw(producer, topic, partition, &records).await;
}

/// Polls `check` every 100 ms until it returns true or `secs` pass.
pub async fn eventually<F, Fut>(secs: u64, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        if check().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out after {secs} s waiting for: {what}");
}

/// The cashback ledger of one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ledger {
    pub credits: i64,
    pub distinct_payments: i64,
    pub cashback_paise: i64,
    pub dedupe_keys: i64,
    pub parked: i64,
    pub outbox: i64,
}

pub async fn ledger(db: &tokio_postgres::Client, consumer: &str) -> Ledger {
    let row = db
        .query_one(
            "SELECT (SELECT count(*) FROM cashback_credits WHERE consumer = $1),
                    (SELECT count(DISTINCT payment_id) FROM cashback_credits WHERE consumer = $1),
                    (SELECT coalesce(sum(cashback_paise), 0)::bigint FROM cashback_credits WHERE consumer = $1),
                    (SELECT count(*) FROM processed_messages WHERE consumer = $1),
                    (SELECT count(*) FROM dead_letters WHERE consumer = $1),
                    (SELECT count(*) FROM outbox o JOIN cashback_credits c
                       ON o.payload->>'cause_event_id' = c.event_id::text WHERE c.consumer = $1)",
            &[&consumer],
        )
        .await
        .unwrap();
    Ledger {
        credits: row.get(0),
        distinct_payments: row.get(1),
        cashback_paise: row.get(2),
        dedupe_keys: row.get(3),
        parked: row.get(4),
        outbox: row.get(5),
    }
}

/// Sum of the wallets of `users`.
pub async fn wallet_total(db: &tokio_postgres::Client, users: &[String]) -> i64 {
    db.query_one(
        "SELECT coalesce(sum(balance_paise), 0)::bigint FROM wallets WHERE user_id = ANY($1)",
        &[&users],
    )
    .await
    .unwrap()
    .get(0)
}
