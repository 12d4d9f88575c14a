//! `dedupe = "business-row"` against the real Kafka and PostgreSQL: the cashback handler's credit
//! (`UNIQUE (payment_id)`) is the key, no ledger row is written, and every kind of copy still
//! changes nothing: copies in one partition, one event on two partitions at once, a double tap,
//! the whole topic read again after a rewind, a payment older than the ledger's retention.
//! Through commit groups (the default) and without.

mod common;

use common::{ledger, Payment};

/// Sends the scenario's records to a new topic of two partitions; returns (topic, the payments
/// credited, the expected cashback, copies sent beyond the first of each event, users).
async fn scenario() -> (String, usize, i64, u64, Vec<String>) {
    let topic = common::unique("bizrow");
    common::create_topic(&topic, 2).await;
    let users: Vec<String> = (0..3).map(|_| common::unique("u")).collect();
    let mut payments: Vec<Payment> = (0..60)
        .map(|i| Payment::new(&users[i % 3], 10_000 + i as i64))
        .collect();
    // Dated 40 days ago, past the ledger's 15-day retention: the key on its row does not expire,
    // so it is applied, not parked.
    payments[5].occurred_at = chrono::Utc::now() - chrono::Duration::days(40);
    let producer = common::producer();
    // Partition 0: every payment, then a copy of every third (a relay's resend).
    let mut p0 = payments.clone();
    p0.extend(payments.iter().step_by(3).cloned());
    // A double tap: the first payment again under a new event id.
    let mut tap = Payment::new(&users[0], 10_000);
    tap.payment_id = payments[0].payment_id.clone();
    p0.push(tap);
    common::send_payments(&producer, &topic, Some(0), &p0).await;
    // Partition 1: the first ten events again, racing partition 0's.
    common::send_payments(&producer, &topic, Some(1), &payments[..10]).await;
    // A payment missing its amount: parked, not applied.
    let poison = br#"{"payment_id": "pay_poison", "user_id": "u"}"#.to_vec();
    let id = uuid::Uuid::now_v7().to_string();
    common::send_raw(&producer, &topic, Some(1), &[(Some(id), poison)]).await;
    let cashback: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    (topic, payments.len(), cashback, 20 + 10, users)
}

async fn copies_change_nothing(extra: &str) {
    let (topic, credited, cashback, copies, users) = scenario().await;
    let consumer = common::unique("rewards-row");
    let config = format!("dedupe = \"business-row\"\n{extra}");
    let records = credited as u64 + copies + 1 + 1; // + the double tap, + the poison
    let worker = common::start_cashback(&consumer, &topic, &config).await;
    let stats = worker.stats(&consumer).unwrap();
    common::wait_records(&stats, records, 60).await;
    let db = common::pg().await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, credited as i64, "{l:?}");
    assert_eq!(l.cashback_paise, cashback);
    assert_eq!(l.dedupe_keys, 0, "no ledger row: the credit is the key");
    assert_eq!(l.outbox, credited as i64);
    assert_eq!(l.parked, 1);
    assert_eq!(common::wallet_total(&db, &users).await, cashback);
    let s = stats.snapshot();
    assert_eq!(s.effects, credited as u64, "{s:?}");
    assert_eq!(
        s.duplicates, copies,
        "copies counted as duplicates of their key: {s:?}"
    );
    assert_eq!(s.business_duplicates, 1, "the double tap: {s:?}");
    worker.stop().await.unwrap();

    // Everything read again from offset 0, as an operator's rewind would: no ledger to stop the
    // copies, only the credits, and they change nothing.
    db.execute(
        "UPDATE consumer_offsets SET next_offset = 0 WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap();
    let worker = common::start_cashback(&consumer, &topic, &config).await;
    let stats = worker.stats(&consumer).unwrap();
    common::wait_records(&stats, records, 60).await;
    let again = ledger(&db, &consumer).await;
    assert_eq!(again, l, "a re-read applies nothing");
    assert_eq!(common::wallet_total(&db, &users).await, cashback);
    let s = stats.snapshot();
    assert_eq!(s.effects, 0, "{s:?}");
    assert_eq!(
        s.duplicates,
        records - 2,
        "every copy but the tap and the poison: {s:?}"
    );
    assert_eq!(s.business_duplicates, 1, "{s:?}");
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_change_nothing_through_commit_groups() {
    copies_change_nothing("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_change_nothing_one_partition_a_transaction() {
    copies_change_nothing("batch = { group_partitions = false }").await;
}
