//! loadgen: produces the seed's payment stream (`PaymentSucceeded` events) to a Kafka topic.
//!
//! This first version produces a fixed count, creating the topic if needed; rates, duplicate
//! injection and the ledger verifier come with the loadgen issue.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde::Serialize;

#[derive(Debug, Parser)]
#[command(name = "loadgen", version, about)]
struct Args {
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Topic to produce to (created with `--partitions` if it does not exist).
    #[arg(long, default_value = "payments")]
    topic: String,
    #[arg(long, default_value_t = 6)]
    partitions: i32,
    /// How many events to produce.
    #[arg(long, default_value_t = 1000)]
    count: u64,
    /// Number of distinct users the payments are spread over (the record key).
    #[arg(long, default_value_t = 1000)]
    users: u64,
}

/// The seed's event: decisions (the amount) travel in the event, never read at apply time.
#[derive(Debug, Serialize)]
struct PaymentSucceeded {
    event_id: uuid::Uuid,
    payment_id: String,
    user_id: String,
    amount_paise: i64,
    occurred_at: chrono::DateTime<chrono::Utc>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("warn").init();
    let args = Args::parse();
    ensure_topic(&args).await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .create()
        .context("creating the producer")?;
    let started = Instant::now();
    let mut pending = Vec::with_capacity(args.count as usize);
    for i in 0..args.count {
        let event_id = uuid::Uuid::now_v7();
        let event = PaymentSucceeded {
            event_id,
            payment_id: format!("pay_{}", event_id.simple()),
            user_id: format!("u_{}", i % args.users.max(1)),
            amount_paise: 100 * (1 + (i as i64 * 7919) % 5000),
            occurred_at: chrono::Utc::now(),
        };
        let payload = serde_json::to_vec(&event)?;
        let producer = producer.clone();
        let topic = args.topic.clone();
        pending.push(tokio::spawn(async move {
            let id = event.event_id.to_string();
            let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                key: "event_id",
                value: Some(id.as_bytes()),
            });
            let record = FutureRecord::to(&topic)
                .key(&event.user_id)
                .payload(&payload)
                .headers(headers);
            producer.send(record, Duration::from_secs(30)).await
        }));
    }
    let mut acked = 0u64;
    for p in pending {
        if p.await?.is_ok() {
            acked += 1;
        }
    }
    println!(
        "produced {} of {} events to {} in {:.2?}",
        acked,
        args.count,
        args.topic,
        started.elapsed()
    );
    anyhow::ensure!(acked == args.count, "not every event was acknowledged");
    Ok(())
}

async fn ensure_topic(args: &Args) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .create()?;
    let results = admin
        .create_topics(
            &[NewTopic::new(
                &args.topic,
                args.partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new(),
        )
        .await?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => anyhow::bail!("creating topic {t}: {e}"),
        }
    }
    Ok(())
}
