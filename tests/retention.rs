//! Retention against the real PostgreSQL (and Kafka for the guard): daily partitions are
//! created ahead and dropped past retention, a drop does not disturb a running worker, copies
//! are judged by their event date, and only one instance runs maintenance at a time.

mod common;

use std::time::Duration;

use chrono::{Days, NaiveDate};
use common::{eventually, ledger, Payment};
use effectively::store::partitions::{self, Known};
use effectively::store::retention::{self, Ran};

fn today() -> NaiveDate {
    chrono::Utc::now().date_naive()
}

async fn exists(db: &tokio_postgres::Client, date: NaiveDate) -> bool {
    partitions::sizes(db)
        .await
        .unwrap()
        .iter()
        .any(|s| s.date == date)
}

/// Runs maintenance until this instance gets the lock (other tests' workers may hold it).
/// Held for the whole of each test here: every one creates or drops old daily partitions, and a
/// maintenance run (a test's own, or a worker's at start) drops every partition past retention,
/// including the one another test has just created for its rows.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn run_maintenance(db: &tokio_postgres::Client, known: &Known) {
    for _ in 0..100 {
        if let Ran::Done { .. } = retention::run(db, known, today(), 3, 15).await.unwrap() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("never got the maintenance lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitions_are_created_ahead_and_dropped_past_retention() {
    let _serial = SERIAL.lock().await;
    let db = common::pg().await;
    let known = Known::default();
    // Dates far in the past, as a database would hold after years of running.
    let old: Vec<NaiveDate> = (1..=3)
        .map(|d| NaiveDate::from_ymd_opt(2001, 1, d).unwrap())
        .collect();
    known.ensure(&db, old.iter().copied()).await.unwrap();
    let consumer = common::unique("retention");
    db.execute(
        "INSERT INTO processed_messages (consumer, message_id, event_date) VALUES ($1, $2, $3)",
        &[&consumer, &uuid::Uuid::new_v4(), &old[0]],
    )
    .await
    .unwrap();
    // The day just inside retention + margin stays.
    let kept = today() - Days::new(15 + retention::MARGIN_DAYS);
    known.ensure(&db, [kept]).await.unwrap();

    // Any instance may be the one that drops them (other tests' workers run maintenance too):
    // what matters is that they are gone once a run has completed.
    run_maintenance(&db, &known).await;
    for d in &old {
        assert!(!exists(&db, *d).await, "{d} is gone");
    }
    assert!(
        exists(&db, kept).await,
        "{kept} (retention + margin) is kept"
    );
    for ahead in 0..=3 {
        assert!(
            exists(&db, today() + Days::new(ahead)).await,
            "today + {ahead} exists"
        );
    }
    let keys: i64 = db
        .query_one(
            "SELECT count(*) FROM processed_messages WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(keys, 0, "the keys went with their partition");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_instance_holding_the_lock_runs_maintenance() {
    let _serial = SERIAL.lock().await;
    let db = common::pg().await;
    let other = common::pg().await;
    // Another instance is running maintenance: it holds the lock.
    let mut got = false;
    for _ in 0..100 {
        got = other
            .query_one(
                "SELECT pg_try_advisory_lock($1)",
                &[&0x6566_6665_6374_0002_i64],
            )
            .await
            .unwrap()
            .get(0);
        if got {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(got, "took the maintenance lock");
    let ran = retention::run(&db, &Known::default(), today(), 3, 15)
        .await
        .unwrap();
    assert_eq!(ran, Ran::Skipped, "a second instance skips maintenance");
    other
        .execute(
            "SELECT pg_advisory_unlock($1)",
            &[&0x6566_6665_6374_0002_i64],
        )
        .await
        .unwrap();
    run_maintenance(&db, &Known::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_are_judged_by_their_event_date_at_the_window_edges() {
    let _serial = SERIAL.lock().await;
    let topic = common::unique("window");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let db = common::pg().await;
    let now = chrono::Utc::now();
    // On the last day of the 15-day window: applied once, and a copy is still a duplicate.
    let mut last_day = Payment::new(&user, 10_000);
    last_day.occurred_at = now - chrono::Duration::days(15);
    // One day older: refused, its key may be gone.
    let mut too_old = Payment::new(&user, 20_000);
    too_old.occurred_at = now - chrono::Duration::days(16);
    let producer = common::producer();
    common::send_payments(
        &producer,
        &topic,
        Some(0),
        &[last_day.clone(), too_old.clone(), last_day.clone()],
    )
    .await;

    let worker = common::start_cashback(&consumer, &topic, "").await;
    let stats = worker.stats(&consumer).unwrap();
    common::wait_records(&stats, 3, 60).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(
        (l.credits, l.cashback_paise, l.parked),
        (1, 200, 1),
        "{l:?}"
    );
    assert_eq!(stats.snapshot().duplicates, 1);
    let reason: String = db
        .query_one(
            "SELECT reason FROM dead_letters WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(reason, "older_than_retention");
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_partition_does_not_disturb_a_running_worker() {
    let _serial = SERIAL.lock().await;
    let topic = common::unique("dropwhile");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 3).await;
    let users: Vec<String> = (0..20)
        .map(|i| format!("{}-{i}", common::unique("u")))
        .collect();
    let payments: Vec<Payment> = (0..3_000)
        .map(|i| Payment::new(&users[i % 20], 1_000 + i as i64))
        .collect();
    let mut db = common::pg().await;
    let worker = common::start_cashback(&consumer, &topic, "").await;
    let producer = common::producer();
    let send = {
        let (topic, payments) = (topic.clone(), payments.clone());
        tokio::spawn(async move { common::send_payments(&producer, &topic, None, &payments).await })
    };
    // While traffic flows: old partitions with keys in them appear and are dropped, again and again.
    let known = Known::default();
    for round in 0..5u32 {
        let date = NaiveDate::from_ymd_opt(2002, 1, 1 + round).unwrap();
        // One transaction: the worker's own maintenance (at its start) drops every old
        // partition it sees, and must not see this one between its creation and its rows.
        let tx = db.transaction().await.unwrap();
        known.ensure(&tx, [date]).await.unwrap();
        tx.execute(
            "INSERT INTO processed_messages (consumer, message_id, event_date)
             SELECT $1, gen_random_uuid(), $2 FROM generate_series(1, 20000)",
            &[&consumer, &date],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
        run_maintenance(&db, &known).await;
        assert!(
            !exists(&db, date).await,
            "{date} dropped while the worker runs"
        );
    }
    send.await.unwrap();
    eventually(90, "3000 credits", || {
        let db = &db;
        let consumer = consumer.clone();
        async move { ledger(db, &consumer).await.credits >= 3_000 }
    })
    .await;
    let l = ledger(&db, &consumer).await;
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(
        (l.credits, l.cashback_paise, l.parked),
        (3_000, expected, 0),
        "{l:?}"
    );
    worker.stop().await.unwrap();
}

/// An inbox row that is not DONE is work (PENDING, IN_PROGRESS) or a parked message (FAILED):
/// retention keeps its day, dedupe partition and all, until the row is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_whose_inbox_still_has_open_rows_is_kept() {
    let _serial = SERIAL.lock().await;
    let db = common::pg().await;
    let known = Known::default();
    let old = NaiveDate::from_ymd_opt(2002, 3, 4).unwrap();
    known.ensure(&db, [old]).await.unwrap();
    let consumer = common::unique("retention-inbox");
    let id = uuid::Uuid::new_v4();
    db.execute(
        "INSERT INTO inbox (consumer, message_id, event_date, seq, ordering_key, status, topic,
                            partition, \"offset\", payload)
         VALUES ($1, $2, $3, nextval('inbox_seq'), 'k:x', 'FAILED', 't', 0, 0, '\\x7b7d')",
        &[&consumer, &id, &old],
    )
    .await
    .unwrap();
    assert_eq!(retention::open_inbox_rows(&db, old).await.unwrap(), 1);
    run_maintenance(&db, &known).await;
    assert!(exists(&db, old).await, "kept while its inbox row is FAILED");
    db.execute(
        "UPDATE inbox SET status = 'DONE' WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap();
    run_maintenance(&db, &known).await;
    assert!(!exists(&db, old).await, "dropped once the row is done");
    let inbox_left: Option<String> = db
        .query_one(
            "SELECT to_regclass($1)::text",
            &[&partitions::inbox_name_for(old)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox_left, None, "the inbox partition went with it");
}
