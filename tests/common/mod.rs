//! Shared by the integration tests: where the real Kafka and PostgreSQL are, unique names so
//! tests run in parallel, and small helpers to create topics and produce.
#![allow(dead_code)] // each test binary uses a different subset

pub mod poison;
pub mod redis_server;
pub mod relay;
pub mod schema_registry;

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

/// `KAFKA_BROKERS` / `DATABASE_URL` from the environment, else from `.stack/env` (written by
/// `scripts/stack.sh up`), else the stack's defaults.
pub fn setting(name: &str, default: &str) -> String {
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

/// Runs `ddl` (a `CREATE ... IF NOT EXISTS`) under an advisory lock. Tests run in parallel, and
/// two concurrent `CREATE TABLE IF NOT EXISTS` of one table can both find it missing, one then
/// failing on the catalog's unique index.
pub async fn create_once(db: &tokio_postgres::Client, ddl: &str) {
    db.batch_execute(&format!(
        "BEGIN; SELECT pg_advisory_xact_lock(7215); {ddl}; COMMIT"
    ))
    .await
    .expect("create a test table");
}

/// A pool of `size` connections to the local PostgreSQL, as the engine builds its own: for
/// calling `store` functions that take the engine's client or transaction types.
pub fn pool(size: usize) -> deadpool_postgres::Pool {
    effectively::store::pool::build(
        &database_url(),
        &effectively::store::pool::PoolOptions {
            size,
            connect_timeout: std::time::Duration::from_secs(5),
            idle_in_transaction_timeout: std::time::Duration::from_secs(60),
            no_parallel_query: false,
        },
    )
    .expect("a pool for the local PostgreSQL")
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

/// The engine's logs (`RUST_LOG`, by default its own at info) in the test's captured output,
/// which cargo prints only for a test that failed: a timeout then says what the worker did.
/// librdkafka's own threads are not the test's, so its lines are left out by default.
pub fn logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("effectively=info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_test_writer()
        .try_init();
}

pub async fn start(config: Config) -> Worker {
    start_with(config, Registry::new()).await
}

pub async fn start_with(config: Config, registry: Registry) -> Worker {
    logs();
    Worker::start(config, registry)
        .await
        .expect("worker starts")
}

/// Starts one worker running the 2% cashback handler for `consumer` on `topic`; `extra` as in
/// [`config`].
pub async fn start_cashback(consumer: &str, topic: &str, extra: &str) -> Worker {
    start(config(consumer, topic, r#"{ kind = "cashback" }"#, extra)).await
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

// ---------------------------------------------------------------------------------------------
// Failure injection and dead-letter inspection (tests/failures.rs, tests/per_message.rs).
// ---------------------------------------------------------------------------------------------

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use effectively::envelope::{Envelope, Rejection};
use effectively::handler::cashback::Cashback;
use effectively::handler::{Applied, BatchContext, Handler, HandlerError};

/// How a [`Faulty`] handler misbehaves before delegating to the 2% cashback handler.
#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// `HandlerError::Transient` on the very first call, then never again.
    TransientOnce,
    /// `HandlerError::Transient` whenever the fresh messages hold a payment of this amount.
    TransientOnAmount(i64),
    /// `HandlerError::Reject` naming every fresh message with this amount.
    RejectAmount(i64),
    /// Sleeps this long per fresh message before applying them; never fails.
    SlowPerMessage(Duration),
    /// `HandlerError::Transient` whenever the fresh messages hold a payment of this amount, as
    /// long as [`Faulty::broken`] is set (it starts set; the test clears it to fix the handler).
    TransientOnAmountWhileBroken(i64),
}

/// A custom handler wrapping `Cashback::new(200)` that injects a [`Fault`].
pub struct Faulty {
    inner: Cashback,
    fault: Fault,
    failed_once: AtomicBool,
    /// Calls of `apply`, failed or not.
    pub calls: AtomicU64,
    /// Calls that returned an injected error.
    pub injected: AtomicU64,
    /// Whether [`Fault::TransientOnAmountWhileBroken`] fails; true until a test clears it.
    pub broken: AtomicBool,
}

impl Faulty {
    pub fn new(fault: Fault) -> std::sync::Arc<Faulty> {
        std::sync::Arc::new(Faulty {
            inner: Cashback::new(200),
            fault,
            failed_once: AtomicBool::new(false),
            calls: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            broken: AtomicBool::new(true),
        })
    }

    /// A registry holding `handler` under `name`.
    pub fn registry(handler: &std::sync::Arc<Faulty>, name: &str) -> Registry {
        Registry::new().with(name, handler.clone() as std::sync::Arc<dyn Handler>)
    }
}

/// Starts one worker running a new [`Faulty`] with `fault` as the custom handler `name` for
/// `consumer` on `topic`; `extra` as in [`config`].
pub async fn start_faulty(
    consumer: &str,
    topic: &str,
    fault: Fault,
    name: &str,
    extra: &str,
) -> (std::sync::Arc<Faulty>, Worker) {
    let handler = Faulty::new(fault);
    let worker = start_with(
        config(
            consumer,
            topic,
            &format!(r#"{{ kind = "custom", name = "{name}" }}"#),
            extra,
        ),
        Faulty::registry(&handler, name),
    )
    .await;
    (handler, worker)
}

fn amount_of(msg: &Envelope) -> Option<i64> {
    msg.json.as_ref()?.get("amount_paise")?.as_i64()
}

#[async_trait::async_trait]
impl Handler for Faulty {
    fn check(&self, msg: &Envelope) -> Result<(), Rejection> {
        self.inner.check(msg)
    }

    async fn apply(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.fault {
            Fault::TransientOnce => {
                if !self.failed_once.swap(true, Ordering::SeqCst) {
                    self.injected.fetch_add(1, Ordering::SeqCst);
                    return Err(HandlerError::Transient("injected: fails once".into()));
                }
            }
            Fault::TransientOnAmount(poison) => {
                if fresh.iter().any(|m| amount_of(m) == Some(poison)) {
                    self.injected.fetch_add(1, Ordering::SeqCst);
                    return Err(HandlerError::Transient(format!(
                        "injected: amount {poison} always fails"
                    )));
                }
            }
            Fault::RejectAmount(poison) => {
                let bad: Vec<(usize, String)> = fresh
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| amount_of(m) == Some(poison))
                    .map(|(i, _)| (i, format!("injected: amount {poison} is refused")))
                    .collect();
                if !bad.is_empty() {
                    self.injected.fetch_add(1, Ordering::SeqCst);
                    return Err(HandlerError::Reject(bad));
                }
            }
            Fault::SlowPerMessage(delay) => {
                tokio::time::sleep(delay * fresh.len() as u32).await;
            }
            Fault::TransientOnAmountWhileBroken(poison) => {
                let poisoned = fresh.iter().any(|m| amount_of(m) == Some(poison));
                if poisoned && self.broken.load(Ordering::SeqCst) {
                    self.injected.fetch_add(1, Ordering::SeqCst);
                    return Err(HandlerError::Transient(
                        "injected: the ledger is down for this one".into(),
                    ));
                }
            }
        }
        self.inner.apply(tx, ctx, fresh).await
    }
}

/// One `dead_letters` row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub message_id: Option<uuid::Uuid>,
    /// The text a text id was made from.
    pub message_key: Option<String>,
    pub reason: String,
    pub detail: String,
    pub key: Option<Vec<u8>>,
    pub header_names: Vec<String>,
    pub header_values: Vec<Option<Vec<u8>>>,
    pub payload: Option<Vec<u8>>,
    pub attempts: i32,
}

/// The dead letters of `consumer`, in (topic, partition, offset) order.
pub async fn dead_letters(db: &tokio_postgres::Client, consumer: &str) -> Vec<DeadLetter> {
    db.query(
        "SELECT topic, partition, \"offset\", message_id, reason, detail, key, header_names,
                header_values, payload, attempts, message_key
         FROM dead_letters WHERE consumer = $1 ORDER BY topic, partition, \"offset\"",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| DeadLetter {
        topic: r.get(0),
        partition: r.get(1),
        offset: r.get(2),
        message_id: r.get(3),
        reason: r.get(4),
        detail: r.get(5),
        key: r.get(6),
        header_names: r.get(7),
        header_values: r.get(8),
        payload: r.get(9),
        attempts: r.get(10),
        message_key: r.get(11),
    })
    .collect()
}

/// How many of `ids` have a dedupe key for `consumer`.
pub async fn processed_among(
    db: &tokio_postgres::Client,
    consumer: &str,
    ids: &[uuid::Uuid],
) -> i64 {
    db.query_one(
        "SELECT count(*) FROM processed_messages WHERE consumer = $1 AND message_id = ANY($2)",
        &[&consumer, &ids],
    )
    .await
    .unwrap()
    .get(0)
}

/// The next offset PostgreSQL stores for one partition of `consumer` (None: no row, or NULL).
pub async fn stored_offset(
    db: &tokio_postgres::Client,
    consumer: &str,
    topic: &str,
    partition: i32,
) -> Option<i64> {
    db.query_opt(
        "SELECT next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $2 AND partition = $3",
        &[&consumer, &topic, &partition],
    )
    .await
    .unwrap()
    .and_then(|r| r.get(0))
}

/// Cashback credits of `consumer`, counted per payment: `(payment_id, count)` of any credited
/// more than once (empty when every payment has at most one credit).
pub async fn doubly_credited(db: &tokio_postgres::Client, consumer: &str) -> Vec<(String, i64)> {
    db.query(
        "SELECT payment_id, count(*) FROM cashback_credits WHERE consumer = $1
         GROUP BY payment_id HAVING count(*) > 1",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// Waits until the worker has processed at least `n` records (its own counter), or fails the
/// test after `secs`.
pub async fn wait_records(stats: &std::sync::Arc<effectively::stats::Stats>, n: u64, secs: u64) {
    eventually(secs, &format!("{n} records processed"), || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= n }
    })
    .await;
}
