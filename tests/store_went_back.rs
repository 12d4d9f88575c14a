//! PostgreSQL going back in time under a running worker, against the real Kafka and PostgreSQL.
//!
//! A failover to an asynchronous standby that lacked the primary's last commits, or a restore
//! to an earlier point, takes away the tail of the committed transactions: their dedupe keys,
//! their effects and the offsets they stored, together (they were one transaction each). The
//! claim row is older and survives, so the epoch still matches. Here the test takes the tail
//! away itself, in one transaction, exactly as a rollback would leave the tables: the last
//! payments' credits, outbox rows, wallet amounts and dedupe keys, and the stored offset back to
//! the first of them. The worker must notice at its next batch, read the partition again from
//! the stored offset, and apply every lost payment once: nothing lost, nothing doubled.

mod common;

use common::{eventually, ledger, Payment};

/// Takes back the commits of `lost` (the last payments applied, in offset order from `from`):
/// what PostgreSQL would hold had those transactions never reached the server that survived.
async fn forget_the_tail(
    db: &mut tokio_postgres::Client,
    consumer: &str,
    topic: &str,
    lost: &[Payment],
    from: i64,
) {
    let ids: Vec<uuid::Uuid> = lost.iter().map(|p| p.event_id).collect();
    let tx = db.transaction().await.unwrap();
    tx.execute(
        "UPDATE wallets w SET balance_paise = w.balance_paise - c.sum
         FROM (SELECT user_id, sum(cashback_paise) AS sum FROM cashback_credits
               WHERE consumer = $1 AND event_id = ANY($2) GROUP BY user_id) c
         WHERE w.user_id = c.user_id",
        &[&consumer, &ids],
    )
    .await
    .unwrap();
    tx.execute(
        "DELETE FROM outbox WHERE payload->>'cause_event_id' = ANY($1::uuid[]::text[])",
        &[&ids],
    )
    .await
    .unwrap();
    let credits = tx
        .execute(
            "DELETE FROM cashback_credits WHERE consumer = $1 AND event_id = ANY($2)",
            &[&consumer, &ids],
        )
        .await
        .unwrap();
    assert_eq!(credits, lost.len() as u64, "the tail was applied before");
    tx.execute(
        "DELETE FROM processed_messages WHERE consumer = $1 AND message_id = ANY($2)",
        &[&consumer, &ids],
    )
    .await
    .unwrap();
    let n = tx
        .execute(
            "UPDATE consumer_offsets SET next_offset = $3 WHERE consumer = $1 AND topic = $2",
            &[&consumer, &topic, &from],
        )
        .await
        .unwrap();
    assert_eq!(n, 1);
    tx.commit().await.unwrap();
}

async fn lost_tail_is_applied_again(strategy: &str) {
    let topic = common::unique("went-back");
    let consumer = topic.clone();
    common::create_topic(&topic, 1).await;
    let mut db = common::pg().await;
    let users: Vec<String> = (0..5).map(|i| format!("{consumer}-u{i}")).collect();
    let wave1: Vec<Payment> = (0..50)
        .map(|i| Payment::new(&users[i % users.len()], 1_000 + i as i64 * 10))
        .collect();
    let wave2: Vec<Payment> = (0..30)
        .map(|i| Payment::new(&users[i % users.len()], 2_000 + i as i64 * 10))
        .collect();
    let extra = format!("strategy = \"{strategy}\"");
    let worker = common::start_cashback(&consumer, &topic, &extra).await;
    let stats = worker.stats(&consumer).unwrap();
    let producer = common::producer();

    common::send_payments(&producer, &topic, Some(0), &wave1).await;
    eventually(60, "wave 1 applied and its offset stored", || {
        let db = &db;
        let (consumer, topic) = (&consumer, &topic);
        async move { common::stored_offset(db, consumer, topic, 0).await == Some(50) }
    })
    .await;

    // The last 20 commits are lost: offsets 30..50 (one record per offset, in order).
    forget_the_tail(&mut db, &consumer, &topic, &wave1[30..], 30).await;
    assert_eq!(ledger(&db, &consumer).await.credits, 30);

    common::send_payments(&producer, &topic, Some(0), &wave2).await;
    eventually(60, "every payment of both waves applied", || {
        let db = &db;
        let consumer = &consumer;
        async move { ledger(db, consumer).await.credits >= 80 }
    })
    .await;
    eventually(30, "the stored offset past both waves", || {
        let db = &db;
        let (consumer, topic) = (&consumer, &topic);
        async move { common::stored_offset(db, consumer, topic, 0).await == Some(80) }
    })
    .await;
    let s = stats.snapshot();
    worker.stop().await.unwrap();

    let all: Vec<&Payment> = wave1.iter().chain(&wave2).collect();
    let l = ledger(&db, &consumer).await;
    let expected: i64 = all.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.credits, 80, "{strategy}: each payment once: {l:?}");
    assert_eq!(l.distinct_payments, 80);
    assert_eq!(l.dedupe_keys, 80);
    assert_eq!(l.outbox, 80);
    assert_eq!(l.cashback_paise, expected);
    assert_eq!(common::wallet_total(&db, &users).await, expected);
    assert!(common::doubly_credited(&db, &consumer).await.is_empty());
    assert_eq!(
        s.went_back, 1,
        "{strategy}: one batch found the store gone back: {s:?}"
    );
    assert_eq!(
        s.fenced, 0,
        "{strategy}: a store that went back is no zombie"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_strategy_applies_the_commits_postgres_lost_again() {
    lost_tail_is_applied_again("batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_message_strategy_applies_the_commits_postgres_lost_again() {
    lost_tail_is_applied_again("per-message").await;
}
