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

    let worker = common::start(common::config(
        &consumer,
        &topic,
        r#"{ kind = "cashback" }"#,
        "",
    ))
    .await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    eventually(60, "4 records processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= 4 }
    })
    .await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 2, "one credit per payment: {l:?}");
    assert_eq!(l.cashback_paise, 2_400 + 1_000);
    assert_eq!(l.dedupe_keys, 2);
    assert_eq!(l.outbox, 2);
    assert_eq!(common::wallet_total(&db, std::slice::from_ref(&user)).await, 3_400);
    let s = stats.snapshot();
    assert_eq!(s.duplicates, 2, "{s:?}");
    assert_eq!(s.effects, 2);
    worker.stop().await.unwrap();
}
