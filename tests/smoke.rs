//! The foundation's smoke test: real Kafka, real PostgreSQL. Produce 1,000 messages, consume
//! them in a consumer group, write one row per message in a PostgreSQL transaction, commit the
//! Kafka offsets only after the database commit, and check the table holds exactly the 1,000.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

const N: usize = 1_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_messages_land_once_with_offsets_committed_after_the_database() {
    let topic = common::unique("smoke");
    let table = topic.replace('-', "_");
    common::create_topic(&topic, 3).await;

    let mut db = common::pg().await;
    db.batch_execute(&format!(
        "CREATE TABLE {table} (topic_partition int, kafka_offset bigint, n int PRIMARY KEY, body text NOT NULL)"
    ))
    .await
    .unwrap();

    let records: Vec<(String, Vec<u8>)> = (0..N)
        .map(|i| {
            (
                format!("k{}", i % 17),
                format!("{{\"n\":{i}}}").into_bytes(),
            )
        })
        .collect();
    common::produce(&common::producer(), &topic, None, &records).await;

    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .set("group.id", &topic)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[&topic]).unwrap();

    let mut seen = 0;
    while seen < N {
        // One small batch per transaction: whatever is ready, up to 100 messages.
        let mut batch = Vec::new();
        let first = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .expect("messages within 60 s")
            .unwrap();
        batch.push(first.detach());
        while batch.len() < 100 {
            match tokio::time::timeout(Duration::from_millis(20), consumer.recv()).await {
                Ok(m) => batch.push(m.unwrap().detach()),
                Err(_) => break,
            }
        }
        let tx = db.transaction().await.unwrap();
        let mut next: BTreeMap<i32, i64> = BTreeMap::new();
        for m in &batch {
            let body = std::str::from_utf8(m.payload().unwrap()).unwrap();
            let v: serde_json::Value = serde_json::from_str(body).unwrap();
            let n = v["n"].as_i64().unwrap() as i32;
            tx.execute(
                &format!("INSERT INTO {table} VALUES ($1, $2, $3, $4)"),
                &[&m.partition(), &m.offset(), &n, &body],
            )
            .await
            .unwrap();
            next.insert(m.partition(), m.offset() + 1);
        }
        tx.commit().await.unwrap();
        let mut tpl = TopicPartitionList::new();
        for (p, o) in &next {
            tpl.add_partition_offset(&topic, *p, Offset::Offset(*o))
                .unwrap();
        }
        consumer.commit(&tpl, CommitMode::Sync).unwrap();
        seen += batch.len();
    }
    assert_eq!(seen, N, "consumed exactly what was produced");

    let row = db
        .query_one(
            &format!("SELECT count(*), count(DISTINCT n), min(n), max(n) FROM {table}"),
            &[],
        )
        .await
        .unwrap();
    let (count, distinct, min, max): (i64, i64, i32, i32) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        (count, distinct, min, max),
        (N as i64, N as i64, 0, N as i32 - 1)
    );
    let bad: i64 = db
        .query_one(
            &format!("SELECT count(*) FROM {table} WHERE body <> format('{{\"n\":%s}}', n)"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(bad, 0, "every payload stored as produced");

    // Kafka's committed offsets cover every row, and were written after the rows committed.
    let committed = consumer
        .committed(Duration::from_secs(10))
        .expect("committed offsets");
    let mut total_committed = 0;
    for e in committed.elements() {
        if let Offset::Offset(o) = e.offset() {
            total_committed += o;
        }
    }
    assert_eq!(total_committed, N as i64);
    db.batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
