//! Crashes, rebalances and zombies against the real Kafka and PostgreSQL: the ledger stays
//! exact (one credit per unique payment, wallets equal to 2% of the unique payments).

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{eventually, ledger, Payment};

/// Payments spread over `users` users, with every tenth one sent twice (a relay resend).
fn stream(users: &[String], n: usize) -> (Vec<Payment>, Vec<Payment>) {
    let unique: Vec<Payment> = (0..n)
        .map(|i| Payment::new(&users[i % users.len()], 1_000 + (i as i64 * 37) % 9_000))
        .collect();
    let mut sent = Vec::with_capacity(n + n / 10);
    for (i, p) in unique.iter().enumerate() {
        sent.push(p.clone());
        if i % 10 == 0 {
            sent.push(p.clone());
        }
    }
    (unique, sent)
}

async fn assert_exact(
    db: &tokio_postgres::Client,
    consumer: &str,
    unique: &[Payment],
    users: &[String],
) {
    let l = ledger(db, consumer).await;
    let expected: i64 = unique.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(
        l.credits,
        unique.len() as i64,
        "one credit per unique payment: {l:?}"
    );
    assert_eq!(l.distinct_payments, unique.len() as i64);
    assert_eq!(l.dedupe_keys, unique.len() as i64);
    assert_eq!(
        l.cashback_paise, expected,
        "sum of credits = 2% of the unique payments"
    );
    assert_eq!(common::wallet_total(db, users).await, expected);
    assert_eq!(l.parked, 0);
}

/// The config of group member `id`: the cashback handler on `topic`, batches of 100.
fn member(consumer: &str, topic: &str, id: &str) -> effectively::config::Config {
    let mut c = common::config(
        consumer,
        topic,
        r#"{ kind = "cashback" }"#,
        r#"batch = { max_messages = 100 }"#,
    );
    c.worker.id = Some(id.to_string());
    c
}

/// Waits until the consumer's credits reach `n`.
async fn wait_credits(db: &tokio_postgres::Client, consumer: &str, n: i64, secs: u64) {
    eventually(secs, &format!("{n} credits"), || async move {
        ledger(db, consumer).await.credits >= n
    })
    .await;
}

fn spawn_worker(config_path: &std::path::Path, log: &std::path::Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_effectively"))
        .args(["run", "--config"])
        .arg(config_path)
        .env("KAFKA_BROKERS", common::kafka_brokers())
        .env("DATABASE_URL", common::database_url())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn effectively run")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_resumes_at_the_stored_offsets() {
    let topic = common::unique("crash");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 3).await;
    let users: Vec<String> = (0..30)
        .map(|i| format!("{}-{i}", common::unique("u")))
        .collect();
    let (unique, sent) = stream(&users, 3_000);
    let producer = common::producer();
    common::send_payments(&producer, &topic, None, &sent).await;

    let dir = std::env::temp_dir().join(&consumer);
    std::fs::create_dir_all(&dir).unwrap();
    let config_path = dir.join("effectively.toml");
    // Small batches so the kill lands between many commits.
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
handler = {{ kind = "cashback" }}
batch = {{ max_messages = 50 }}
"#
        ),
    )
    .unwrap();
    let db = common::pg().await;
    for round in 0..2 {
        let mut child = spawn_worker(&config_path, &dir.join(format!("worker-{round}.log")));
        let target = 600 * (round + 1);
        wait_credits(&db, &consumer, target, 90).await;
        // SIGKILL: no drain, no commit, no goodbye to the group.
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let mut last = spawn_worker(&config_path, &dir.join("worker-last.log"));
    wait_credits(&db, &consumer, unique.len() as i64, 120).await;
    // Let it settle: nothing more may be credited.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_exact(&db, &consumer, &unique, &users).await;
    // Every partition's stored offset is at the end of the partition.
    let stored = effectively::store::offsets::load(&db, &consumer, &topic)
        .await
        .unwrap();
    let total: i64 = stored.iter().filter_map(|s| s.next_offset).sum();
    assert_eq!(total, sent.len() as i64);
    let term = Command::new("kill")
        .args(["-TERM", &last.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = last.wait().unwrap();
    assert!(status.success(), "SIGTERM exits 0: {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_joining_and_leaving_keep_the_ledger_exact() {
    let topic = common::unique("rebalance");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 6).await;
    let users: Vec<String> = (0..60)
        .map(|i| format!("{}-{i}", common::unique("u")))
        .collect();
    let (unique, sent) = stream(&users, 6_000);
    let producer = common::producer();
    let db = common::pg().await;

    let worker = |id: &str| common::start(member(&consumer, &topic, id));
    let w1 = worker("w1").await;
    let w2 = worker("w2").await;
    // Traffic flows in chunks while members come and go.
    let chunks: Vec<&[Payment]> = sent.chunks(sent.len() / 4 + 1).collect();
    common::send_payments(&producer, &topic, None, chunks[0]).await;
    wait_credits(&db, &consumer, 500, 60).await;
    let w3 = worker("w3").await;
    common::send_payments(&producer, &topic, None, chunks[1]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    w1.stop().await.unwrap();
    common::send_payments(&producer, &topic, None, chunks[2]).await;
    // A crash this time: the worker is dropped without stopping.
    drop(w2);
    common::send_payments(&producer, &topic, None, chunks[3]).await;
    wait_credits(&db, &consumer, unique.len() as i64, 120).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_exact(&db, &consumer, &unique, &users).await;
    let stats = w3.stats(&consumer).unwrap().snapshot();
    assert!(stats.rebalances >= 2, "w3 saw the group change: {stats:?}");
    w3.stop().await.unwrap();
}

/// Kafka's consumer group protocol (KIP-848, `"group.protocol" = "consumer"`): the broker
/// assigns, partitions move one step at a time, and the engine leaves out the classic
/// protocol's assignor, session and heartbeat (librdkafka refuses a client that sets them).
/// A member joining and one leaving mid-stream keep the ledger exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_consumer_group_protocol_members_come_and_go_and_the_ledger_stays_exact() {
    let topic = common::unique("kip848");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 6).await;
    let users: Vec<String> = (0..30)
        .map(|i| format!("{}-{i}", common::unique("u")))
        .collect();
    let (unique, sent) = stream(&users, 3_000);
    let producer = common::producer();
    let db = common::pg().await;

    let worker = |id: &str| {
        let mut c = member(&consumer, &topic, id);
        // The test config's classic heartbeat would be refused under this protocol.
        c.kafka.options.remove("heartbeat.interval.ms");
        c.kafka
            .options
            .insert("group.protocol".into(), "consumer".into());
        common::start(c)
    };
    let w1 = worker("w1").await;
    let chunks: Vec<&[Payment]> = sent.chunks(sent.len() / 3 + 1).collect();
    common::send_payments(&producer, &topic, None, chunks[0]).await;
    wait_credits(&db, &consumer, 300, 60).await;
    let w2 = worker("w2").await;
    common::send_payments(&producer, &topic, None, chunks[1]).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    w1.stop().await.unwrap();
    common::send_payments(&producer, &topic, None, chunks[2]).await;
    wait_credits(&db, &consumer, unique.len() as i64, 120).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_exact(&db, &consumer, &unique, &users).await;
    let stats = w2.stats(&consumer).unwrap().snapshot();
    assert!(stats.rebalances >= 2, "w2 got partitions twice: {stats:?}");
    w2.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_whose_partition_was_claimed_is_fenced_and_credits_nothing() {
    let topic = common::unique("zombie");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let db = common::pg().await;
    let producer = common::producer();

    let mut cfg = common::config(&consumer, &topic, r#"{ kind = "cashback" }"#, "");
    cfg.worker.id = Some("zombie".into());
    let zombie = common::start(cfg.clone()).await;
    let zstats = zombie.stats(&consumer).unwrap();
    let warmup = Payment::new(&user, 10_000);
    common::send_payments(&producer, &topic, Some(0), std::slice::from_ref(&warmup)).await;
    wait_credits(&db, &consumer, 1, 60).await;

    // Another worker takes the partition in PostgreSQL (as it does on assignment) while the
    // zombie still believes it owns it.
    let claim = effectively::store::offsets::claim(&db, &consumer, &topic, 0, "usurper")
        .await
        .unwrap();
    assert_eq!(claim.next_offset, Some(1));
    let p = Payment::new(&user, 50_000);
    common::send_payments(&producer, &topic, Some(0), std::slice::from_ref(&p)).await;
    eventually(60, "the zombie is fenced", || {
        let zstats = zstats.clone();
        async move { zstats.snapshot().fenced >= 1 }
    })
    .await;
    assert_eq!(
        ledger(&db, &consumer).await.credits,
        1,
        "the zombie's batch rolled back"
    );
    let stored = effectively::store::offsets::load(&db, &consumer, &topic)
        .await
        .unwrap();
    assert_eq!(
        (stored[0].next_offset, stored[0].owner.as_str()),
        (Some(1), "usurper")
    );

    // The rightful owner (a new member of the group) gets the partition when the zombie
    // leaves, and applies the payment once.
    cfg.worker.id = Some("heir".into());
    let heir = common::start(cfg).await;
    zombie.stop().await.unwrap();
    wait_credits(&db, &consumer, 2, 60).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.cashback_paise), (2, 200 + 1_000), "{l:?}");
    heir.stop().await.unwrap();
}
