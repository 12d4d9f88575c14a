//! The Prometheus endpoint against the real Kafka and PostgreSQL: the counters agree with the
//! traffic and the ledger, and every metric the dashboard and the alert rules use is one the
//! worker really exports (and every exported metric is watched by one of them).
//!
//! The recorder is process-wide and installed once per process, and its HTTP listener runs on
//! the runtime that installed it: every metrics test lives in this one binary, shares one
//! runtime that outlives the tests ([`runtime`]) and one fixture ([`fixture`]), and filters
//! by its own `consumer` label.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::OnceLock;
use std::time::Duration;

use common::{eventually, ledger, Payment};
use effectively::metrics;

// ---------------------------------------------------------------------------------------------
// The exposition format, scraped by hand (no HTTP client in the dependencies).
// ---------------------------------------------------------------------------------------------

/// One sample line: `name{label="value",...} value`.
#[derive(Debug, Clone)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// `GET /metrics` over a plain TCP stream; the body, or a panic with what went wrong.
fn scrape(addr: SocketAddr) -> String {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("connect to the metrics endpoint {addr}: {e}"));
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nAccept: text/plain\r\n\r\n"
    )
    .unwrap();
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .expect("read the response");
    let response = String::from_utf8(response).expect("a UTF-8 response");
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP header in: {response:?}"));
    let status = head.lines().next().unwrap_or_default();
    assert!(
        status.starts_with("HTTP/1.") && status.contains(" 200"),
        "GET /metrics on {addr}: {status}"
    );
    assert!(
        !head
            .to_ascii_lowercase()
            .contains("transfer-encoding: chunked"),
        "a chunked answer to HTTP/1.0: {head}"
    );
    body.to_string()
}

/// The samples of a text-format scrape (comments skipped).
fn parse(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => panic!("bad sample line: {line:?}"),
        };
        let mut labels = BTreeMap::new();
        let rest = if let Some(mut inner) = rest.strip_prefix('{') {
            loop {
                inner = inner.trim_start_matches([',', ' ']);
                if let Some(after) = inner.strip_prefix('}') {
                    break after;
                }
                let (key, after) = inner
                    .split_once("=\"")
                    .unwrap_or_else(|| panic!("bad labels in {line:?}"));
                let mut value = String::new();
                let mut chars = after.char_indices();
                let end = loop {
                    match chars.next() {
                        Some((_, '\\')) => match chars.next() {
                            Some((_, 'n')) => value.push('\n'),
                            Some((_, c)) => value.push(c),
                            None => panic!("bad escape in {line:?}"),
                        },
                        Some((i, '"')) => break i,
                        Some((_, c)) => value.push(c),
                        None => panic!("unterminated label value in {line:?}"),
                    }
                };
                labels.insert(key.trim().to_string(), value);
                inner = &after[end + 1..];
            }
        } else {
            rest
        };
        let value = rest
            .split_whitespace()
            .next()
            .unwrap_or_else(|| panic!("no value in {line:?}"));
        let value = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v
                .parse()
                .unwrap_or_else(|e| panic!("bad value in {line:?}: {e}")),
        };
        out.push(Sample {
            name: name.to_string(),
            labels,
            value,
        });
    }
    out
}

/// Sum of the samples named `name` whose labels include every pair of `with`.
fn sum(samples: &[Sample], name: &str, with: &[(&str, &str)]) -> f64 {
    matching(samples, name, with).map(|s| s.value).sum()
}

fn matching<'a>(
    samples: &'a [Sample],
    name: &'a str,
    with: &'a [(&'a str, &'a str)],
) -> impl Iterator<Item = &'a Sample> + 'a {
    samples.iter().filter(move |s| {
        s.name == name
            && with
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
    })
}

/// A metric family's name: a histogram's `_bucket`, `_count` and `_sum` series are its own.
fn family(name: &str) -> &str {
    ["_bucket", "_count", "_sum"]
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// Every `effectively_*` identifier in a PromQL expression, as a family name.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(i) = rest.find("effectively_") {
        let preceded = rest[..i]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if !preceded {
            out.insert(family(&tail[..end]).to_string());
        }
        rest = &tail[end..];
    }
    out
}

// ---------------------------------------------------------------------------------------------
// One worker, one traffic mix, shared by the tests of this binary.
// ---------------------------------------------------------------------------------------------

/// Outlives every test: the exporter's listener is spawned on it at the first install.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .expect("tokio runtime")
    })
}

/// What the fixture sent to its consumer, and where the metrics are.
#[derive(Debug)]
struct Fixture {
    addr: SocketAddr,
    consumer: String,
    /// A second consumer that was fenced once and had a partition revoked.
    fenced_consumer: String,
    /// A third, with the inbox strategy: five payments received and applied.
    inbox_consumer: String,
    /// A fifth, with a Redis pre-filter: five payments applied, then the same five again.
    prefilter_consumer: String,
    /// Every record produced to the consumer's topic.
    sent: u64,
    /// Unique payments: what must be credited.
    payments: u64,
    /// Copies of payments already applied (same event id, same bytes).
    copies: u64,
    /// New event ids for payments already credited.
    double_taps: u64,
    /// Records that cannot be applied.
    poison: u64,
    /// The scrape taken once everything settled.
    text: String,
}

static FIXTURE: tokio::sync::OnceCell<Fixture> = tokio::sync::OnceCell::const_new();

fn free_loopback_addr() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let addr = listener.local_addr().unwrap();
    drop(listener);
    addr
}

async fn fixture() -> &'static Fixture {
    FIXTURE.get_or_init(set_up).await
}

async fn set_up() -> Fixture {
    let addr = free_loopback_addr();
    let topic = common::unique("metrics");
    let consumer = common::unique("metrics");
    common::create_topic(&topic, 2).await;
    let db = common::pg().await;
    let producer = common::producer();
    let user = common::unique("u");

    let mut cfg = common::config(&consumer, &topic, r#"{ kind = "cashback" }"#, "");
    cfg.worker.metrics_addr = Some(addr);
    let worker = common::start(cfg).await;
    let stats = worker.stats(&consumer).unwrap();

    // Ten payments on each partition, applied first.
    let payments: Vec<Payment> = (0..20)
        .map(|i| Payment::new(&user, 10_000 + i * 100))
        .collect();
    for (p, chunk) in payments.chunks(10).enumerate() {
        common::send_payments(&producer, &topic, Some(p as i32), chunk).await;
    }
    eventually(40, "the 20 payments credited", || {
        let db = &db;
        let consumer = &consumer;
        async move { ledger(db, consumer).await.credits == 20 }
    })
    .await;

    // Then what a real stream adds: relay resends (the same record again), double taps (a new
    // event id for a payment already credited) and poison.
    let copies: Vec<Payment> = payments[..6].to_vec();
    common::send_payments(&producer, &topic, Some(0), &copies[..3]).await;
    common::send_payments(&producer, &topic, Some(1), &copies[3..]).await;
    let double_taps: Vec<Payment> = payments[10..13]
        .iter()
        .map(|p| {
            let mut tap = Payment::new(&user, p.amount_paise);
            tap.payment_id = p.payment_id.clone();
            tap
        })
        .collect();
    common::send_payments(&producer, &topic, Some(1), &double_taps).await;
    let no_event_id = Payment::new(&user, 777).json();
    let not_json = b"{\"payment_id\": \"pay_broken\", \x00\xff not json".to_vec();
    common::send_raw(
        &producer,
        &topic,
        Some(0),
        &[
            (None, no_event_id),
            (Some(uuid::Uuid::now_v7().to_string()), not_json),
        ],
    )
    .await;
    let poison = 2u64;
    let sent = payments.len() as u64 + copies.len() as u64 + double_taps.len() as u64 + poison;
    eventually(40, "every record processed", || {
        let stats = stats.clone();
        async move { stats.snapshot().records >= sent }
    })
    .await;

    // A second consumer, fenced once: a usurper claims its partition 0 in PostgreSQL, so its
    // next batch hits the epoch fence; then a new member joins and one of the zombie's two
    // partitions is revoked in the (cooperative) rebalance. The fenced payment is applied by
    // the heir if partition 0 moved, or by the zombie claiming it again if it stayed.
    let fenced_consumer = common::unique("metrics-fenced");
    let fenced_topic = common::unique("metrics-fenced");
    common::create_topic(&fenced_topic, 2).await;
    let zcfg = common::config(
        &fenced_consumer,
        &fenced_topic,
        r#"{ kind = "cashback" }"#,
        "",
    );
    let zombie = common::start(zcfg.clone()).await;
    let zstats = zombie.stats(&fenced_consumer).unwrap();
    let warmup = Payment::new(&user, 1_000);
    common::send_payments(&producer, &fenced_topic, Some(0), &[warmup]).await;
    eventually(40, "the zombie's first payment credited", || {
        let db = &db;
        let c = &fenced_consumer;
        async move { ledger(db, c).await.credits == 1 }
    })
    .await;
    effectively::store::offsets::claim(&db, &fenced_consumer, &fenced_topic, 0, "usurper")
        .await
        .unwrap();
    common::send_payments(
        &producer,
        &fenced_topic,
        Some(0),
        &[Payment::new(&user, 2_000)],
    )
    .await;
    eventually(40, "the zombie fenced", || {
        let zstats = zstats.clone();
        async move { zstats.snapshot().fenced >= 1 }
    })
    .await;
    let heir = common::start(zcfg).await;
    eventually(40, "the heir applies the fenced payment", || {
        let db = &db;
        let c = &fenced_consumer;
        async move { ledger(db, c).await.credits == 2 }
    })
    .await;

    // A third consumer with the inbox strategy, so its processors' metrics are exported too
    // (every worker of this process records into the one exporter).
    let inbox_consumer = common::unique("metrics-inbox");
    let inbox_topic = common::unique("metrics-inbox");
    common::create_topic(&inbox_topic, 1).await;
    let inbox = common::start_cashback(&inbox_consumer, &inbox_topic, "strategy = \"inbox\"").await;
    let inbox_payments: Vec<Payment> = (0..5).map(|i| Payment::new(&user, 500 + i)).collect();
    common::send_payments(&producer, &inbox_topic, Some(0), &inbox_payments).await;
    eventually(40, "the inbox consumer's payments credited", || {
        let db = &db;
        let c = &inbox_consumer;
        async move { ledger(db, c).await.credits == 5 }
    })
    .await;

    // A fourth, versioned (delta): version 1 applied, 3 held behind the missing 2, and a copy
    // of 1 under a new event id acked as a duplicate.
    let versioned_consumer = common::unique("metrics-versioned");
    let versioned_topic = common::unique("metrics-versioned");
    common::create_topic(&versioned_topic, 1).await;
    let versioned = common::start(common::config(
        &versioned_consumer,
        &versioned_topic,
        r#"{ kind = "order-status" }"#,
        "[consumer.version]\naggregate = \"/order_id\"\nversion = \"/version\"\nmode = \"delta\"",
    ))
    .await;
    let order = common::unique("metrics-order");
    let status = |v: i64| {
        (
            Some(uuid::Uuid::now_v7().to_string()),
            serde_json::to_vec(
                &serde_json::json!({"order_id": order, "version": v, "status": "PAID"}),
            )
            .unwrap(),
        )
    };
    common::send_raw(
        &producer,
        &versioned_topic,
        Some(0),
        &[status(1), status(3)],
    )
    .await;
    common::send_raw(&producer, &versioned_topic, Some(0), &[status(1)]).await;
    eventually(40, "the versioned consumer's three records stored", || {
        let db = &db;
        let (c, t) = (&versioned_consumer, &versioned_topic);
        async move { common::stored_offset(db, c, t, 0).await == Some(3) }
    })
    .await;

    // A fifth, with a Redis pre-filter (a redis-server of its own): five payments applied and
    // set in Redis, then the same five records again, which hit.
    let redis = common::redis_server::Redis::start();
    let prefilter_consumer = common::unique("metrics-prefilter");
    let prefilter_topic = common::unique("metrics-prefilter");
    common::create_topic(&prefilter_topic, 1).await;
    let prefiltered = common::start_cashback(
        &prefilter_consumer,
        &prefilter_topic,
        &format!(
            "[consumer.prefilter]\nredis = \"{}\"\ntimeout = \"1s\"",
            redis.url()
        ),
    )
    .await;
    let pstats = prefiltered.stats(&prefilter_consumer).unwrap();
    let prefilter_payments: Vec<Payment> = (0..5).map(|i| Payment::new(&user, 700 + i)).collect();
    common::send_payments(&producer, &prefilter_topic, Some(0), &prefilter_payments).await;
    common::wait_records(&pstats, 5, 40).await;
    common::send_payments(&producer, &prefilter_topic, Some(0), &prefilter_payments).await;
    common::wait_records(&pstats, 10, 40).await;
    prefiltered.stop().await.unwrap();
    drop(redis);

    // An outbox relay in this process, publishing one row.
    let relay_type = common::unique("MetricsEvent");
    let relay_topic = common::unique("metrics-relay");
    common::create_topic(&relay_topic, 1).await;
    let relay_config = effectively::config::Config::from_toml_str(&format!(
        "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n\
         [relay]\ntopics = {{ \"{relay_type}\" = \"{relay_topic}\" }}\npoll_interval = \"50ms\"\n",
        common::kafka_brokers(),
        common::database_url()
    ))
    .unwrap();
    let relay_stop = tokio_util::sync::CancellationToken::new();
    let relay = tokio::spawn(
        effectively::relay::Relay::new(&relay_config)
            .unwrap()
            .run(relay_stop.clone()),
    );
    db.execute(
        "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ($1, 'a', $2, '{}')",
        &[&uuid::Uuid::now_v7(), &relay_type],
    )
    .await
    .unwrap();
    eventually(40, "the relay published its row", || {
        let db = &db;
        let t = &relay_type;
        async move {
            let left: i64 = db
                .query_one(
                    "SELECT count(*) FROM outbox WHERE event_type = $1 AND published_at IS NULL",
                    &[t],
                )
                .await
                .unwrap()
                .get(0);
            left == 0
        }
    })
    .await;
    relay_stop.cancel();
    relay.await.unwrap();

    // A notification sender in this process, delivering one notification to a provider stub.
    let stub = provider_stub::ProviderStub::start("127.0.0.1:0")
        .await
        .unwrap();
    let channel = common::unique("metrics-sms");
    let sender_config = effectively::config::Config::from_toml_str(&format!(
        "[database]\nurl = \"{}\"\n[sender]\npoll_interval = \"50ms\"\n\
         [sender.channels.{channel}]\nurl = \"{}/v1/messages\"\nlookup = true\n",
        common::database_url(),
        stub.url()
    ))
    .unwrap();
    db.execute(
        "INSERT INTO notifications (event_id, channel, payload) VALUES ($1, $2, '{}')",
        &[&uuid::Uuid::now_v7(), &channel],
    )
    .await
    .unwrap();
    let sender_stop = tokio_util::sync::CancellationToken::new();
    let sender = tokio::spawn(
        effectively::sender::Sender::new(&sender_config)
            .unwrap()
            .run(sender_stop.clone()),
    );
    eventually(40, "the sender delivered its notification", || {
        let stub = &stub;
        async move { stub.messages().len() == 1 }
    })
    .await;
    sender_stop.cancel();
    sender.await.unwrap();

    // The sampled gauges: the dead letters and the inbox rows (every 15 s) and the lag (every
    // 5 s) catch up.
    eventually(
        40,
        "dead_letters_waiting, the inbox rows, the held versions and the lag sampled",
        || {
            let consumer = consumer.clone();
            let inbox_consumer = inbox_consumer.clone();
            let versioned_consumer = versioned_consumer.clone();
            async move {
                let s = parse(&scrape(addr));
                let lag = [("consumer", consumer.as_str())];
                let inbox = [("consumer", inbox_consumer.as_str())];
                let v = [("consumer", versioned_consumer.as_str())];
                let reason =
                    |r: &'static str| [("consumer", versioned_consumer.as_str()), ("reason", r)];
                sum(&s, metrics::DEAD_LETTERS_WAITING, &lag) == poison as f64
                    && matching(&s, metrics::CONSUMER_LAG, &lag).count() == 2
                    && sum(&s, metrics::CONSUMER_LAG, &lag) == 0.0
                    && matching(&s, metrics::INBOX_ROWS, &inbox).count() == 3
                    && sum(&s, metrics::INBOX_ROWS, &inbox) == 0.0
                    && sum(&s, metrics::VERSION_HELD, &v) == 1.0
                    && sum(&s, metrics::VERSION_GAPS_OVERDUE, &v) == 0.0
                    && sum(&s, metrics::VERSION_SKIPPED, &reason("held")) == 1.0
                    && sum(&s, metrics::VERSION_SKIPPED, &reason("duplicate")) == 1.0
                    && sum(&s, metrics::VERSION_SKIPPED, &reason("stale")) == 0.0
            }
        },
    )
    .await;

    versioned.stop().await.unwrap();
    inbox.stop().await.unwrap();
    heir.stop().await.unwrap();
    zombie.stop().await.unwrap();
    worker.stop().await.unwrap();
    Fixture {
        addr,
        consumer,
        fenced_consumer,
        inbox_consumer,
        prefilter_consumer,
        sent,
        payments: payments.len() as u64,
        copies: copies.len() as u64,
        double_taps: double_taps.len() as u64,
        poison,
        text: scrape(addr),
    }
}

// ---------------------------------------------------------------------------------------------
// The tests.
// ---------------------------------------------------------------------------------------------

#[test]
fn the_inbox_counters_agree_with_its_ledger() {
    runtime().block_on(async {
        let f = fixture().await;
        let s = parse(&f.text);
        let c = f.inbox_consumer.as_str();
        let outcome = |o| {
            sum(
                &s,
                metrics::INBOX_PROCESSED,
                &[("consumer", c), ("outcome", o)],
            )
        };
        assert_eq!(
            (outcome("done"), outcome("retry"), outcome("failed")),
            (5.0, 0.0, 0.0)
        );
        let me = [("consumer", c)];
        assert_eq!(sum(&s, metrics::EFFECTS_APPLIED, &me), 5.0);
        assert_eq!(sum(&s, metrics::INBOX_LEASE_LOST, &me), 0.0);
        let rounds = format!("{}_count", metrics::INBOX_PROCESS_DURATION);
        assert!(sum(&s, &rounds, &me) >= 1.0, "rounds observed");
        assert_eq!(sum(&s, metrics::INBOX_OLDEST_PENDING_AGE, &me), 0.0);
        // The receiver counts its records like any strategy; it applies nothing itself.
        assert_eq!(sum(&s, metrics::RECORDS_RECEIVED, &me), 5.0);
    })
}

#[test]
fn the_prefilter_counters_agree_with_its_traffic() {
    runtime().block_on(async {
        let f = fixture().await;
        let s = parse(&f.text);
        let c = f.prefilter_consumer.as_str();
        let with = |k, v| [("consumer", c), (k, v)];
        let lookups = |r| sum(&s, metrics::PREFILTER_LOOKUPS, &with("result", r));
        assert_eq!(
            (lookups("hit"), lookups("miss"), lookups("error")),
            (5.0, 5.0, 0.0),
            "the second copies hit, the first missed"
        );
        let sets = |r| sum(&s, metrics::PREFILTER_SETS, &with("result", r));
        assert_eq!(
            (sets("ok"), sets("error")),
            (5.0, 0.0),
            "committed keys set"
        );
        assert_eq!(sum(&s, metrics::PREFILTER_ERRORS, &[("consumer", c)]), 0.0);
        assert_eq!(
            matching(&s, metrics::PREFILTER_ERRORS, &[("consumer", c)]).count(),
            6,
            "every op and kind published at 0"
        );
        let count = format!("{}_count", metrics::PREFILTER_DURATION);
        assert!(
            sum(&s, &count, &with("op", "lookup")) >= 2.0,
            "lookups timed"
        );
        assert!(sum(&s, &count, &with("op", "set")) >= 1.0, "sets timed");
        let dup = |r| {
            sum(
                &s,
                metrics::DUPLICATES_SKIPPED,
                &[("consumer", c), ("reason", r)],
            )
        };
        assert_eq!((dup("prefilter"), dup("dedupe_key")), (5.0, 0.0));
        assert_eq!(sum(&s, metrics::EFFECTS_APPLIED, &[("consumer", c)]), 5.0);
    })
}

#[test]
fn the_counters_agree_with_the_traffic_and_the_ledger() {
    runtime().block_on(async {
        let f = fixture().await;
        let s = parse(&f.text);
        let me = [("consumer", f.consumer.as_str())];
        let db = common::pg().await;
        let l = ledger(&db, &f.consumer).await;
        assert_eq!(l.credits, f.payments as i64, "{l:?}");
        assert_eq!(l.parked, f.poison as i64, "{l:?}");

        let received = sum(&s, metrics::RECORDS_RECEIVED, &me);
        assert_eq!(received, f.sent as f64, "records received");
        // Two partitions: one series each.
        assert_eq!(matching(&s, metrics::RECORDS_RECEIVED, &me).count(), 2);
        assert_eq!(
            sum(&s, metrics::EFFECTS_APPLIED, &me),
            l.credits as f64,
            "effects applied = payments credited in the ledger"
        );
        let dup = |reason| {
            sum(
                &s,
                metrics::DUPLICATES_SKIPPED,
                &[("consumer", f.consumer.as_str()), ("reason", reason)],
            )
        };
        assert_eq!(dup("dedupe_key"), f.copies as f64, "copies skipped");
        assert_eq!(dup("business_key"), f.double_taps as f64, "double taps");
        assert_eq!(dup("below_stored_offset"), 0.0, "no seek race: one worker");
        assert_eq!(
            sum(&s, metrics::PARKED, &me),
            f.poison as f64,
            "parked, all reasons"
        );
        let reason = |r| {
            sum(
                &s,
                metrics::PARKED,
                &[("consumer", f.consumer.as_str()), ("reason", r)],
            )
        };
        assert_eq!(reason("missing_event_id"), 1.0);
        assert_eq!(reason("undecodable_payload"), 1.0);

        // One latency observation per fresh message committed: every payment's effect, and
        // every double tap's (a new dedupe key whose effect was already there).
        let e2e_count = format!("{}_count", metrics::E2E_LATENCY);
        assert_eq!(
            sum(&s, &e2e_count, &me),
            (l.credits as u64 + f.double_taps as u64) as f64,
            "e2e latency observations = fresh keys ({} credits + {} double taps)",
            l.credits,
            f.double_taps
        );
        let inf = [("consumer", f.consumer.as_str()), ("le", "+Inf")];
        let e2e_bucket = format!("{}_bucket", metrics::E2E_LATENCY);
        assert_eq!(
            sum(&s, &e2e_bucket, &inf),
            sum(&s, &e2e_count, &me),
            "the +Inf bucket holds every observation"
        );

        // Every record went through a batch.
        let batch_size_sum = format!("{}_sum", metrics::BATCH_SIZE);
        assert_eq!(sum(&s, &batch_size_sum, &me), f.sent as f64, "batch sizes");
        for phase in ["fence", "stage", "dedupe", "effect", "commit"] {
            let with = [("consumer", f.consumer.as_str()), ("phase", phase)];
            let count = format!("{}_count", metrics::BATCH_PHASE);
            assert!(sum(&s, &count, &with) >= 1.0, "phase {phase} observed");
        }

        // Gauges, sampled after the traffic.
        assert_eq!(sum(&s, metrics::DEAD_LETTERS_WAITING, &me), l.parked as f64);
        assert_eq!(sum(&s, metrics::CONSUMER_LAG, &me), 0.0, "caught up");
        assert!(sum(&s, metrics::PARTITIONS_ASSIGNED, &me) >= 2.0);
        assert!(sum(&s, metrics::REBALANCES, &me) >= 1.0);
        assert_eq!(sum(&s, metrics::FENCED, &me), 0.0, "never fenced");
        let ahead = sum(&s, metrics::DEDUPE_PARTITIONS_AHEAD, &[]);
        assert!(ahead >= 1.0, "dedupe partitions ahead: {ahead}");
        let today = chrono::Utc::now()
            .date_naive()
            .format("%Y-%m-%d")
            .to_string();
        assert_eq!(
            matching(
                &s,
                metrics::DEDUPE_PARTITION_BYTES,
                &[("day", today.as_str())]
            )
            .count(),
            1,
            "today's dedupe partition is measured"
        );

        // The fenced consumer: one fence, one revocation.
        let z = [("consumer", f.fenced_consumer.as_str())];
        assert_eq!(sum(&s, metrics::FENCED, &z), 1.0, "one fenced transaction");
        assert!(sum(&s, metrics::PARTITIONS_REVOKED, &z) >= 1.0);
    });
}

#[test]
fn every_metric_the_dashboard_and_alerts_use_is_exported_and_every_export_is_watched() {
    let root = env!("CARGO_MANIFEST_DIR");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{root}/grafana/dashboards/effectively.json")).unwrap(),
    )
    .expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 20, "panel queries: {exprs:?}");
    let in_dashboard: BTreeSet<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    let variable = dashboard["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == "consumer")
        .expect("a consumer variable");
    assert_eq!(
        variable["definition"],
        "label_values(effectively_records_received_total, consumer)"
    );

    let alerts = std::fs::read_to_string(format!("{root}/grafana/alerts.yml")).unwrap();
    let alert_exprs = yaml_exprs(&alerts);
    assert_eq!(
        alert_exprs.len(),
        alerts.matches("- alert:").count(),
        "one expr per alert: {alert_exprs:#?}"
    );
    let in_alerts: BTreeSet<String> = alert_exprs.iter().flat_map(|e| metric_names(e)).collect();

    let exported: BTreeSet<&str> = metrics::ALL.iter().copied().collect();
    let used: BTreeSet<&str> = in_dashboard
        .iter()
        .chain(&in_alerts)
        .map(String::as_str)
        .collect();
    let unknown: Vec<&&str> = used.difference(&exported).collect();
    assert!(unknown.is_empty(), "not in metrics::ALL: {unknown:?}");
    // Every export is watched. (No exception: should one be needed, list it here with why.)
    const UNWATCHED: &[(&str, &str)] = &[];
    let unwatched: Vec<&&str> = exported
        .difference(&used)
        .filter(|n| !UNWATCHED.iter().any(|(u, _)| u == *n))
        .collect();
    assert!(
        unwatched.is_empty(),
        "exported but on no panel and in no alert: {unwatched:?}"
    );

    // And each one is in a real scrape of a worker that processed traffic.
    runtime().block_on(async {
        let f = fixture().await;
        let live = scrape(f.addr);
        let samples = parse(&live);
        let families: BTreeSet<&str> = samples.iter().map(|s| family(&s.name)).collect();
        let missing: Vec<&&str> = used.iter().filter(|n| !families.contains(**n)).collect();
        assert!(
            missing.is_empty(),
            "used by the dashboard or alerts but absent from the scrape: {missing:?}"
        );
        for name in metrics::ALL {
            assert!(
                live.contains(&format!("# HELP {name} ")),
                "{name} has no description"
            );
            assert!(
                live.contains(&format!("# TYPE {name} ")),
                "{name} has no type"
            );
        }
    });
}

/// Every `expr` string in a JSON document (the dashboard's panel queries).
fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", serde_json::Value::String(e)) => out.push(e.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(items) => items.iter().for_each(|i| collect_exprs(i, out)),
        _ => {}
    }
}

/// The `expr:` values of a rules file: the key's line and the lines indented under it (block
/// and multi-line scalars), which is all the YAML these rules use.
fn yaml_exprs(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for line in text.lines() {
        let indent = line.len() - line.trim_start().len();
        let trimmed = line.trim();
        if let Some((key_indent, expr)) = current.as_mut() {
            if trimmed.is_empty() || indent > *key_indent {
                expr.push(' ');
                expr.push_str(trimmed);
                continue;
            }
            out.push(std::mem::take(expr));
            current = None;
        }
        if trimmed.starts_with('#') {
            continue;
        }
        if let Some(rest) = trimmed.strip_prefix("expr:") {
            current = Some((indent, rest.trim().to_string()));
        }
    }
    out.extend(current.map(|(_, e)| e));
    out
}
