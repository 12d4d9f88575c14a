//! The checks a scenario makes beside loadgen's verifier: Kafka's committed offsets against
//! PostgreSQL's stored ones (sampled throughout, and equal after a clean stop), the effects
//! counted, and the inbox's rows by status.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use super::ChaosArgs;

/// Samples Kafka's committed offsets against PostgreSQL's stored ones until stopped.
pub(super) fn sample_offsets(
    args: &ChaosArgs,
    name: &str,
    partitions: i32,
    stop: Arc<AtomicU64>,
    ahead: Arc<AtomicU64>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let observer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.services.brokers)
        .set("group.id", name)
        .create()?;
    let observer = Arc::new(observer);
    let (url, name) = (args.services.database_url.clone(), name.to_string());
    Ok(tokio::spawn(async move {
        let db = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            Ok((db, conn)) => {
                tokio::spawn(conn);
                db
            }
            Err(_) => return,
        };
        while stop.load(Relaxed) == 0 {
            if let Some(n) = partitions_ahead(&observer, &db, &name, partitions).await {
                ahead.fetch_add(n, Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }))
}

/// One sample: on how many partitions of consumer (and group, and topic) `name` Kafka's
/// committed offset is ahead of the offset stored in PostgreSQL (None: either did not answer).
pub(crate) async fn partitions_ahead(
    observer: &Arc<BaseConsumer>,
    db: &tokio_postgres::Client,
    name: &str,
    partitions: i32,
) -> Option<u64> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(name, p);
    }
    let o = Arc::clone(observer);
    let committed =
        tokio::task::spawn_blocking(move || o.committed_offsets(tpl, Duration::from_secs(3))).await;
    let (Ok(Ok(committed)), Ok(rows)) = (
        committed,
        db.query("SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $1", &[&name]).await,
    ) else {
        return None;
    };
    let stored: HashMap<i32, i64> = rows
        .iter()
        .filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get(0), o)))
        .collect();
    let ahead = committed
        .elements()
        .iter()
        .filter(|e| match e.offset() {
            Offset::Offset(k) => k > stored.get(&e.partition()).copied().unwrap_or(0),
            _ => false,
        })
        .count();
    Some(ahead as u64)
}

/// A connection for a scenario's own checks of the inbox.
pub(crate) struct Db(tokio_postgres::Client);

impl Db {
    pub(crate) async fn connect(url: &str) -> anyhow::Result<Db> {
        let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        Ok(Db(db))
    }

    async fn count(&self, consumer: &str, statuses: &[&str]) -> anyhow::Result<u64> {
        let n: i64 = self
            .0
            .query_one(
                "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = ANY($2)",
                &[&consumer, &statuses],
            )
            .await?
            .get(0);
        Ok(n as u64)
    }

    /// Rows processors have yet to finish.
    pub(super) async fn open(&self, consumer: &str) -> anyhow::Result<u64> {
        Ok(crate::verify::inbox_open(&self.0, consumer).await? as u64)
    }

    /// Rows leased by a processor (`claim = "lease"`).
    pub(super) async fn in_progress(&self, consumer: &str) -> anyhow::Result<u64> {
        self.count(consumer, &["IN_PROGRESS"]).await
    }

    /// Parked rows (the verifier counts them with the dead letters).
    pub(crate) async fn failed(&self, consumer: &str) -> anyhow::Result<u64> {
        self.count(consumer, &["FAILED"]).await
    }
}

pub(super) async fn verify_effects(url: &str, consumer: &str) -> anyhow::Result<u64> {
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM cashback_credits WHERE consumer = $1",
            &[&consumer],
        )
        .await?
        .get(0);
    Ok(n as u64)
}

/// Whether Kafka's committed offset equals PostgreSQL's stored one on every partition.
pub(super) async fn offsets_equal(
    args: &ChaosArgs,
    topic: &str,
    partitions: i32,
) -> anyhow::Result<bool> {
    let observer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.services.brokers)
        .set("group.id", topic)
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = tokio::task::spawn_blocking(move || {
        observer.committed_offsets(tpl, Duration::from_secs(5))
    })
    .await??;
    let (db, conn) =
        tokio_postgres::connect(&args.services.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let rows = db
        .query(
            "SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $1",
            &[&topic],
        )
        .await?;
    let stored: HashMap<i32, i64> = rows
        .iter()
        .filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get(0), o)))
        .collect();
    Ok(committed.elements().iter().all(|e| match e.offset() {
        Offset::Offset(k) => stored.get(&e.partition()) == Some(&k),
        _ => !stored.contains_key(&e.partition()),
    }))
}
