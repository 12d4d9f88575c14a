//! Two consumers on two databases (`[database.NAME]`), against the real Kafka and two real
//! PostgreSQL servers: the stack's, and its second one (`scripts/stack.sh pg2-up`, a cluster of
//! its own on another port, which this test starts if it is not running). One worker holds
//! both consumers: `a` on `[database]`, `b` on `[database.second]`.
//!
//! Each applies its topic's payments (with resends of the same events) exactly once, into its
//! own database only. Then the second server crashes (`pg2-crash`, an immediate stop) while both
//! topics get more payments: `a` applies all of its own meanwhile, untouched, and the worker
//! says which database is down (`/readyz`); `b` waits, parks nothing, and applies what waited
//! once the server is back (`pg2-up`). The ledgers are compared with what was sent: nothing lost
//! or doubled in either. Last, the same consumers with their databases swapped are refused at
//! start: their offsets are in the other database.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{ledger, wallet_total, Ledger, Payment};
use effectively::config::Config;
use effectively::handler::Registry;
use effectively::worker::{Worker, WorkerError};

/// Runs `scripts/stack.sh action` (on the caller's `STACK_DIR`) and returns what it printed.
fn stack(action: &str) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/stack.sh");
    let out = Command::new(script)
        .arg(action)
        .output()
        .expect("scripts/stack.sh runs");
    assert!(
        out.status.success(),
        "scripts/stack.sh {action} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The second server's URL, starting it if need be (`pg2-up` is idempotent and prints it).
fn second_url() -> String {
    let printed = stack("pg2-up");
    (printed.lines())
        .find_map(|l| l.strip_prefix("export DATABASE_URL_2="))
        .unwrap_or_else(|| panic!("pg2-up printed no DATABASE_URL_2: {printed}"))
        .to_string()
}

fn config(a: (&str, &str, &str), b: (&str, &str, &str), second: &str) -> Config {
    let consumer = |(name, topic, database): (&str, &str, &str)| {
        format!(
            "[[consumer]]\nname = \"{name}\"\ntopics = [\"{topic}\"]\n\
             handler = {{ kind = \"cashback\" }}\ndatabase = \"{database}\"\n\
             retry = {{ max_backoff = \"1s\" }}\n"
        )
    };
    let text = format!(
        "[kafka]\nbrokers = \"{}\"\nsession_timeout = \"10s\"\n\
         [kafka.options]\n\"heartbeat.interval.ms\" = \"500\"\n\
         [database]\nurl = \"{}\"\npool_size = 4\n\
         [database.second]\nurl = \"{second}\"\npool_size = 4\ntransaction_deadline = \"5s\"\n\
         connect_timeout = \"2s\"\n\
         [worker]\nrevoke_deadline = \"5s\"\n{}{}",
        common::kafka_brokers(),
        common::database_url(),
        consumer(a),
        consumer(b),
    );
    Config::from_toml_str(&text).expect("test config")
}

/// `n` payments of `user`, and a resend (the same event) of every fifth.
fn payments(user: &str, n: i64, from: i64) -> (Vec<Payment>, Vec<Payment>) {
    let ps: Vec<Payment> = (0..n)
        .map(|i| Payment::new(user, 1_000 + from + i))
        .collect();
    let mut sent = ps.clone();
    sent.extend(ps.iter().step_by(5).cloned());
    (ps, sent)
}

fn cashback(ps: &[Payment]) -> i64 {
    ps.iter().map(|p| p.amount_paise * 200 / 10_000).sum()
}

/// What the ledger must hold for `ps`: one credit and one key per payment, nothing parked.
fn expected(ps: &[Payment]) -> Ledger {
    let n = ps.len() as i64;
    Ledger {
        credits: n,
        distinct_payments: n,
        cashback_paise: cashback(ps),
        dedupe_keys: n,
        parked: 0,
        outbox: n,
    }
}

async fn offsets_rows(db: &tokio_postgres::Client, consumer: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM consumer_offsets WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_on_two_databases_each_exactly_once_and_one_crash_leaves_the_other_alone() {
    let second = second_url();
    let mut db2 = effectively::store::pool::connect(&second)
        .await
        .expect("the second PostgreSQL answers");
    effectively::store::migrate::run(&mut db2)
        .await
        .expect("migrate the second database");
    let db1 = common::pg().await;
    let (ta, tb) = (common::unique("dbs-a"), common::unique("dbs-b"));
    let (ca, cb) = (common::unique("dbs-a"), common::unique("dbs-b"));
    common::create_topic(&ta, 3).await;
    common::create_topic(&tb, 3).await;
    let (ua, ub) = (common::unique("ua"), common::unique("ub"));
    let cfg = config((&ca, &ta, "default"), (&cb, &tb, "second"), &second);
    let worker = common::start_with(cfg, Registry::new()).await;
    let producer = common::producer();

    // Each consumer applies its own topic once, into its own database.
    let (pa1, sent) = payments(&ua, 60, 0);
    common::send_payments(&producer, &ta, None, &sent).await;
    let (pb1, sent) = payments(&ub, 60, 0);
    common::send_payments(&producer, &tb, None, &sent).await;
    common::eventually(60, "both ledgers hold the first payments", || async {
        ledger(&db1, &ca).await.credits == 60 && ledger(&db2, &cb).await.credits == 60
    })
    .await;
    assert_eq!(ledger(&db1, &ca).await, expected(&pa1));
    assert_eq!(ledger(&db2, &cb).await, expected(&pb1));
    // Nothing of either consumer in the other's database: not a key, not an offset.
    let empty = expected(&[]);
    assert_eq!(
        ledger(&db2, &ca).await,
        empty,
        "a's rows are in [database] only"
    );
    assert_eq!(
        ledger(&db1, &cb).await,
        empty,
        "b's rows are in [database.second] only"
    );
    assert_eq!(offsets_rows(&db2, &ca).await, 0);
    assert_eq!(offsets_rows(&db1, &cb).await, 0);
    assert_eq!(offsets_rows(&db1, &ca).await, 3);
    assert_eq!(offsets_rows(&db2, &cb).await, 3);
    drop(db2);

    // The second server crashes; both topics go on receiving payments.
    stack("pg2-crash");
    let crashed = Instant::now();
    let (pa2, sent) = payments(&ua, 60, 100);
    common::send_payments(&producer, &ta, None, &sent).await;
    let (pb2, sent) = payments(&ub, 60, 100);
    common::send_payments(&producer, &tb, None, &sent).await;
    let all_a: Vec<Payment> = pa1.iter().chain(&pa2).cloned().collect();
    common::eventually(
        30,
        "a applies its payments while the second server is down",
        || {
            let db1 = &db1;
            let ca = &ca;
            async move { ledger(db1, ca).await.credits == 120 }
        },
    )
    .await;
    let a_done = crashed.elapsed();
    assert!(
        effectively::store::pool::connect(&second).await.is_err(),
        "the second server was still down while a applied its payments"
    );
    assert_eq!(ledger(&db1, &ca).await, expected(&all_a));
    // The worker says which database is down (within the probe's 2 s period and settle).
    let health = worker.health();
    common::eventually(20, "readiness names the database that is down", || {
        let health = std::sync::Arc::clone(&health);
        async move {
            let r = health.readiness();
            !r.ok && r.text.contains("database second: unavailable")
        }
    })
    .await;
    assert!(
        !health.readiness().text.contains("database: "),
        "the default database is fine: {}",
        health.readiness().text
    );
    assert!(
        health.liveness().ok,
        "an outage is no reason to restart: {}",
        health.liveness().text
    );

    // The server comes back: b applies what waited, once.
    stack("pg2-up");
    let db2 = effectively::store::pool::connect(&second)
        .await
        .expect("the second server is back");
    let all_b: Vec<Payment> = pb1.iter().chain(&pb2).cloned().collect();
    common::eventually(60, "b applies what waited once its server is back", || {
        let (db2, cb) = (&db2, &cb);
        async move { ledger(db2, cb).await.credits == 120 }
    })
    .await;
    // Let a late duplicate show itself, if there were one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        ledger(&db1, &ca).await,
        expected(&all_a),
        "a: nothing lost or doubled"
    );
    assert_eq!(
        ledger(&db2, &cb).await,
        expected(&all_b),
        "b: nothing lost or doubled"
    );
    assert_eq!(
        wallet_total(&db1, std::slice::from_ref(&ua)).await,
        cashback(&all_a)
    );
    assert_eq!(
        wallet_total(&db2, std::slice::from_ref(&ub)).await,
        cashback(&all_b)
    );
    assert_eq!(ledger(&db2, &ca).await, empty);
    assert_eq!(ledger(&db1, &cb).await, empty);
    eprintln!(
        "a applied its 60 new payments {:.1} s after the second server crashed",
        a_done.as_secs_f64()
    );
    worker.stop().await.expect("the worker stops cleanly");

    // The same consumers with their databases swapped: each would start again from nothing
    // where it has no offsets. Refused, naming where its offsets are.
    let swapped = config((&ca, &ta, "second"), (&cb, &tb, "default"), &second);
    match Worker::start(swapped, Registry::new()).await {
        Err(WorkerError::Moved {
            consumer,
            found,
            configured,
        }) => {
            assert!(consumer == ca || consumer == cb, "{consumer}");
            assert_ne!(found, configured);
        }
        Err(e) => panic!("expected WorkerError::Moved, got {e}"),
        Ok(_) => panic!("a consumer moved to another database must not start"),
    }

    // `a` alone, moved off [database] to `second`: this worker has no pool on [database], and
    // looks there all the same.
    let alone = |database: &str, url: &str| {
        let text = format!(
            "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n\
             [database.{database}]\nurl = \"{url}\"\n\
             [[consumer]]\nname = \"{ca}\"\ntopics = [\"{ta}\"]\n\
             handler = {{ kind = \"cashback\" }}\ndatabase = \"{database}\"\n",
            common::kafka_brokers(),
            common::database_url(),
        );
        Config::from_toml_str(&text).expect("test config")
    };
    match Worker::start(alone("second", &second), Registry::new()).await {
        Err(WorkerError::Moved { found, .. }) => assert_eq!(found, "default"),
        Err(e) => panic!("expected WorkerError::Moved, got {e}"),
        Ok(_) => panic!("a consumer moved off [database] must not start"),
    }
    // [database] again under another name and another spelling of its host: one database, so
    // `a` starts where its offsets are.
    let alias = common::database_url().replacen("127.0.0.1", "localhost", 1);
    assert_ne!(
        alias,
        common::database_url(),
        "the stack's URL names 127.0.0.1"
    );
    let worker = Worker::start(alone("alias", &alias), Registry::new())
        .await
        .expect("one database under two names is where `a` ran");
    worker.stop().await.expect("the worker stops cleanly");
}
