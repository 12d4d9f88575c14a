//! A stored offset outside the partition's log (issue 24), against the real Kafka and
//! PostgreSQL: above the log end (the topic deleted and recreated), below the log start
//! (records deleted under a stopped consumer, and under a running one), with
//! `on_offset_out_of_range` = stop, earliest and latest. The ledger is what is asserted: the
//! effects counted in PostgreSQL, the stored offset, and the worker's own counters.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{eventually, ledger, Payment};
use effectively::envelope::Envelope;
use effectively::handler::cashback::Cashback;
use effectively::handler::{Applied, BatchContext, Handler, HandlerError, Registry};
use effectively::source::range::End;
use effectively::stats::Stats;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

fn admin() -> AdminClient<DefaultClientContext> {
    ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .create()
        .expect("admin client")
}

/// (low, high) of partition 0, as a client that is not the engine reads them.
fn watermarks(topic: &str) -> (i64, i64) {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", common::kafka_brokers())
        .create()
        .expect("a consumer for the watermarks");
    c.fetch_watermarks(topic, 0, Duration::from_secs(10))
        .expect("watermarks")
}

/// Deletes and creates `topic` again (1 partition), and waits until the new one is empty and
/// writable.
async fn recreate(topic: &str) {
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    for r in admin()
        .delete_topics(&[topic], &opts)
        .await
        .expect("delete")
    {
        r.unwrap_or_else(|(t, e)| panic!("deleting {t}: {e}"));
    }
    // The deletion completes in the background: creating too soon fails with "marked for
    // deletion".
    let until = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let created = admin()
            .create_topics(
                &[rdkafka::admin::NewTopic::new(
                    topic,
                    1,
                    rdkafka::admin::TopicReplication::Fixed(1),
                )],
                &opts,
            )
            .await
            .expect("create_topics");
        match &created[0] {
            Ok(_) => break,
            Err((_, e)) if std::time::Instant::now() < until => {
                eprintln!("recreating {topic}: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err((t, e)) => panic!("recreating {t}: {e}"),
        }
    }
    eventually(30, "the recreated topic is empty", || async {
        tokio::task::spawn_blocking({
            let t = topic.to_string();
            move || {
                let c: BaseConsumer = ClientConfig::new()
                    .set("bootstrap.servers", common::kafka_brokers())
                    .create()
                    .unwrap();
                c.fetch_watermarks(&t, 0, Duration::from_secs(5)) == Ok((0, 0))
            }
        })
        .await
        .unwrap()
    })
    .await;
}

/// Deletes partition 0's records below `before` (the log start moves there).
async fn delete_records(topic: &str, before: i64) {
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Offset(before))
        .unwrap();
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
    let done = admin()
        .delete_records(&tpl, &opts)
        .await
        .expect("delete_records");
    for e in done.elements() {
        e.error().expect("records deleted");
    }
    let t = topic.to_string();
    let (low, _) = tokio::task::spawn_blocking(move || watermarks(&t))
        .await
        .unwrap();
    assert_eq!(low, before, "the log start moved");
}

fn config(consumer: &str, topic: &str, policy: &str) -> effectively::config::Config {
    let extra = format!("on_offset_out_of_range = \"{policy}\"\nbatch = {{ max_messages = 5 }}");
    common::config(consumer, topic, r#"{ kind = "cashback" }"#, &extra)
}

async fn credits(db: &tokio_postgres::Client, consumer: &str) -> i64 {
    ledger(db, consumer).await.credits
}

async fn wait_credits(db: &tokio_postgres::Client, consumer: &str, n: i64) {
    eventually(60, &format!("{n} credits"), || async move {
        credits(db, consumer).await >= n
    })
    .await;
}

/// Waits until the worker holds partition 0 of `topic` for `end`.
async fn wait_held(stats: &Arc<Stats>, topic: &str, end: End) {
    eventually(
        60,
        &format!("partition 0 held, stored offset {end:?}"),
        || {
            let stats = stats.clone();
            let key = (topic.to_string(), 0);
            async move { stats.held_out_of_range().get(&key).map(|h| h.0) == Some(end) }
        },
    )
    .await;
}

/// Nothing more is credited for `secs` seconds.
async fn stays(db: &tokio_postgres::Client, consumer: &str, n: i64, secs: u64) {
    let until = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < until {
        assert_eq!(credits(db, consumer).await, n, "nothing more is applied");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn payments(user: &str, n: usize, base: i64) -> Vec<Payment> {
    (0..n)
        .map(|i| Payment::new(user, base + i as i64 * 100))
        .collect()
}

fn cashback(ps: &[&Payment]) -> i64 {
    ps.iter().map(|p| p.amount_paise * 2 / 100).sum()
}

/// The topic is recreated under a stored offset of 10; the new log holds 7 records, 3 of them
/// copies of events applied before (republished into the new topic). `stop` reads nothing of
/// it; `earliest` reads it from the start and applies the 4 new events once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn above_the_log_end_stop_reads_nothing_and_earliest_reads_the_new_log_once() {
    let topic = common::unique("range-above");
    let consumer = topic.clone();
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    let producer = common::producer();
    let user = format!("{consumer}-u");
    let old = payments(&user, 10, 1_000);
    common::send_payments(&producer, &topic, Some(0), &old).await;
    let w1 = common::start(config(&consumer, &topic, "stop")).await;
    wait_credits(&db, &consumer, 10).await;
    w1.stop().await.unwrap();
    let stored = common::stored_offset(&db, &consumer, &topic, 0).await;
    assert_eq!(stored, Some(10));

    recreate(&topic).await;
    let new = payments(&user, 4, 5_000);
    let mut second: Vec<Payment> = old[..3].to_vec();
    second.extend(new.iter().cloned());
    common::send_payments(&producer, &topic, Some(0), &second).await;
    assert_eq!(watermarks(&topic), (0, 7));

    // stop: the partition is assigned, nothing of it is read or applied, the offset stays.
    let w2 = common::start(config(&consumer, &topic, "stop")).await;
    let s2 = w2.stats(&consumer).unwrap();
    wait_held(&s2, &topic, End::Above).await;
    stays(&db, &consumer, 10, 3).await;
    let snap = s2.snapshot();
    assert_eq!(
        (snap.records, snap.batches, snap.offset_resets),
        (0, 0, 0),
        "{snap:?}"
    );
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(10)
    );
    w2.stop().await.unwrap();
    assert!(
        s2.held_out_of_range().is_empty(),
        "no longer held once the partition is given up"
    );

    // earliest: from the start of the new log; the 3 copies are duplicates by their keys.
    let w3 = common::start(config(&consumer, &topic, "earliest")).await;
    let s3 = w3.stats(&consumer).unwrap();
    wait_credits(&db, &consumer, 14).await;
    eventually(30, "the new log's 7 records stored", || async {
        common::stored_offset(&db, &consumer, &topic, 0).await == Some(7)
    })
    .await;
    let more = payments(&user, 2, 9_000);
    common::send_payments(&producer, &topic, Some(0), &more).await;
    wait_credits(&db, &consumer, 16).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let l = ledger(&db, &consumer).await;
    let all: Vec<&Payment> = old.iter().chain(&new).chain(&more).collect();
    assert_eq!(l.credits, 16, "{l:?}");
    assert_eq!((l.distinct_payments, l.dedupe_keys), (16, 16), "{l:?}");
    assert_eq!(l.cashback_paise, cashback(&all), "{l:?}");
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        cashback(&all)
    );
    assert!(common::doubly_credited(&db, &consumer).await.is_empty());
    let snap = s3.snapshot();
    assert_eq!(snap.offset_resets, 1, "{snap:?}");
    assert_eq!(snap.duplicates, 3, "the republished copies: {snap:?}");
    assert!(s3.held_out_of_range().is_empty());
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(9)
    );
    w3.stop().await.unwrap();
}

/// 20 records arrive while the consumer is stopped at offset 10, and the first 25 of the
/// partition are deleted (retention): the stored offset is below the log start. `stop` reads
/// nothing; `latest` skips to the end and applies only what comes after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn below_the_log_start_stop_reads_nothing_and_latest_skips_to_the_end() {
    let topic = common::unique("range-below");
    let consumer = topic.clone();
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    let producer = common::producer();
    let user = format!("{consumer}-u");
    let first = payments(&user, 10, 1_000);
    common::send_payments(&producer, &topic, Some(0), &first).await;
    let w1 = common::start(config(&consumer, &topic, "stop")).await;
    wait_credits(&db, &consumer, 10).await;
    w1.stop().await.unwrap();
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(10)
    );

    let missed = payments(&user, 20, 3_000);
    common::send_payments(&producer, &topic, Some(0), &missed).await;
    delete_records(&topic, 25).await;

    let w2 = common::start(config(&consumer, &topic, "stop")).await;
    let s2 = w2.stats(&consumer).unwrap();
    wait_held(&s2, &topic, End::Below).await;
    stays(&db, &consumer, 10, 3).await;
    assert_eq!(s2.snapshot().records, 0);
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(10)
    );
    w2.stop().await.unwrap();

    // latest: to the high watermark (30), stored at once; the 5 records still in the log are
    // skipped, the ones produced afterwards applied.
    let w3 = common::start(config(&consumer, &topic, "latest")).await;
    let s3 = w3.stats(&consumer).unwrap();
    eventually(60, "the reset to the log end stored", || async {
        common::stored_offset(&db, &consumer, &topic, 0).await == Some(30)
    })
    .await;
    assert_eq!(s3.snapshot().offset_resets, 1);
    let after = payments(&user, 3, 7_000);
    common::send_payments(&producer, &topic, Some(0), &after).await;
    wait_credits(&db, &consumer, 13).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let l = ledger(&db, &consumer).await;
    let applied: Vec<&Payment> = first.iter().chain(&after).collect();
    assert_eq!((l.credits, l.dedupe_keys), (13, 13), "{l:?}");
    assert_eq!(l.cashback_paise, cashback(&applied), "{l:?}");
    assert_eq!(
        common::processed_among(&db, &consumer, &ids(&missed)).await,
        0
    );
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(33)
    );
    assert_eq!(
        s3.snapshot().records,
        3,
        "nothing below the log end was read"
    );
    w3.stop().await.unwrap();
}

fn ids(ps: &[Payment]) -> Vec<uuid::Uuid> {
    ps.iter().map(|p| p.event_id).collect()
}

// ---------------------------------------------------------------------------------------------
// While consuming: retention deletes records under a lagging consumer, and librdkafka's next
// fetch is out of range.
// ---------------------------------------------------------------------------------------------

/// The 2% cashback handler, whose first call waits until the test opens the gate: the
/// consumer lags while the test deletes the records ahead of it.
struct Gated {
    inner: Cashback,
    gate: tokio::sync::Semaphore,
    calls: std::sync::atomic::AtomicU64,
}

#[async_trait::async_trait]
impl Handler for Gated {
    fn check(&self, msg: &Envelope) -> Result<(), effectively::envelope::Rejection> {
        self.inner.check(msg)
    }

    async fn apply(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // One permit per call once open (the test adds plenty).
        self.gate.acquire().await.expect("gate").forget();
        self.inner.apply(tx, ctx, fresh).await
    }
}

/// A worker that lags: its handler is held on the first record while 40 more are produced and
/// then deleted (the log start moves to the high watermark); librdkafka holds only a few of
/// them (a 1 KB fetch queue). When the handler is let go, the task applies what was fetched
/// before the deletion, then librdkafka's next fetch is out of range.
async fn lagging(policy: &str) -> (String, String, effectively::worker::Worker, Arc<Gated>) {
    common::logs();
    let topic = common::unique(&format!("range-lag-{policy}"));
    let consumer = topic.clone();
    common::create_topic(&topic, 1).await;
    let producer = common::producer();
    let user = format!("{consumer}-u");
    let gated = Arc::new(Gated {
        inner: Cashback::new(200),
        gate: tokio::sync::Semaphore::new(0),
        calls: Default::default(),
    });
    let extra = format!(
        "on_offset_out_of_range = \"{policy}\"\nbatch = {{ max_messages = 1, backlog_max_messages = 1 }}"
    );
    let mut cfg = common::config(
        &consumer,
        &topic,
        r#"{ kind = "custom", name = "gated" }"#,
        &extra,
    );
    for (k, v) in [
        ("queued.min.messages", "1"),
        ("queued.max.messages.kbytes", "1"),
        // One fetch brings a record or two, not the whole partition (fetch.max.bytes may not
        // be below message.max.bytes).
        ("message.max.bytes", "1000"),
        ("fetch.max.bytes", "1000"),
        ("max.partition.fetch.bytes", "400"),
    ] {
        cfg.kafka.options.insert(k.into(), v.into());
    }
    let registry = Registry::new().with("gated", gated.clone() as Arc<dyn Handler>);
    let worker = common::start_with(cfg, registry).await;
    let stats = worker.stats(&consumer).unwrap();
    common::send_payments(&producer, &topic, Some(0), &payments(&user, 1, 1_000)).await;
    eventually(60, "the first record is in the handler", || {
        let gated = gated.clone();
        async move { gated.calls.load(std::sync::atomic::Ordering::SeqCst) >= 1 }
    })
    .await;
    assert_eq!(
        stats.snapshot().records,
        0,
        "the first batch waits for the gate"
    );
    common::send_payments(&producer, &topic, Some(0), &payments(&user, 40, 2_000)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    delete_records(&topic, 41).await;
    gated.gate.add_permits(1_000);
    (topic, consumer, worker, gated)
}

/// `stop`: what was fetched before the deletion is applied, then nothing: the partition is
/// held below the log start, and records produced afterwards are not read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_below_the_log_start_while_consuming_stops_the_partition() {
    let (topic, consumer, worker, _gated) = lagging("stop").await;
    let db = common::pg().await;
    let stats = worker.stats(&consumer).unwrap();
    wait_held(&stats, &topic, End::Below).await;
    let stored = common::stored_offset(&db, &consumer, &topic, 0)
        .await
        .expect("the fetched records were applied");
    assert!(
        (1..41).contains(&stored),
        "stopped below the log start: {stored}"
    );
    let applied = credits(&db, &consumer).await;
    assert_eq!(
        applied, stored,
        "every record below the stored offset, once"
    );
    let user = format!("{consumer}-u");
    let producer = common::producer();
    common::send_payments(&producer, &topic, Some(0), &payments(&user, 3, 9_000)).await;
    stays(&db, &consumer, applied, 3).await;
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(stored)
    );
    assert_eq!(stats.snapshot().offset_resets, 0);
    worker.stop().await.unwrap();
}

/// `latest`: the partition moves to the log end (stored at once) and goes on from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fetch_below_the_log_start_while_consuming_moves_to_the_end_with_latest() {
    let (topic, consumer, worker, _gated) = lagging("latest").await;
    let db = common::pg().await;
    let stats = worker.stats(&consumer).unwrap();
    eventually(60, "the reset to the log end stored", || async {
        common::stored_offset(&db, &consumer, &topic, 0).await == Some(41)
    })
    .await;
    assert_eq!(stats.snapshot().offset_resets, 1);
    assert!(stats.held_out_of_range().is_empty());
    let before = credits(&db, &consumer).await;
    assert!((1..41).contains(&before), "{before}");
    let user = format!("{consumer}-u");
    let producer = common::producer();
    let after = payments(&user, 3, 9_000);
    common::send_payments(&producer, &topic, Some(0), &after).await;
    wait_credits(&db, &consumer, before + 3).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(credits(&db, &consumer).await, before + 3);
    assert_eq!(
        common::processed_among(&db, &consumer, &ids(&after)).await,
        3
    );
    assert_eq!(
        common::stored_offset(&db, &consumer, &topic, 0).await,
        Some(44)
    );
    assert!(common::doubly_credited(&db, &consumer).await.is_empty());
    worker.stop().await.unwrap();
}
