//! A partition that cannot progress is never silent, against the real Kafka and PostgreSQL:
//!
//! - **stuck**: a topic the worker's SASL user may not read (a DENY READ ACL on the stack's
//!   broker, which runs the StandardAuthorizer: `scripts/stack.sh`). Every fetch of its
//!   partitions fails with TopicAuthorizationFailed: the error counter and the stuck gauge say
//!   so per partition, `/readyz`'s verdict is "not ready" naming the error, and the console's
//!   overview marks both partitions. The ACL removed, everything is applied once and the marks
//!   clear.
//! - **stalled**: a batch that cannot commit (its wallet row locked by another connection)
//!   past `stall_after` (2 s): the stalled gauge and the console's mark, cleared once the lock
//!   goes and the batch commits, every payment applied once.

mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::{eventually, ledger, Payment};
use effectively::config::{Config, KafkaSasl, KafkaTls, SaslMechanism};
use effectively::metrics::{PARTITION_ERRORS, PARTITION_STALLED, PARTITION_STUCK};
use effectively::store::partition_health;

/// This process's samples of `metric` for `consumer`: (the sample's labels, value).
fn samples(metric: &str, consumer: &str) -> Vec<(String, f64)> {
    let text = effectively::metrics::recorder()
        .expect("the recorder")
        .render();
    let needle = format!("consumer=\"{consumer}\"");
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) && l.contains(&needle))
        .filter_map(|l| {
            let (labels, value) = l.rsplit_once(' ')?;
            Some((labels.to_string(), value.parse().ok()?))
        })
        .collect()
}

fn sum(metric: &str, consumer: &str) -> f64 {
    samples(metric, consumer).iter().map(|(_, v)| v).sum()
}

/// The stack's broker's jars, found beside its CA file (`.stack/kafka/tls/ca.pem`).
fn kafka_home() -> PathBuf {
    let ca = common::setting("KAFKA_CA_FILE", "");
    assert!(
        !ca.is_empty(),
        "KAFKA_CA_FILE is not set: run `scripts/stack.sh up`"
    );
    PathBuf::from(ca)
        .parent()
        .and_then(|tls| tls.parent())
        .expect("the CA file sits in <kafka home>/tls")
        .to_path_buf()
}

/// Kafka's own ACL tool, over the plaintext listener (a super user there).
fn acls(args: &[&str]) {
    let home = kafka_home();
    let out = std::process::Command::new("java")
        .arg("-cp")
        .arg(format!("{}/lib/*", home.display()))
        .arg("org.apache.kafka.tools.AclCommand")
        .args(["--bootstrap-server", &common::kafka_brokers()])
        .args(args)
        .output()
        .expect("running kafka's AclCommand (java)");
    assert!(
        out.status.success(),
        "AclCommand {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The SASL listener as the user `effectively` (SCRAM-SHA-512 over TLS).
fn over_sasl(cfg: &mut Config) {
    let get = |name: &str| {
        let v = common::setting(name, "");
        assert!(
            !v.is_empty(),
            "{name} is not set: run `scripts/stack.sh up`"
        );
        v
    };
    cfg.kafka.brokers = get("KAFKA_SASL_BROKERS");
    cfg.kafka.tls = Some(KafkaTls {
        ca_file: Some(get("KAFKA_CA_FILE").into()),
        cert_file: None,
        key_file: None,
        verify_hostname: true,
    });
    cfg.kafka.sasl = Some(KafkaSasl {
        mechanism: SaslMechanism::ScramSha512,
        username: "effectively".into(),
        password_env: None,
        password_file: Some(get("KAFKA_SASL_PASSWORD_FILE").into()),
    });
}

/// The console, in-process on 127.0.0.1:0, for the worker's config; its overview's HTML.
async fn overview(config: &Config) -> String {
    let mut config = config.clone();
    config.console = Some(Default::default());
    if let Some(c) = config.console.as_mut() {
        c.addr = "127.0.0.1:0".parse().unwrap();
    }
    let bound = effectively::console::bind(&config, None)
        .await
        .expect("console binds");
    let addr: SocketAddr = bound.addr;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(bound.run(async move {
        let _ = stopped.await;
    }));
    let page = reqwest::Client::new()
        .get(format!("http://{addr}/"))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("GET /")
        .text()
        .await
        .unwrap();
    let _ = stop.send(());
    page
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_topic_the_user_may_not_read_is_stuck_visibly_and_resumes_when_allowed() {
    let topic = common::unique("denied");
    let consumer = common::unique("denied");
    common::create_topic(&topic, 2).await;
    // The user may see the topic (metadata) but not read it: the group forms, the partitions
    // are assigned, and every fetch fails.
    acls(&[
        "--add",
        "--allow-principal",
        "User:effectively",
        "--operation",
        "Describe",
        "--topic",
        &topic,
    ]);
    acls(&[
        "--add",
        "--deny-principal",
        "User:effectively",
        "--operation",
        "Read",
        "--topic",
        &topic,
    ]);
    let users: Vec<String> = (0..4).map(|_| common::unique("u")).collect();
    let payments: Vec<Payment> = (0..40)
        .map(|i| Payment::new(&users[i % 4], 1_000 + i as i64))
        .collect();
    let producer = common::producer();
    common::send_payments(&producer, &topic, Some(0), &payments[..20]).await;
    common::send_payments(&producer, &topic, Some(1), &payments[20..]).await;

    let mut cfg = common::config(&consumer, &topic, r#"{ kind = "cashback" }"#, "");
    over_sasl(&mut cfg);
    cfg.validate().expect("a valid config");
    let worker = common::start(cfg.clone()).await;
    let health = worker.health();
    let db = common::pg().await;
    let (db, consumer, health) = (&db, &consumer, &health);

    eventually(60, "both partitions stuck", || async move {
        let stuck = samples(PARTITION_STUCK, consumer);
        stuck.len() == 2 && stuck.iter().all(|(_, v)| *v == 1.0)
    })
    .await;
    let errors = samples(PARTITION_ERRORS, consumer);
    assert!(
        errors
            .iter()
            .any(|(l, v)| l.contains("code=\"TopicAuthorizationFailed\"") && *v >= 1.0),
        "the error counter names the code: {errors:?}"
    );
    let ready = health.readiness();
    assert!(!ready.ok, "every partition stuck: not ready");
    assert!(
        ready.text.contains(&format!(
            "consumer {consumer}: every partition it holds (2) is stuck"
        )) && ready.text.to_lowercase().contains("authoriz"),
        "{}",
        ready.text
    );
    // The console (another process in production) reads what the owner wrote.
    eventually(20, "the partitions' health rows", || async move {
        let rows = partition_health::of_consumer(db, consumer).await.unwrap();
        rows.len() == 2 && rows.iter().all(|r| r.marks.stuck.is_some())
    })
    .await;
    let page = overview(&cfg).await;
    assert!(
        page.contains("2 partition(s) of") && page.matches("class=\"bad stuck\"").count() == 2,
        "the overview marks both partitions: {page}"
    );
    assert!(page.to_lowercase().contains("authoriz"), "with the error");
    assert_eq!(ledger(db, consumer).await.credits, 0, "nothing read");

    acls(&["--remove", "--force", "--topic", &topic]);
    eventually(
        60,
        "every payment credited once the topic is readable",
        || async move { ledger(db, consumer).await.credits >= 40 },
    )
    .await;
    let l = ledger(db, consumer).await;
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!(
        (l.credits, l.distinct_payments, l.dedupe_keys),
        (40, 40, 40),
        "{l:?}"
    );
    assert_eq!(l.cashback_paise, expected, "{l:?}");
    assert_eq!(l.parked, 0, "nothing parked: {l:?}");
    assert_eq!(common::wallet_total(db, &users).await, expected);
    eventually(20, "the marks cleared", || async move {
        sum(PARTITION_STUCK, consumer) == 0.0
            && health.readiness().ok
            && partition_health::of_consumer(db, consumer)
                .await
                .unwrap()
                .is_empty()
    })
    .await;
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_blocked_past_stall_after_is_a_stall_until_it_commits() {
    let topic = common::unique("stall");
    let consumer = common::unique("stall");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let db = common::pg().await;
    // Another connection holds the wallet's row: the batch's cashback waits on the lock.
    db.execute(
        "INSERT INTO wallets (user_id, balance_paise) VALUES ($1, 0)",
        &[&user],
    )
    .await
    .unwrap();
    let mut locker = common::pg().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM wallets WHERE user_id = $1 FOR UPDATE",
        &[&user],
    )
    .await
    .unwrap();

    let payments: Vec<Payment> = (0..10).map(|i| Payment::new(&user, 1_000 + i)).collect();
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;
    let worker = common::start_cashback(&consumer, &topic, r#"stall_after = "2s""#).await;
    let (db, consumer) = (&db, &consumer);

    eventually(60, "the partition stalled", || async move {
        sum(PARTITION_STALLED, consumer) == 1.0
    })
    .await;
    eventually(
        20,
        "the stall in the partition's health row",
        || async move {
            let rows = partition_health::of_consumer(db, consumer).await.unwrap();
            rows.len() == 1 && rows[0].marks.stalled_since.is_some()
        },
    )
    .await;
    let cfg = common::config(consumer, &topic, r#"{ kind = "cashback" }"#, "");
    let page = overview(&cfg).await;
    assert!(
        page.contains("class=\"bad stalled\"") && page.contains("stalled for"),
        "the overview marks the partition: {page}"
    );
    assert_eq!(ledger(db, consumer).await.credits, 0, "nothing committed");

    lock.rollback().await.unwrap();
    eventually(
        60,
        "every payment credited once the lock is gone",
        || async move { ledger(db, consumer).await.credits >= 10 },
    )
    .await;
    let l = ledger(db, consumer).await;
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    assert_eq!((l.credits, l.dedupe_keys, l.parked), (10, 10, 0), "{l:?}");
    assert_eq!(
        common::wallet_total(db, std::slice::from_ref(&user)).await,
        expected
    );
    eventually(20, "the stall cleared", || async move {
        sum(PARTITION_STALLED, consumer) == 0.0
            && partition_health::of_consumer(db, consumer)
                .await
                .unwrap()
                .is_empty()
    })
    .await;
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inbox_processors_failing_past_stall_after_are_a_stall_until_a_round_commits() {
    let topic = common::unique("stall-inbox");
    let consumer = common::unique("stall-inbox");
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let db = common::pg().await;
    db.execute(
        "INSERT INTO wallets (user_id, balance_paise) VALUES ($1, 0)",
        &[&user],
    )
    .await
    .unwrap();
    let mut locker = common::pg().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM wallets WHERE user_id = $1 FOR UPDATE",
        &[&user],
    )
    .await
    .unwrap();

    let payments: Vec<Payment> = (0..10).map(|i| Payment::new(&user, 2_000 + i)).collect();
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;
    // The processor's round claims the rows and waits on the wallet's lock (up to the
    // transaction deadline, 30 s): past stall_after it is a stall.
    let cfg = common::config(
        &consumer,
        &topic,
        r#"{ kind = "cashback" }"#,
        "strategy = \"inbox\"\nstall_after = \"2s\"\n[consumer.inbox]\nprocessors = 1",
    );
    let worker = common::start(cfg).await;
    let (db, consumer) = (&db, &consumer);

    eventually(60, "the inbox processor stalled", || async move {
        sum(effectively::metrics::INBOX_PROCESSOR_STALLED, consumer) == 1.0
    })
    .await;
    assert_eq!(ledger(db, consumer).await.credits, 0, "nothing applied");
    assert_eq!(
        sum(PARTITION_STALLED, consumer),
        0.0,
        "the receiver stores its batches: the partition itself is not stalled"
    );

    lock.rollback().await.unwrap();
    eventually(
        60,
        "every payment credited once the lock is gone",
        || async move { ledger(db, consumer).await.credits >= 10 },
    )
    .await;
    let l = ledger(db, consumer).await;
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    // (An inbox consumer's dedupe keys are its inbox rows, not processed_messages.)
    assert_eq!(
        (l.credits, l.distinct_payments, l.parked),
        (10, 10, 0),
        "{l:?}"
    );
    assert_eq!(
        common::wallet_total(db, std::slice::from_ref(&user)).await,
        expected
    );
    eventually(20, "the stall cleared", || async move {
        sum(effectively::metrics::INBOX_PROCESSOR_STALLED, consumer) == 0.0
    })
    .await;
    worker.stop().await.unwrap();
}

/// A worker cut off mid-statement (a COPY waiting for its rows is not "idle in transaction")
/// must not hold its locks on the server for the kernel's two-hour keepalive default: the
/// engine's sessions ask PostgreSQL for keepalives of their own (chaos-net's `commit-stall`
/// is the scenario; this checks the server took the settings).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_probes_an_engine_session_that_went_silent() {
    let pool = common::pool(1);
    let db = pool.get().await.unwrap();
    for (name, want) in [
        ("tcp_keepalives_idle", "10"),
        ("tcp_keepalives_interval", "5"),
        ("tcp_keepalives_count", "3"),
        ("tcp_user_timeout", "30000"),
    ] {
        let got: String = db
            .query_one(&format!("SHOW {name}"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(got, want, "{name}");
    }
}
