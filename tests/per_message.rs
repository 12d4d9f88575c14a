//! The core guarantees under `strategy = "per-message"` (one transaction per message: key,
//! effect, offset), against the real Kafka and PostgreSQL.

mod common;

use common::poison::{start_poisoned, Poisoned};
use common::{eventually, ledger, Fault, Payment};
use std::sync::atomic::Ordering;

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

    let worker = common::start_cashback(&consumer, &topic, PER_MESSAGE).await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    common::wait_records(&stats, 4, 60).await;

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

    let (flaky, worker) = common::start_faulty(
        &consumer,
        &topic,
        Fault::TransientOnce,
        "flaky",
        &per_message_fast_retry(),
    )
    .await;
    let stats = worker.stats(&consumer).unwrap();
    let db = common::pg().await;
    common::wait_records(&stats, 10, 60).await;

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
        "pm-poison",
        Fault::TransientOnAmount(666),
        "poisoned",
        &per_message_fast_retry(),
    )
    .await;
    let poison = &payments[poison];
    common::wait_records(&stats, 20, 60).await;

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
    assert_eq!(
        (dl.topic.as_str(), dl.partition, dl.offset),
        (topic.as_str(), 0, 10)
    );
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

/// The crash scenario: `N` payments on one partition; the payment at `STUCK` belongs to a user
/// whose wallet row the test keeps locked, so the worker applies the `STUCK` payments before it
/// and then waits inside the transaction of the next one. The crash lands there, on a
/// transaction in flight, every time.
const N: usize = 200;
const STUCK: usize = 100;

struct CrashScene {
    topic: String,
    consumer: String,
    users: Vec<String>,
    payments: Vec<Payment>,
    db: tokio_postgres::Client,
    /// A connection holding `FOR UPDATE` on the stuck user's wallet, in an open transaction.
    blocker: tokio_postgres::Client,
    blocker_pid: i32,
}

impl CrashScene {
    async fn new(prefix: &str) -> CrashScene {
        let topic = common::unique(prefix);
        let consumer = common::unique("rewards");
        common::create_topic(&topic, 1).await;
        let mut users: Vec<String> = (0..5).map(|_| common::unique("u")).collect();
        let stuck_user = common::unique("stuck");
        let payments: Vec<Payment> = (0..N)
            .map(|i| {
                let user = if i == STUCK {
                    &stuck_user
                } else {
                    &users[i % users.len()]
                };
                Payment::new(user, 1_000 + i as i64 * 37)
            })
            .collect();
        users.push(stuck_user.clone());

        let db = common::pg().await;
        db.execute(
            "INSERT INTO wallets (user_id, balance_paise) VALUES ($1, 0)",
            &[&stuck_user],
        )
        .await
        .unwrap();
        let blocker = common::pg().await;
        blocker.batch_execute("BEGIN").await.unwrap();
        blocker
            .query_one(
                "SELECT user_id FROM wallets WHERE user_id = $1 FOR UPDATE",
                &[&stuck_user],
            )
            .await
            .unwrap();
        let blocker_pid: i32 = blocker
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        common::send_payments(&common::producer(), &topic, Some(0), &payments).await;
        CrashScene {
            topic,
            consumer,
            users,
            payments,
            db,
            blocker,
            blocker_pid,
        }
    }

    /// Waits until the first `STUCK` payments are credited and the next one's transaction waits
    /// on the locked wallet.
    async fn wait_until_stuck(&self) {
        eventually(60, "STUCK payments credited, the next one waiting on the lock", || {
            let scene = &self;
            async move {
                let credited = ledger(&scene.db, &scene.consumer).await.credits;
                let waiting: i64 = scene
                    .db
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                        &[&scene.blocker_pid],
                    )
                    .await
                    .unwrap()
                    .get(0);
                credited >= STUCK as i64 && waiting >= 1
            }
        })
        .await;
        let l = ledger(&self.db, &self.consumer).await;
        assert_eq!(l.credits, STUCK as i64, "the crash lands mid-stream: {l:?}");
        assert_eq!(l.dedupe_keys, STUCK as i64, "{l:?}");
    }

    async fn release(&self) {
        self.blocker.batch_execute("ROLLBACK").await.unwrap();
    }

    fn config(&self) -> effectively::config::Config {
        common::config(
            &self.consumer,
            &self.topic,
            r#"{ kind = "cashback" }"#,
            PER_MESSAGE,
        )
    }

    /// Starts a worker, waits until it has applied everything, and checks the ledger is exact
    /// and that this worker applied exactly the payments the crashed one had not committed.
    async fn restart_and_check(&self, credited_before: i64) {
        let second = common::start(self.config()).await;
        let stats = second.stats(&self.consumer).unwrap();
        eventually(90, "every payment applied after the restart", || {
            let scene = &self;
            async move { ledger(&scene.db, &scene.consumer).await.dedupe_keys >= N as i64 }
        })
        .await;
        eventually(30, "the stored offset past the last record", || {
            let scene = &self;
            async move {
                common::stored_offset(&scene.db, &scene.consumer, &scene.topic, 0).await
                    == Some(N as i64)
            }
        })
        .await;

        let l = ledger(&self.db, &self.consumer).await;
        let want: i64 = self.payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
        assert_eq!(l.credits, N as i64, "{l:?}");
        assert_eq!(l.distinct_payments, N as i64, "{l:?}");
        assert_eq!(l.cashback_paise, want, "{l:?}");
        assert_eq!(l.dedupe_keys, N as i64, "{l:?}");
        assert_eq!(l.outbox, N as i64, "{l:?}");
        assert_eq!(l.parked, 0, "{l:?}");
        assert_eq!(
            common::doubly_credited(&self.db, &self.consumer).await,
            vec![]
        );
        let distinct_events: i64 = self
            .db
            .query_one(
                "SELECT count(DISTINCT event_id) FROM cashback_credits WHERE consumer = $1",
                &[&self.consumer],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(distinct_events, N as i64);
        assert_eq!(common::wallet_total(&self.db, &self.users).await, want);
        // The crashed worker's transaction in flight rolled back, and it applied nothing after
        // the crash: the new worker applied exactly the rest, starting at the stuck payment.
        let s = stats.snapshot();
        assert_eq!(
            s.effects as i64,
            N as i64 - credited_before,
            "the restarted worker applies exactly what the crashed one had not committed: {s:?}"
        );
        assert_eq!(s.duplicates, 0, "{s:?}");
        second.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_dropped_mid_stream_and_restarted_applies_everything_exactly_once() {
    let scene = CrashScene::new("pm-crash").await;
    let first = common::start(scene.config()).await;
    scene.wait_until_stuck().await;
    // A crash: no stop, no drain, no leaving the group; the JoinSet aborts the tasks.
    drop(first);
    scene.release().await;
    scene.restart_and_check(STUCK as i64).await;
}

/// Kills its process on drop, so a failing test leaves no worker behind.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_killed_mid_stream_and_restarted_applies_everything_exactly_once() {
    let scene = CrashScene::new("pm-kill").await;
    let dir = std::env::temp_dir();
    let config_path = dir.join(format!("{}.toml", scene.consumer));
    let log_path = dir.join(format!("{}.log", scene.consumer));
    std::fs::write(
        &config_path,
        format!(
            r#"
[kafka]
brokers = "{brokers}"
session_timeout = "10s"
[kafka.options]
"heartbeat.interval.ms" = "500"
[database]
url = "{db}"
pool_size = 4
[worker]
revoke_deadline = "5s"
[[consumer]]
name = "{consumer}"
topics = ["{topic}"]
handler = {{ kind = "cashback" }}
{PER_MESSAGE}
"#,
            brokers = common::kafka_brokers(),
            db = common::database_url(),
            consumer = scene.consumer,
            topic = scene.topic,
        ),
    )
    .unwrap();
    let log = std::fs::File::create(&log_path).unwrap();
    let mut first = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_effectively"))
            .arg("run")
            .arg("--config")
            .arg(&config_path)
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start the effectively binary"),
    );
    scene.wait_until_stuck().await;
    // SIGKILL: the process is gone at once, its transaction in flight with it.
    first.0.kill().unwrap();
    first.0.wait().unwrap();
    scene.release().await;
    scene.restart_and_check(STUCK as i64).await;
    let _ = std::fs::remove_file(&config_path);
    let _ = std::fs::remove_file(&log_path);
}
