//! What the engine does with each kind of database error a user's SQL handler meets, against the
//! real Kafka and PostgreSQL, under the `batch`, `per-message` and `inbox` strategies
//! (docs/DESIGN.md, "Which database errors are retried"):
//!
//! - an upsert that meets two messages of one key in one statement (SQLSTATE 21000) is split
//!   until the halves apply: every message applied once, the sums right, nothing parked;
//! - a trigger's `RAISE EXCEPTION` (P0001) parks its message at once, with the SQLSTATE and the
//!   message in the reason, and the partition moves on;
//! - a SQLSTATE of unknown meaning (U0001) is retried up to `retry.max_attempts`, then parked:
//!   never retried for ever;
//! - a lost connection is still retried for as long as it takes, past the retry budget.
//!
//! Each test has its own topic, consumer and tables (random suffixes), so they run in parallel.

mod common;

use std::time::Duration;

use common::*;

/// Three attempts, small backoffs so retries cost milliseconds.
const RETRY: &str =
    r#"retry = { max_attempts = 3, initial_backoff = "10ms", max_backoff = "50ms" }"#;

/// The consumer's `extra` config for `strategy` (`batch-grouped`: the batch strategy with
/// commit groups). The inbox gets one processor, so a round claims every stored row and the
/// rows of one key meet in one handler call.
fn extra(strategy: &str) -> String {
    let mut text = match strategy {
        "batch-grouped" => {
            format!("strategy = \"batch\"\n{RETRY}\nbatch = {{ group_partitions = true }}\n")
        }
        _ => format!("strategy = \"{strategy}\"\n{RETRY}\n"),
    };
    if strategy == "inbox" {
        text.push_str("[consumer.inbox]\nprocessors = 1\nclaim_batch = 100\n");
    }
    text
}

/// A new table name (letters, digits and `_`).
fn table(prefix: &str) -> String {
    unique(prefix).replace('-', "_")
}

/// Counts of one consumer's inbox rows: (PENDING or IN_PROGRESS, DONE, FAILED).
async fn inbox_statuses(db: &tokio_postgres::Client, consumer: &str) -> (i64, i64, i64) {
    let r = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status IN ('PENDING', 'IN_PROGRESS')),
                    count(*) FILTER (WHERE status = 'DONE'),
                    count(*) FILTER (WHERE status = 'FAILED')
             FROM inbox WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// Waits until every one of `n` records is done with: for the inbox, no row left to process;
/// for the others, the stored offset past the last.
async fn wait_settled(
    db: &tokio_postgres::Client,
    strategy: &str,
    consumer: &str,
    topic: &str,
    n: i64,
) {
    eventually(90, "every record done with", || async {
        if strategy == "inbox" {
            let (open, done, failed) = inbox_statuses(db, consumer).await;
            open == 0 && done + failed == n
        } else {
            stored_offset(db, consumer, topic, 0).await == Some(n)
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// 21000: one upsert meets two messages of one key.
// ---------------------------------------------------------------------------------------------

/// The upsert a new user writes first: one row per user, the amounts summed. Two payments of
/// one user in one statement fail with 21000.
fn naive_upsert(t: &str) -> String {
    format!(
        "INSERT INTO {t} (user_id, total, n) \
         SELECT payload->>'user_id', (payload->>'amount_paise')::bigint, 1 \
         FROM fresh_messages ORDER BY seq \
         ON CONFLICT (user_id) DO UPDATE SET total = {t}.total + EXCLUDED.total, n = {t}.n + EXCLUDED.n"
    )
}

/// The same effect written as docs/CONFIGURATION.md shows: aggregated per key in the SELECT.
fn aggregated_upsert(t: &str) -> String {
    format!(
        "INSERT INTO {t} (user_id, total, n) \
         SELECT payload->>'user_id', sum((payload->>'amount_paise')::bigint), count(*) \
         FROM fresh_messages GROUP BY 1 ORDER BY 1 \
         ON CONFLICT (user_id) DO UPDATE SET total = {t}.total + EXCLUDED.total, n = {t}.n + EXCLUDED.n"
    )
}

async fn create_totals(db: &tokio_postgres::Client, t: &str) {
    db.batch_execute(&format!(
        "CREATE TABLE {t} (user_id text PRIMARY KEY, total bigint NOT NULL, n int NOT NULL)"
    ))
    .await
    .unwrap();
}

/// `(user_id, total, n)` of every row, by user.
async fn totals(db: &tokio_postgres::Client, t: &str) -> Vec<(String, i64, i32)> {
    db.query(
        &format!("SELECT user_id, total, n FROM {t} ORDER BY user_id"),
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// What `totals` must read after `payments` applied once each.
fn want_totals(payments: &[Payment]) -> Vec<(String, i64, i32)> {
    let mut by_user = std::collections::BTreeMap::<String, (i64, i32)>::new();
    for p in payments {
        let e = by_user.entry(p.user_id.clone()).or_default();
        e.0 += p.amount_paise;
        e.1 += 1;
    }
    by_user.into_iter().map(|(u, (t, n))| (u, t, n)).collect()
}

/// 40 payments of 5 users (8 each), produced before the worker starts so they meet in one batch.
fn payments_of_five_users() -> Vec<Payment> {
    let users: Vec<String> = (0..5).map(|_| unique("u")).collect();
    (0..40)
        .map(|i| Payment::new(&users[i % 5], 1_000 + i as i64 * 10))
        .collect()
}

async fn a_key_met_twice_is_split_until_it_applies(strategy: &str) {
    let topic = unique("sqlstate-21000");
    let consumer = unique("totals");
    let t = table("totals");
    create_topic(&topic, 1).await;
    let db = pg().await;
    create_totals(&db, &t).await;

    // The scenario is real: the statement itself fails with 21000 on two rows of one key.
    let doubled = naive_upsert(&t).replace(
        "fresh_messages",
        "(VALUES (1, '{\"user_id\": \"x\", \"amount_paise\": 1}'::jsonb),
                 (2, '{\"user_id\": \"x\", \"amount_paise\": 2}'::jsonb)) AS v(seq, payload)",
    );
    let err = db.execute(&doubled, &[]).await.unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("21000"), "{err}");

    let payments = payments_of_five_users();
    send_payments(&producer(), &topic, Some(0), &payments).await;
    let handler = format!(r#"{{ kind = "sql", statement = "{}" }}"#, naive_upsert(&t));
    let worker = start(config(&consumer, &topic, &handler, &extra(strategy))).await;
    let stats = worker.stats(&consumer).unwrap();
    wait_settled(&db, strategy, &consumer, &topic, 40).await;

    // Every payment applied exactly once: each user's sum and count are the payments'.
    assert_eq!(totals(&db, &t).await, want_totals(&payments));
    assert!(
        dead_letters(&db, &consumer).await.is_empty(),
        "nothing parked"
    );
    let ids: Vec<uuid::Uuid> = payments.iter().map(|p| p.event_id).collect();
    match strategy {
        "inbox" => assert_eq!(inbox_statuses(&db, &consumer).await, (0, 40, 0)),
        _ => {
            assert_eq!(processed_among(&db, &consumer, &ids).await, 40);
            wait_records(&stats, 40, 30).await;
            let s = stats.snapshot();
            assert_eq!((s.records, s.effects, s.parked), (40, 40, 0), "{s:?}");
            if strategy.starts_with("batch") {
                // The batch failed with 21000 and was split: more than one commit.
                assert!(s.retries >= 1 && s.commits > 1, "{s:?}");
            }
        }
    }
    worker.stop().await.unwrap();
    db.batch_execute(&format!("DROP TABLE {t}")).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_a_key_met_twice_is_split_until_it_applies() {
    a_key_met_twice_is_split_until_it_applies("batch").await;
}

/// A commit group that fails sends each batch back to be committed on its own, split as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_a_key_met_twice_is_split_until_it_applies() {
    a_key_met_twice_is_split_until_it_applies("batch-grouped").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_a_key_met_twice_applies_once_each() {
    a_key_met_twice_is_split_until_it_applies("per-message").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_a_key_met_twice_is_applied_one_by_one() {
    a_key_met_twice_is_split_until_it_applies("inbox").await;
}

// ---------------------------------------------------------------------------------------------
// P0001 and an unknown SQLSTATE, raised by the user's trigger.
// ---------------------------------------------------------------------------------------------

/// Amounts the trigger refuses: P0001 (a business rule), and a user's own SQLSTATE U0001.
const RULE: i64 = 666;
const UNKNOWN: i64 = 777;

/// A table of payments whose trigger raises P0001 for [`RULE`] and U0001 for [`UNKNOWN`].
async fn create_guarded(db: &tokio_postgres::Client, t: &str) {
    db.batch_execute(&format!(
        "CREATE TABLE {t} (event_id uuid PRIMARY KEY, user_id text NOT NULL, amount bigint NOT NULL);
         CREATE FUNCTION {t}_rule() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
           IF NEW.amount = {RULE} THEN
             RAISE EXCEPTION 'amount % breaks the ledger rule', NEW.amount;
           END IF;
           IF NEW.amount = {UNKNOWN} THEN
             RAISE EXCEPTION 'amount % meets a state nobody classified', NEW.amount
               USING ERRCODE = 'U0001';
           END IF;
           RETURN NEW;
         END $$;
         CREATE TRIGGER rule BEFORE INSERT ON {t} FOR EACH ROW EXECUTE FUNCTION {t}_rule();"
    ))
    .await
    .unwrap();
}

async fn a_trigger_error_parks_its_message(strategy: &str) {
    let topic = unique("sqlstate-p0001");
    let consumer = unique("guarded");
    let t = table("guarded");
    create_topic(&topic, 1).await;
    let db = pg().await;
    create_guarded(&db, &t).await;

    let user = unique("u");
    let refused = [7usize, 19];
    let unknown = 12usize;
    let payments: Vec<Payment> = (0..30)
        .map(|i| {
            let amount = match i {
                i if refused.contains(&i) => RULE,
                i if i == unknown => UNKNOWN,
                i => 10_000 + i as i64,
            };
            Payment::new(&user, amount)
        })
        .collect();
    send_payments(&producer(), &topic, Some(0), &payments).await;
    let handler = format!(
        r#"{{ kind = "sql", statement = "INSERT INTO {t} SELECT message_id, payload->>'user_id', (payload->>'amount_paise')::bigint FROM fresh_messages ORDER BY message_id" }}"#
    );
    let worker = start(config(&consumer, &topic, &handler, &extra(strategy))).await;
    wait_settled(&db, strategy, &consumer, &topic, 30).await;

    // Every other payment applied once, with its amount.
    let rows: Vec<(uuid::Uuid, i64)> = db
        .query(
            &format!("SELECT event_id, amount FROM {t} ORDER BY event_id"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let is_bad = |i: usize| refused.contains(&i) || i == unknown;
    let mut want: Vec<(uuid::Uuid, i64)> = (payments.iter().enumerate())
        .filter(|(i, _)| !is_bad(*i))
        .map(|(_, p)| (p.event_id, p.amount_paise))
        .collect();
    want.sort();
    assert_eq!(rows, want);

    // The three are parked with the SQLSTATE and the server's message: P0001 at its first
    // attempt, U0001 after the retry budget (3 attempts).
    let expect = |i: usize| -> (&str, &str, i32) {
        if i == unknown {
            (
                "SQLSTATE U0001: amount 777 meets a state nobody classified",
                "retries_exhausted",
                3,
            )
        } else {
            (
                "SQLSTATE P0001: amount 666 breaks the ledger rule",
                "handler_rejected",
                1,
            )
        }
    };
    let bad: Vec<usize> = (0..30).filter(|&i| is_bad(i)).collect();
    if strategy == "inbox" {
        // The inbox parks as FAILED (replayable after a fix), never in dead_letters.
        assert_eq!(inbox_statuses(&db, &consumer).await, (0, 27, 3));
        assert!(dead_letters(&db, &consumer).await.is_empty());
        for &i in &bad {
            let r = db
                .query_one(
                    "SELECT status, attempts, last_error FROM inbox
                     WHERE consumer = $1 AND message_id = $2",
                    &[&consumer, &payments[i].event_id],
                )
                .await
                .unwrap();
            let (status, attempts, error): (String, i32, String) = (r.get(0), r.get(1), r.get(2));
            let (text, _, want_attempts) = expect(i);
            assert_eq!(
                (status.as_str(), attempts),
                ("FAILED", want_attempts),
                "{error}"
            );
            assert!(error.contains(text), "{error}");
        }
    } else {
        let parked = dead_letters(&db, &consumer).await;
        let offsets: Vec<i64> = parked.iter().map(|d| d.offset).collect();
        assert_eq!(
            offsets,
            bad.iter().map(|&i| i as i64).collect::<Vec<_>>(),
            "{parked:#?}"
        );
        for d in &parked {
            let i = d.offset as usize;
            let (text, reason, attempts) = expect(i);
            assert_eq!(
                (d.reason.as_str(), d.attempts),
                (reason, attempts),
                "{}",
                d.detail
            );
            assert!(d.detail.contains(text), "{}", d.detail);
            assert_eq!(d.message_id, Some(payments[i].event_id));
            assert_eq!(d.payload.as_deref(), Some(payments[i].json().as_slice()));
        }
        let bad_ids: Vec<uuid::Uuid> = bad.iter().map(|&i| payments[i].event_id).collect();
        assert_eq!(processed_among(&db, &consumer, &bad_ids).await, 0);
        let all: Vec<uuid::Uuid> = payments.iter().map(|p| p.event_id).collect();
        assert_eq!(processed_among(&db, &consumer, &all).await, 27);
        assert_eq!(stored_offset(&db, &consumer, &topic, 0).await, Some(30));
    }

    // The partition moves on: a payment sent now is applied too.
    let later = Payment::new(&user, 50_000);
    send_payments(&producer(), &topic, Some(0), std::slice::from_ref(&later)).await;
    eventually(30, "the payment sent after them applied", || async {
        db.query_one(
            &format!("SELECT count(*) FROM {t} WHERE event_id = $1"),
            &[&later.event_id],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            == 1
    })
    .await;
    worker.stop().await.unwrap();
    db.batch_execute(&format!("DROP TABLE {t}; DROP FUNCTION {t}_rule()"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_a_trigger_error_parks_its_message() {
    a_trigger_error_parks_its_message("batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_message_a_trigger_error_parks_its_message() {
    a_trigger_error_parks_its_message("per-message").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbox_a_trigger_error_parks_its_message() {
    a_trigger_error_parks_its_message("inbox").await;
}

// ---------------------------------------------------------------------------------------------
// A lost connection is retried past the budget.
// ---------------------------------------------------------------------------------------------

/// The handler's statement waits on a lock the test holds; the test kills the backend running
/// it five times (more than `max_attempts` = 3), then lets go. Nothing is parked: a lost
/// connection is the database's trouble, not the message's. Only backends running this test's
/// statement (its table's unique name) are terminated, so parallel tests are not touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_retried_past_the_budget() {
    let topic = unique("sqlstate-lost");
    let consumer = unique("totals");
    let t = table("totals");
    create_topic(&topic, 1).await;
    let db = pg().await;
    create_totals(&db, &t).await;
    let handler = format!(
        r#"{{ kind = "sql", statement = "{}" }}"#,
        aggregated_upsert(&t)
    );
    let worker = start(config(&consumer, &topic, &handler, &extra("batch"))).await;
    let stats = worker.stats(&consumer).unwrap();

    // Inserts (and the statement's parse, which locks its table) wait for this lock until the
    // test commits. Taken once the worker has prepared its statement at start-up.
    let mut holder = pg().await;
    let lock = holder.transaction().await.unwrap();
    lock.batch_execute(&format!("LOCK TABLE {t} IN SHARE MODE"))
        .await
        .unwrap();
    let payments = payments_of_five_users();
    send_payments(&producer(), &topic, Some(0), &payments).await;
    let waiting = format!(
        "SELECT pid FROM pg_stat_activity WHERE pid <> pg_backend_pid()
           AND wait_event_type = 'Lock' AND query LIKE '%INSERT INTO {t} %'"
    );
    // A terminated backend may still show as waiting for a moment: each kill needs a new one.
    let mut killed: Vec<i32> = Vec::new();
    for kill in 1..=5 {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        let pids: Vec<i32> = loop {
            let pids: Vec<i32> = (db.query(&waiting, &[]).await.unwrap().iter())
                .map(|r| r.get(0))
                .filter(|pid| !killed.contains(pid))
                .collect();
            if !pids.is_empty() {
                break pids;
            }
            assert!(
                std::time::Instant::now() < until,
                "attempt {kill} never waited on the lock"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        for pid in pids {
            db.execute("SELECT pg_terminate_backend($1)", &[&pid])
                .await
                .unwrap();
            killed.push(pid);
        }
    }
    assert!(
        totals(&db, &t).await.is_empty(),
        "nothing applied while locked"
    );
    lock.commit().await.unwrap();
    wait_records(&stats, 40, 60).await;

    assert_eq!(totals(&db, &t).await, want_totals(&payments));
    assert!(
        dead_letters(&db, &consumer).await.is_empty(),
        "nothing parked"
    );
    let s = stats.snapshot();
    // One commit a batch: the documented statement needs no split, and the five lost attempts
    // were retried whole.
    assert_eq!((s.records, s.effects, s.parked), (40, 40, 0), "{s:?}");
    assert_eq!(s.commits, s.batches, "{s:?}");
    assert!(s.retries >= 5, "{s:?}");
    assert_eq!(stored_offset(&db, &consumer, &topic, 0).await, Some(40));
    worker.stop().await.unwrap();
    db.batch_execute(&format!("DROP TABLE {t}")).await.unwrap();
}
