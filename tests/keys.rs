//! Dedupe keys as producers make them, against the real broker and database: text ids
//! (Stripe-like), a template business key, the record key, UUID keys unchanged when text ids
//! are turned on, CloudEvents in both modes, and tombstones parked or skipped.

mod common;

use std::time::Duration;

use common::{eventually, ledger, Payment};
use effectively::envelope::KEY_NAMESPACE;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use uuid::Uuid;

/// One record to send: its key, headers and value (None: a tombstone).
struct Rec {
    key: Option<String>,
    headers: Vec<(&'static str, String)>,
    value: Option<Vec<u8>>,
}

impl Rec {
    /// A payment with an `event_id` header holding `id`.
    fn payment(id: &str, p: &Payment) -> Rec {
        Rec {
            key: Some(p.user_id.clone()),
            headers: vec![("event_id", id.to_string())],
            value: Some(p.json()),
        }
    }
}

/// Sends `recs` to partition 0 of `topic`, in order.
async fn send(topic: &str, recs: &[Rec]) {
    let producer = common::producer();
    for r in recs {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut rec = FutureRecord::<str, [u8]>::to(topic)
            .partition(0)
            .headers(headers);
        if let Some(k) = &r.key {
            rec = rec.key(k.as_str());
        }
        if let Some(v) = &r.value {
            rec = rec.payload(v.as_slice());
        }
        producer
            .send(rec, Duration::from_secs(30))
            .await
            .expect("delivery");
    }
}

/// Waits until `consumer` has stored offset `n` for partition 0 of `topic`: every record read
/// and decided (applied, counted as a duplicate, parked or skipped).
async fn drained(db: &tokio_postgres::Client, consumer: &str, topic: &str, n: i64) {
    eventually(60, &format!("{consumer} past offset {n}"), || async move {
        common::stored_offset(db, consumer, topic, 0).await == Some(n)
    })
    .await;
}

async fn keys_of(db: &tokio_postgres::Client, consumer: &str) -> Vec<Uuid> {
    db.query(
        "SELECT message_id FROM processed_messages WHERE consumer = $1 ORDER BY message_id",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

fn v5(text: &str) -> Uuid {
    Uuid::new_v5(&KEY_NAMESPACE, text.as_bytes())
}

const TEXT_IDS: &str = "message_id = { header = \"event_id\", any_string = true }\n\
                        event_date = \"/occurred_at\"";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_like_ids_are_applied_once_and_kept_readable() {
    let (topic, consumer) = (common::unique("keys-text"), common::unique("keys-text"));
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let payments: Vec<Payment> = (0..20).map(|i| Payment::new(&user, 1_000 + i)).collect();
    let ids: Vec<String> = payments
        .iter()
        .map(|p| format!("evt_1N{}", p.event_id.simple()))
        .collect();
    let mut recs: Vec<Rec> = Vec::new();
    for (p, id) in payments.iter().zip(&ids) {
        recs.push(Rec::payment(id, p));
        recs.push(Rec::payment(id, p)); // the relay's resend
    }
    // A UUID id on the same consumer stays that UUID.
    let uuid_payment = Payment::new(&user, 5_000);
    recs.push(Rec::payment(
        &uuid_payment.event_id.to_string(),
        &uuid_payment,
    ));
    // Bad input: a blank id, and a text id with no event date in the payload.
    recs.push(Rec::payment("   ", &Payment::new(&user, 7)));
    recs.push(Rec {
        key: Some(user.clone()),
        headers: vec![("event_id", "whk_delivery_9".into())],
        value: Some(br#"{"payment_id":"p","user_id":"u","amount_paise":1}"#.to_vec()),
    });
    send(&topic, &recs).await;

    let worker = common::start_cashback(&consumer, &topic, TEXT_IDS).await;
    let db = common::pg().await;
    drained(&db, &consumer, &topic, recs.len() as i64).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(
        (l.credits, l.distinct_payments, l.dedupe_keys),
        (21, 21, 21),
        "{l:?}"
    );
    let mut expected: Vec<Uuid> = ids.iter().map(|id| v5(id)).collect();
    expected.push(uuid_payment.event_id);
    expected.sort();
    assert_eq!(
        keys_of(&db, &consumer).await,
        expected,
        "text ids as v5 UUIDs, the UUID kept"
    );
    let s = worker.stats(&consumer).unwrap().snapshot();
    assert_eq!((s.duplicates, s.parked), (20, 2), "{s:?}");

    let dead = common::dead_letters(&db, &consumer).await;
    assert_eq!(dead[0].reason, "missing_event_id", "{dead:?}");
    assert_eq!(
        (dead[1].reason.as_str(), dead[1].message_key.as_deref()),
        ("no_event_date", Some("whk_delivery_9")),
        "the text is kept beside the parked record: {dead:?}"
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_key_catches_a_double_tap_sent_with_a_new_event_id() {
    let (topic, consumer) = (common::unique("keys-tpl"), common::unique("keys-tpl"));
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let p = Payment::new(&user, 10_000);
    let with_status = |event_id: Uuid, status: Option<&str>| {
        let mut v: serde_json::Value = serde_json::from_slice(&p.json()).unwrap();
        v["event_id"] = event_id.to_string().into();
        if let Some(s) = status {
            v["status"] = s.into();
        }
        Rec {
            key: Some(user.clone()),
            headers: vec![("event_id", event_id.to_string())],
            value: Some(serde_json::to_vec(&v).unwrap()),
        }
    };
    let recs = vec![
        with_status(Uuid::now_v7(), Some("CAPTURED")),
        // The upstream sent the same capture again with a fresh event id: one key.
        with_status(Uuid::now_v7(), Some("CAPTURED")),
        // A part missing: parked, never a shorter key.
        with_status(Uuid::now_v7(), None),
    ];
    send(&topic, &recs).await;
    let extra =
        "message_id = { template = \"{/payment_id}:{/status}\" }\nevent_date = \"/occurred_at\"";
    let worker = common::start_cashback(&consumer, &topic, extra).await;
    let db = common::pg().await;
    drained(&db, &consumer, &topic, 3).await;
    let key = format!("{}:CAPTURED", p.payment_id);
    assert_eq!(keys_of(&db, &consumer).await, vec![v5(&key)]);
    let s = worker.stats(&consumer).unwrap().snapshot();
    assert_eq!(
        (s.effects, s.duplicates, s.business_duplicates, s.parked),
        (1, 1, 0, 1),
        "the ledger's key caught the double tap, not the handler's business key: {s:?}"
    );
    let dead = common::dead_letters(&db, &consumer).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].reason, "missing_event_id");
    assert!(
        dead[0].detail.contains("{/payment_id}:{/status}") && dead[0].detail.contains("/status"),
        "{dead:?}"
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uuid_keys_are_unchanged_when_text_ids_are_turned_on() {
    let (topic, consumer) = (common::unique("keys-up"), common::unique("keys-up"));
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let p = Payment::new(&user, 2_000);
    send(&topic, &[Rec::payment(&p.event_id.to_string(), &p)]).await;
    let db = common::pg().await;
    let before = common::start_cashback(&consumer, &topic, "").await;
    drained(&db, &consumer, &topic, 1).await;
    before.stop().await.unwrap();
    let recorded = effectively::store::keys::recorded(&db, &consumer)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        recorded.made_by,
        "message_id = { header = \"event_id\" }, event_date = \"auto\""
    );

    // The upgrade: text ids on (and the date from the payload), then a resend of the old
    // payment and a new text-id payment.
    let q = Payment::new(&user, 3_000);
    send(
        &topic,
        &[
            Rec::payment(&p.event_id.to_string(), &p),
            Rec::payment("evt_after", &q),
        ],
    )
    .await;
    let after = common::start_cashback(&consumer, &topic, TEXT_IDS).await;
    drained(&db, &consumer, &topic, 3).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.dedupe_keys, l.parked), (2, 2, 0), "{l:?}");
    let mut expected = vec![p.event_id, v5("evt_after")];
    expected.sort();
    assert_eq!(keys_of(&db, &consumer).await, expected);
    assert_eq!(after.stats(&consumer).unwrap().snapshot().duplicates, 1);
    // The change of settings is on record, with what came before.
    let row = db
        .query_one(
            "SELECT made_by, previous FROM consumer_keys WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap();
    let (made_by, previous): (String, Option<String>) = (row.get(0), row.get(1));
    assert!(made_by.contains("any_string = true"), "{made_by}");
    assert_eq!(previous.as_deref(), Some(recorded.made_by.as_str()));
    after.stop().await.unwrap();

    // A deploy that would go back to the old settings: check-config --connect warns.
    let dir = std::env::temp_dir().join(common::unique("keys-check"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("effectively.toml");
    std::fs::write(
        &file,
        format!(
            "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n[[consumer]]\nname = \"{consumer}\"\n\
             topics = [\"{topic}\"]\nhandler = {{ kind = \"cashback\" }}\n",
            common::kafka_brokers(),
            common::database_url()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_effectively"))
        .args(["check-config", "--connect", "--config"])
        .arg(&file)
        .output()
        .expect("running effectively");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains(&format!("WARNING consumer {consumer:?}"))
            && text.contains("any_string = true"),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_key_can_be_the_message_id() {
    let (topic, consumer) = (common::unique("keys-key"), common::unique("keys-key"));
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let p = Payment::new(&user, 4_000);
    let keyed = |key: Option<&str>| Rec {
        key: key.map(str::to_string),
        headers: Vec::new(),
        value: Some(p.json()),
    };
    send(
        &topic,
        &[
            keyed(Some("order-77")),
            keyed(Some("order-77")),
            keyed(None),
        ],
    )
    .await;
    let extra = "message_id = \"key\"\nevent_date = \"/occurred_at\"";
    let worker = common::start_cashback(&consumer, &topic, extra).await;
    let db = common::pg().await;
    drained(&db, &consumer, &topic, 3).await;
    assert_eq!(keys_of(&db, &consumer).await, vec![v5("order-77")]);
    let dead = common::dead_letters(&db, &consumer).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].reason, "missing_event_id", "{dead:?}");
    worker.stop().await.unwrap();
}

/// A CloudEvent in binary mode: the payment as the data.
fn binary(source: &str, id: &str, p: &Payment, time: bool) -> Rec {
    let mut headers = vec![
        ("ce_specversion", "1.0".to_string()),
        ("ce_id", id.to_string()),
        ("ce_source", source.to_string()),
        ("ce_type", "payment.succeeded".into()),
        ("content-type", "application/json".into()),
    ];
    if time {
        headers.push(("ce_time", p.occurred_at.to_rfc3339()));
    }
    Rec {
        key: Some(p.user_id.clone()),
        headers,
        value: Some(p.json()),
    }
}

/// The same event in structured mode.
fn structured(source: &str, id: &str, p: &Payment) -> Rec {
    let data: serde_json::Value = serde_json::from_slice(&p.json()).unwrap();
    let event = serde_json::json!({
        "specversion": "1.0", "id": id, "source": source, "type": "payment.succeeded",
        "time": p.occurred_at.to_rfc3339(), "datacontenttype": "application/json", "data": data,
    });
    Rec {
        key: Some(p.user_id.clone()),
        headers: vec![(
            "content-type",
            "application/cloudevents+json; charset=utf-8".into(),
        )],
        value: Some(serde_json::to_vec(&event).unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_are_keyed_by_source_and_id_in_either_mode() {
    let (topic, consumer) = (common::unique("keys-ce"), common::unique("keys-ce"));
    common::create_topic(&topic, 1).await;
    let user = common::unique("u");
    let (a, b) = (Payment::new(&user, 1_000), Payment::new(&user, 2_000));
    let recs = vec![
        binary("/billing", "evt_1", &a, true),
        structured("/billing", "evt_1", &a), // the same event, structured: a duplicate
        structured("/refunds", "evt_1", &b), // the same id from another source: another event
        binary("/billing", "evt_2", &Payment::new(&user, 9), false), // no time: parked
        Rec {
            key: Some(user.clone()),
            headers: vec![("ce_id", "x".into())],
            value: None,
        }, // a tombstone
        Rec {
            key: None,
            headers: Vec::new(),
            value: Some(a.json()),
        }, // not a CloudEvent
    ];
    send(&topic, &recs).await;
    let worker = common::start_cashback(&consumer, &topic, "envelope = \"cloudevents\"").await;
    let db = common::pg().await;
    drained(&db, &consumer, &topic, recs.len() as i64).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.dedupe_keys), (2, 2), "{l:?}");
    let mut expected = vec![v5(r#"["/billing","evt_1"]"#), v5(r#"["/refunds","evt_1"]"#)];
    expected.sort();
    assert_eq!(keys_of(&db, &consumer).await, expected);
    assert_eq!(worker.stats(&consumer).unwrap().snapshot().duplicates, 1);
    let dead = common::dead_letters(&db, &consumer).await;
    let reasons: Vec<&str> = dead.iter().map(|d| d.reason.as_str()).collect();
    assert_eq!(
        reasons,
        ["no_event_date", "tombstone", "missing_event_id"],
        "{dead:?}"
    );
    assert_eq!(
        dead[0].message_key.as_deref(),
        Some(r#"["/billing","evt_2"]"#)
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tombstones_are_parked_by_default_and_skipped_when_asked() {
    let db = common::pg().await;
    for (setting, parked_expected) in [("", 2), ("on_tombstone = \"skip\"", 0)] {
        // A topic and payments of its own each: a payment is credited once across consumers.
        let (topic, consumer) = (common::unique("keys-tomb"), common::unique("keys-tomb"));
        common::create_topic(&topic, 1).await;
        let user = common::unique("u");
        let (a, b) = (Payment::new(&user, 1_000), Payment::new(&user, 2_000));
        let tombstone = || Rec {
            key: Some(user.clone()),
            headers: Vec::new(),
            value: None,
        };
        let recs = vec![
            Rec::payment(&a.event_id.to_string(), &a),
            tombstone(),
            Rec::payment(&b.event_id.to_string(), &b),
            tombstone(),
        ];
        send(&topic, &recs).await;
        let worker = common::start_cashback(&consumer, &topic, setting).await;
        // The offset moves past the last tombstone either way.
        drained(&db, &consumer, &topic, 4).await;
        let l = ledger(&db, &consumer).await;
        assert_eq!(
            (l.credits, l.parked),
            (2, parked_expected),
            "{setting:?}: {l:?}"
        );
        let s = worker.stats(&consumer).unwrap().snapshot();
        assert_eq!(s.skipped, 2 - parked_expected as u64, "{setting:?}: {s:?}");
        if parked_expected > 0 {
            let dead = common::dead_letters(&db, &consumer).await;
            assert!(dead.iter().all(|d| d.reason == "tombstone"), "{dead:?}");
        }
        worker.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_handler_reads_a_cloudevents_attributes_and_data() {
    let (topic, consumer) = (common::unique("keys-cesql"), common::unique("keys-cesql"));
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    let table = consumer.replace('-', "_");
    db.batch_execute(&format!(
        "CREATE TABLE {table} (event_id uuid PRIMARY KEY, type text, source text, ce_id text,
                               amount bigint)"
    ))
    .await
    .unwrap();
    let user = common::unique("u");
    let (a, b) = (Payment::new(&user, 1_000), Payment::new(&user, 2_000));
    send(
        &topic,
        &[
            binary("/shop", "o-1", &a, true),
            structured("/shop", "o-2", &b),
        ],
    )
    .await;
    let handler = format!(
        r#"{{ kind = "sql", statement = "INSERT INTO {table} SELECT message_id, ce->>'type', ce->>'source', ce->>'id', (payload->>'amount_paise')::bigint FROM fresh_messages ORDER BY message_id" }}"#
    );
    let worker = common::start(common::config(
        &consumer,
        &topic,
        &handler,
        "envelope = \"cloudevents\"",
    ))
    .await;
    drained(&db, &consumer, &topic, 2).await;
    let rows: Vec<(String, String, String, i64)> = db
        .query(
            &format!("SELECT type, source, ce_id, amount FROM {table} ORDER BY ce_id"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let row = |id: &str, amount| {
        (
            "payment.succeeded".to_string(),
            "/shop".to_string(),
            id.to_string(),
            amount,
        )
    };
    assert_eq!(
        rows,
        vec![row("o-1", 1_000), row("o-2", 2_000)],
        "both modes' attributes in ce, the data as payload"
    );
    worker.stop().await.unwrap();
}
