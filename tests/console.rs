//! The web console against the real Kafka and PostgreSQL: a worker in-process parks real
//! messages (a missing event id, an undecodable payload, a payment without its payment id that
//! carries a card number) under a batch consumer and an inbox consumer; then the console is
//! started in-process on 127.0.0.1:0 and asked over HTTP.
//!
//! Pages, filters, the security defaults (token, read-only, cross-site refusal, CSP), masking,
//! the actions with their confirmations, a consumer's page with its pause, resume and offset
//! reset, a crawler that follows every link from the overview, and headless Chromium rendering
//! three pages (screenshots into docs/img/).

mod common;

use std::collections::{BTreeSet, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use effectively::config::Config;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;

/// The card number the masked payloads carry: no page may ever show it.
const CARD: &str = "4111 1111 1111 1111";

/// One test's world: a topic, two consumers with parked rows, a FAILED notification.
struct World {
    topic: String,
    batch: String,
    inbox: String,
    channel: String,
    /// The poison payment's event id (no payment_id, a card number).
    card_event: uuid::Uuid,
    /// A payment the batch consumer applied (for a redrive that must change nothing).
    applied: Payment,
}

fn config_text(w: &World, console: &str) -> String {
    format!(
        r#"
[kafka]
brokers = "{brokers}"
session_timeout = "10s"
[kafka.options]
"heartbeat.interval.ms" = "500"
"topic.metadata.refresh.interval.ms" = "1000"
[database]
url = "{db}"
pool_size = 8
[worker]
revoke_deadline = "5s"
[[consumer]]
name = "{batch}"
topics = ["{topic}"]
handler = {{ kind = "cashback" }}
[[consumer]]
name = "{inbox}"
topics = ["{topic}"]
strategy = "inbox"
handler = {{ kind = "cashback" }}
retry = {{ max_attempts = 1, initial_backoff = "10ms", max_backoff = "10ms" }}
[consumer.inbox]
processors = 1
[console]
addr = "127.0.0.1:0"
mask = ["/card/number"]
{console}
"#,
        brokers = kafka_brokers(),
        db = database_url(),
        batch = w.batch,
        inbox = w.inbox,
        topic = w.topic,
    )
}

async fn send(topic: &str, partition: i32, event_id: Option<uuid::Uuid>, payload: &[u8]) {
    let p = producer();
    let mut headers = OwnedHeaders::new();
    let id = event_id.map(|e| e.to_string());
    if let Some(id) = &id {
        headers = headers.insert(Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        });
    }
    let headers = headers.insert(Header {
        key: "source",
        value: Some(b"console-test".as_slice()),
    });
    let rec = FutureRecord::<[u8], [u8]>::to(topic)
        .partition(partition)
        .key(b"k-1".as_slice())
        .payload(payload)
        .headers(headers);
    p.send(rec, Duration::from_secs(30))
        .await
        .expect("delivery");
}

/// Runs a worker over a fresh topic until both consumers parked what they must, then stops it.
async fn world() -> World {
    let w = World {
        topic: unique("console"),
        batch: unique("console-batch"),
        inbox: unique("console-inbox"),
        channel: unique("sms"),
        card_event: uuid::Uuid::now_v7(),
        applied: Payment::new("u0", 10_000),
    };
    create_topic(&w.topic, 2).await;
    let config = Config::from_toml_str(&config_text(&w, "")).expect("config");
    let worker = start(config).await;
    send(&w.topic, 0, Some(w.applied.event_id), &w.applied.json()).await;
    for i in 1..5 {
        let pay = Payment::new(&format!("u{i}"), 10_000 + i);
        send(&w.topic, 0, Some(pay.event_id), &pay.json()).await;
    }
    // No event id: missing_event_id, for both consumers.
    send(&w.topic, 0, None, &Payment::new("u1", 500).json()).await;
    // Not JSON.
    send(
        &w.topic,
        0,
        Some(uuid::Uuid::now_v7()),
        b"\xff\xfe not json",
    )
    .await;
    // A payment without payment_id that carries a card number: refused by the handler's check
    // (a dead letter for the batch consumer, a FAILED row for the inbox consumer).
    let card = serde_json::json!({
        "event_id": w.card_event, "user_id": "u9", "amount_paise": 1,
        "occurred_at": chrono::Utc::now().to_rfc3339(),
        "card": {"number": CARD, "exp": "12/29"},
    });
    send(
        &w.topic,
        1,
        Some(w.card_event),
        &serde_json::to_vec(&card).unwrap(),
    )
    .await;
    let db = pg().await;
    let (batch, inbox) = (w.batch.clone(), w.inbox.clone());
    eventually(60, "3 dead letters and 2 + 1 FAILED", || {
        let db = &db;
        let (batch, inbox) = (batch.clone(), inbox.clone());
        async move {
            let n = |sql: &'static str, c: String| async move {
                db.query_one(sql, &[&c]).await.unwrap().get::<_, i64>(0)
            };
            let dl = "SELECT count(*) FROM dead_letters WHERE consumer = $1";
            let failed = "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = 'FAILED'";
            n(dl, batch).await == 3
                && n(dl, inbox.clone()).await == 2
                && n(failed, inbox).await == 1
        }
    })
    .await;
    worker.stop().await.expect("worker stops");
    db.execute(
        "INSERT INTO notifications (event_id, channel, status, payload, last_error)
         VALUES ($1, $2, 'FAILED', $3, 'provider said no')",
        &[
            &uuid::Uuid::now_v7(),
            &w.channel,
            &serde_json::json!({"to": "+911234567890", "card": {"number": CARD}}),
        ],
    )
    .await
    .unwrap();
    w
}

/// A console for `w` with `console` settings appended to `[console]`; stops when dropped.
struct Running {
    addr: SocketAddr,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn console(w: &World, settings: &str) -> Running {
    let config = Config::from_toml_str(&config_text(w, settings)).expect("config");
    let bound = effectively::console::bind(&config, None)
        .await
        .expect("console binds");
    let addr = bound.addr;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(bound.run(async move {
        let _ = stopped.await;
    }));
    Running { addr, _stop: stop }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn get(addr: SocketAddr, path: &str) -> (u16, String, reqwest::header::HeaderMap) {
    let r = client()
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap();
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, r.text().await.unwrap(), headers)
}

/// Every `href="…"` of a page that points into the console, unescaped.
fn links(html: &str) -> Vec<String> {
    html.split("href=\"")
        .skip(1)
        .filter_map(|rest| rest.split('"').next())
        .map(|h| h.replace("&amp;", "&").replace("&#38;", "&"))
        .filter(|h| h.starts_with('/'))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pages_render_with_data_and_every_link_works() {
    let w = world().await;
    let c = console(&w, "").await;

    let (status, overview, headers) = get(c.addr, "/").await;
    assert_eq!(status, 200, "{overview}");
    assert!(headers["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("default-src 'none'"));
    assert!(overview.contains(&w.batch) && overview.contains(&w.inbox));
    assert!(
        overview.contains("missing_event_id"),
        "dead letters by reason"
    );
    assert!(
        overview.contains("<meta http-equiv=\"refresh\""),
        "live refresh"
    );
    assert!(overview.contains("Pause"));
    let (_, paused, _) = get(c.addr, "/?refresh=off").await;
    assert!(!paused.contains("http-equiv=\"refresh\"") && paused.contains("Resume"));

    let (status, inbox, _) = get(
        c.addr,
        &format!("/inbox?consumer={}&status=FAILED", w.inbox),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        inbox.contains(&w.card_event.to_string()),
        "the FAILED row is listed"
    );
    let (status, outbox, _) = get(c.addr, "/outbox?published=0").await;
    assert_eq!(status, 200, "{outbox}");
    let (status, notes, _) = get(
        c.addr,
        &format!("/notifications?status=FAILED&channel={}", w.channel),
    )
    .await;
    assert_eq!(status, 200);
    assert!(
        notes.contains(&w.channel) && notes.contains("***"),
        "masked payload shown"
    );

    // The crawler: every link from the overview, breadth first, each page once.
    let mut seen = BTreeSet::new();
    let mut queue = VecDeque::from([("/".to_string(), "start".to_string())]);
    while let Some((path, from)) = queue.pop_front() {
        if !seen.insert(path.clone()) || seen.len() > 400 {
            continue;
        }
        let (status, body, headers) = get(c.addr, &path).await;
        assert_eq!(
            status, 200,
            "{path} (linked from {from}) answered {status}: {body}"
        );
        assert!(headers.contains_key("content-security-policy"), "{path}");
        assert!(!body.contains(CARD), "{path} shows the masked card number");
        for link in links(&body) {
            if !seen.contains(&link) {
                queue.push_back((link, path.clone()));
            }
        }
    }
    assert!(seen.len() > 10, "the crawler saw only {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn security_defaults() {
    let w = world().await;
    // A non-loopback address without a token is refused at load.
    let err = Config::from_toml_str(&config_text(&w, "").replace("127.0.0.1:0", "0.0.0.0:0"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a loopback address"), "{err}");

    // Read-only (the default): a same-origin POST is still refused.
    let c = console(&w, "").await;
    let r = client()
        .post(format!("http://{}/", c.addr))
        .header("sec-fetch-site", "same-origin")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);
    assert!(r.text().await.unwrap().contains("read-only"));
    // Without a token, a page asked for by another name (DNS rebinding) is refused.
    let r = client()
        .get(format!("http://{}/", c.addr))
        .header("host", format!("attacker.example:{}", c.addr.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);
    assert!(r.text().await.unwrap().contains("Host not allowed"));
    let r = client()
        .get(format!("http://localhost:{}/", c.addr.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "localhost is loopback");

    // With writes on: a cross-site POST, a foreign Origin, or neither header: refused.
    let c = console(&w, "writes = true").await;
    let post = |extra: &'static [(&'static str, &'static str)]| {
        let mut rb = client().post(format!("http://{}/", c.addr));
        for (k, v) in extra {
            rb = rb.header(*k, *v);
        }
        async move { rb.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(post(&[("sec-fetch-site", "cross-site")]).await, 403);
    assert_eq!(post(&[("origin", "http://evil.example")]).await, 403);
    assert_eq!(post(&[]).await, 403);
    // Same origin and writes on: past the guard (no page answers POST /).
    assert_eq!(post(&[("sec-fetch-site", "same-origin")]).await, 405);

    // A token: missing and wrong are 401 (with the browser's prompt), right is 200.
    let file = std::env::temp_dir().join(unique("console-token"));
    std::fs::write(&file, "0123456789abcdef-secret\n").unwrap();
    let c = console(
        &w,
        &format!("token_file = {:?}", file.display().to_string()),
    )
    .await;
    let url = format!("http://{}/", c.addr);
    let r = client().get(&url).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.headers()["www-authenticate"]
        .to_str()
        .unwrap()
        .starts_with("Basic"));
    assert!(!r.text().await.unwrap().contains("secret"));
    let status =
        |rb: reqwest::RequestBuilder| async move { rb.send().await.unwrap().status().as_u16() };
    assert_eq!(
        status(client().get(&url).bearer_auth("wrong-token-0123456")).await,
        401
    );
    assert_eq!(
        status(client().get(&url).bearer_auth("0123456789abcdef-secret")).await,
        200
    );
    assert_eq!(
        status(
            client()
                .get(&url)
                .basic_auth("ops", Some("0123456789abcdef-secret"))
        )
        .await,
        200
    );
    assert_eq!(
        status(client().get(format!("http://{}/static/console.css", c.addr))).await,
        401,
        "the stylesheet too"
    );
    let _ = std::fs::remove_file(file);
}

async fn one(
    db: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> i64 {
    db.query_one(sql, params).await.unwrap().get(0)
}

/// A consumer's credits and dead letters (parked or resolved).
async fn credits(db: &tokio_postgres::Client, consumer: &str) -> (i64, i64) {
    let r = db
        .query_one(
            "SELECT (SELECT count(*) FROM cashback_credits WHERE consumer = $1),
                    (SELECT count(*) FROM dead_letters WHERE consumer = $1)",
            &[&consumer],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// The batch consumer's dead letter of `reason` (its id).
async fn dead_letter_id(db: &tokio_postgres::Client, consumer: &str, reason: &str) -> i64 {
    one(
        db,
        "SELECT id FROM dead_letters WHERE consumer = $1 AND reason = $2 ORDER BY id LIMIT 1",
        &[&consumer, &reason],
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parked_filters_and_message_pages() {
    let w = world().await;
    let c = console(&w, "").await;
    let db = pg().await;
    let rows = |html: &str| html.matches("<tr><td>").count();

    let (status, all, _) = get(c.addr, &format!("/parked?consumer={}", w.batch)).await;
    assert_eq!(status, 200, "{all}");
    assert_eq!(
        rows(&all),
        3,
        "the batch consumer's three dead letters: {all}"
    );
    assert!(
        !all.contains(&format!("<td>{}</td>", w.inbox)),
        "another consumer's rows are filtered out: {all}"
    );
    let (_, inbox, _) = get(c.addr, &format!("/parked?consumer={}", w.inbox)).await;
    assert_eq!(
        rows(&inbox),
        3,
        "two dead letters and a FAILED row: {inbox}"
    );
    assert!(inbox.contains("inbox FAILED") && inbox.contains(&w.card_event.to_string()));
    let (_, failed, _) = get(
        c.addr,
        &format!("/parked?consumer={}&reason=inbox_failed", w.inbox),
    )
    .await;
    assert_eq!(rows(&failed), 1, "{failed}");
    assert!(!failed.contains(">dead letter<"), "{failed}");
    let (_, missing, _) = get(
        c.addr,
        &format!("/parked?consumer={}&reason=missing_event_id", w.batch),
    )
    .await;
    assert_eq!(rows(&missing), 1, "{missing}");
    let (_, p1, _) = get(c.addr, &format!("/parked?topic={}&partition=1", w.topic)).await;
    assert_eq!(
        rows(&p1),
        2,
        "partition 1 holds the card payment of both consumers: {p1}"
    );
    let (_, future, _) = get(
        c.addr,
        &format!("/parked?topic={}&since=2099-01-01T00:00", w.topic),
    )
    .await;
    assert!(future.contains("Nothing parked matches"), "{future}");
    let (_, past, _) = get(c.addr, &format!("/parked?topic={}&until=2h", w.topic)).await;
    assert!(past.contains("Nothing parked matches"), "{past}");
    let (_, recent, _) = get(c.addr, &format!("/parked?topic={}&since=1h", w.topic)).await;
    assert_eq!(rows(&recent), 6, "{recent}");
    assert_eq!(get(c.addr, "/parked?partition=x").await.0, 400);
    // Keyset pages: one row a page walks every row once, by id and seq, and by time when a
    // window is given.
    let c1 = console(&w, "page_size = 1").await;
    for start in [
        format!("/parked?topic={}", w.topic),
        format!("/parked?topic={}&since=1h&until=2099-01-01T00:00", w.topic),
    ] {
        let mut path = start.clone();
        let mut seen = Vec::new();
        loop {
            let (status, page, _) = get(c1.addr, &path).await;
            assert_eq!(status, 200, "{path}: {page}");
            for l in links(&page)
                .into_iter()
                .filter(|l| l.starts_with("/parked/"))
            {
                seen.push(l);
            }
            match links(&page)
                .into_iter()
                .filter(|l| !l.contains("refresh=off"))
                .find(|l| l.contains("dl_before") || l.contains("ib_before"))
            {
                Some(next) => path = next,
                None => break,
            }
            assert!(seen.len() <= 6, "{start}: {seen:?}");
        }
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 6, "{start}: {seen:?}");
    }

    // A dead letter's page: coordinates, reason, key, headers, the JSON masked.
    let id = one(
        &db,
        "SELECT id FROM dead_letters WHERE consumer = $1 AND message_id = $2",
        &[&w.batch, &w.card_event],
    )
    .await;
    let (status, page, _) = get(c.addr, &format!("/parked/dead-letters/{id}")).await;
    assert_eq!(status, 200, "{page}");
    for want in [
        w.topic.as_str(),
        "console-test",
        "k-1",
        "12/29",
        "***",
        "JSON",
        "UTF-8",
        "Hex",
        "payment_id",
    ] {
        assert!(page.contains(want), "the page lacks {want:?}: {page}");
    }
    assert!(!page.contains(CARD), "masked");
    // Not JSON, with masking on: withheld rather than shown unmasked.
    let undecodable = one(
        &db,
        "SELECT id FROM dead_letters WHERE consumer = $1 AND reason <> 'missing_event_id' AND message_id <> $2",
        &[&w.batch, &w.card_event],
    )
    .await;
    let (_, page, _) = get(c.addr, &format!("/parked/dead-letters/{undecodable}")).await;
    assert!(page.contains("not shown: masking is configured"), "{page}");
    // The FAILED inbox row's page.
    let (status, page, _) = get(
        c.addr,
        &format!("/parked/inbox/{}/{}", w.inbox, w.card_event),
    )
    .await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("FAILED") && page.contains("12/29") && !page.contains(CARD),
        "{page}"
    );
    assert_eq!(
        get(c.addr, "/parked/dead-letters/999999999999").await.0,
        404
    );
}

/// A same-origin form POST, as the console's own pages send it.
async fn post(
    addr: SocketAddr,
    path: &str,
    form: &[(&str, String)],
) -> (u16, String, Option<String>) {
    let r = client()
        .post(format!("http://{addr}{path}"))
        .header("sec-fetch-site", "same-origin")
        .form(form)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let location = r
        .headers()
        .get("location")
        .map(|l| l.to_str().unwrap().to_string());
    (status, r.text().await.unwrap(), location)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn actions_confirm_the_count_and_change_only_what_they_say() {
    let w = world().await;
    let db = pg().await;
    let resolution = |id: i64| {
        let db = &db;
        async move {
            db.query_one(
                "SELECT resolution, resolved_by FROM dead_letters WHERE id = $1",
                &[&id],
            )
            .await
            .unwrap()
        }
    };

    // Read-only: the confirmation step is refused too.
    let ro = console(&w, "").await;
    let undecodable = one(
        &db,
        "SELECT id FROM dead_letters WHERE consumer = $1 AND reason <> 'missing_event_id' AND message_id <> $2",
        &[&w.batch, &w.card_event],
    )
    .await;
    let form = vec![
        ("verb", "discard-dead-letters".to_string()),
        ("id", undecodable.to_string()),
    ];
    assert_eq!(post(ro.addr, "/actions/confirm", &form).await.0, 403);

    let c = console(&w, "writes = true").await;
    // One row: the count first, a wrong number changes nothing, the right one acts.
    let (status, page, _) = post(c.addr, "/actions/confirm", &form).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains(&format!("dead letter #{undecodable}")) && page.contains("Type <b>1</b>"),
        "{page}"
    );
    let mut wrong = form.clone();
    wrong.push(("typed", "2".into()));
    let (status, page, _) = post(c.addr, "/actions/do", &wrong).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("Nothing was done"), "{page}");
    assert_eq!(
        resolution(undecodable).await.get::<_, Option<String>>(0),
        None
    );
    let mut right = form.clone();
    right.push(("typed", "1".into()));
    right.push(("note", "junk bytes".into()));
    let (status, _, location) = post(c.addr, "/actions/do", &right).await;
    assert_eq!(status, 303);
    let row = resolution(undecodable).await;
    assert_eq!(
        row.get::<_, Option<String>>(0).as_deref(),
        Some("discarded")
    );
    assert!(row.get::<_, String>(1).starts_with("console:127.0.0.1"));
    let (status, audit, _) = get(c.addr, &location.unwrap()).await;
    assert_eq!(status, 200);
    assert!(
        audit.contains("Done: discard of dead_letters, 1 row(s)") && audit.contains("junk bytes"),
        "{audit}"
    );
    // Done already: the same form now matches nothing.
    let (status, page, _) = post(c.addr, "/actions/do", &right).await;
    assert_eq!(status, 409);
    assert!(page.contains("Nothing matches now"), "{page}");

    // A redrive of a message already applied changes nothing: park a copy of an applied
    // payment, redrive it from the console, run the worker over the copy.
    let before = credits(&db, &w.batch).await;
    let copy = one(
        &db,
        "INSERT INTO dead_letters (consumer, topic, partition, \"offset\", message_id, reason, detail,
                                   key, header_names, header_values, payload)
         VALUES ($1, $2, 0, 1000000, $3, 'handler_error', 'parked by the test', 'k-1',
                 '{event_id}', ARRAY[$4::bytea], $5) RETURNING id",
        &[
            &w.batch,
            &w.topic,
            &w.applied.event_id,
            &w.applied.event_id.to_string().into_bytes(),
            &w.applied.json(),
        ],
    )
    .await;
    let form = vec![
        ("verb", "redrive".to_string()),
        ("id", copy.to_string()),
        ("typed", "1".into()),
    ];
    let (status, page, _) = post(c.addr, "/actions/do", &form).await;
    assert_eq!(status, 303, "{page}");
    assert_eq!(
        resolution(copy)
            .await
            .get::<_, Option<String>>(0)
            .as_deref(),
        Some("redriven")
    );
    let config = Config::from_toml_str(&config_text(&w, "")).expect("config");
    let worker = start(config).await;
    let high = {
        let consumer: rdkafka::consumer::BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", kafka_brokers())
            .create()
            .unwrap();
        let topic = w.topic.clone();
        tokio::task::spawn_blocking(move || {
            rdkafka::consumer::Consumer::fetch_watermarks(
                &consumer,
                &topic,
                0,
                Duration::from_secs(10),
            )
            .unwrap()
            .1
        })
        .await
        .unwrap()
    };
    eventually(60, "the batch consumer read the redriven copy", || async {
        stored_offset(&db, &w.batch, &w.topic, 0).await == Some(high)
    })
    .await;
    worker.stop().await.unwrap();
    // The copy's own row stays (resolved); no credit and no new dead letter.
    assert_eq!(
        credits(&db, &w.batch).await,
        (before.0, before.1 + 1),
        "credits and dead letters unchanged by the redrive"
    );

    // Every row matching a filter: the filter is run again for the count.
    let filter = vec![
        ("verb", "redrive".to_string()),
        ("consumer", w.batch.clone()),
        ("reason", "missing_event_id".into()),
    ];
    let (_, page, _) = post(c.addr, "/actions/confirm", &filter).await;
    assert!(
        page.contains("every parked dead letter matching consumer")
            && page.contains("Type <b>1</b>"),
        "{page}"
    );
    let mut typed = filter.clone();
    typed.push(("typed", "1".into()));
    assert_eq!(post(c.addr, "/actions/do", &typed).await.0, 303);
    let id = dead_letter_id(&db, &w.batch, "missing_event_id").await;
    assert_eq!(
        resolution(id).await.get::<_, Option<String>>(0).as_deref(),
        Some("redriven")
    );

    // The FAILED inbox row: replayed (PENDING again).
    let replay = vec![
        ("verb", "replay".to_string()),
        ("consumer", w.inbox.clone()),
        ("message_id", w.card_event.to_string()),
        ("typed", "1".into()),
    ];
    assert_eq!(post(c.addr, "/actions/do", &replay).await.0, 303);
    let status: String = db
        .query_one(
            "SELECT status FROM inbox WHERE consumer = $1 AND message_id = $2",
            &[&w.inbox, &w.card_event],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(status, "PENDING");

    // The FAILED notification: retried (PENDING again), by channel filter.
    let retry = vec![
        ("verb", "retry-notifications".to_string()),
        ("channel", w.channel.clone()),
    ];
    let (_, page, _) = post(c.addr, "/actions/confirm", &retry).await;
    assert!(page.contains("Type <b>1</b>"), "{page}");
    let mut typed = retry.clone();
    typed.push(("typed", "1".into()));
    assert_eq!(post(c.addr, "/actions/do", &typed).await.0, 303);
    let n = one(
        &db,
        "SELECT count(*) FROM notifications WHERE channel = $1 AND status = 'PENDING'",
        &[&w.channel],
    )
    .await;
    assert_eq!(n, 1);

    let (_, audit, _) = get(c.addr, "/audit").await;
    for verb in ["discard", "redrive", "replay", "retry"] {
        assert!(
            audit.contains(&format!("<td>{verb}</td>")),
            "{verb}: {audit}"
        );
    }
}

/// One partition's `consumer_offsets` row: next offset, epoch, owner.
async fn offset_row(
    db: &tokio_postgres::Client,
    consumer: &str,
    topic: &str,
    partition: i32,
) -> (Option<i64>, i64, String) {
    let r = db
        .query_one(
            "SELECT next_offset, epoch, owner FROM consumer_offsets
             WHERE consumer = $1 AND topic = $2 AND partition = $3",
            &[&consumer, &topic, &partition],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// The partitions table's row of `topic` [`partition`] on a consumer page.
fn partition_row(page: &str, topic: &str, partition: i32) -> String {
    let start = format!("<tr><td>{topic}</td><td class=\"num\">{partition}</td>");
    let at = page
        .find(&start)
        .unwrap_or_else(|| panic!("no row for {topic} [{partition}]: {page}"));
    let rest = &page[at..];
    rest[..rest.find("</tr>").unwrap()].to_string()
}

/// The hidden fields of the form that posts to `action`, unescaped, as a browser sends them.
fn hidden_fields(page: &str, action: &str) -> Vec<(String, String)> {
    let form = page
        .split(&format!("action=\"{action}\""))
        .nth(1)
        .unwrap_or_else(|| panic!("no form posting to {action}: {page}"));
    let form = &form[..form.find("</form>").unwrap()];
    let attr = |tag: &str, name: &str| {
        let v = tag.split(&format!("{name}=\"")).nth(1)?;
        Some(
            v[..v.find('"')?]
                .replace("&#43;", "+")
                .replace("&#58;", ":")
                .replace("&#34;", "\"")
                .replace("&#39;", "'")
                .replace("&#60;", "<")
                .replace("&#62;", ">")
                .replace("&#38;", "&")
                .replace("&amp;", "&"),
        )
    };
    form.split("<input type=\"hidden\"")
        .skip(1)
        .filter_map(|tag| Some((attr(tag, "name")?, attr(tag, "value")?)))
        .collect()
}

/// A confirmation's hidden fields and the typed number: the second step's form.
fn typed_in<'a>(hidden: &'a [(String, String)], typed: &str) -> Vec<(&'a str, String)> {
    let mut f: Vec<(&str, String)> = (hidden.iter())
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    f.push(("typed", typed.to_string()));
    f
}

/// How many rows `consumer_pauses` has for `consumer`.
async fn pauses(db: &tokio_postgres::Client, consumer: &str) -> i64 {
    one(
        db,
        "SELECT count(*) FROM consumer_pauses WHERE consumer = $1",
        &[&consumer],
    )
    .await
}

/// The audit rows of `verb` whose selection names `consumer`: (count, actor, note) each.
async fn audited(
    db: &tokio_postgres::Client,
    consumer: &str,
    verb: &str,
) -> Vec<(i64, String, Option<String>)> {
    db.query(
        "SELECT count, actor, note FROM operator_actions
         WHERE verb = $1 AND filter->>'consumer' = $2 ORDER BY id",
        &[&verb, &consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_consumer_page_shows_offsets_pauses_and_resets() {
    let w = world().await;
    let db = pg().await;
    let page_path = format!("/consumer?name={}", w.batch);
    // The worker applied partition 0's seven records and partition 1's one.
    let before = offset_row(&db, &w.batch, &w.topic, 0).await;
    let (p0, epoch0) = (before.0, before.1);
    assert_eq!(p0, Some(7));
    assert_eq!(stored_offset(&db, &w.batch, &w.topic, 1).await, Some(1));

    // Read-only: the partitions beside Kafka's log, linked from the overview; no form.
    let ro = console(&w, "").await;
    let (_, overview, _) = get(ro.addr, "/").await;
    assert!(
        overview.contains(&format!("href=\"{page_path}\"")),
        "the overview links the consumer's page: {overview}"
    );
    let (status, page, _) = get(ro.addr, &page_path).await;
    assert_eq!(status, 200, "{page}");
    let row = partition_row(&page, &w.topic, 0);
    // stored 7, low 0, high 7, lag 0, the epoch, the worker that owns it.
    assert!(
        row.contains(
            "<td class=\"num\">7</td><td class=\"num\">0</td><td class=\"num\">7</td><td class=\"num ok\">0</td>"
        ) && row.contains(&format!("<td class=\"num\">{epoch0}</td>"))
            && row.contains("reading"),
        "{row}"
    );
    let row = partition_row(&page, &w.topic, 1);
    assert!(
        row.contains("<td class=\"num\">1</td><td class=\"num\">0</td><td class=\"num\">1</td><td class=\"num ok\">0</td>"),
        "{row}"
    );
    assert!(page.contains("unlimited"), "no max_rate: {page}");
    assert!(!page.contains("<form"), "no form on a read-only console");
    let scope = vec![("consumer", w.batch.clone())];
    assert_eq!(post(ro.addr, "/consumer/pause", &scope).await.0, 403);
    assert_eq!(get(ro.addr, "/consumer?name=nobody").await.0, 404);
    assert_eq!(get(ro.addr, "/consumer").await.0, 400);

    // Writes on: pause one partition, with a note.
    let c = console(&w, "writes = true").await;
    let (_, page, _) = get(c.addr, &page_path).await;
    assert!(
        page.contains("action=\"/consumer/pause\"") && page.contains("Plan the reset"),
        "{page}"
    );
    assert!(
        !page.contains("http-equiv=\"refresh\""),
        "a page with forms does not reload itself by default"
    );
    let one_partition = vec![
        ("consumer", w.batch.clone()),
        ("topic", w.topic.clone()),
        ("partition", "1".to_string()),
        ("note", "hold p1".to_string()),
    ];
    let (status, body, location) = post(c.addr, "/consumer/pause", &one_partition).await;
    assert_eq!(status, 303, "{body}");
    let location = location.unwrap();
    assert!(
        location.starts_with(&format!("{page_path}&action=")),
        "{location}"
    );
    let row = db
        .query_one(
            "SELECT paused_by, note FROM consumer_pauses
             WHERE consumer = $1 AND topic = $2 AND partition = 1",
            &[&w.batch, &w.topic],
        )
        .await
        .unwrap();
    assert!(row.get::<_, String>(0).starts_with("console:127.0.0.1"));
    assert_eq!(row.get::<_, Option<String>>(1).as_deref(), Some("hold p1"));
    let audit = audited(&db, &w.batch, "pause").await;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0].0, 1);
    assert!(audit[0].1.starts_with("console:127.0.0.1"));
    let (status, page, _) = get(c.addr, &location).await;
    assert_eq!(status, 200, "{page}");
    assert!(page.contains(&format!("Paused {} [1]", w.topic)), "{page}");
    assert!(
        partition_row(&page, &w.topic, 1).contains("class=\"pill paused\""),
        "{page}"
    );
    assert!(partition_row(&page, &w.topic, 0).contains("reading"));
    assert!(page.contains("hold p1"), "the pauses table: {page}");

    // The whole consumer, then a resume of the partition: the wider pause still holds it.
    assert_eq!(post(c.addr, "/consumer/pause", &scope).await.0, 303);
    assert_eq!(pauses(&db, &w.batch).await, 2);
    let (_, page, _) = get(c.addr, &page_path).await;
    assert!(
        partition_row(&page, &w.topic, 0).contains("paused (consumer)"),
        "{page}"
    );
    let (status, _, location) = post(c.addr, "/consumer/resume", &one_partition).await;
    assert_eq!(status, 303);
    assert_eq!(pauses(&db, &w.batch).await, 1);
    let (_, page, _) = get(c.addr, &location.unwrap()).await;
    assert!(
        page.contains("Still paused by a wider pause: the whole consumer"),
        "{page}"
    );
    // Resuming the consumer lifts everything.
    assert_eq!(post(c.addr, "/consumer/resume", &scope).await.0, 303);
    assert_eq!(pauses(&db, &w.batch).await, 0);
    let resumes = audited(&db, &w.batch, "resume").await;
    assert_eq!(
        resumes.iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![1, 1],
        "{resumes:?}"
    );
    let (_, page, _) = get(c.addr, &page_path).await;
    assert!(!page.contains("class=\"pill paused\""), "{page}");
    assert!(
        page.contains("<td>pause</td>") && page.contains("<td>resume</td>"),
        "audit rows: {page}"
    );

    // Reset partition 0 to offset 2: the plan, a wrong number (nothing changes), the right one.
    let reset = vec![
        ("consumer", w.batch.clone()),
        ("topic", w.topic.clone()),
        ("partition", "0".to_string()),
        ("kind", "offset".to_string()),
        ("value", "2".to_string()),
    ];
    let (status, plan, _) = post(c.addr, "/consumer/reset/confirm", &reset).await;
    assert_eq!(status, 200, "{plan}");
    assert!(
        plan.contains("Type <b>1</b>")
            && plan.contains("<td class=\"num\">7</td><td class=\"num\"><b>2</b></td>")
            && plan.contains("5 record(s) read again"),
        "{plan}"
    );
    let hidden = hidden_fields(&plan, "/consumer/reset/do");
    assert!(hidden.contains(&("to".into(), "2".into())), "{hidden:?}");
    let step2 = |typed: &str| {
        let mut f = typed_in(&hidden, typed);
        f.push(("note", "replay p0".to_string()));
        f
    };
    let (status, page, _) = post(c.addr, "/consumer/reset/do", &step2("2")).await;
    assert_eq!(status, 409, "{page}");
    assert!(page.contains("Nothing was done"), "{page}");
    assert_eq!(
        offset_row(&db, &w.batch, &w.topic, 0).await,
        before,
        "unchanged"
    );
    assert!(audited(&db, &w.batch, "reset").await.is_empty());
    let (status, page, location) = post(c.addr, "/consumer/reset/do", &step2("1")).await;
    assert_eq!(status, 303, "{page}");
    let (next, epoch, owner) = offset_row(&db, &w.batch, &w.topic, 0).await;
    assert_eq!((next, epoch), (Some(2), epoch0 + 1));
    assert!(owner.starts_with("reset:console:127.0.0.1"), "{owner}");
    assert_eq!(
        stored_offset(&db, &w.batch, &w.topic, 1).await,
        Some(1),
        "only partition 0"
    );
    let (status, audit, _) = get(c.addr, &location.unwrap()).await;
    assert_eq!(status, 200);
    assert!(
        audit.contains("Done: reset of consumer_offsets, 1 row(s)") && audit.contains("replay p0"),
        "{audit}"
    );

    // A shift of the whole topic, then a time after the last record: the log's end.
    let shift = vec![
        ("consumer", w.batch.clone()),
        ("topic", w.topic.clone()),
        ("kind", "shift".to_string()),
        ("value", "-1".to_string()),
    ];
    let (_, plan, _) = post(c.addr, "/consumer/reset/confirm", &shift).await;
    assert!(plan.contains("Type <b>2</b>"), "{plan}");
    let hidden = hidden_fields(&plan, "/consumer/reset/do");
    assert!(
        hidden.contains(&("shift_by".into(), "-1".into())),
        "{hidden:?}"
    );
    assert_eq!(
        post(c.addr, "/consumer/reset/do", &typed_in(&hidden, "2"))
            .await
            .0,
        303
    );
    assert_eq!(stored_offset(&db, &w.batch, &w.topic, 0).await, Some(1));
    assert_eq!(stored_offset(&db, &w.batch, &w.topic, 1).await, Some(0));
    let later = vec![
        ("consumer", w.batch.clone()),
        ("kind", "time".to_string()),
        ("value", "2099-01-01T00:00".to_string()),
    ];
    let (_, plan, _) = post(c.addr, "/consumer/reset/confirm", &later).await;
    let hidden = hidden_fields(&plan, "/consumer/reset/do");
    assert!(
        hidden.contains(&("to".into(), "2099-01-01T00:00:00Z".into())),
        "the time as resolved: {hidden:?}"
    );
    assert_eq!(
        post(c.addr, "/consumer/reset/do", &typed_in(&hidden, "2"))
            .await
            .0,
        303
    );
    assert_eq!(stored_offset(&db, &w.batch, &w.topic, 0).await, Some(7));
    assert_eq!(stored_offset(&db, &w.batch, &w.topic, 1).await, Some(1));
    assert_eq!(audited(&db, &w.batch, "reset").await.len(), 3);
    // An offset outside the log is refused at the plan.
    let mut outside = reset.clone();
    outside[4].1 = "999".into();
    let (status, page, _) = post(c.addr, "/consumer/reset/confirm", &outside).await;
    assert_eq!(status, 400, "{page}");
    assert!(page.contains("outside the log"), "{page}");

    // Kafka unreachable: the page still renders, from PostgreSQL, and says so.
    let config =
        Config::from_toml_str(&config_text(&w, "").replace(&kafka_brokers(), "127.0.0.1:9"))
            .expect("config");
    let bound = effectively::console::bind(&config, None)
        .await
        .expect("console binds");
    let addr = bound.addr;
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(bound.run(async move {
        let _ = stopped.await;
    }));
    let asked = std::time::Instant::now();
    let (status, page, _) = get(addr, &page_path).await;
    assert_eq!(status, 200, "{page}");
    assert!(
        asked.elapsed() < Duration::from_secs(8),
        "{:?}",
        asked.elapsed()
    );
    assert!(page.contains("Kafka: "), "{page}");
    let row = partition_row(&page, &w.topic, 0);
    assert!(
        row.contains("<td class=\"num\">7</td><td class=\"num\">?</td><td class=\"num\">?</td><td class=\"num muted\">?</td>"),
        "{row}"
    );
}

/// Headless Chromium (Debian's `chromium`) with a fresh profile: `args` then `url`; stdout.
fn chromium(args: &[String], url: &str) -> Option<String> {
    let profile = std::env::temp_dir().join(unique("console-chromium"));
    let out = std::process::Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1280,1000",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(url)
        .output()
        .ok()?;
    let _ = std::fs::remove_dir_all(profile);
    assert!(
        out.status.success(),
        "chromium: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_browser_renders_the_overview_a_parked_message_and_a_consumer() {
    if std::process::Command::new("chromium")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("skipped: no chromium (apt-get install -y chromium)");
        return;
    }
    let w = world().await;
    let c = console(&w, "").await;
    // The consumer page with its forms, and one partition paused.
    let writable = console(&w, "writes = true").await;
    let pause = vec![
        ("consumer", w.batch.clone()),
        ("topic", w.topic.clone()),
        ("partition", "1".to_string()),
        ("note", "waiting for the card fix".to_string()),
    ];
    assert_eq!(post(writable.addr, "/consumer/pause", &pause).await.0, 303);
    let db = pg().await;
    let id = one(
        &db,
        "SELECT id FROM dead_letters WHERE consumer = $1 AND message_id = $2",
        &[&w.batch, &w.card_event],
    )
    .await;
    let img = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/img");
    std::fs::create_dir_all(img).unwrap();
    for (addr, path, shot, wants) in [
        (
            c.addr,
            "/".to_string(),
            "console-overview.png",
            vec![
                w.batch.clone(),
                w.inbox.clone(),
                "missing_event_id".into(),
                "Partitions".into(),
            ],
        ),
        (
            c.addr,
            format!("/parked/dead-letters/{id}"),
            "console-message.png",
            vec![
                w.topic.clone(),
                "missing_field".into(),
                "12/29".into(),
                "Hex".into(),
            ],
        ),
        (
            writable.addr,
            format!("/consumer?name={}", w.batch),
            "console-consumer.png",
            vec![
                w.topic.clone(),
                "stored offset".into(),
                "paused".into(),
                "waiting for the card fix".into(),
                "Plan the reset".into(),
            ],
        ),
    ] {
        let url = format!("http://{addr}{path}");
        let u = url.clone();
        let dom = tokio::task::spawn_blocking(move || chromium(&["--dump-dom".into()], &u))
            .await
            .unwrap()
            .expect("chromium runs");
        // The rendered DOM: the page's data, the stylesheet applied (no CSP refusal of it).
        for want in &wants {
            assert!(
                dom.contains(want.as_str()),
                "{path}: the DOM lacks {want:?}: {dom}"
            );
        }
        assert!(!dom.contains(CARD), "{path}: masked");
        let file = format!("{img}/{shot}");
        let arg = format!("--screenshot={file}");
        let u = url.clone();
        tokio::task::spawn_blocking(move || chromium(&[arg], &u))
            .await
            .unwrap()
            .expect("chromium runs");
        let png = std::fs::read(&file).expect("a screenshot");
        assert!(png.starts_with(b"\x89PNG") && png.len() > 10_000, "{file}");
    }
}
