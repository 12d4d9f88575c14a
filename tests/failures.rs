//! Bad input and handler failures under the default `batch` strategy, against the real Kafka and
//! PostgreSQL: whatever cannot be applied is parked with its reason and its bytes intact, and
//! everything around it is applied exactly once.

mod common;

use std::time::Duration;

use common::poison::{start_poisoned, with_poison, Poisoned};
use common::{eventually, ledger, Fault, Payment};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// One record as produced: key, headers (a `None` value is a null header), payload.
struct Sent {
    key: Vec<u8>,
    headers: Vec<(&'static str, Option<Vec<u8>>)>,
    payload: Vec<u8>,
}

/// Produces `records` to partition 0, one at a time, so their offsets follow the slice.
async fn send_records(producer: &FutureProducer, topic: &str, records: &[Sent]) {
    for r in records {
        let mut headers = OwnedHeaders::new();
        for (name, value) in &r.headers {
            headers = headers.insert(Header {
                key: name,
                value: value.as_deref(),
            });
        }
        let rec = FutureRecord::to(topic)
            .partition(0)
            .key(r.key.as_slice())
            .payload(r.payload.as_slice())
            .headers(headers);
        producer
            .send(rec, Duration::from_secs(30))
            .await
            .expect("delivery");
    }
}

fn payment_value(p: &Payment) -> serde_json::Value {
    serde_json::from_slice(&p.json()).unwrap()
}

/// Small backoffs so that retries cost milliseconds.
const FAST_RETRY: &str =
    r#"retry = { max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_bad_input_is_parked_with_its_reason_and_bytes() {
    let topic = common::unique("bad-input");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");

    let good1 = Payment::new(&user, 120_000);
    let good2 = Payment::new(&user, 50_000);
    let id = || uuid::Uuid::now_v7();
    let with_id = |id: uuid::Uuid| -> Vec<(&'static str, Option<Vec<u8>>)> {
        vec![
            ("origin", Some(b"failures-test".to_vec())),
            ("event_id", Some(id.to_string().into_bytes())),
        ]
    };

    // 2,000 bytes of valid JSON, over the 1,000-byte limit.
    let mut big = payment_value(&Payment::new(&user, 1_000));
    big["pad"] = serde_json::Value::String(String::new());
    let short = serde_json::to_vec(&big).unwrap().len();
    big["pad"] = serde_json::Value::String("x".repeat(2_000 - short));
    let oversized = serde_json::to_vec(&big).unwrap();
    assert_eq!(oversized.len(), 2_000);

    let mut no_amount = payment_value(&Payment::new(&user, 7_000));
    no_amount.as_object_mut().unwrap().remove("amount_paise");

    let mut old = Payment::new(&user, 8_000);
    old.occurred_at = chrono::Utc::now() - chrono::Duration::days(40);
    let mut future = Payment::new(&user, 9_000);
    future.occurred_at = chrono::Utc::now() + chrono::Duration::days(10);

    // (record, expected reason, expected message id in the dead letter)
    let (undecodable_id, oversized_id, no_amount_id) = (id(), id(), id());
    let bad: Vec<(Sent, &str, Option<uuid::Uuid>)> = vec![
        (
            Sent {
                key: b"k-missing".to_vec(),
                headers: vec![("origin", Some(b"failures-test".to_vec())), ("trace", None)],
                payload: Payment::new(&user, 1_100).json(),
            },
            "missing_event_id",
            None,
        ),
        (
            Sent {
                key: b"k-invalid".to_vec(),
                headers: vec![
                    ("origin", Some(b"failures-test".to_vec())),
                    ("event_id", Some(b"not-a-uuid".to_vec())),
                ],
                payload: Payment::new(&user, 1_200).json(),
            },
            "invalid_event_id",
            None,
        ),
        (
            Sent {
                key: b"k-undecodable".to_vec(),
                headers: with_id(undecodable_id),
                payload: b"{\"payment_id\": \"pay_broken\", \x00\xff not json".to_vec(),
            },
            "undecodable_payload",
            Some(undecodable_id),
        ),
        (
            Sent {
                key: b"k-oversized".to_vec(),
                headers: with_id(oversized_id),
                payload: oversized,
            },
            "oversized_payload",
            Some(oversized_id),
        ),
        (
            Sent {
                key: b"k-no-amount".to_vec(),
                headers: with_id(no_amount_id),
                payload: serde_json::to_vec(&no_amount).unwrap(),
            },
            "missing_field",
            Some(no_amount_id),
        ),
        (
            Sent {
                key: b"k-old".to_vec(),
                headers: with_id(old.event_id),
                payload: old.json(),
            },
            "older_than_retention",
            Some(old.event_id),
        ),
        (
            Sent {
                key: b"k-future".to_vec(),
                headers: with_id(future.event_id),
                payload: future.json(),
            },
            "future_event_date",
            Some(future.event_id),
        ),
    ];
    let good = |p: &Payment| Sent {
        key: p.payment_id.clone().into_bytes(),
        headers: with_id(p.event_id),
        payload: p.json(),
    };
    let mut records = vec![good(&good1)];
    let mut expected = Vec::new();
    for (sent, reason, message_id) in bad {
        expected.push((records.len() as i64, reason, message_id));
        records.push(sent);
    }
    records.push(good(&good2));
    let total = records.len() as i64;
    send_records(&common::producer(), &topic, &records).await;

    let worker = common::start_cashback(&consumer, &topic, "max_payload_bytes = 1000").await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    eventually(60, "every record processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= total as u64 }
    })
    .await;

    // Exactly the two good payments credited.
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 2, "{l:?}");
    assert_eq!(l.distinct_payments, 2);
    assert_eq!(l.cashback_paise, 2_400 + 1_000);
    assert_eq!(l.dedupe_keys, 2);
    assert_eq!(l.outbox, 2);
    assert_eq!(l.parked, expected.len() as i64);
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        3_400
    );
    let credited: Vec<String> = db
        .query(
            "SELECT payment_id FROM cashback_credits WHERE consumer = $1 ORDER BY payment_id",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut want = vec![good1.payment_id.clone(), good2.payment_id.clone()];
    want.sort();
    assert_eq!(credited, want);

    // One dead letter per bad record, its reason, and the record as it was sent.
    let parked = common::dead_letters(&db, &consumer).await;
    assert_eq!(parked.len(), expected.len(), "{parked:#?}");
    for (dl, (offset, reason, message_id)) in parked.iter().zip(&expected) {
        let sent = &records[*offset as usize];
        assert_eq!(dl.offset, *offset, "{dl:?}");
        assert_eq!(dl.reason, *reason, "offset {offset}: {}", dl.detail);
        assert!(!dl.detail.is_empty());
        assert_eq!(dl.topic, topic);
        assert_eq!(dl.partition, 0);
        assert_eq!(dl.message_id, *message_id, "{reason}");
        assert_eq!(
            dl.payload.as_deref(),
            Some(sent.payload.as_slice()),
            "{reason}: payload bytes differ"
        );
        assert_eq!(dl.key.as_deref(), Some(sent.key.as_slice()), "{reason}");
        let names: Vec<&str> = sent.headers.iter().map(|(n, _)| *n).collect();
        let values: Vec<Option<Vec<u8>>> = sent.headers.iter().map(|(_, v)| v.clone()).collect();
        assert_eq!(dl.header_names, names, "{reason}");
        assert_eq!(dl.header_values, values, "{reason}");
    }

    // A parked message left no dedupe key behind.
    let parked_ids: Vec<uuid::Uuid> = expected.iter().filter_map(|e| e.2).collect();
    assert_eq!(parked_ids.len(), 5);
    assert_eq!(
        common::processed_among(&db, &consumer, &parked_ids).await,
        0
    );

    let s = stats.snapshot();
    assert_eq!(s.parked, expected.len() as u64, "{s:?}");
    assert_eq!(s.effects, 2, "{s:?}");
    assert_eq!(s.records, total as u64, "{s:?}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(total),
        "the stored offset is past the last record"
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_failing_transiently_once_applies_every_effect_exactly_once() {
    let topic = common::unique("flaky");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let payments: Vec<Payment> = (1..=10).map(|i| Payment::new(&user, i * 10_000)).collect();
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;

    let (flaky, worker) =
        common::start_faulty(&consumer, &topic, Fault::TransientOnce, "flaky", FAST_RETRY).await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    eventually(60, "10 payments credited", || {
        let db = &db;
        let consumer = &consumer;
        async move { ledger(db, consumer).await.credits >= 10 }
    })
    .await;
    eventually(30, "10 records counted", || {
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
    assert_eq!(flaky.injected.load(std::sync::atomic::Ordering::SeqCst), 1);
    let s = stats.snapshot();
    assert!(s.retries >= 1, "{s:?}");
    assert_eq!(s.effects, 10, "{s:?}");
    assert_eq!(s.parked, 0, "{s:?}");
    worker.stop().await.unwrap();
}

/// Waits until `consumer` has processed `n` records, and checks that every payment but the
/// poison is credited exactly once and the poison left no dedupe key.
async fn assert_all_but_poison_applied(
    db: &tokio_postgres::Client,
    consumer: &str,
    payments: &[Payment],
    poison: usize,
) {
    let others: Vec<&Payment> = (payments.iter().enumerate())
        .filter(|(i, _)| *i != poison)
        .map(|(_, p)| p)
        .collect();
    let l = ledger(db, consumer).await;
    let want: i64 = others.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(l.credits, others.len() as i64, "{l:?}");
    assert_eq!(l.distinct_payments, others.len() as i64);
    assert_eq!(l.cashback_paise, want);
    assert_eq!(l.dedupe_keys, others.len() as i64);
    assert_eq!(l.outbox, others.len() as i64);
    assert_eq!(l.parked, 1);
    let credited: Vec<uuid::Uuid> = db
        .query(
            "SELECT event_id FROM cashback_credits WHERE consumer = $1 ORDER BY event_id",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut want_ids: Vec<uuid::Uuid> = others.iter().map(|p| p.event_id).collect();
    want_ids.sort();
    assert_eq!(credited, want_ids);
    assert_eq!(
        common::processed_among(db, consumer, &[payments[poison].event_id]).await,
        0,
        "the parked poison has no dedupe key"
    );
}

/// The poison's dead letter: its reason, id, offset and bytes.
async fn assert_poison_parked(
    db: &tokio_postgres::Client,
    consumer: &str,
    topic: &str,
    poison: &Payment,
    offset: i64,
    reason: &str,
) -> common::DeadLetter {
    let parked = common::dead_letters(db, consumer).await;
    assert_eq!(parked.len(), 1, "{parked:#?}");
    let dl = parked.into_iter().next().unwrap();
    assert_eq!(dl.reason, reason, "{}", dl.detail);
    assert_eq!(dl.message_id, Some(poison.event_id));
    assert_eq!(
        (dl.topic.as_str(), dl.partition, dl.offset),
        (topic, 0, offset)
    );
    assert_eq!(dl.payload.as_deref(), Some(poison.json().as_slice()));
    assert_eq!(dl.header_names, vec!["event_id".to_string()]);
    assert_eq!(
        dl.header_values,
        vec![Some(poison.event_id.to_string().into_bytes())]
    );
    dl
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_always_fails_is_parked_after_its_attempts_and_the_batch_applied() {
    let Poisoned {
        topic,
        consumer,
        payments,
        poison,
        handler,
        worker,
        stats,
        db,
    } = start_poisoned(
        "poison",
        Fault::TransientOnAmount(666),
        "poisoned",
        FAST_RETRY,
    )
    .await;
    common::wait_records(&stats, 20, 60).await;

    assert_all_but_poison_applied(&db, &consumer, &payments, poison).await;
    let dl = assert_poison_parked(
        &db,
        &consumer,
        &topic,
        &payments[poison],
        poison as i64,
        "retries_exhausted",
    )
    .await;
    assert!(
        dl.attempts >= 3 || dl.detail.contains("3 attempt"),
        "the dead letter says how often it was tried: {dl:?}"
    );
    // Alone, the poison got its full three attempts.
    assert!(handler.injected.load(std::sync::atomic::Ordering::SeqCst) >= 3);
    let s = stats.snapshot();
    assert_eq!(s.parked, 1, "{s:?}");
    assert_eq!(s.effects, 19, "{s:?}");
    assert!(s.retries >= 3, "{s:?}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(20)
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_handler_rejects_is_parked_and_the_rest_applied() {
    let Poisoned {
        topic,
        consumer,
        payments,
        poison,
        handler: _handler,
        worker,
        stats,
        db,
    } = start_poisoned("reject", Fault::RejectAmount(666), "picky", FAST_RETRY).await;
    common::wait_records(&stats, 20, 60).await;

    assert_all_but_poison_applied(&db, &consumer, &payments, poison).await;
    let dl = assert_poison_parked(
        &db,
        &consumer,
        &topic,
        &payments[poison],
        poison as i64,
        "handler_rejected",
    )
    .await;
    assert!(dl.detail.contains("amount 666 is refused"), "{dl:?}");
    let s = stats.snapshot();
    assert_eq!(s.parked, 1, "{s:?}");
    assert_eq!(s.effects, 19, "{s:?}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(20)
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_constraint_violation_without_a_culprit_is_isolated_and_parked() {
    let topic = common::unique("sql-check");
    let consumer = common::unique("audit");
    let table = common::unique("audit").replace('-', "_");
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    db.batch_execute(&format!(
        "CREATE TABLE {table} (event_id uuid PRIMARY KEY, amount bigint CHECK (amount <> 666))"
    ))
    .await
    .unwrap();
    let user = common::unique("u");
    let (payments, poison) = with_poison(&user);
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;

    let handler = format!(
        r#"{{ kind = "sql", statement = "INSERT INTO {table} SELECT message_id, (payload->>'amount_paise')::bigint FROM fresh_messages ORDER BY message_id" }}"#
    );
    let worker = common::start(common::config(&consumer, &topic, &handler, FAST_RETRY)).await;
    let stats = worker.stats(&consumer).unwrap();
    common::wait_records(&stats, 20, 60).await;

    // Every other row is in the table exactly once (the primary key forbids more; the count
    // and the id list say none is missing), with its amount.
    let rows: Vec<(uuid::Uuid, i64)> = db
        .query(
            &format!("SELECT event_id, amount FROM {table} ORDER BY event_id"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let mut want: Vec<(uuid::Uuid, i64)> = (payments.iter().enumerate())
        .filter(|(i, _)| *i != poison)
        .map(|(_, p)| (p.event_id, p.amount_paise))
        .collect();
    want.sort();
    assert_eq!(rows, want);

    let dl = assert_poison_parked(
        &db,
        &consumer,
        &topic,
        &payments[poison],
        poison as i64,
        "handler_rejected",
    )
    .await;
    assert!(dl.detail.contains("23514"), "the CHECK violation: {dl:?}");
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.dedupe_keys, 19, "{l:?}");
    assert_eq!(l.parked, 1);
    assert_eq!(
        common::processed_among(&db, &consumer, &[payments[poison].event_id]).await,
        0
    );
    let s = stats.snapshot();
    assert_eq!(s.parked, 1, "{s:?}");
    assert_eq!(s.effects, 19, "{s:?}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(20)
    );
    worker.stop().await.unwrap();
    db.batch_execute(&format!("DROP TABLE {table}"))
        .await
        .unwrap();
}
