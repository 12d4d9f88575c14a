//! The Redis pre-filter against the real Kafka and PostgreSQL, with a real `redis-server` each
//! test owns: hits skip the work and change nothing; Redis killed, hung, flushed, restarted and
//! evicting mid-run still leaves every payment credited exactly once; no Redis at all is the
//! engine without a pre-filter.

mod common;

use std::time::Duration;

use common::redis_server::Redis;
use common::{eventually, ledger, Fault, Faulty, Payment};

const CASHBACK: &str = r#"{ kind = "cashback" }"#;

fn prefilter(url: &str) -> String {
    format!("[consumer.prefilter]\nredis = \"{url}\"\ntimeout = \"50ms\"\n")
}

/// The 2% cashback of `payments`, as the handler rounds it (down, per payment).
fn cashback(payments: &[Payment]) -> i64 {
    payments.iter().map(|p| p.amount_paise * 200 / 10_000).sum()
}

/// Waits until `consumer` has stored offsets summing to `end` over `partitions` partitions.
async fn drained(db: &tokio_postgres::Client, consumer: &str, topic: &str, end: i64) {
    eventually(60, &format!("{consumer} drained to {end}"), || async move {
        let mut sum = 0;
        for p in 0..2 {
            sum += common::stored_offset(db, consumer, topic, p)
                .await
                .unwrap_or(0);
        }
        sum == end
    })
    .await;
}

/// Hits skip the work and change nothing, under both strategies that take a pre-filter; a
/// parked message, and the candidates of a rolled-back attempt, never reach Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_of_committed_keys_hits_in_redis_and_changes_nothing() {
    let redis = Redis::start();
    let db = common::pg().await;
    let producer = common::producer();
    for strategy in ["batch", "per-message"] {
        let topic = common::unique("prefilter-replay");
        let consumer = common::unique("prefilter-replay");
        common::create_topic(&topic, 2).await;
        let user = common::unique("u");
        let poison = 13_579;
        let payments: Vec<Payment> = (0..150)
            .map(|i| Payment::new(&user, 1_000 + i * 50))
            .collect();
        let refused = Payment::new(&user, poison);
        // The handler refuses one payment: its batch rolls back once, then commits without it
        // (parked). Neither the rolled-back attempt's candidates nor the parked message may be
        // set in Redis; everything committed must be.
        let handler = Faulty::new(Fault::RejectAmount(poison));
        let cfg = common::config(
            &consumer,
            &topic,
            r#"{ kind = "custom", name = "faulty" }"#,
            &format!("strategy = \"{strategy}\"\n{}", prefilter(&redis.url())),
        );
        let worker = common::start_with(cfg.clone(), Faulty::registry(&handler, "faulty")).await;
        common::send_payments(&producer, &topic, Some(0), &payments[..75]).await;
        common::send_payments(&producer, &topic, Some(0), std::slice::from_ref(&refused)).await;
        common::send_payments(&producer, &topic, Some(1), &payments[75..]).await;
        let records = payments.len() as i64 + 1;
        drained(&db, &consumer, &topic, records).await;
        worker.stop().await.unwrap();
        let first = ledger(&db, &consumer).await;
        assert_eq!(
            (first.credits, first.parked),
            (150, 1),
            "{strategy}: {first:?}"
        );
        assert!(
            handler.injected.load(std::sync::atomic::Ordering::SeqCst) >= 1,
            "the refusal rolled an attempt back"
        );
        let pattern = format!("effectively:{consumer}:*");
        let keys: Vec<String> = redis.cmd(&["KEYS", &pattern]);
        assert_eq!(
            keys.len(),
            150,
            "{strategy}: every committed key, nothing else"
        );
        let refused_key = effectively::prefilter::key(
            &consumer,
            &refused.event_id,
            refused.occurred_at.date_naive(),
        );
        assert!(
            !keys.contains(&refused_key),
            "a parked message is never set"
        );
        let one = effectively::prefilter::key(
            &consumer,
            &payments[0].event_id,
            payments[0].occurred_at.date_naive(),
        );
        let ttl: i64 = redis.cmd(&["PTTL", &one]);
        assert!(
            ttl > 14 * 86_400_000 && ttl <= 16 * 86_400_000,
            "TTL: the 15-day retention from the event's date, {ttl} ms"
        );

        // Replay the whole topic: the stored offsets back to the start.
        db.execute(
            "UPDATE consumer_offsets SET next_offset = 0 WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap();
        let calls_before = handler.calls.load(std::sync::atomic::Ordering::SeqCst);
        let replay = common::start_with(cfg, Faulty::registry(&handler, "faulty")).await;
        let stats = replay.stats(&consumer).unwrap();
        common::wait_records(&stats, records as u64, 60).await;
        drained(&db, &consumer, &topic, records).await;
        let s = stats.snapshot();
        replay.stop().await.unwrap();
        assert_eq!(
            s.prefilter_hits, 150,
            "{strategy}: every applied key hit: {s:?}"
        );
        assert_eq!((s.fresh, s.effects), (0, 0), "{strategy}: {s:?}");
        assert_eq!(s.duplicates, 150, "{strategy}: hits are duplicates: {s:?}");
        // Only the refused message (parked: no key in PostgreSQL, so none in Redis) reached
        // the handler again, once: refused, rolled back, parked again.
        assert_eq!(
            handler.calls.load(std::sync::atomic::Ordering::SeqCst) - calls_before,
            1,
            "{strategy}: the handler never ran for a hit"
        );
        if strategy == "per-message" {
            // Hits ride in the transaction of the next record that is not one (the parked
            // message's), or one per batch when a batch is all hits: not one per message.
            assert!(s.commits <= 2 * s.batches, "{strategy}: {s:?}");
            assert!(s.commits < records as u64 / 2, "{strategy}: {s:?}");
        }
        let after = ledger(&db, &consumer).await;
        assert_eq!(after, first, "{strategy}: the replay changed nothing");
        assert_eq!(
            common::wallet_total(&db, std::slice::from_ref(&user)).await,
            cashback(&payments),
            "{strategy}: the wallet"
        );
    }
}

/// Redis flushed, killed, hung (SIGSTOP), restarted empty, and evicting under a tiny
/// maxmemory, between waves of new payments and copies of old ones: every payment credited
/// exactly once, the wallet exact, and the pre-filter hit again once Redis was back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_killed_hung_flushed_restarted_and_evicting_mid_run_still_exactly_once() {
    let mut redis = Redis::start();
    let db = common::pg().await;
    let producer = common::producer();
    let topic = common::unique("prefilter-chaos");
    let consumer = common::unique("prefilter-chaos");
    common::create_topic(&topic, 2).await;
    let user = common::unique("u");
    let cfg = common::config(&consumer, &topic, CASHBACK, &prefilter(&redis.url()));
    let worker = common::start(cfg).await;
    let stats = worker.stats(&consumer).unwrap();

    let mut sent: Vec<Payment> = Vec::new();
    let mut records = 0u64;
    // One wave: `new` fresh payments and a copy of every payment sent so far (the same record
    // again, as a relay's resend), spread over both partitions; then wait for all of it.
    let mut wave = |new: usize, label: &'static str| {
        let fresh: Vec<Payment> = (0..new)
            .map(|i| Payment::new(&user, 500 + (i as i64 % 40) * 50))
            .collect();
        let copies = sent.clone();
        sent.extend(fresh.iter().cloned());
        records += (fresh.len() + copies.len()) as u64;
        let (producer, topic, stats) = (&producer, &topic, stats.clone());
        let want = records;
        async move {
            let all: Vec<Payment> = copies.into_iter().chain(fresh).collect();
            let (a, b) = all.split_at(all.len() / 2);
            common::send_payments(producer, topic, Some(0), a).await;
            common::send_payments(producer, topic, Some(1), b).await;
            eventually(60, label, || {
                let stats = stats.clone();
                async move { stats.snapshot().records >= want }
            })
            .await;
        }
    };

    wave(100, "wave 1: fresh").await;
    wave(50, "wave 2: copies hit").await;
    let hits_warm = stats.snapshot().prefilter_hits;
    assert!(
        hits_warm >= 100,
        "copies of committed keys hit: {hits_warm}"
    );

    redis.cmd::<()>(&["FLUSHALL"]);
    wave(50, "wave 3: after FLUSHALL (misses; PostgreSQL dedupes)").await;

    redis.kill();
    wave(50, "wave 4: Redis killed").await;

    redis.restart();
    // The worker reconnects in the background (its circuit is at most 5 s).
    tokio::time::sleep(Duration::from_secs(6)).await;
    wave(50, "wave 5: Redis restarted empty").await;

    redis.pause(true);
    let t0 = std::time::Instant::now();
    wave(50, "wave 6: Redis hung (SIGSTOP)").await;
    let hung = t0.elapsed();
    redis.pause(false);
    assert!(
        hung < Duration::from_secs(30),
        "a hung Redis held the partitions: {hung:?}"
    );
    tokio::time::sleep(Duration::from_secs(6)).await;

    // Eviction: a memory limit just above what Redis uses now, least recently used keys out.
    let used = redis.info("used_memory");
    redis.cmd::<()>(&["CONFIG", "SET", "maxmemory-policy", "allkeys-lru"]);
    redis.cmd::<()>(&[
        "CONFIG",
        "SET",
        "maxmemory",
        &(used + 16 * 1024).to_string(),
    ]);
    let hits_before = stats.snapshot().prefilter_hits;
    wave(300, "wave 7: Redis evicting").await;
    wave(50, "wave 8: still evicting").await;
    assert!(redis.info("evicted_keys") > 0, "Redis evicted keys");
    assert!(
        stats.snapshot().prefilter_hits > hits_before,
        "hits again after the restart"
    );

    let s = stats.snapshot();
    worker.stop().await.unwrap();
    let unique = sent.len() as i64;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, unique, "{l:?}");
    assert_eq!(l.distinct_payments, unique, "{l:?}");
    assert_eq!(l.dedupe_keys, unique, "{l:?}");
    assert_eq!(l.parked, 0, "{l:?}");
    assert!(common::doubly_credited(&db, &consumer).await.is_empty());
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        cashback(&sent),
        "the wallet"
    );
    assert_eq!(s.records, records, "{s:?}");
    assert_eq!(s.effects as i64, unique, "{s:?}");
    assert_eq!(s.duplicates, records - unique as u64, "{s:?}");
}

/// A pre-filter whose Redis is not there at all (a closed port): the worker starts, applies
/// everything once, and the batches do not wait for Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_redis_at_all_the_worker_runs_as_without_a_prefilter() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let db = common::pg().await;
    let producer = common::producer();
    let topic = common::unique("prefilter-none");
    let consumer = common::unique("prefilter-none");
    common::create_topic(&topic, 2).await;
    let user = common::unique("u");
    let url = format!("redis://127.0.0.1:{closed}");
    // A timeout far above a batch's time: were it waited for, the drain would show it.
    let extra = format!("[consumer.prefilter]\nredis = \"{url}\"\ntimeout = \"5s\"\n");
    // (Even the first batch does not wait: the refused connection was seen at start-up.)
    let worker = common::start(common::config(&consumer, &topic, CASHBACK, &extra)).await;
    let stats = worker.stats(&consumer).unwrap();
    let payments: Vec<Payment> = (0..200).map(|i| Payment::new(&user, 100 + i)).collect();
    let t0 = std::time::Instant::now();
    for chunk in payments.chunks(20) {
        common::send_payments(&producer, &topic, None, chunk).await;
        common::send_payments(&producer, &topic, None, &chunk[..5]).await;
    }
    common::wait_records(&stats, 250, 60).await;
    let took = t0.elapsed();
    let s = stats.snapshot();
    worker.stop().await.unwrap();
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.parked), (200, 0), "{l:?}");
    assert_eq!(
        (s.effects, s.duplicates, s.prefilter_hits),
        (200, 50, 0),
        "{s:?}"
    );
    // One waited timeout alone would be 5 s.
    assert!(
        took < Duration::from_millis(4_500),
        "{} batches in {took:?}",
        s.batches
    );
}
