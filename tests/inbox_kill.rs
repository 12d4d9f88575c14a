//! Inbox processors in real worker processes: two `effectively run` processes with two
//! processors each work one inbox; one is killed with SIGKILL while its processors hold claims.
//! With row locks its rows are free as soon as PostgreSQL ends its transaction; with leases they
//! stay IN_PROGRESS until the lease runs out and are then reclaimed. Either way every message is
//! applied exactly once.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

fn spawn_worker(config_path: &std::path::Path, log: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_effectively"))
        .args(["run", "--metrics-addr", "off", "--config"])
        .arg(config_path)
        .env("KAFKA_BROKERS", kafka_brokers())
        .env("DATABASE_URL", database_url())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn effectively run")
}

/// Rows of `consumer`'s inbox held by a processor right now: IN_PROGRESS (leases), or PENDING
/// rows locked by a transaction (what SKIP LOCKED skips, seen from a probe that takes and
/// gives back the rest).
async fn held(db: &tokio_postgres::Client, consumer: &str) -> i64 {
    let in_progress: i64 = db
        .query_one(
            "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = 'IN_PROGRESS'",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    db.batch_execute("BEGIN").await.unwrap();
    let pending: i64 = db
        .query_one(
            "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = 'PENDING'",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    let free = db
        .query(
            "SELECT 1 FROM inbox WHERE consumer = $1 AND status = 'PENDING'
             FOR UPDATE SKIP LOCKED",
            &[&consumer],
        )
        .await
        .unwrap()
        .len() as i64;
    db.batch_execute("ROLLBACK").await.unwrap();
    in_progress + pending - free
}

async fn applied(db: &tokio_postgres::Client, consumer: &str) -> (i64, i64) {
    let r = db
        .query_one(
            "SELECT count(*), count(DISTINCT message_id) FROM inbox_kill_log WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

async fn a_killed_processor_loses_nothing_and_applies_nothing_twice(claim: &str) {
    const N: usize = 400;
    let (topic, consumer) = (unique("inbox-kill"), unique("inbox-kill"));
    create_topic(&topic, 2).await;
    let db = pg().await;
    // No unique key here on purpose: a row applied twice shows as two log rows.
    create_once(
        &db,
        "CREATE TABLE IF NOT EXISTS inbox_kill_log (
             id bigserial PRIMARY KEY, consumer text NOT NULL, message_id uuid NOT NULL)",
    )
    .await;
    let dir = std::env::temp_dir().join(&consumer);
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("effectively.toml");
    // A handler that takes a second per round, so a processor is nearly always mid-claim.
    std::fs::write(
        &config_path,
        format!(
            r#"
[kafka]
session_timeout = "6s"
[kafka.options]
"heartbeat.interval.ms" = "500"
[worker]
revoke_deadline = "3s"
[[consumer]]
name = "{consumer}"
topics = ["{topic}"]
strategy = "inbox"
handler = {{ kind = "sql", statement = """
  INSERT INTO inbox_kill_log (consumer, message_id)
  SELECT $1, f.message_id FROM fresh_messages f, (SELECT pg_sleep(1)) s
  ORDER BY f.message_id""" }}
[consumer.inbox]
processors = 2
claim_batch = 10
claim = "{claim}"
lease = "3s"
"#
        ),
    )
    .unwrap();
    let payments: Vec<Payment> = (0..N)
        .map(|i| Payment::new(&format!("u{i}"), 1_000 + i as i64))
        .collect();
    send_payments(&producer(), &topic, None, &payments).await;

    let mut victim = spawn_worker(&config_path, &dir.join("victim.log"));
    let mut survivor = spawn_worker(&config_path, &dir.join("survivor.log"));
    eventually(60, "some rows applied, and claims held", || async {
        applied(&db, &consumer).await.0 >= 40 && held(&db, &consumer).await > 0
    })
    .await;
    // SIGKILL: no rollback, no release, no goodbye to the group.
    victim.kill().unwrap();
    victim.wait().unwrap();
    let at_kill = applied(&db, &consumer).await.0;
    assert!(at_kill < N as i64, "killed before the end ({at_kill})");

    eventually(120, "every message applied", || async {
        applied(&db, &consumer).await.0 >= N as i64
    })
    .await;
    // Let anything still in flight land: nothing more may be applied.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        applied(&db, &consumer).await,
        (N as i64, N as i64),
        "each message applied exactly once"
    );
    let r = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'DONE'), count(*),
                    count(*) FILTER (WHERE attempts > 1)
             FROM inbox WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    let (done, total, retried): (i64, i64, i64) = (r.get(0), r.get(1), r.get(2));
    assert_eq!((done, total), (N as i64, N as i64), "every row DONE");
    if claim == "lease" {
        // The victim's leases were committed before it died: those rows were claimed again
        // once the lease ran out.
        assert!(retried > 0, "some leased rows were reclaimed");
    } else {
        // A lock claim counts its attempt with the commit that applies it: the victim's
        // claims never committed.
        assert_eq!(retried, 0, "a lock claim that died counts nothing");
    }
    // The operator's view of the same inbox, through the command line.
    let cli = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_effectively"))
            .args(["inbox"])
            .args(args)
            .arg("--config")
            .arg(&config_path)
            .env("KAFKA_BROKERS", kafka_brokers())
            .env("DATABASE_URL", database_url())
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let status = cli(&["status"]);
    let line = status.lines().find(|l| l.starts_with(&consumer)).unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    // consumer, pending, due, in_progress, failed, held, oldest pending age
    assert_eq!(fields[1..], ["0", "0", "0", "0", "0", "0s"], "{status}");
    let replayed = cli(&["replay", "--consumer", &consumer, "--failed"]);
    assert!(replayed.starts_with("0 row(s)"), "{replayed}");
    let term = Command::new("kill")
        .args(["-TERM", &survivor.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = survivor.wait().unwrap();
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_mid_claim_releases_its_row_locks() {
    a_killed_processor_loses_nothing_and_applies_nothing_twice("lock").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_mid_claim_has_its_leases_reclaimed() {
    a_killed_processor_loses_nothing_and_applies_nothing_twice("lease").await;
}
