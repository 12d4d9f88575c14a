//! The batch pipeline against the real Kafka and PostgreSQL: duplicates of every kind are
//! applied once.

mod common;

use common::{eventually, ledger, Payment};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_resend_three_copies_one_credit_two_duplicates() {
    let topic = common::unique("resend");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let p = Payment::new(&user, 120_000);
    let other = Payment::new(&user, 50_000);
    let producer = common::producer();
    // Three copies at three offsets, with another payment in between.
    common::send_payments(
        &producer,
        &topic,
        Some(0),
        &[p.clone(), p.clone(), other.clone(), p.clone()],
    )
    .await;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    common::wait_records(&stats, 4, 60).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 2, "one credit per payment: {l:?}");
    assert_eq!(l.cashback_paise, 2_400 + 1_000);
    assert_eq!(l.dedupe_keys, 2);
    assert_eq!(l.outbox, 2);
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        3_400
    );
    let s = stats.snapshot();
    assert_eq!(s.duplicates, 2, "{s:?}");
    assert_eq!(s.effects, 2);
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_event_on_two_partitions_processed_concurrently_credits_once() {
    let topic = common::unique("twoparts");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 2).await;
    let user = common::unique("u");
    let producer = common::producer();
    // Many events, each published to both partitions: the two partition tasks race on every key.
    let payments: Vec<Payment> = (0..200).map(|i| Payment::new(&user, 1_000 + i)).collect();
    common::send_payments(&producer, &topic, Some(0), &payments).await;
    common::send_payments(&producer, &topic, Some(1), &payments).await;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    common::wait_records(&stats, 400, 60).await;
    let db = common::pg().await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 200, "{l:?}");
    assert_eq!(l.distinct_payments, 200);
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.cashback_paise, expected);
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        expected
    );
    let s = stats.snapshot();
    assert_eq!(s.duplicates, 200, "{s:?}");
    assert_eq!(s.effects, 200);
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_tap_same_payment_new_event_id_credits_once() {
    let topic = common::unique("doubletap");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let first = Payment::new(&user, 80_000);
    let mut tap = Payment::new(&user, 80_000);
    tap.payment_id = first.payment_id.clone();
    let producer = common::producer();
    common::send_payments(&producer, &topic, Some(0), std::slice::from_ref(&first)).await;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    eventually(60, "first payment applied", || {
        let stats = stats.clone();
        async move { stats.snapshot().effects >= 1 }
    })
    .await;
    // The second tap arrives in a later batch.
    common::send_payments(&producer, &topic, Some(0), std::slice::from_ref(&tap)).await;
    common::wait_records(&stats, 2, 60).await;
    let db = common::pg().await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 1, "{l:?}");
    assert_eq!(l.cashback_paise, 1_600);
    assert_eq!(l.dedupe_keys, 2, "both event ids are recorded as processed");
    let s = stats.snapshot();
    assert_eq!((s.business_duplicates, s.duplicates), (1, 0), "{s:?}");
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_redelivered_on_a_later_day_is_still_a_duplicate() {
    let topic = common::unique("laterday");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let db = common::pg().await;

    // An event that happened three days ago...
    let mut old = Payment::new(&user, 10_000);
    old.occurred_at = chrono::Utc::now() - chrono::Duration::days(3);
    let event_date = old.occurred_at.date_naive();
    // ...and was applied the day after it happened (its key and effect committed then).
    let partition = effectively::store::partitions::Known::default();
    partition.ensure(&db, [event_date]).await.unwrap();
    db.execute(
        "INSERT INTO processed_messages (consumer, message_id, event_date, processed_at)
         VALUES ($1, $2, $3, now() - interval '2 days')",
        &[&consumer, &old.event_id, &event_date],
    )
    .await
    .unwrap();
    // Today a redrive delivers the same bytes again, plus a fresh event from three days ago.
    let mut other = Payment::new(&user, 20_000);
    other.occurred_at = old.occurred_at;
    let producer = common::producer();
    common::send_payments(&producer, &topic, Some(0), &[old.clone(), other.clone()]).await;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    common::wait_records(&stats, 2, 60).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(
        l.credits, 1,
        "only the never-applied event is credited: {l:?}"
    );
    assert_eq!(l.cashback_paise, 400);
    assert_eq!(stats.snapshot().duplicates, 1);
    // Both keys live in the partition of the event's date, not of the processing date.
    let in_partition: i64 = db
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE consumer = $1",
                effectively::store::partitions::name_for(event_date)
            ),
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(in_partition, 2);
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_committed_offset_never_passes_the_offset_stored_in_postgres() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};
    use std::time::Duration;

    let topic = common::unique("offsets");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 3).await;
    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();

    // A client of the same group that never joins it: it only reads committed offsets.
    let observer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .set("group.id", &consumer)
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..3 {
        tpl.add_partition(&topic, p);
    }
    let db = common::pg().await;
    let producer = common::producer();
    let sender = {
        let topic = topic.clone();
        tokio::spawn(async move {
            for round in 0..20 {
                let user = format!("u{round}");
                let batch: Vec<Payment> = (0..50).map(|i| Payment::new(&user, 100 + i)).collect();
                common::send_payments(&producer, &topic, None, &batch).await;
            }
        })
    };
    let mut samples = 0;
    let mut nonzero = 0;
    while samples < 400 {
        // Kafka first, then PostgreSQL: PostgreSQL's offset only grows, so a Kafka offset
        // read earlier must not exceed it.
        let committed = observer
            .committed_offsets(tpl.clone(), Duration::from_secs(5))
            .unwrap();
        let stored = effectively::store::offsets::load(&db, &consumer, &topic)
            .await
            .unwrap();
        for e in committed.elements() {
            if let Offset::Offset(k) = e.offset() {
                let pg = stored
                    .iter()
                    .find(|s| s.partition == e.partition())
                    .and_then(|s| s.next_offset)
                    .unwrap_or(0);
                assert!(
                    k <= pg,
                    "partition {}: Kafka committed {k} > PostgreSQL {pg}",
                    e.partition()
                );
                nonzero += 1;
            }
        }
        samples += 1;
        if sender.is_finished() && stats.snapshot().records >= 1_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sender.await.unwrap();
    eventually(60, "1000 records processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= 1_000 }
    })
    .await;
    assert!(nonzero > 0, "some committed offsets were observed");
    assert_eq!(ledger(&db, &consumer).await.credits, 1_000);
    worker.stop().await.unwrap();
    // After a clean stop, Kafka's offsets equal PostgreSQL's.
    let committed = observer
        .committed_offsets(tpl, Duration::from_secs(5))
        .unwrap();
    let stored = effectively::store::offsets::load(&db, &consumer, &topic)
        .await
        .unwrap();
    for s in stored {
        let k = committed
            .find_partition(&topic, s.partition)
            .map(|e| e.offset());
        assert_eq!(
            k,
            s.next_offset.map(Offset::Offset),
            "partition {}",
            s.partition
        );
    }
}
