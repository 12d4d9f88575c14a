//! Payloads built to exhaust the decoder, against the real Kafka and PostgreSQL: JSON nested
//! 100,000 deep and a 1 MiB string, under the default `max_payload_bytes` (1 MiB). Each is
//! parked with its bytes and a reason that names the bound, the good records around them are
//! applied once, and the partition moves past them (`tests/fuzz.rs` times the same payloads
//! against the decoder alone).

mod common;

use std::time::Duration;

use common::{eventually, ledger, Payment};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Room for a record over 1 MiB: the broker's default limit is 1 MiB and 12 bytes a batch.
const TWO_MIB: &str = "2097152";

async fn create_big_topic(name: &str) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .create()
        .expect("admin client");
    let topic =
        NewTopic::new(name, 1, TopicReplication::Fixed(1)).set("max.message.bytes", TWO_MIB);
    let results = admin
        .create_topics(
            &[topic],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .expect("create_topics");
    for r in results {
        r.unwrap_or_else(|(t, e)| panic!("creating topic {t}: {e}"));
    }
}

fn big_producer() -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .set("enable.idempotence", "true")
        .set("message.max.bytes", TWO_MIB)
        .create()
        .expect("producer")
}

/// Produces `(event_id, payload)` records to partition 0, in order.
async fn send(producer: &FutureProducer, topic: &str, records: &[(uuid::Uuid, Vec<u8>)]) {
    for (id, payload) in records {
        let id = id.to_string();
        let headers = OwnedHeaders::new().insert(Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        });
        let rec = FutureRecord::<[u8], [u8]>::to(topic)
            .partition(0)
            .payload(payload.as_slice())
            .headers(headers);
        producer
            .send(rec, Duration::from_secs(30))
            .await
            .expect("delivery");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_and_huge_payloads_are_parked_with_their_bytes_and_the_bound_they_broke() {
    let topic = common::unique("hostile");
    let consumer = common::unique("rewards");
    create_big_topic(&topic).await;
    let user = common::unique("u");
    let (good1, good2) = (Payment::new(&user, 100_000), Payment::new(&user, 50_000));

    let deep_objects = "{\"a\":".repeat(100_000).into_bytes();
    let deep_arrays = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes();
    // A payment whose note is a 1 MiB string: valid JSON, over the default limit.
    let mut huge = serde_json::from_slice::<serde_json::Value>(&good1.json()).unwrap();
    huge["note"] = serde_json::Value::String("x".repeat(1 << 20));
    let huge = serde_json::to_vec(&huge).unwrap();
    assert!(huge.len() > 1 << 20);

    let ids: Vec<uuid::Uuid> = (0..3).map(|_| uuid::Uuid::now_v7()).collect();
    let records = vec![
        (good1.event_id, good1.json()),
        (ids[0], deep_objects),
        (ids[1], deep_arrays),
        (ids[2], huge),
        (good2.event_id, good2.json()),
    ];
    send(&big_producer(), &topic, &records).await;
    let total = records.len() as u64;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    eventually(90, "every record processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= total }
    })
    .await;

    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.dedupe_keys, l.parked), (2, 2, 3), "{l:?}");
    assert_eq!(l.cashback_paise, 2_000 + 1_000);

    let parked = common::dead_letters(&db, &consumer).await;
    let expected = [
        (1, "undecodable_payload", "nested deeper than 128 levels"),
        (2, "undecodable_payload", "nested deeper than 128 levels"),
        (3, "oversized_payload", "exceeds the limit of 1048576"),
    ];
    assert_eq!(parked.len(), expected.len(), "{parked:#?}");
    for (dl, (offset, reason, words)) in parked.iter().zip(expected) {
        let (id, payload) = &records[offset];
        assert_eq!(dl.offset, offset as i64);
        assert_eq!(dl.reason, reason, "offset {offset}: {}", dl.detail);
        assert!(dl.detail.contains(words), "offset {offset}: {}", dl.detail);
        assert_eq!(dl.message_id, Some(*id), "offset {offset}");
        assert_eq!(
            dl.payload.as_deref(),
            Some(payload.as_slice()),
            "offset {offset}: the parked bytes differ from those sent"
        );
    }
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(records.len() as i64),
        "the partition moved past them"
    );
    worker.stop().await.unwrap();
}
