//! The outbox relay against the real Kafka and PostgreSQL: a relay that dies between publishing
//! and marking publishes again, and the consumer still credits once; two relays keep each
//! aggregate's order and publish every row once.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::relay::{
    outbox_payments, relay_config_in_new_dir, relay_dies_after_publishing, relay_section,
    relay_until_marked, unpublished, write_outbox,
};
use common::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, TopicPartitionList};
use tokio_util::sync::CancellationToken;

/// Records on `topic` (all partitions), from the watermarks.
fn records_on(topic: &str, partitions: i32) -> i64 {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .create()
        .unwrap();
    (0..partitions)
        .map(|p| {
            let (lo, hi) = c
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            hi - lo
        })
        .sum()
}

#[tokio::test]
async fn a_relay_that_dies_after_publishing_republishes_and_the_consumer_credits_once() {
    let (topic, consumer) = (unique("relay-crash"), unique("relay-crash"));
    let event_type = unique("PaymentSucceeded");
    create_topic(&topic, 2).await;
    let mut db = pg().await;
    outbox_payments(&mut db, &event_type, 20, 10_000).await;

    let (dir, config) = relay_config_in_new_dir("relay-crash", &event_type, &topic);
    // The first relay publishes the rows, the broker acknowledges them, and it dies before it
    // marks them.
    let status = relay_dies_after_publishing(&config, &dir).await;
    assert!(!status.success(), "the failpoint aborts the relay");
    assert_eq!(records_on(&topic, 2), 20, "published once");
    assert_eq!(unpublished(&db, &event_type).await, 20, "nothing marked");

    // The next relay publishes them all again, and marks them.
    let status = relay_until_marked(
        &config,
        &dir,
        &db,
        &event_type,
        "the second relay marked every row",
    )
    .await;
    assert!(status.success(), "a clean stop on SIGTERM");
    assert_eq!(records_on(&topic, 2), 40, "every event twice on the topic");

    // Downstream, the consumer dedupes on the event id the relay put in the header.
    let worker = start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    wait_records(&stats, 40, 60).await;
    worker.stop().await.unwrap();
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 20, "one credit per payment");
    assert!(doubly_credited(&db, &consumer).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_relays_keep_each_aggregates_order_and_publish_every_row_once() {
    let topic = unique("relay-order");
    let event_type = unique("OrderEvent");
    create_topic(&topic, 3).await;
    let mut db = pg().await;
    // 20 aggregates x 10 rows, written interleaved in 10 transactions (one row per aggregate
    // each), so every aggregate's rows are spread over the seq range.
    let aggregates: Vec<String> = (0..20).map(|i| format!("{}-{i}", unique("agg"))).collect();
    let mut order: HashMap<String, Vec<uuid::Uuid>> = HashMap::new();
    for _ in 0..10 {
        let rows: Vec<(String, Payment)> = aggregates
            .iter()
            .map(|a| (a.clone(), Payment::new(a, 100)))
            .collect();
        for (a, p) in &rows {
            order.entry(a.clone()).or_default().push(p.event_id);
        }
        write_outbox(&mut db, &event_type, &rows).await;
    }

    // Two relays in this process, small batches so that they interleave.
    let text = format!(
        "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n{}",
        kafka_brokers(),
        database_url(),
        relay_section(&event_type, &topic, "batch = 7\npublished = \"delete\"")
    );
    let cfg = effectively::config::Config::from_toml_str(&text).unwrap();
    let stop = CancellationToken::new();
    let relays: Vec<_> = (0..2)
        .map(|_| {
            let relay = effectively::relay::Relay::new(&cfg).unwrap();
            tokio::spawn(relay.run(stop.clone()))
        })
        .collect();
    eventually(60, "every row published and deleted", || async {
        let left: i64 = db
            .query_one(
                "SELECT count(*) FROM outbox WHERE event_type = $1",
                &[&event_type],
            )
            .await
            .unwrap()
            .get(0);
        left == 0
    })
    .await;
    stop.cancel();
    for r in relays {
        r.await.unwrap();
    }

    // Read the topic back: each aggregate's events in the order they were written, once each.
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .set("group.id", unique("relay-reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..3 {
        tpl.add_partition_offset(&topic, p, rdkafka::Offset::Beginning)
            .unwrap();
    }
    reader.assign(&tpl).unwrap();
    let mut seen: HashMap<String, Vec<uuid::Uuid>> = HashMap::new();
    let mut n = 0;
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while n < 200 && std::time::Instant::now() < until {
        let Some(m) = reader.poll(Duration::from_millis(200)) else {
            continue;
        };
        let m = m.unwrap();
        let key = String::from_utf8(m.key().unwrap().to_vec()).unwrap();
        let headers = m.headers().unwrap();
        let id = headers
            .iter()
            .find(|h| h.key == "event_id")
            .and_then(|h| h.value)
            .map(|v| uuid::Uuid::parse_str(std::str::from_utf8(v).unwrap()).unwrap())
            .unwrap();
        seen.entry(key).or_default().push(id);
        n += 1;
    }
    assert_eq!(n, 200, "every row once");
    assert_eq!(records_on(&topic, 3), 200, "and no more");
    for (a, ids) in &order {
        assert_eq!(
            seen.get(a),
            Some(ids),
            "aggregate {a} in the order it was written"
        );
    }
}

/// The seed's walk end to end: payments commits each payment and its outbox row together; the
/// relay publishes, dies before marking, publishes again; an operator redrives one payment days
/// later (the same bytes at a new offset). Rewards credits each payment once, records one SMS
/// intent and one CashbackCredited outbox row per credit, and the sender delivers one SMS each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_full_walk_credits_once_sends_one_sms_and_writes_one_cashback_event() {
    use provider_stub::ProviderStub;
    let (topic, consumer) = (unique("walk"), unique("walk"));
    let event_type = unique("PaymentSucceeded");
    let channel = unique("sms");
    create_topic(&topic, 2).await;
    let mut db = pg().await;
    let payments = outbox_payments(&mut db, &event_type, 10, 120_000).await;

    // Delivery 1 and 2: the relay publishes, dies before marking, the next one publishes again.
    let (dir, relay_file) = relay_config_in_new_dir("walk", &event_type, &topic);
    relay_dies_after_publishing(&relay_file, &dir).await;
    relay_until_marked(
        &relay_file,
        &dir,
        &db,
        &event_type,
        "every payment published and marked",
    )
    .await;
    // Delivery 3: a redrive of the first payment, its bytes produced again at a new offset.
    send_payments(&producer(), &topic, Some(0), &[payments[0].1.clone()]).await;
    assert_eq!(records_on(&topic, 2), 21);

    // Rewards, with an SMS per credit.
    let handler = format!("{{ kind = \"cashback\", notify = \"{channel}\" }}");
    let worker = start(config(&consumer, &topic, &handler, "")).await;
    let stats = worker.stats(&consumer).unwrap();
    wait_records(&stats, 21, 60).await;
    worker.stop().await.unwrap();
    assert_eq!(
        ledger(&db, &consumer).await.credits,
        10,
        "one credit per payment"
    );
    assert!(doubly_credited(&db, &consumer).await.is_empty());
    let ids: Vec<uuid::Uuid> = payments.iter().map(|(_, p)| p.event_id).collect();
    let cashback_events: i64 = db
        .query_one(
            "SELECT count(*) FROM outbox WHERE event_type = 'CashbackCredited'
             AND (payload->>'cause_event_id')::uuid = ANY($1)",
            &[&ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(cashback_events, 10, "one CashbackCredited per credit");

    // The sender delivers the SMS intents: one each, whatever the redeliveries upstream.
    let stub = ProviderStub::start("127.0.0.1:0").await.unwrap();
    let sender_config = effectively::config::Config::from_toml_str(&format!(
        "[database]\nurl = \"{}\"\n[sender]\npoll_interval = \"50ms\"\n\
         [sender.channels.{channel}]\nurl = \"{}/v1/messages\"\nlookup = true\n",
        database_url(),
        stub.url()
    ))
    .unwrap();
    let stop = CancellationToken::new();
    let sender = tokio::spawn(
        effectively::sender::Sender::new(&sender_config)
            .unwrap()
            .run(stop.clone()),
    );
    eventually(30, "ten SMS sent", || async {
        let sent: i64 = db
            .query_one(
                "SELECT count(*) FROM notifications WHERE channel = $1 AND status = 'SENT'",
                &[&channel],
            )
            .await
            .unwrap()
            .get(0);
        sent == 10
    })
    .await;
    stop.cancel();
    sender.await.unwrap();
    let messages = stub.messages();
    assert_eq!(messages.len(), 10, "one SMS per payment");
    for (_, p) in &payments {
        // A notification's id is its credit's outbox id (consumer, event date, message id).
        let id = effectively::handler::cashback::outbox_id(
            &consumer,
            p.occurred_at.date_naive(),
            &p.event_id,
        );
        assert_eq!(stub.effects_for(&format!("{channel}:{id}")), 1);
    }
}
