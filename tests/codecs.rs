//! Every compression codec a producer may write with (`compression.type` none, gzip, snappy,
//! lz4, zstd), against the real broker: each payment applied exactly once, and no partition
//! ever stuck on a fetch it cannot decompress (librdkafka without zstd fails every fetch of a
//! zstd topic with "Local: Not implemented", and the partition never moves).

mod common;

use std::time::Duration;

use common::{eventually, ledger, Payment};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

/// How many payments each codec's topic gets.
const PAYMENTS: i64 = 200;

/// Sends every payment at once (batches of many records, compressed together, as a real
/// producer writes them) and waits for each acknowledgement.
async fn send_compressed(topic: &str, codec: &str, payments: &[Payment]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .set("enable.idempotence", "true")
        .set("linger.ms", "50")
        .set("compression.type", codec)
        .create()
        .expect("producer");
    let sends: Vec<_> = payments
        .iter()
        .map(|p| {
            let id = p.event_id.to_string();
            let headers = OwnedHeaders::new().insert(Header {
                key: "event_id",
                value: Some(id.as_bytes()),
            });
            let payload = p.json();
            let key = p.user_id.clone();
            let producer = producer.clone();
            let topic = topic.to_string();
            async move {
                let rec = FutureRecord::to(&topic)
                    .key(key.as_bytes())
                    .payload(&payload)
                    .headers(headers);
                producer.send(rec, Duration::from_secs(30)).await
            }
        })
        .collect();
    for r in futures::future::join_all(sends).await {
        r.unwrap_or_else(|(e, _)| panic!("{codec}: delivery failed: {e}"));
    }
}

/// The sum of a partition-error counter of `consumer` in this process's metrics.
fn partition_errors(consumer: &str) -> f64 {
    let text = effectively::metrics::recorder()
        .expect("the recorder")
        .render();
    let needle = format!("consumer=\"{consumer}\"");
    text.lines()
        .filter(|l| l.starts_with(effectively::metrics::PARTITION_ERRORS) && l.contains(&needle))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn applied_once(codec: &str) {
    let topic = common::unique(&format!("codec-{codec}"));
    let consumer = common::unique(&format!("codec-{codec}"));
    common::create_topic(&topic, 2).await;
    // Ten users: the keys spread the payments over both partitions.
    let users: Vec<String> = (0..10).map(|_| common::unique("u")).collect();
    let payments: Vec<Payment> = (0..PAYMENTS)
        .map(|i| Payment::new(&users[(i % 10) as usize], 1_000 + i))
        .collect();
    send_compressed(&topic, codec, &payments).await;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let db = common::pg().await;
    eventually(
        60,
        &format!("{codec}: {PAYMENTS} payments credited"),
        || {
            let (db, c) = (&db, &consumer);
            async move { ledger(db, c).await.credits >= PAYMENTS }
        },
    )
    .await;
    let l = ledger(&db, &consumer).await;
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(
        l.credits, PAYMENTS,
        "{codec}: one credit per payment: {l:?}"
    );
    assert_eq!(l.distinct_payments, PAYMENTS, "{codec}: {l:?}");
    assert_eq!(l.dedupe_keys, PAYMENTS, "{codec}: {l:?}");
    assert_eq!(l.cashback_paise, expected, "{codec}: {l:?}");
    assert_eq!(l.parked, 0, "{codec}: nothing parked: {l:?}");
    assert_eq!(common::wallet_total(&db, &users).await, expected, "{codec}");
    let s = worker.stats(&consumer).unwrap().snapshot();
    assert_eq!(
        s.records, PAYMENTS as u64,
        "{codec}: each record read once: {s:?}"
    );
    assert_eq!(s.duplicates, 0, "{codec}: {s:?}");
    assert_eq!(
        partition_errors(&consumer),
        0.0,
        "{codec}: no fetch of the topic failed"
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uncompressed_payments_are_applied_once() {
    applied_once("none").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_payments_are_applied_once() {
    applied_once("gzip").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snappy_payments_are_applied_once() {
    applied_once("snappy").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lz4_payments_are_applied_once() {
    applied_once("lz4").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zstd_payments_are_applied_once() {
    applied_once("zstd").await;
}
