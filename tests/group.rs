//! Commit groups (`batch.group_partitions`) against the real Kafka and PostgreSQL: several
//! partitions' batches in one transaction, each partition still fenced, and failures sent back to
//! the partitions' own transactions.

mod common;

use std::time::Duration;

use common::{eventually, ledger, Fault, Payment};
use rdkafka::producer::{FutureProducer, FutureRecord};

const GROUPED: &str =
    "batch = { max_messages = 5, backlog_max_messages = 5, group_partitions = true }\n\
     retry = { max_attempts = 3, initial_backoff = \"10ms\", max_backoff = \"50ms\" }";

/// Sends every payment (with its `event_id` header) to `partition_of(i)` without waiting for
/// each acknowledgement, so they reach the worker together.
async fn send_spread(
    producer: &FutureProducer,
    topic: &str,
    payments: &[Payment],
    partition_of: impl Fn(usize) -> i32,
) {
    use rdkafka::message::{Header, OwnedHeaders};
    let bodies: Vec<(String, Vec<u8>)> = payments
        .iter()
        .map(|p| (p.event_id.to_string(), p.json()))
        .collect();
    let sends: Vec<_> = (bodies.iter().enumerate())
        .map(|(i, (id, body))| {
            let headers = OwnedHeaders::new().insert(Header {
                key: "event_id",
                value: Some(id.as_bytes()),
            });
            let rec = FutureRecord::<[u8], [u8]>::to(topic)
                .payload(body.as_slice())
                .headers(headers)
                .partition(partition_of(i));
            producer.send(rec, Duration::from_secs(30))
        })
        .collect();
    for s in sends {
        s.await.expect("delivery");
    }
}

async fn wait_credits(db: &tokio_postgres::Client, consumer: &str, n: i64) {
    eventually(90, &format!("{n} credits"), || async move {
        ledger(db, consumer).await.credits >= n
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_partitions_share_transactions_and_the_ledger_is_exact() {
    let topic = common::unique("grouped");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 24).await;
    let users: Vec<String> = (0..40)
        .map(|i| format!("{}-{i}", common::unique("u")))
        .collect();
    let unique: Vec<Payment> = (0..1_200)
        .map(|i| Payment::new(&users[i % users.len()], 1_000 + (i as i64 * 37) % 9_000))
        .collect();
    // Every tenth payment twice, the copy in another partition (a relay that resent it): the
    // group's dedupe meets both copies, sometimes in one transaction.
    let mut sent = Vec::new();
    for (i, p) in unique.iter().enumerate() {
        sent.push(p.clone());
        if i % 10 == 0 {
            sent.push(p.clone());
        }
    }
    let producer = common::producer();
    send_spread(&producer, &topic, &sent, |i| (i % 24) as i32).await;
    // One record that is not a payment at all: parked with its bytes from inside a group.
    common::send_raw(&producer, &topic, Some(7), &[(None, b"not json".to_vec())]).await;

    let db = common::pg().await;
    let worker = common::start_cashback(&consumer, &topic, GROUPED).await;
    let stats = worker.stats(&consumer).unwrap();
    wait_credits(&db, &consumer, unique.len() as i64).await;
    common::wait_records(&stats, sent.len() as u64 + 1, 60).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let l = ledger(&db, &consumer).await;
    let expected: i64 = unique.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.credits, unique.len() as i64, "{l:?}");
    assert_eq!(l.distinct_payments, unique.len() as i64);
    assert_eq!(l.dedupe_keys, unique.len() as i64);
    assert_eq!(l.outbox, unique.len() as i64);
    assert_eq!(l.cashback_paise, expected);
    assert_eq!(common::wallet_total(&db, &users).await, expected);
    let parked = common::dead_letters(&db, &consumer).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(
        (parked[0].partition, parked[0].payload.as_deref()),
        (7, Some(&b"not json"[..]))
    );
    // Every partition's offset stands at its end.
    let stored = effectively::store::offsets::load(&db, &consumer, &topic)
        .await
        .unwrap();
    let total: i64 = stored.iter().filter_map(|s| s.next_offset).sum();
    assert_eq!(total, sent.len() as i64 + 1);
    // Batches of at most 5 records from 24 partitions with a backlog, one group in flight (the
    // default): a group carries the batches that waited meanwhile, so there are far fewer
    // transactions than batches.
    let s = stats.snapshot();
    assert_eq!(s.duplicates, (sent.len() - unique.len()) as u64, "{s:?}");
    assert!(s.batches >= 200, "small batches: {s:?}");
    assert!(
        s.commits * 2 <= s.batches,
        "several batches per transaction: {s:?}"
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_group_sends_each_batch_back_to_its_own_transaction() {
    let topic = common::unique("grouped-poison");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 8).await;
    let user = common::unique("u");
    // 6 payments per partition; the handler refuses one of partition 3's, which fails the group
    // it is in.
    let mut payments: Vec<Payment> = (0..48)
        .map(|i| Payment::new(&user, 10_000 + i * 100))
        .collect();
    let poison = 3 + 8 * 2;
    payments[poison].amount_paise = 666;
    let producer = common::producer();
    send_spread(&producer, &topic, &payments, |i| (i % 8) as i32).await;

    let (handler, worker) = common::start_faulty(
        &consumer,
        &topic,
        Fault::RejectAmount(666),
        "picky",
        GROUPED,
    )
    .await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    common::wait_records(&stats, payments.len() as u64, 60).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let l = ledger(&db, &consumer).await;
    let good: Vec<&Payment> = (payments.iter().enumerate())
        .filter(|(i, _)| *i != poison)
        .map(|(_, p)| p)
        .collect();
    let expected: i64 = good.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.credits, good.len() as i64, "{l:?}");
    assert_eq!(l.dedupe_keys, good.len() as i64);
    assert_eq!(l.cashback_paise, expected);
    let parked = common::dead_letters(&db, &consumer).await;
    assert_eq!(parked.len(), 1, "{parked:?}");
    assert_eq!(parked[0].message_id, Some(payments[poison].event_id));
    assert_eq!(parked[0].reason, "handler_rejected");
    assert!(handler.injected.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    let stored = effectively::store::offsets::load(&db, &consumer, &topic)
        .await
        .unwrap();
    assert!(
        stored.iter().all(|s| s.next_offset == Some(6)),
        "{stored:?}"
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_partition_is_fenced_while_its_group_commits_the_others() {
    let topic = common::unique("grouped-zombie");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 4).await;
    let user = common::unique("u");
    let producer = common::producer();
    let db = common::pg().await;
    let mut cfg = common::config(&consumer, &topic, r#"{ kind = "cashback" }"#, GROUPED);
    cfg.worker.id = Some("zombie".into());
    let zombie = common::start(cfg).await;
    let zstats = zombie.stats(&consumer).unwrap();
    // One payment per partition: each partition is claimed and has an offset.
    let warmup: Vec<Payment> = (0..4).map(|_| Payment::new(&user, 10_000)).collect();
    send_spread(&producer, &topic, &warmup, |i| i as i32).await;
    wait_credits(&db, &consumer, 4).await;

    // Another worker takes partition 0 in PostgreSQL while the zombie still believes it owns it.
    effectively::store::offsets::claim(&db, &consumer, &topic, 0, "usurper")
        .await
        .unwrap();
    let next: Vec<Payment> = (0..40).map(|i| Payment::new(&user, 20_000 + i)).collect();
    send_spread(&producer, &topic, &next, |i| (i % 4) as i32).await;
    eventually(60, "the zombie is fenced", || {
        let zstats = zstats.clone();
        async move { zstats.snapshot().fenced >= 1 }
    })
    .await;
    // Right after the fence (the worker claims the partition again 3 s later, as Kafka still
    // assigns it here): partition 0 stands where the usurper's claim left it.
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(1)
    );
    assert!(ledger(&db, &consumer).await.credits <= 34);
    // Partitions 1 to 3 went on; partition 0's payments come once it is claimed again.
    wait_credits(&db, &consumer, 44).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(
        (l.credits, l.distinct_payments, l.dedupe_keys),
        (44, 44, 44),
        "{l:?}"
    );
    let stored = effectively::store::offsets::load(&db, &consumer, &topic)
        .await
        .unwrap();
    assert!(
        stored.iter().all(|s| s.next_offset == Some(11)),
        "{stored:?}"
    );
    zombie.stop().await.unwrap();
}
