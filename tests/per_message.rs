//! The core guarantees under `strategy = "per-message"` (one transaction per message: key,
//! effect, offset), against the real Kafka and PostgreSQL.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{eventually, ledger, Fault, Faulty, Payment};

const PER_MESSAGE: &str = r#"strategy = "per-message""#;

fn per_message_fast_retry() -> String {
    format!(
        "{PER_MESSAGE}\n\
         retry = {{ max_attempts = 3, initial_backoff = \"10ms\", max_backoff = \"50ms\" }}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_copies_of_one_event_credit_once() {
    let topic = common::unique("pm-resend");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let p = Payment::new(&user, 120_000);
    let other = Payment::new(&user, 50_000);
    // Three copies at three offsets, with another payment in between.
    common::send_payments(
        &common::producer(),
        &topic,
        Some(0),
        &[p.clone(), p.clone(), other.clone(), p.clone()],
    )
    .await;

    let worker = common::start(common::config(
        &consumer,
        &topic,
        r#"{ kind = "cashback" }"#,
        PER_MESSAGE,
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
    assert_eq!(l.distinct_payments, 2);
    assert_eq!(l.cashback_paise, 2_400 + 1_000);
    assert_eq!(l.dedupe_keys, 2);
    assert_eq!(l.outbox, 2);
    assert_eq!(l.parked, 0);
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        3_400
    );
    let s = stats.snapshot();
    assert_eq!(s.duplicates, 2, "{s:?}");
    assert_eq!(s.effects, 2, "{s:?}");
    assert_eq!(s.records, 4, "{s:?}");
    // One transaction per record, duplicates included: the offset moves past each of them.
    assert!(s.commits >= 4, "{s:?}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(4)
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_transiently_once_applies_every_effect_exactly_once() {
    let topic = common::unique("pm-flaky");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let payments: Vec<Payment> = (1..=10).map(|i| Payment::new(&user, i * 10_000)).collect();
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;

    let flaky = Faulty::new(Fault::TransientOnce);
    let worker = common::start_with(
        common::config(
            &consumer,
            &topic,
            r#"{ kind = "custom", name = "flaky" }"#,
            &per_message_fast_retry(),
        ),
        Faulty::registry(&flaky, "flaky"),
    )
    .await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    eventually(60, "10 records processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= 10 }
    })
    .await;

    let l = ledger(&db, &consumer).await;
    let want: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.credits, 10, "{l:?}");
    assert_eq!(l.distinct_payments, 10);
    assert_eq!(l.cashback_paise, want);
    assert_eq!(l.dedupe_keys, 10);
    assert_eq!(l.outbox, 10);
    assert_eq!(
        l.parked,
        0,
        "nothing parked: {:?}",
        common::dead_letters(&db, &consumer).await
    );
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        want
    );
    assert_eq!(flaky.injected.load(Ordering::SeqCst), 1);
    let s = stats.snapshot();
    assert!(s.retries >= 1, "{s:?}");
    assert_eq!(s.effects, 10, "{s:?}");
    assert_eq!(s.parked, 0, "{s:?}");
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_always_fails_is_parked_and_the_others_applied() {
    let topic = common::unique("pm-poison");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let payments: Vec<Payment> = (0..20)
        .map(|i| Payment::new(&user, if i == 10 { 666 } else { 10_000 + i * 100 }))
        .collect();
    let poison = &payments[10];
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;

    let handler = Faulty::new(Fault::TransientOnAmount(666));
    let worker = common::start_with(
        common::config(
            &consumer,
            &topic,
            r#"{ kind = "custom", name = "poisoned" }"#,
            &per_message_fast_retry(),
        ),
        Faulty::registry(&handler, "poisoned"),
    )
    .await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    eventually(60, "20 records processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= 20 }
    })
    .await;

    let others: Vec<&Payment> = payments.iter().filter(|p| p.amount_paise != 666).collect();
    let want: i64 = others.iter().map(|p| p.amount_paise * 2 / 100).sum();
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 19, "{l:?}");
    assert_eq!(l.distinct_payments, 19);
    assert_eq!(l.cashback_paise, want);
    assert_eq!(l.dedupe_keys, 19);
    assert_eq!(l.outbox, 19);
    assert_eq!(l.parked, 1);
    assert_eq!(
        common::processed_among(&db, &consumer, &[poison.event_id]).await,
        0,
        "the parked poison has no dedupe key"
    );

    let parked = common::dead_letters(&db, &consumer).await;
    assert_eq!(parked.len(), 1, "{parked:#?}");
    let dl = &parked[0];
    assert_eq!(dl.reason, "retries_exhausted", "{}", dl.detail);
    assert_eq!(dl.message_id, Some(poison.event_id));
    assert_eq!((dl.topic.as_str(), dl.partition, dl.offset), (topic.as_str(), 0, 10));
    assert_eq!(dl.payload.as_deref(), Some(poison.json().as_slice()));
    assert!(
        dl.attempts >= 3 || dl.detail.contains("3 attempt"),
        "the dead letter says how often it was tried: {dl:?}"
    );
    assert_eq!(handler.injected.load(Ordering::SeqCst), 3);

    let s = stats.snapshot();
    assert_eq!(s.parked, 1, "{s:?}");
    assert_eq!(s.effects, 19, "{s:?}");
    assert!(s.retries >= 2, "{s:?}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(20)
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_and_restarted_applies_everything_exactly_once() {
    const N: usize = 200;
    let topic = common::unique("pm-crash");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let users: Vec<String> = (0..5).map(|_| common::unique("u")).collect();
    let payments: Vec<Payment> = (0..N)
        .map(|i| Payment::new(&users[i % users.len()], 1_000 + i as i64 * 37))
        .collect();
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;

    // Slowed down (about 10 ms per message) so the crash lands mid-stream.
    let config = common::config(
        &consumer,
        &topic,
        r#"{ kind = "custom", name = "slow" }"#,
        PER_MESSAGE,
    );
    let slow = Faulty::new(Fault::SlowPerMessage(Duration::from_millis(10)));
    let registry = Faulty::registry(&slow, "slow");
    let db = common::pg().await;

    let first = common::start_with(config.clone(), registry.clone()).await;
    eventually(60, "at least 20 payments credited", || {
        let (db, consumer) = (&db, &consumer);
        async move { ledger(db, consumer).await.credits >= 20 }
    })
    .await;
    // A crash: no stop, no drain, no leaving the group; the JoinSet aborts the tasks.
    drop(first);
    let t0 = std::time::Instant::now();
    let at_crash = ledger(&db, &consumer).await;
    assert!(
        (at_crash.credits as usize) < N,
        "the crash must land mid-stream: {at_crash:?}"
    );

    let second = common::start_with(config, registry).await;
    eventually(90, "all payments credited after the restart", || {
        let (db, consumer) = (&db, &consumer);
        async move { ledger(db, consumer).await.dedupe_keys >= N as i64 }
    })
    .await;
    eprintln!("DEBUG done after {:?}", t0.elapsed());
    eventually(30, "the stored offset past the last record", || {
        let (db, consumer, topic) = (&db, &consumer, &topic);
        async move { common::stored_offset(db, consumer, topic, 0).await == Some(N as i64) }
    })
    .await;

    let l = ledger(&db, &consumer).await;
    let want: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.credits, N as i64, "{l:?}");
    assert_eq!(l.distinct_payments, N as i64);
    assert_eq!(l.cashback_paise, want);
    assert_eq!(l.dedupe_keys, N as i64);
    assert_eq!(l.outbox, N as i64);
    assert_eq!(l.parked, 0);
    assert_eq!(common::doubly_credited(&db, &consumer).await, vec![]);
    let distinct_events: i64 = db
        .query_one(
            "SELECT count(DISTINCT event_id) FROM cashback_credits WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(distinct_events, N as i64);
    assert_eq!(common::wallet_total(&db, &users).await, want);
    let s2 = second.stats(&consumer).unwrap().snapshot();
    eprintln!("DEBUG at_crash={at_crash:?} second={s2:?} calls={}", slow.calls.load(Ordering::SeqCst));
    second.stop().await.unwrap();
}
