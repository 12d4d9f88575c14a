//! Steering running consumers against the real Kafka and PostgreSQL: a rewind online under
//! load replays only duplicates, a rewind past the retention window parks the older copies,
//! pause and resume across two workers (and a restart), the rate held, and static membership's
//! restart without a rebalance.

mod common;

use std::time::{Duration, Instant};

use common::{eventually, ledger, Payment};
use effectively::config::Config;
use effectively::operator::control::{self as op, KafkaLookup, Target};
use effectively::operator::Actor;
use effectively::store::control::Scope;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// Sends `payments` to `partition` at once (acknowledged before it returns), each record
/// stamped `timestamp_ms` (Kafka's CreateTime, what offsets-for-times searches).
async fn send_stamped(
    producer: &FutureProducer,
    topic: &str,
    partition: i32,
    payments: &[Payment],
    timestamp_ms: i64,
) {
    let bodies: Vec<(String, Vec<u8>)> = payments
        .iter()
        .map(|p| (p.event_id.to_string(), p.json()))
        .collect();
    let sends: Vec<_> = bodies
        .iter()
        .map(|(id, body)| {
            let headers = OwnedHeaders::new().insert(Header {
                key: "event_id",
                value: Some(id.as_bytes()),
            });
            let rec = FutureRecord::<[u8], [u8]>::to(topic)
                .payload(body.as_slice())
                .headers(headers)
                .partition(partition)
                .timestamp(timestamp_ms);
            // Enqueued now (an `async send` would enqueue only when awaited, one at a time).
            producer
                .send_result(rec)
                .map_err(|(e, _)| e)
                .expect("enqueued")
        })
        .collect();
    for s in sends {
        s.await.expect("delivery").expect("acknowledged");
    }
}

fn payments(users: &[String], n: usize) -> Vec<Payment> {
    (0..n)
        .map(|i| Payment::new(&users[i % users.len()], 1_000 + (i as i64 * 37) % 9_000))
        .collect()
}

fn users(n: usize) -> Vec<String> {
    (0..n).map(|_| common::unique("user")).collect()
}

fn member(consumer: &str, topic: &str, id: &str, extra: &str) -> Config {
    let mut c = common::config(consumer, topic, r#"{ kind = "cashback" }"#, extra);
    c.worker.id = Some(id.to_string());
    c
}

async fn wait_credits(db: &tokio_postgres::Client, consumer: &str, n: i64, secs: u64) {
    eventually(secs, &format!("{n} credits"), || async move {
        ledger(db, consumer).await.credits >= n
    })
    .await;
}

/// The consumer of `config`, reset to `target` as `effectively offsets reset` does.
async fn reset(config: &Config, target: Target) -> Vec<op::Move> {
    let c = &config.consumers[0];
    let kafka = KafkaLookup::new(&config.kafka).expect("kafka client");
    let pool = common::pool(2);
    let plan = op::plan_reset(&pool, &kafka, c, None, None, target)
        .await
        .expect("plan");
    let (done, moved) = op::reset(
        &pool,
        &c.name,
        target,
        &plan,
        &Actor("test".into()),
        Some("test"),
    )
    .await
    .expect("reset");
    assert_eq!(done.count as usize, plan.len());
    moved
}

async fn audited(db: &tokio_postgres::Client, verb: &str, consumer: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM operator_actions WHERE verb = $1 AND filter->>'consumer' = $2",
        &[&verb, &consumer],
    )
    .await
    .unwrap()
    .get(0)
}

/// Two hours of a topic applied, a live stream on top, then a rewind by two hours while the
/// worker runs: what is read again is only duplicates (no new credit, each copy counted as a
/// duplicate), nothing older than the rewind is read, and nothing is lost or doubled.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rewinding_two_hours_online_replays_only_duplicates() {
    let (topic, consumer) = (common::unique("ctl-rewind"), common::unique("ctl-rewind"));
    common::create_topic(&topic, 2).await;
    let db = common::pg().await;
    let producer = common::producer();
    let us = users(20);
    let now = chrono::Utc::now().timestamp_millis();
    let hour = 3_600_000;
    // Per partition: 100 records of three hours ago, 100 of one hour ago.
    let old = payments(&us, 200);
    let recent = payments(&us, 200);
    for p in 0..2 {
        let i = p as usize * 100;
        send_stamped(&producer, &topic, p, &old[i..i + 100], now - 3 * hour).await;
        send_stamped(&producer, &topic, p, &recent[i..i + 100], now - hour).await;
    }
    let config = member(
        &consumer,
        &topic,
        "w-rewind",
        "batch = { max_messages = 50 }",
    );
    let worker = common::start(config.clone()).await;
    let stats = worker.stats(&consumer).unwrap();
    wait_credits(&db, &consumer, 400, 60).await;

    let before = stats.snapshot();
    // Under load: a live stream while the rewind happens.
    let live = payments(&us, 300);
    let stream = {
        let (producer, topic, live) = (producer.clone(), topic.clone(), live.clone());
        tokio::spawn(async move {
            for (i, chunk) in live.chunks(10).enumerate() {
                let ts = chrono::Utc::now().timestamp_millis();
                send_stamped(&producer, &topic, (i % 2) as i32, chunk, ts).await;
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(600)).await;
    let two_hours_ago = chrono::Utc::now() - chrono::Duration::hours(2);
    let moved = reset(&config, Target::Time(two_hours_ago)).await;
    for m in &moved {
        // The first record of one hour ago: each partition's 100 old records come first.
        assert_eq!(m.to, 100, "{m:?}");
        assert!(m.from.unwrap() >= 200, "{m:?}");
    }
    let replayed: u64 = moved.iter().map(|m| (m.from.unwrap() - m.to) as u64).sum();
    stream.await.unwrap();
    wait_credits(&db, &consumer, 700, 60).await;
    eventually(30, "every replayed copy counted as a duplicate", || {
        let stats = stats.clone();
        async move { stats.snapshot().duplicates - before.duplicates >= replayed }
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = stats.snapshot();
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 700, "one credit per payment: {l:?}");
    assert_eq!(l.distinct_payments, 700);
    assert!(common::doubly_credited(&db, &consumer).await.is_empty());
    assert_eq!(l.parked, 0);
    assert_eq!(
        after.duplicates - before.duplicates,
        replayed,
        "exactly the rewound records came back, as duplicates (nothing older than two hours)"
    );
    assert_eq!(
        after.effects - before.effects,
        300,
        "the only new effects are the live stream's"
    );
    // The owner was fenced and claimed the partitions again, with no restart.
    let owners: Vec<String> = db
        .query(
            "SELECT owner FROM consumer_offsets WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(owners.iter().all(|o| o == "w-rewind"), "{owners:?}");
    assert_eq!(audited(&db, "reset", &consumer).await, 1);
    worker.stop().await.unwrap();
}

/// Payments dated four days ago, applied under a five-day retention; then the retention is two
/// days (as if three more days had passed) and the consumer is rewound to the start: every copy
/// read again is parked as older than the retention window, none applied twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_rewind_past_the_retention_window_parks_the_older_copies() {
    let (topic, consumer) = (common::unique("ctl-past"), common::unique("ctl-past"));
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    let producer = common::producer();
    let us = users(5);
    let mut old = payments(&us, 50);
    for p in &mut old {
        p.occurred_at = chrono::Utc::now() - chrono::Duration::days(4);
    }
    send_stamped(
        &producer,
        &topic,
        0,
        &old,
        chrono::Utc::now().timestamp_millis(),
    )
    .await;
    let worker = common::start(member(
        &consumer,
        &topic,
        "w-past",
        r#"retention = "5days""#,
    ))
    .await;
    wait_credits(&db, &consumer, 50, 60).await;
    worker.stop().await.unwrap();

    let config = member(&consumer, &topic, "w-past", r#"retention = "2days""#);
    let worker = common::start(config.clone()).await;
    let moved = reset(&config, Target::Earliest).await;
    assert_eq!((moved[0].from, moved[0].to), (Some(50), 0));
    eventually(30, "50 copies parked", || async {
        ledger(&db, &consumer).await.parked >= 50
    })
    .await;
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.parked), (50, 50), "{l:?}");
    let reasons: Vec<String> = common::dead_letters(&db, &consumer)
        .await
        .into_iter()
        .map(|d| d.reason)
        .collect();
    assert!(
        reasons.iter().all(|r| r == "older_than_retention"),
        "{reasons:?}"
    );
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(50)
    );
    worker.stop().await.unwrap();
}

/// A partition paused across two workers fetches nothing, while the others go on; it stays
/// paused through a worker's restart (a rebalance); resumed, it catches up, exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_and_resume_across_two_workers_and_a_restart() {
    let (topic, consumer) = (common::unique("ctl-pause"), common::unique("ctl-pause"));
    common::create_topic(&topic, 4).await;
    let db = common::pg().await;
    let producer = common::producer();
    let pool = common::pool(2);
    let us = users(10);
    let a = common::start(member(&consumer, &topic, "w-a", "")).await;
    let b = common::start(member(&consumer, &topic, "w-b", "")).await;
    let config = member(&consumer, &topic, "w-a", "");
    let warm = payments(&us, 40);
    for p in 0..4 {
        send_stamped(
            &producer,
            &topic,
            p,
            &warm[p as usize * 10..p as usize * 10 + 10],
            chrono::Utc::now().timestamp_millis(),
        )
        .await;
    }
    wait_credits(&db, &consumer, 40, 60).await;

    let one = Scope {
        consumer: consumer.clone(),
        topic: Some(topic.clone()),
        partition: Some(1),
    };
    let actor = Actor("test".into());
    let done = op::pause(&pool, &one, &actor, Some("test")).await.unwrap();
    assert_eq!(done.count, 1);
    // Applied within about a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let stored_1 = common::stored_offset(&db, &consumer, &topic, 1).await;
    let more = payments(&us, 80);
    for p in 0..4 {
        let i = p as usize * 20;
        send_stamped(
            &producer,
            &topic,
            p,
            &more[i..i + 20],
            chrono::Utc::now().timestamp_millis(),
        )
        .await;
    }
    wait_credits(&db, &consumer, 100, 60).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        ledger(&db, &consumer).await.credits,
        100,
        "partition 1's 20 wait"
    );
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 1).await,
        stored_1
    );
    let kafka = KafkaLookup::new(&config.kafka).unwrap();
    let view = op::show(&pool, &kafka, &config.consumers[0], None)
        .await
        .unwrap();
    let p1 = view.partitions.iter().find(|p| p.partition == 1).unwrap();
    assert!(p1.paused && p1.lag == Some(20), "{p1:?}");
    assert!(view
        .partitions
        .iter()
        .filter(|p| p.partition != 1)
        .all(|p| !p.paused && p.lag == Some(0)));
    // Still owned by a worker (no rebalance), and both workers ready.
    assert!(p1.owner.as_deref().is_some_and(|o| o.starts_with("w-")));
    for w in [&a, &b] {
        let v = w.health().readiness();
        assert!(
            v.ok,
            "a paused partition leaves the worker ready: {}",
            v.text
        );
    }

    // A restart moves partitions around; the pause holds from the first record.
    a.stop().await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let a = common::start(member(&consumer, &topic, "w-a", "")).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        ledger(&db, &consumer).await.credits,
        100,
        "still paused after the restart"
    );

    // A resume of the consumer lifts the partition's pause.
    let wider = Scope {
        consumer: consumer.clone(),
        topic: None,
        partition: None,
    };
    let r = op::resume(&pool, &wider, &actor, None).await.unwrap();
    assert_eq!(r.done.count, 1);
    assert!(r.still_paused_by.is_empty());
    wait_credits(&db, &consumer, 120, 30).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.distinct_payments, l.parked), (120, 120, 0));
    assert_eq!(audited(&db, "pause", &consumer).await, 1);
    assert_eq!(audited(&db, "resume", &consumer).await, 1);
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// The rate [`max_rate_holds_the_asked_rate`] asks: 300 by default, for `make test`, whose three
/// test shards share two cores with a debug build (there a worker asked for 500/s ran at 428 and
/// 450/s in two clean-clone runs: the machine, not the limiter, set the pace);
/// `EFFECTIVELY_TEST_RATE=500` for the issue's figure (488 to 503/s in six runs alone here).
fn asked_rate() -> u32 {
    std::env::var("EFFECTIVELY_TEST_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// The least-squares slope of `points` (x, y).
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = points
        .iter()
        .fold((0.0, 0.0), |(a, b), (x, y)| (a + x / n, b + y / n));
    let (num, den) = points.iter().fold((0.0, 0.0), |(a, b), (x, y)| {
        (a + (x - mx) * (y - my), b + (x - mx) * (x - mx))
    });
    num / den
}

/// `max_rate`: a backlog of 16 s of records on four partitions is taken at the asked rate
/// (+- 5%), measured over 8 s by the worker's own count once it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_rate_holds_the_asked_rate() {
    let asked = asked_rate();
    let (topic, consumer) = (common::unique("ctl-rate"), common::unique("ctl-rate"));
    common::create_topic(&topic, 4).await;
    let producer = common::producer();
    let us = users(50);
    let per_partition = asked as usize * 4;
    let backlog = payments(&us, per_partition * 4);
    for p in 0..4 {
        let i = p as usize * per_partition;
        send_stamped(
            &producer,
            &topic,
            p,
            &backlog[i..i + per_partition],
            chrono::Utc::now().timestamp_millis(),
        )
        .await;
    }
    let extra = format!("max_rate = {asked}");
    let worker = common::start(member(&consumer, &topic, "w-rate", &extra)).await;
    let stats = worker.stats(&consumer).unwrap();
    // Past the first burst.
    common::wait_records(&stats, u64::from(asked), 30).await;
    // Commits come in chunks of a quarter second's records, so two readings 8 s apart are off
    // by up to a chunk (3%): the slope of a reading every 100 ms is not.
    let start = Instant::now();
    let mut points = Vec::new();
    while start.elapsed() < Duration::from_secs(8) {
        points.push((
            start.elapsed().as_secs_f64(),
            stats.snapshot().records as f64,
        ));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let rate = slope(&points);
    println!(
        "asked {asked}/s, measured {rate:.1}/s (least squares over {} readings in 8 s)",
        points.len()
    );
    let asked = f64::from(asked);
    assert!(
        (asked * 0.95..=asked * 1.05).contains(&rate),
        "asked {asked}/s, got {rate:.1}/s"
    );
    worker.stop().await.unwrap();
}

/// With static membership, a worker stopped and started again within the session timeout gets
/// its partitions back without a rebalance: the other member hears of nothing. Without it, the
/// other member is given the leaver's partitions, then gives them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn static_membership_restarts_without_a_rebalance() {
    for on in [true, false] {
        let (topic, consumer) = (common::unique("ctl-static"), common::unique("ctl-static"));
        common::create_topic(&topic, 4).await;
        let config = |id: &str| {
            let mut c = member(&consumer, &topic, id, "");
            c.kafka.static_membership = on;
            c
        };
        let a = common::start(config("w-a")).await;
        let b = common::start(config("w-b")).await;
        let b_stats = b.stats(&consumer).unwrap();
        // Both members hold partitions.
        let db = common::pg().await;
        eventually(30, "both members claimed partitions", || async {
            let n: i64 = db
                .query_one(
                    "SELECT count(DISTINCT owner) FROM consumer_offsets WHERE consumer = $1",
                    &[&consumer],
                )
                .await
                .unwrap()
                .get(0);
            n == 2
        })
        .await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let before = b_stats.snapshot().group_rebalances;
        a.stop().await.unwrap();
        let a = common::start(config("w-a")).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let after = b_stats.snapshot().group_rebalances;
        println!(
            "static membership {on}: the other member took part in {} rebalance callback(s) through the restart",
            after - before
        );
        if on {
            assert_eq!(after, before, "no rebalance reached the other member");
        } else {
            assert!(
                after > before,
                "without static membership the group rebalances"
            );
        }
        a.stop().await.unwrap();
        b.stop().await.unwrap();
    }
}

/// The commands as an operator types them: `offsets show`, `offsets reset --dry-run`, a reset
/// refused without the typed number, `pause`, `resume`, `throttle`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_commands_show_reset_pause_and_throttle() {
    let (topic, consumer) = (common::unique("ctl-cli"), common::unique("ctl-cli"));
    common::create_topic(&topic, 2).await;
    let db = common::pg().await;
    let producer = common::producer();
    let us = users(4);
    let ps = payments(&us, 20);
    for p in 0..2 {
        let i = p as usize * 10;
        send_stamped(
            &producer,
            &topic,
            p,
            &ps[i..i + 10],
            chrono::Utc::now().timestamp_millis(),
        )
        .await;
    }
    let worker = common::start(member(&consumer, &topic, "w-cli", "")).await;
    wait_credits(&db, &consumer, 20, 60).await;

    let dir = std::env::temp_dir().join(common::unique("ctl-cli"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("effectively.toml");
    std::fs::write(
        &path,
        format!(
            "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n[[consumer]]\nname = \"{consumer}\"\n\
             topics = [\"{topic}\"]\nhandler = {{ kind = \"cashback\" }}\n",
            common::kafka_brokers(),
            common::database_url()
        ),
    )
    .unwrap();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_effectively"))
            .args(args)
            .arg("--config")
            .arg(&path)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("effectively runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };

    let (ok, out) = run(&["offsets", "show", "--consumer", &consumer]);
    assert!(ok, "{out}");
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with(&topic)).collect();
    assert_eq!(rows.len(), 2, "{out}");
    assert!(
        rows.iter()
            .all(|r| r.split_whitespace().collect::<Vec<_>>()[2..6] == ["10", "0", "10", "0"]),
        "stored 10, log 0..10, lag 0: {out}"
    );

    let (ok, out) = run(&[
        "offsets",
        "reset",
        "--consumer",
        &consumer,
        "--shift-by",
        "-4",
        "--dry-run",
    ]);
    assert!(
        ok && out.contains("dry run") && out.contains("(4 records again)"),
        "{out}"
    );
    // Two partitions and no --yes: the typed number is asked, stdin is closed, nothing moves.
    let (ok, out) = run(&[
        "offsets",
        "reset",
        "--consumer",
        &consumer,
        "--to",
        "earliest",
    ]);
    assert!(!ok && out.contains("not confirmed"), "{out}");
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(10)
    );
    let (ok, out) = run(&[
        "offsets",
        "reset",
        "--consumer",
        &consumer,
        "--topic",
        &topic,
        "--partition",
        "1",
        "--to",
        "99",
    ]);
    assert!(!ok && out.contains("outside the log"), "{out}");
    let (ok, out) = run(&[
        "offsets",
        "reset",
        "--consumer",
        &consumer,
        "--topic",
        &topic,
        "--partition",
        "0",
        "--shift-by",
        "-4",
        "--note",
        "replay",
    ]);
    assert!(ok && out.contains("reset 1 partition(s)"), "{out}");
    // The worker claims partition 0 again and reads the 4 records as duplicates.
    let stats = worker.stats(&consumer).unwrap();
    eventually(15, "4 duplicates", || {
        let stats = stats.clone();
        async move { stats.snapshot().duplicates >= 4 }
    })
    .await;
    assert_eq!(ledger(&db, &consumer).await.credits, 20);

    let (ok, out) = run(&["pause", "--consumer", &consumer, "--topic", &topic]);
    assert!(ok && out.contains("paused"), "{out}");
    let (ok, out) = run(&[
        "resume",
        "--consumer",
        &consumer,
        "--topic",
        &topic,
        "--partition",
        "1",
    ]);
    assert!(ok && out.contains("still paused by a wider pause"), "{out}");
    let (ok, out) = run(&["offsets", "show", "--consumer", &consumer]);
    assert!(
        ok && out
            .lines()
            .filter(|l| l.starts_with(&topic) && l.contains(" paused "))
            .count()
            == 2,
        "{out}"
    );
    let (ok, out) = run(&["resume", "--consumer", &consumer]);
    assert!(ok && out.contains("1 pause(s) lifted"), "{out}");
    let (ok, out) = run(&["throttle", "--consumer", &consumer, "--rate", "250"]);
    assert!(
        ok && out.contains("250 msg/s") && out.contains("burst 125"),
        "{out}"
    );
    let (ok, out) = run(&["offsets", "show", "--consumer", &consumer]);
    assert!(
        ok && out.contains("throttled at run time: 250 msg/s"),
        "{out}"
    );
    let (ok, out) = run(&["throttle", "--consumer", &consumer, "--off"]);
    assert!(ok && out.contains("lifted"), "{out}");
    let (ok, out) = run(&["pause", "--consumer", "nobody"]);
    assert!(!ok && out.contains("no consumer \"nobody\""), "{out}");
    for verb in ["reset", "pause", "resume", "throttle"] {
        assert!(audited(&db, verb, &consumer).await >= 1, "{verb} audited");
    }
    worker.stop().await.unwrap();
}
