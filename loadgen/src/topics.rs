//! Kafka topics: creating one unless it exists, and warming a new producer up on a topic of its
//! own so that a run's first records do not wait for the producer's start.

use std::time::Duration;

use anyhow::Context;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;

/// The topic a new producer's first record goes to, so that the measured run does not wait for
/// the producer's own start.
pub(crate) const WARM_UP_TOPIC: &str = "loadgen-warmup";

/// Waits until the producer can send at once: an idempotent producer holds every record until
/// it has its producer id (on a fresh broker the first one also waits for the transaction
/// coordinator to load: about a second), and the first record to a topic waits for its
/// metadata. Record timestamps are taken when loadgen produces, so without this the run's first
/// records would count the producer's start as the engine's latency. The warm-up record goes to
/// a topic of its own, which no consumer of a run reads.
pub async fn warm_up(brokers: &str, producer: &FutureProducer, topic: &str) -> anyhow::Result<()> {
    ensure_topic(brokers, WARM_UP_TOPIC, 1).await?;
    producer
        .send(
            FutureRecord::<(), [u8]>::to(WARM_UP_TOPIC).payload(b"warm-up"),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| anyhow::anyhow!("warming the producer up: {e}"))?;
    let (producer, topic) = (producer.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .map(drop)
    })
    .await?
    .context("fetching the topic's metadata")?;
    Ok(())
}

pub async fn ensure_topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    create_topic(brokers, topic, partitions, 1).await
}

/// Creates `topic` with `partitions` and `replication` replicas of each, unless it exists.
pub(crate) async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
) -> anyhow::Result<()> {
    // Topic configs for every topic loadgen creates, `key=value,key=value`: e.g.
    // `message.timestamp.type=LogAppendTime`, so that a run's latencies start when the broker
    // appended a record rather than when loadgen's producer made it (docs/PERFORMANCE.md).
    let env = std::env::var("LOADGEN_TOPIC_CONFIG").unwrap_or_default();
    let mut configs = Vec::new();
    for kv in env.split(',').filter(|kv| !kv.trim().is_empty()) {
        let Some((k, v)) = kv.split_once('=') else {
            anyhow::bail!("LOADGEN_TOPIC_CONFIG: {kv:?} is not key=value");
        };
        configs.push((k.trim(), v.trim()));
    }
    create_topic_with(brokers, topic, partitions, replication, &configs).await
}

/// Creates `topic` with these topic configs, unless it exists (then its configs stay).
pub(crate) async fn create_topic_with(
    brokers: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
    configs: &[(&str, &str)],
) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let mut new = NewTopic::new(topic, partitions, TopicReplication::Fixed(replication));
    for (k, v) in configs {
        new = new.set(k, v);
    }
    let results = admin.create_topics(&[new], &AdminOptions::new()).await?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => anyhow::bail!("creating topic {t}: {e}"),
        }
    }
    Ok(())
}
