//! The inbox strategy against the real Kafka and PostgreSQL: the receiver lets Kafka move on
//! whatever the handler costs, processors keep per-key order under retries, park poison as
//! FAILED without holding other keys, replay applies once, and many processors in several
//! workers (or one that dies holding a claim) never apply a row twice.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use common::*;
use deadpool_postgres::Transaction;
use effectively::envelope::Envelope;
use effectively::handler::{Applied, BatchContext, Handler, HandlerError, Registry};
use effectively::store::inbox::{self, ReplayFilter};

const INBOX: &str = r#"strategy = "inbox"
[consumer.retry]
max_attempts = 3
initial_backoff = "50ms"
max_backoff = "200ms"
"#;

/// Counts of one consumer's inbox rows by status.
async fn statuses(db: &tokio_postgres::Client, consumer: &str) -> (i64, i64, i64, i64) {
    let r = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'PENDING'),
                    count(*) FILTER (WHERE status = 'IN_PROGRESS'),
                    count(*) FILTER (WHERE status = 'DONE'),
                    count(*) FILTER (WHERE status = 'FAILED')
             FROM inbox WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

#[tokio::test]
async fn a_slow_handler_does_not_hold_kafka() {
    let (topic, consumer) = (unique("inbox-slow"), unique("inbox-slow"));
    create_topic(&topic, 1).await;
    let extra = format!("{INBOX}[consumer.inbox]\nclaim_batch = 1\nprocessors = 4\n");
    let (_slow, worker) = start_faulty(
        &consumer,
        &topic,
        Fault::SlowPerMessage(Duration::from_secs(5)),
        "slow",
        &extra,
    )
    .await;
    let stats = worker.stats(&consumer).unwrap();
    let db = pg().await;
    let payments: Vec<Payment> = (0..3)
        .map(|i| Payment::new(&format!("u{i}"), 10_000))
        .collect();
    let p = producer();
    send_payments(&p, &topic, Some(0), &payments).await;
    let sent = Instant::now();
    eventually(
        5,
        "the partition's offset stored past all three",
        || async { stored_offset(&db, &consumer, &topic, 0).await == Some(3) },
    )
    .await;
    let took = sent.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "offsets moved on after {took:?}"
    );
    assert_eq!(
        ledger(&db, &consumer).await.credits,
        0,
        "no handler call finished yet"
    );
    // Three processors take one row each: about one handler call's time, not three.
    eventually(20, "three credits", || async {
        ledger(&db, &consumer).await.credits == 3
    })
    .await;
    let s = stats.snapshot();
    assert_eq!((s.records, s.duplicates, s.rebalances), (3, 0, 1), "{s:?}");
    assert_eq!(statuses(&db, &consumer).await, (0, 0, 3, 0));
    worker.stop().await.unwrap();
}

/// Logs `(key, n)` of every message it applies, in the order of the slice, and fails
/// transiently on key A's `n == 3` the first two times.
#[derive(Default)]
struct OrderLog {
    failures_left: AtomicU32,
}

#[async_trait]
impl Handler for OrderLog {
    async fn apply(
        &self,
        tx: &Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        let mut keys = Vec::new();
        let mut ns = Vec::new();
        for m in fresh {
            let doc = m.json.as_ref().unwrap();
            let n = doc["n"].as_i64().unwrap() as i32;
            if doc["k"] == "A" && n == 3 && self.failures_left.load(Ordering::SeqCst) > 0 {
                self.failures_left.fetch_sub(1, Ordering::SeqCst);
                return Err(HandlerError::Transient("injected: A3 fails".into()));
            }
            keys.push(doc["k"].as_str().unwrap().to_string());
            ns.push(n);
        }
        tx.execute(
            "INSERT INTO inbox_test_log (consumer, key, n)
             SELECT $1, k, n FROM unnest($2::text[], $3::int[]) WITH ORDINALITY AS t(k, n, o)
             ORDER BY o",
            &[&ctx.consumer, &keys, &ns],
        )
        .await?;
        Ok(Applied {
            effects: fresh.len() as u64,
            ..Applied::default()
        })
    }
}

#[tokio::test]
async fn per_key_order_holds_under_retries() {
    let (topic, consumer) = (unique("inbox-order"), unique("inbox-order"));
    create_topic(&topic, 2).await;
    let db = pg().await;
    create_once(
        &db,
        "CREATE TABLE IF NOT EXISTS inbox_test_log (
             id bigserial PRIMARY KEY, consumer text NOT NULL, key text NOT NULL, n int NOT NULL)",
    )
    .await;
    let log = Arc::new(OrderLog {
        failures_left: AtomicU32::new(2),
    });
    let registry = Registry::new().with("log", log.clone() as Arc<dyn Handler>);
    // One row a round, so each of A3's attempts is one handler call; a backoff long enough that
    // B and C finish while A waits.
    let extra = "message_id = { json_pointer = \"/event_id\" }\nstrategy = \"inbox\"\n\
                 [consumer.retry]\nmax_attempts = 5\ninitial_backoff = \"700ms\"\n\
                 max_backoff = \"700ms\"\n[consumer.inbox]\nclaim_batch = 1\n";
    let config = config(
        &consumer,
        &topic,
        "{ kind = \"custom\", name = \"log\" }",
        extra,
    );
    let worker = start_with(config, registry).await;
    // Keys A and B on one partition, C on the other, events 1..5 each, interleaved.
    let mut records = Vec::new();
    for n in 1..=5 {
        for k in ["A", "B"] {
            let id = uuid::Uuid::now_v7();
            let body = serde_json::json!({"event_id": id, "k": k, "n": n});
            records.push((k.to_string(), serde_json::to_vec(&body).unwrap()));
        }
    }
    let p = producer();
    produce(&p, &topic, Some(0), &records).await;
    let c: Vec<(String, Vec<u8>)> = (1..=5)
        .map(|n| {
            let body = serde_json::json!({"event_id": uuid::Uuid::now_v7(), "k": "C", "n": n});
            ("C".to_string(), serde_json::to_vec(&body).unwrap())
        })
        .collect();
    produce(&p, &topic, Some(1), &c).await;
    eventually(20, "15 events applied", || async {
        statuses(&db, &consumer).await.2 == 15
    })
    .await;
    for k in ["A", "B", "C"] {
        let order: Vec<i32> = db
            .query(
                "SELECT n FROM inbox_test_log WHERE consumer = $1 AND key = $2 ORDER BY id",
                &[&consumer, &k],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert_eq!(order, vec![1, 2, 3, 4, 5], "key {k}");
    }
    assert_eq!(
        log.failures_left.load(Ordering::SeqCst),
        0,
        "A3 failed twice"
    );
    let attempts: Vec<i32> = db
        .query(
            "SELECT attempts FROM inbox WHERE consumer = $1 AND ordering_key = 'k:A'
             ORDER BY seq",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(attempts, vec![1, 1, 3, 1, 1]);
    // A's failing head held back A alone: B and C were all applied before A3 was.
    let log_id = |k: &'static str, n: i32| {
        let db = &db;
        let consumer = &consumer;
        async move {
            db.query_one(
                "SELECT id FROM inbox_test_log WHERE consumer = $1 AND key = $2 AND n = $3",
                &[consumer, &k, &n],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    let a3 = log_id("A", 3).await;
    assert!(log_id("B", 5).await < a3, "B waited for A");
    assert!(log_id("C", 5).await < a3, "C waited for A");
    worker.stop().await.unwrap();
}

#[tokio::test]
async fn poison_is_parked_others_flow_and_replay_applies_once() {
    let (topic, consumer) = (unique("inbox-poison"), unique("inbox-poison"));
    create_topic(&topic, 2).await;
    let (flaky, worker) = start_faulty(
        &consumer,
        &topic,
        Fault::TransientOnAmountWhileBroken(1_313),
        "flaky",
        INBOX,
    )
    .await;
    let db = pg().await;
    let mut payments: Vec<Payment> = (0..40)
        .map(|i| Payment::new(&format!("u{}", i % 8), 10_000 + i))
        .collect();
    let poison = Payment::new("u0", 1_313);
    let poison_id_sent = poison.event_id;
    payments.insert(5, poison);
    let p = producer();
    // Keyed by user: u0's events share a key with the poison.
    let records: Vec<(String, Vec<u8>)> = payments
        .iter()
        .map(|p| (p.user_id.clone(), p.json()))
        .collect();
    let mut with_ids = Vec::new();
    for (p, (k, v)) in payments.iter().zip(records) {
        with_ids.push((k, v, p.event_id));
    }
    send_keyed(&p, &topic, &with_ids).await;
    // A bad field: refused by the handler's check, FAILED at once (no retry can fix it).
    let bad = uuid::Uuid::now_v7();
    let bad_body = serde_json::json!({"event_id": bad, "user_id": "u9", "amount_paise": 1,
        "occurred_at": chrono::Utc::now().to_rfc3339()});
    send_keyed(
        &p,
        &topic,
        &[("u9".into(), serde_json::to_vec(&bad_body).unwrap(), bad)],
    )
    .await;
    eventually(20, "40 credits and two FAILED rows", || async {
        ledger(&db, &consumer).await.credits == 40 && statuses(&db, &consumer).await.3 == 2
    })
    .await;
    let rows = db
        .query(
            "SELECT message_id, attempts, last_error FROM inbox WHERE consumer = $1
             AND status = 'FAILED' ORDER BY attempts",
            &[&consumer],
        )
        .await
        .unwrap();
    let (bad_id, bad_attempts): (uuid::Uuid, i32) = (rows[0].get(0), rows[0].get(1));
    assert_eq!(
        (bad_id, bad_attempts),
        (bad, 1),
        "a bad field fails at once"
    );
    let err: String = rows[0].get(2);
    assert!(err.contains("payment_id"), "{err}");
    let (poison_id, poison_attempts): (uuid::Uuid, i32) = (rows[1].get(0), rows[1].get(1));
    assert_eq!(
        (poison_id, poison_attempts),
        (poison_id_sent, 3),
        "max_attempts"
    );
    let err: String = rows[1].get(2);
    assert!(err.contains("after 3 attempt(s)"), "{err}");
    assert_eq!(
        ledger(&db, &consumer).await.parked,
        0,
        "nothing in dead_letters"
    );
    let status = inbox::status(&db, std::slice::from_ref(&consumer))
        .await
        .unwrap();
    assert_eq!((status[0].failed, status[0].pending), (2, 0));

    // The fix, then a replay of the FAILED rows: the poison is applied, once.
    flaky.broken.store(false, Ordering::SeqCst);
    let failed_only = ReplayFilter {
        failed_only: true,
        key: Some("k:u0".into()),
        ..ReplayFilter::default()
    };
    assert_eq!(
        inbox::replay(&db, &consumer, &failed_only).await.unwrap(),
        1
    );
    eventually(10, "41 credits", || async {
        ledger(&db, &consumer).await.credits == 41
    })
    .await;
    // Replaying everything (DONE rows too) is a no-op: the effect keeps its business key.
    let all = inbox::replay(&db, &consumer, &ReplayFilter::default())
        .await
        .unwrap();
    assert_eq!(all, 42);
    eventually(10, "every replayed row done again", || async {
        statuses(&db, &consumer).await == (0, 0, 41, 1)
    })
    .await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 41);
    assert!(doubly_credited(&db, &consumer).await.is_empty());
    worker.stop().await.unwrap();
}

/// Sends `(key, payload, event_id)` records keyed, with the `event_id` header, in order.
async fn send_keyed(
    producer: &rdkafka::producer::FutureProducer,
    topic: &str,
    records: &[(String, Vec<u8>, uuid::Uuid)],
) {
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::FutureRecord;
    for (key, payload, id) in records {
        let id = id.to_string();
        let headers = OwnedHeaders::new().insert(Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        });
        let rec = FutureRecord::to(topic)
            .key(key.as_bytes())
            .payload(payload.as_slice())
            .headers(headers);
        producer
            .send(rec, Duration::from_secs(30))
            .await
            .expect("delivery");
    }
}

async fn many_processors_apply_once(claim: &str) {
    let (topic, consumer) = (unique("inbox-many"), unique("inbox-many"));
    create_topic(&topic, 4).await;
    let extra = format!(
        "{INBOX}[consumer.inbox]\nprocessors = 2\nclaim_batch = 50\nclaim = \"{claim}\"\nlease = \"2s\"\n"
    );
    let mut one = config(&consumer, &topic, "{ kind = \"cashback\" }", &extra);
    let mut two = one.clone();
    let mut receiver = one.clone();
    one.worker.id = Some(format!("{consumer}-one"));
    two.worker.id = Some(format!("{consumer}-two"));
    receiver.worker.id = Some(format!("{consumer}-receiver"));
    receiver.consumers[0].inbox.processors = 0;
    let db = pg().await;
    let payments: Vec<Payment> = (0..2_000)
        .map(|i| Payment::new(&format!("u{}", i % 50), 1_000 + i))
        .collect();
    let p = producer();
    // A receiver-only worker stores a first slice; a "processor" claims part of it and dies
    // holding the claim (its connection closes without a commit); then two workers with two
    // processors each start.
    let mut w0 = start(receiver).await;
    // A receive-only worker runs until it is stopped, like any other.
    assert!(
        tokio::time::timeout(Duration::from_secs(1), w0.failed())
            .await
            .is_err(),
        "the receive-only worker ended on its own"
    );
    send_payments(&p, &topic, None, &payments[..200]).await;
    eventually(10, "200 rows stored", || async {
        let (pending, prog, done, _) = statuses(&db, &consumer).await;
        pending + prog + done == 200
    })
    .await;
    let dead = pg().await;
    let held = if claim == "lease" {
        // Lease claims commit at once: the rows stay IN_PROGRESS until the lease expires.
        let pool = pool(1);
        let conn = pool.get().await.unwrap();
        let token = uuid::Uuid::new_v4();
        inbox::claim_leased(&conn, &consumer, 20, inbox::Slice::ALL, 2_000, token)
            .await
            .unwrap()
            .len()
    } else {
        dead.batch_execute("BEGIN").await.unwrap();
        dead.query(
            "SELECT 1 FROM inbox WHERE consumer = $1 AND status = 'PENDING'
             ORDER BY seq LIMIT 20 FOR UPDATE SKIP LOCKED",
            &[&consumer],
        )
        .await
        .unwrap()
        .len()
    };
    drop(dead);
    let w1 = start(one).await;
    let w2 = start(two).await;
    send_payments(&p, &topic, None, &payments[200..]).await;
    eventually(60, "2,000 credits", || async {
        ledger(&db, &consumer).await.credits == 2_000
    })
    .await;
    assert!(held > 0, "the dead processor held rows");
    assert!(doubly_credited(&db, &consumer).await.is_empty());
    let expected: i64 = payments
        .iter()
        .map(|p| effectively::handler::cashback::cashback_paise(p.amount_paise, 200))
        .sum();
    assert_eq!(ledger(&db, &consumer).await.cashback_paise, expected);
    eventually(10, "every row DONE", || async {
        statuses(&db, &consumer).await == (0, 0, 2_000, 0)
    })
    .await;
    let effects = w1.stats(&consumer).unwrap().snapshot().effects
        + w2.stats(&consumer).unwrap().snapshot().effects;
    assert_eq!(effects, 2_000, "each row applied by exactly one processor");
    assert_eq!(
        w0.stats(&consumer).unwrap().snapshot().effects,
        0,
        "receive only"
    );
    w0.stop().await.unwrap();
    w1.stop().await.unwrap();
    w2.stop().await.unwrap();
}

#[tokio::test]
async fn four_processors_in_two_workers_apply_once_with_row_locks() {
    many_processors_apply_once("lock").await;
}

#[tokio::test]
async fn four_processors_in_two_workers_apply_once_with_leases() {
    many_processors_apply_once("lease").await;
}

#[tokio::test]
async fn done_rows_deleted_still_dedupe_redeliveries() {
    let (topic, consumer) = (unique("inbox-delete"), unique("inbox-delete"));
    create_topic(&topic, 1).await;
    let extra = format!("{INBOX}[consumer.inbox]\ndone = \"delete\"\n");
    let sql = "{ kind = \"sql\", statement = \"INSERT INTO inbox_test_log (consumer, key, n) \
               SELECT $1, message_id::text, 1 FROM fresh_messages ORDER BY message_id\" }";
    let db = pg().await;
    create_once(
        &db,
        "CREATE TABLE IF NOT EXISTS inbox_test_log (
             id bigserial PRIMARY KEY, consumer text NOT NULL, key text NOT NULL, n int NOT NULL)",
    )
    .await;
    let worker = start(config(&consumer, &topic, sql, &extra)).await;
    let payments: Vec<Payment> = (0..30).map(|i| Payment::new("u1", 100 + i)).collect();
    let p = producer();
    send_payments(&p, &topic, Some(0), &payments).await;
    let applied = || async {
        db.query_one(
            "SELECT count(*) FROM inbox_test_log WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    eventually(10, "30 applied and deleted", || async {
        applied().await == 30 && statuses(&db, &consumer).await == (0, 0, 0, 0)
    })
    .await;
    // Every copy again (a redrive): the dedupe ledger still knows them.
    send_payments(&p, &topic, Some(0), &payments).await;
    eventually(10, "the copies received", || async {
        stored_offset(&db, &consumer, &topic, 0).await == Some(60)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(applied().await, 30);
    assert_eq!(statuses(&db, &consumer).await, (0, 0, 0, 0));
    assert_eq!(ledger(&db, &consumer).await.dedupe_keys, 30);
    worker.stop().await.unwrap();
}

/// A few keys holding most of the backlog (3,000 rows of key A, its head in a long backoff) in
/// front of other keys: the claim still finds the other keys' heads, past the rows it reads by
/// arrival order, and a second processor finds nothing while the first holds them.
#[tokio::test]
async fn a_hot_key_in_front_does_not_hide_the_other_keys() {
    let consumer = unique("inbox-hot");
    let db = pg().await;
    let today = chrono::Utc::now().date_naive();
    effectively::store::partitions::Known::default()
        .ensure(&db, [today])
        .await
        .unwrap();
    db.execute(
        "INSERT INTO inbox (consumer, message_id, event_date, seq, ordering_key, topic, partition,
                            \"offset\", payload, next_attempt_at)
         SELECT $1, gen_random_uuid(), $2, nextval('inbox_seq'),
                CASE WHEN g <= 3000 THEN 'k:A' ELSE 'k:B' || g END, 't', 0, g, '\\x7b7d',
                CASE WHEN g = 1 THEN now() + interval '1 hour' ELSE now() END
         FROM generate_series(1, 3010) g",
        &[&consumer, &today],
    )
    .await
    .unwrap();
    let pool = pool(2);
    let mut first = pool.get().await.unwrap();
    let mut second = pool.get().await.unwrap();
    let tx = first.transaction().await.unwrap();
    let got = inbox::claim_locked(&tx, &consumer, 100, inbox::Slice::ALL)
        .await
        .unwrap();
    let keys: Vec<&str> = got.iter().map(|c| c.ordering_key.as_str()).collect();
    let expected: Vec<String> = (3001..=3010).map(|g| format!("k:B{g}")).collect();
    assert_eq!(
        keys, expected,
        "A's head waits; every other key's head is claimed"
    );
    let tx2 = second.transaction().await.unwrap();
    assert!(inbox::claim_locked(&tx2, &consumer, 100, inbox::Slice::ALL)
        .await
        .unwrap()
        .is_empty());
    tx2.rollback().await.unwrap();
    tx.rollback().await.unwrap();
    // Leases: the same heads, and A's head once its backoff is over.
    db.execute(
        "UPDATE inbox SET next_attempt_at = now() WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap();
    let leased = inbox::claim_leased(
        &first,
        &consumer,
        100,
        inbox::Slice::ALL,
        60_000,
        uuid::Uuid::new_v4(),
    )
    .await
    .unwrap();
    assert_eq!(leased.len(), 11);
    assert_eq!(leased[0].ordering_key, "k:A");
    assert_eq!(leased[0].offset, 1, "A's oldest row, not a later one");
    let again = inbox::claim_leased(
        &second,
        &consumer,
        100,
        inbox::Slice::ALL,
        60_000,
        uuid::Uuid::new_v4(),
    )
    .await
    .unwrap();
    assert!(again.is_empty(), "every head is leased");
    db.execute("DELETE FROM inbox WHERE consumer = $1", &[&consumer])
        .await
        .unwrap();
}
