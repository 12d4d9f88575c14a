//! Schema Registry payloads against the real broker and the real registry (the stack's Apicurio
//! Registry 3.3.3, `scripts/stack.sh registry-up`): Avro, Protobuf and JSON Schema payments
//! into the cashback handler and the SQL handler, the inbox strategy with Avro, a schema that
//! evolves mid-stream, a decoded key, and each kind of bad input parked with its reason and its
//! raw bytes.

mod common;

use apache_avro::types::Value as Avro;
use common::schema_registry::{self as sr, PAYMENT_AVSC, PAYMENT_JSON_SCHEMA, PAYMENT_PROTO};
use common::{eventually, ledger, Payment};

/// `payload = {...}` for a consumer reading `format` from the stack's registry.
fn payload(format: &str, url: &str, more: &str) -> String {
    format!("payload = {{ format = \"{format}\", registry = \"{url}\"{more} }}")
}

/// Payments with the `event_id` header, as loadgen writes them; `bytes` encodes each.
fn records(
    payments: &[Payment],
    bytes: impl Fn(&Payment) -> Vec<u8>,
) -> Vec<(Option<String>, Vec<u8>)> {
    payments
        .iter()
        .map(|p| (Some(p.event_id.to_string()), bytes(p)))
        .collect()
}

/// Writes one payment's record.
type Encode = dyn Fn(&Payment) -> Vec<u8>;

/// 40 payments (and a resend of every fourth) in `format` into the cashback handler: each
/// credited once, nothing parked.
async fn cashback_in(format: &str, strategy: &str) {
    let url = sr::url().await;
    let topic = common::unique(&format!("reg-{format}"));
    let consumer = common::unique("reg");
    common::create_topic(&topic, 2).await;
    let subject = format!("{topic}-value");
    let user = common::unique("u");
    let payments: Vec<Payment> = (0..40)
        .map(|i| Payment::new(&user, 10_000 + i * 100))
        .collect();
    let encode: Box<Encode> = match format {
        "avro" => {
            let id = sr::register(&url, &subject, "AVRO", PAYMENT_AVSC).await;
            let schema = apache_avro::Schema::parse_str(PAYMENT_AVSC).unwrap();
            Box::new(move |p| sr::avro(id, &schema, p, &[]))
        }
        "protobuf" => {
            let id = sr::register(&url, &subject, "PROTOBUF", PAYMENT_PROTO).await;
            let desc = sr::proto_payment();
            Box::new(move |p| sr::protobuf(id, &desc, p))
        }
        "json-schema" => {
            let id = sr::register(&url, &subject, "JSON", PAYMENT_JSON_SCHEMA).await;
            Box::new(move |p| sr::json_schema(id, p))
        }
        other => panic!("no format {other}"),
    };
    let mut recs = records(&payments, &encode);
    let resends: Vec<Payment> = payments.iter().step_by(4).cloned().collect();
    recs.extend(records(&resends, &encode));
    let producer = common::producer();
    common::send_raw(&producer, &topic, None, &recs).await;

    let extra = format!("strategy = \"{strategy}\"\n{}", payload(format, &url, ""));
    let worker = common::start_cashback(&consumer, &topic, &extra).await;
    let db = common::pg().await;
    let expected: i64 = payments.iter().map(|p| p.amount_paise * 2 / 100).sum();
    eventually(90, "every payment credited", || async {
        ledger(&db, &consumer).await.credits == 40
    })
    .await;
    // A moment for a resend that would (wrongly) credit twice.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 40, "{format}: {l:?}");
    assert_eq!(l.distinct_payments, 40);
    assert_eq!(l.cashback_paise, expected);
    assert_eq!(
        l.parked,
        0,
        "{format}: nothing parked: {:?}",
        common::dead_letters(&db, &consumer).await
    );
    assert_eq!(common::wallet_total(&db, &[user]).await, expected);
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_payments_are_credited_once() {
    cashback_in("avro", "batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protobuf_payments_are_credited_once() {
    cashback_in("protobuf", "batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_payments_are_credited_once() {
    cashback_in("json-schema", "batch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_payments_through_the_inbox_are_credited_once() {
    cashback_in("avro", "inbox").await;
}

/// A SQL handler's table of what it saw: the decoded payload and key, as jsonb and text.
async fn sql_table(db: &tokio_postgres::Client) -> String {
    let table = common::unique("reg_seen").replace('-', "_");
    db.batch_execute(&format!(
        "CREATE TABLE {table} (message_id uuid PRIMARY KEY, payload jsonb NOT NULL, key text)"
    ))
    .await
    .unwrap();
    table
}

fn sql_handler(table: &str) -> String {
    format!(
        "{{ kind = \"sql\", statement = \"INSERT INTO {table} SELECT message_id, payload, \
         convert_from(key, 'UTF8') FROM fresh_messages\" }}"
    )
}

/// A worker with the SQL handler on `topic`, run until its table holds `rows` rows.
async fn sql_run(
    db: &tokio_postgres::Client,
    consumer: &str,
    topic: &str,
    payload: &str,
    rows: usize,
) -> (effectively::worker::Worker, String) {
    let table = sql_table(db).await;
    let config = common::config(consumer, topic, &sql_handler(&table), payload);
    let worker = common::start(config).await;
    eventually(60, &format!("{rows} rows"), || async {
        seen(db, &table).await.len() == rows
    })
    .await;
    (worker, table)
}

async fn seen(
    db: &tokio_postgres::Client,
    table: &str,
) -> Vec<(serde_json::Value, Option<String>)> {
    db.query(
        &format!("SELECT payload, key FROM {table} ORDER BY payload->>'payment_id'"),
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_handler_sees_protobuf_as_the_json_demo_s_object_and_a_decoded_key() {
    let url = sr::url().await;
    let topic = common::unique("reg-sql");
    let consumer = common::unique("reg");
    common::create_topic(&topic, 1).await;
    let value_id = sr::register(&url, &format!("{topic}-value"), "PROTOBUF", PAYMENT_PROTO).await;
    let key_id = sr::register(&url, &format!("{topic}-key"), "AVRO", "\"string\"").await;
    let desc = sr::proto_payment();
    let user = common::unique("u");
    let payments: Vec<Payment> = (0..5).map(|i| Payment::new(&user, 500 + i)).collect();
    let producer = common::producer();
    for p in &payments {
        let key = sr::framed(
            key_id,
            &sr::datum(
                &apache_avro::Schema::parse_str("\"string\"").unwrap(),
                Avro::String(p.user_id.clone()),
            ),
        );
        let value = sr::protobuf(value_id, &desc, p);
        let rec = rdkafka::producer::FutureRecord::to(&topic)
            .key(&key)
            .payload(&value)
            .headers(
                rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
                    key: "event_id",
                    value: Some(p.event_id.to_string().as_bytes()),
                }),
            );
        producer
            .send(rec, std::time::Duration::from_secs(30))
            .await
            .unwrap();
    }
    let db = common::pg().await;
    let (worker, table) = sql_run(
        &db,
        &consumer,
        &topic,
        &payload("protobuf", &url, ", key_format = \"avro\""),
        5,
    )
    .await;
    let rows = seen(&db, &table).await;
    let mut expected: Vec<_> = payments
        .iter()
        .map(|p| (sr::payment_json(p), p.user_id.clone()))
        .collect();
    expected.sort_by(|a, b| a.0["payment_id"].as_str().cmp(&b.0["payment_id"].as_str()));
    for ((payload, key), (want, user)) in rows.iter().zip(&expected) {
        assert_eq!(
            payload, want,
            "the decoded payload is the JSON demo's object"
        );
        // A key in the wire format is its JSON text: an Avro string is a JSON string.
        assert_eq!(key.as_deref(), Some(format!("\"{user}\"").as_str()));
    }
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_that_evolves_mid_stream_decodes_both_versions() {
    let url = sr::url().await;
    let topic = common::unique("reg-evolve");
    let consumer = common::unique("reg");
    common::create_topic(&topic, 1).await;
    let subject = format!("{topic}-value");
    let v1 = sr::register(&url, &subject, "AVRO", PAYMENT_AVSC).await;
    // v2 adds a field with a default (a backward-compatible change).
    let mut v2_json: serde_json::Value = serde_json::from_str(PAYMENT_AVSC).unwrap();
    v2_json["fields"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!(
            {"name": "channel", "type": "string", "default": "web"}
        ));
    let v2_text = v2_json.to_string();
    let v2 = sr::register(&url, &subject, "AVRO", &v2_text).await;
    assert_ne!(v1, v2);
    let s1 = apache_avro::Schema::parse_str(PAYMENT_AVSC).unwrap();
    let s2 = apache_avro::Schema::parse_str(&v2_text).unwrap();
    let user = common::unique("u");
    let payments: Vec<Payment> = (0..10).map(|i| Payment::new(&user, 100 + i)).collect();
    // A v1 producer still writing between v2 records.
    let recs = records(&payments, |p| {
        if p.amount_paise % 2 == 0 {
            sr::avro(v2, &s2, p, &[("channel", Avro::String("app".into()))])
        } else {
            sr::avro(v1, &s1, p, &[])
        }
    });
    common::send_raw(&common::producer(), &topic, Some(0), &recs).await;
    let db = common::pg().await;
    let (worker, table) = sql_run(&db, &consumer, &topic, &payload("avro", &url, ""), 10).await;
    for (payload, _) in seen(&db, &table).await {
        let amount = payload["amount_paise"].as_i64().unwrap();
        if amount % 2 == 0 {
            assert_eq!(payload["channel"], "app", "{payload}");
        } else {
            assert!(
                payload.get("channel").is_none(),
                "v1 has no channel: {payload}"
            );
        }
    }
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_parked_with_its_reason_and_raw_bytes() {
    let url = sr::url().await;
    let topic = common::unique("reg-bad");
    let consumer = common::unique("reg");
    common::create_topic(&topic, 1).await;
    let id = sr::register(&url, &format!("{topic}-value"), "AVRO", PAYMENT_AVSC).await;
    // A Protobuf schema under another subject: its id names a schema of the wrong kind.
    let proto_id = sr::register(&url, &format!("{topic}-other"), "PROTOBUF", PAYMENT_PROTO).await;
    let schema = apache_avro::Schema::parse_str(PAYMENT_AVSC).unwrap();
    let user = common::unique("u");
    let good: Vec<Payment> = (0..4).map(|i| Payment::new(&user, 1_000 + i)).collect();
    let bad: Vec<Payment> = (0..5).map(|i| Payment::new(&user, 9_000 + i)).collect();
    let truncated = {
        let b = sr::avro(id, &schema, &bad[2], &[]);
        b[..b.len() - 4].to_vec()
    };
    let unknown_id = 2_000_000_000u32;
    let bad_bytes = vec![
        (bad[0].json(), "not_wire_format"),
        (
            sr::avro(unknown_id, &schema, &bad[1], &[]),
            "unknown_schema",
        ),
        (truncated, "schema_mismatch"),
        (
            sr::protobuf(proto_id, &sr::proto_payment(), &bad[3]),
            "schema_mismatch",
        ),
        (vec![0u8, 0, 0], "not_wire_format"),
    ];
    let mut recs = Vec::new();
    for (i, (bytes, _)) in bad_bytes.iter().enumerate() {
        recs.push((
            Some(good[i % 4].event_id.to_string()),
            sr::avro(id, &schema, &good[i % 4], &[]),
        ));
        recs.push((Some(bad[i].event_id.to_string()), bytes.clone()));
    }
    common::send_raw(&common::producer(), &topic, Some(0), &recs).await;

    let worker = common::start_cashback(&consumer, &topic, &payload("avro", &url, "")).await;
    let db = common::pg().await;
    eventually(60, "four credits and five parked", || async {
        let l = ledger(&db, &consumer).await;
        l.credits == 4 && l.parked == 5
    })
    .await;
    let parked = common::dead_letters(&db, &consumer).await;
    assert_eq!(parked.len(), 5);
    for (d, (bytes, reason)) in parked.iter().zip(&bad_bytes) {
        assert_eq!(d.reason, *reason, "{d:?}");
        assert_eq!(
            d.payload.as_deref(),
            Some(bytes.as_slice()),
            "the raw bytes are kept"
        );
        assert!(d.message_id.is_some(), "the header's id is kept: {d:?}");
    }
    assert!(
        parked[1]
            .detail
            .contains(&format!("schema id {unknown_id}")),
        "{}",
        parked[1].detail
    );
    assert!(parked[1].detail.contains("404"), "{}", parked[1].detail);
    assert!(
        parked[2].detail.contains(&format!("schema id {id}")),
        "{}",
        parked[2].detail
    );
    assert!(
        parked[3].detail.contains("PROTOBUF"),
        "{}",
        parked[3].detail
    );
    assert!(
        parked[0].detail.contains("magic byte"),
        "{}",
        parked[0].detail
    );
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sql_handler_sees_json_schema_and_avro_payloads_as_the_json_demo_s_object() {
    let url = sr::url().await;
    let db = common::pg().await;
    for format in ["json-schema", "avro"] {
        let topic = common::unique("reg-sql2");
        let consumer = common::unique("reg");
        common::create_topic(&topic, 1).await;
        let subject = format!("{topic}-value");
        let user = common::unique("u");
        let payments: Vec<Payment> = (0..6).map(|i| Payment::new(&user, 700 + i)).collect();
        let recs = if format == "avro" {
            let id = sr::register(&url, &subject, "AVRO", PAYMENT_AVSC).await;
            let schema = apache_avro::Schema::parse_str(PAYMENT_AVSC).unwrap();
            records(&payments, |p| sr::avro(id, &schema, p, &[]))
        } else {
            let id = sr::register(&url, &subject, "JSON", PAYMENT_JSON_SCHEMA).await;
            records(&payments, |p| sr::json_schema(id, p))
        };
        common::send_raw(&common::producer(), &topic, Some(0), &recs).await;
        let (worker, table) = sql_run(&db, &consumer, &topic, &payload(format, &url, ""), 6).await;
        let mut want: Vec<_> = payments.iter().map(sr::payment_json).collect();
        want.sort_by(|a, b| a["payment_id"].as_str().cmp(&b["payment_id"].as_str()));
        let got: Vec<_> = seen(&db, &table)
            .await
            .into_iter()
            .map(|(p, _)| p)
            .collect();
        assert_eq!(got, want, "{format}: the decoded payloads");
        worker.stop().await.unwrap();
    }
}
