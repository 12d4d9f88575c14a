//! Traces end to end, against the real Kafka, PostgreSQL and Jaeger v2 (`scripts/stack.sh
//! jaeger-up`, started here when it does not answer): a payment produced with a `traceparent`
//! is applied by the engine, whose effect writes an outbox row; the relay publishes the row and
//! a second consumer applies the record. Jaeger must then hold one trace with the engine's
//! transaction span (child of, and linked to, the producer's span), the relay's span (child of
//! the transaction's) and the second consumer's span (child of the relay's).

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use effectively::config::Config;
use effectively::worker::Worker;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::FutureRecord;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

fn jaeger_query_url() -> String {
    setting("JAEGER_QUERY_URL", "http://127.0.0.1:16686")
}

fn jaeger_otlp_endpoint() -> String {
    setting("JAEGER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
}

/// Jaeger's query API, started with `scripts/stack.sh jaeger-up` if it does not answer (the
/// first start builds it: minutes).
async fn jaeger() -> String {
    let url = jaeger_query_url();
    let answers = || async {
        reqwest::get(format!("{url}/api/services"))
            .await
            .is_ok_and(|r| r.status().is_success())
    };
    if !answers().await {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack.sh");
        let status = tokio::process::Command::new(script)
            .arg("jaeger-up")
            .stdout(std::process::Stdio::null())
            .status()
            .await
            .expect("run scripts/stack.sh jaeger-up");
        assert!(status.success(), "scripts/stack.sh jaeger-up failed");
    }
    assert!(answers().await, "Jaeger does not answer at {url}");
    url
}

/// The `[tracing]` section every part of this test runs with: all of it sampled.
fn tracing_section(service: &str) -> String {
    format!(
        "[tracing]\nenabled = true\notlp_endpoint = \"{}\"\nsampling_ratio = 1.0\n\
         service_name = \"{service}\"\nexport_timeout = \"5s\"\n",
        jaeger_otlp_endpoint()
    )
}

fn base(service: &str) -> String {
    format!(
        "[kafka]\nbrokers = \"{}\"\nsession_timeout = \"10s\"\n[kafka.options]\n\
         \"heartbeat.interval.ms\" = \"500\"\n\"topic.metadata.refresh.interval.ms\" = \"1000\"\n\
         [database]\nurl = \"{}\"\npool_size = 8\n[worker]\nrevoke_deadline = \"5s\"\n{}",
        kafka_brokers(),
        database_url(),
        tracing_section(service)
    )
}

/// A span of a Jaeger trace, as its API gives it.
#[derive(Debug)]
struct SpanView {
    span_id: String,
    operation: String,
    /// (refType, spanID): CHILD_OF is the parent, FOLLOWS_FROM a link. Jaeger shows a parent
    /// that is also linked (the engine links every message's context, its parent's too) as one
    /// FOLLOWS_FROM reference.
    references: Vec<(String, String)>,
    tags: HashMap<String, Value>,
    /// The span's events (Jaeger's logs) by name: the transaction's stages.
    events: Vec<String>,
}

impl SpanView {
    /// The span it hangs under: its only reference (the trace id is the one the test asked
    /// for, so a reference is a parent, not a link into another trace).
    fn parent(&self) -> Option<&str> {
        match &self.references[..] {
            [(_, s)] => Some(s.as_str()),
            _ => None,
        }
    }
}

async fn trace_spans(url: &str, trace_id: &str) -> Vec<SpanView> {
    let Ok(resp) = reqwest::get(format!("{url}/api/traces/{trace_id}")).await else {
        return Vec::new();
    };
    let Ok(body) = resp.json::<Value>().await else {
        return Vec::new();
    };
    let spans = body["data"][0]["spans"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    spans
        .iter()
        .map(|s| SpanView {
            span_id: s["spanID"].as_str().unwrap_or_default().to_string(),
            operation: s["operationName"].as_str().unwrap_or_default().to_string(),
            references: (s["references"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter())
            .map(|r| {
                (
                    r["refType"].as_str().unwrap_or_default().to_string(),
                    r["spanID"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect(),
            tags: (s["tags"].as_array().cloned().unwrap_or_default().iter())
                .map(|t| {
                    (
                        t["key"].as_str().unwrap_or_default().to_string(),
                        t["value"].clone(),
                    )
                })
                .collect(),
            events: (s["logs"].as_array().cloned().unwrap_or_default().iter())
                .filter_map(|l| {
                    let fields = l["fields"].as_array()?;
                    let event = fields.iter().find(|f| f["key"] == "event")?;
                    Some(event["value"].as_str()?.to_string())
                })
                .collect(),
        })
        .collect()
}

async fn send_with_headers(topic: &str, p: &Payment, extra: &[(&str, &str)]) {
    let id = p.event_id.to_string();
    let mut headers = OwnedHeaders::new().insert(Header {
        key: "event_id",
        value: Some(id.as_bytes()),
    });
    for (k, v) in extra {
        headers = headers.insert(Header {
            key: k,
            value: Some(v.as_bytes()),
        });
    }
    let payload = p.json();
    producer()
        .send(
            FutureRecord::<[u8], [u8]>::to(topic)
                .payload(payload.as_slice())
                .headers(headers),
            Duration::from_secs(30),
        )
        .await
        .expect("delivery");
}

async fn seen(db: &tokio_postgres::Client, consumer: &str, event_id: &uuid::Uuid) -> bool {
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM trace_test_seen WHERE consumer = $1 AND event_id = $2",
            &[&consumer, event_id],
        )
        .await
        .unwrap()
        .get(0);
    n > 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_runs_from_the_producer_through_the_engine_and_the_relay_to_the_next_consumer() {
    let url = jaeger().await;
    let (topic_in, topic_out) = (unique("traces-in"), unique("traces-out"));
    let (first, second) = (unique("traces-a"), unique("traces-b"));
    let event_type = unique("TracedPayment");
    let service = unique("effectively-test");
    create_topic(&topic_in, 1).await;
    create_topic(&topic_out, 1).await;
    let db = pg().await;
    create_once(
        &db,
        "CREATE TABLE IF NOT EXISTS trace_test_seen (consumer text, event_id uuid)",
    )
    .await;

    // The first consumer's effect writes an outbox row per payment (an SQL handler: the row's
    // trace context comes from the column defaults, not from the handler); the second one
    // records what it saw.
    let text = format!(
        "{base}\n[[consumer]]\nname = \"{first}\"\ntopics = [\"{topic_in}\"]\n\
         handler = {{ kind = \"sql\", statement = \"\"\"\n\
         INSERT INTO outbox (id, aggregate_id, event_type, payload)\n\
         SELECT message_id, payload->>'user_id', '{event_type}', payload\n\
         FROM fresh_messages ORDER BY message_id\"\"\" }}\n\
         [[consumer]]\nname = \"{second}\"\ntopics = [\"{topic_out}\"]\n\
         handler = {{ kind = \"sql\", statement = \"\"\"\n\
         INSERT INTO trace_test_seen (consumer, event_id)\n\
         SELECT '{second}', message_id FROM fresh_messages\"\"\" }}\n\
         [relay]\ntopics = {{ \"{event_type}\" = \"{topic_out}\" }}\npoll_interval = \"50ms\"\n",
        base = base(&service),
    );
    let config = Config::from_toml_str(&text).expect("test config");
    let worker = Worker::start(config.clone(), Default::default())
        .await
        .expect("worker starts");
    let stop = CancellationToken::new();
    let relay = tokio::spawn(
        effectively::relay::Relay::new(&config)
            .expect("relay")
            .run(stop.clone()),
    );

    // A malformed traceparent changes nothing: the payment is applied and relayed, not parked.
    let bad = Payment::new(&unique("u"), 10_000);
    send_with_headers(&topic_in, &bad, &[("traceparent", "00-not-a-trace-01")]).await;
    eventually(
        60,
        "the payment with a bad traceparent went through",
        || seen(&db, &second, &bad.event_id),
    )
    .await;

    // The traced payment: the producer's span is 00f067aa0ba902b7 in a new trace.
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let producer_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{producer_span}-01");
    let good = Payment::new(&unique("u"), 20_000);
    send_with_headers(
        &topic_in,
        &good,
        &[("traceparent", &traceparent), ("tracestate", "vendor=x1")],
    )
    .await;
    eventually(60, "the traced payment reached the second consumer", || {
        seen(&db, &second, &good.event_id)
    })
    .await;
    // The outbox row kept the engine's transaction context, in the producer's trace.
    let row = db
        .query_one(
            "SELECT traceparent, tracestate FROM outbox WHERE id = $1",
            &[&good.event_id],
        )
        .await
        .unwrap();
    let (kept, state): (Option<String>, Option<String>) = (row.get(0), row.get(1));
    let kept = kept.expect("the outbox row keeps a traceparent");
    assert!(
        kept.starts_with(&format!("00-{trace_id}-")) && kept.ends_with("-01"),
        "{kept}"
    );
    assert_eq!(state.as_deref(), Some("vendor=x1"), "tracestate goes on");
    let engine_span = kept[36..52].to_string();
    let parked: i64 = db
        .query_one(
            "SELECT count(*) FROM dead_letters WHERE consumer = $1",
            &[&first],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(parked, 0, "nothing parked, the bad traceparent included");

    // A graceful stop flushes the spans.
    stop.cancel();
    relay.await.unwrap();
    worker.stop().await.unwrap();

    let mut spans = Vec::new();
    for _ in 0..60 {
        spans = trace_spans(&url, &trace_id).await;
        if spans.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let by_op = |op: &str| -> &SpanView {
        spans
            .iter()
            .find(|s| s.operation == op)
            .unwrap_or_else(|| panic!("no span {op:?} in trace {trace_id}: {spans:#?}"))
    };
    let engine = by_op(&format!("process {topic_in}"));
    let relayed = by_op(&format!("send {topic_out}"));
    let next = by_op(&format!("process {topic_out}"));
    assert_eq!(spans.len(), 3, "{spans:#?}");

    assert_eq!(
        engine.span_id, engine_span,
        "the outbox row holds the engine's span"
    );
    assert_eq!(
        engine.parent(),
        Some(producer_span),
        "child of the producer: {engine:#?}"
    );
    assert_eq!(engine.references[0].0, "FOLLOWS_FROM", "and linked to it");
    assert_eq!(engine.tags["messaging.system"], "kafka");
    assert_eq!(engine.tags["messaging.consumer.group.name"], first.as_str());
    assert_eq!(engine.tags["messaging.destination.partition.id"], "0");
    assert_eq!(engine.tags["messaging.batch.message_count"], 1);
    assert_eq!(engine.tags["effectively.fresh"], 1);
    assert_eq!(engine.tags["effectively.strategy"], "batch");
    assert_eq!(engine.tags["effectively.messages_with_context"], 1);
    let stages: Vec<&str> = engine.events.iter().map(String::as_str).collect();
    assert_eq!(stages, ["fence", "stage", "dedupe", "effect", "commit"]);

    assert_eq!(
        relayed.parent(),
        Some(engine.span_id.as_str()),
        "{relayed:#?}"
    );
    assert_eq!(
        relayed.tags["messaging.message.id"],
        good.event_id.to_string()
    );
    assert_eq!(next.parent(), Some(relayed.span_id.as_str()), "{next:#?}");
    assert_eq!(next.tags["messaging.consumer.group.name"], second.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inbox_row_and_a_notification_keep_the_trace_to_the_providers_call() {
    let url = jaeger().await;
    let topic = unique("traces-inbox");
    let consumer = unique("traces-inbox");
    let channel = unique("traces_sms").replace('-', "_");
    let service = unique("effectively-test");
    create_topic(&topic, 1).await;
    let db = pg().await;
    let stub = provider_stub::ProviderStub::start("127.0.0.1:0")
        .await
        .expect("provider stub");

    // The inbox receiver stores the message with its context; a processor applies it, and its
    // effect records a notification, which the sender delivers.
    let text = format!(
        "{base}\n[[consumer]]\nname = \"{consumer}\"\ntopics = [\"{topic}\"]\n\
         strategy = \"inbox\"\n\
         handler = {{ kind = \"sql\", statement = \"\"\"\n\
         INSERT INTO notifications (event_id, channel, payload)\n\
         SELECT message_id, '{channel}', payload FROM fresh_messages\"\"\" }}\n\
         [consumer.inbox]\nprocessors = 1\npoll_interval = \"50ms\"\n\
         [sender]\npoll_interval = \"50ms\"\n\
         [sender.channels.{channel}]\nurl = \"{stub}/v1/messages\"\n",
        base = base(&service),
        stub = stub.url(),
    );
    let config = Config::from_toml_str(&text).expect("test config");
    let worker = Worker::start(config.clone(), Default::default())
        .await
        .expect("worker starts");
    let stop = CancellationToken::new();
    let sender = tokio::spawn(
        effectively::sender::Sender::new(&config)
            .expect("sender")
            .run(stop.clone()),
    );

    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let producer_span = "0000000000a1b2c3";
    let p = Payment::new(&unique("u"), 30_000);
    send_with_headers(
        &topic,
        &p,
        &[("traceparent", &format!("00-{trace_id}-{producer_span}-01"))],
    )
    .await;
    eventually(60, "the notification was sent", || async {
        let status: Option<String> = db
            .query_opt(
                "SELECT status FROM notifications WHERE event_id = $1 AND channel = $2",
                &[&p.event_id, &channel],
            )
            .await
            .unwrap()
            .map(|r| r.get(0));
        status.as_deref() == Some("SENT")
    })
    .await;
    let inbox_row: Option<String> = db
        .query_one(
            "SELECT traceparent FROM inbox WHERE consumer = $1 AND message_id = $2",
            &[&consumer, &p.event_id],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        inbox_row.as_deref(),
        Some(format!("00-{trace_id}-{producer_span}-01").as_str()),
        "the inbox row keeps its message's context"
    );
    stop.cancel();
    sender.await.unwrap();
    worker.stop().await.unwrap();
    assert_eq!(stub.messages().len(), 1);

    let mut spans = Vec::new();
    for _ in 0..60 {
        spans = trace_spans(&url, &trace_id).await;
        if spans.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let by_op = |op: &str| -> &SpanView {
        spans
            .iter()
            .find(|s| s.operation == op)
            .unwrap_or_else(|| panic!("no span {op:?} in trace {trace_id}: {spans:#?}"))
    };
    let received = by_op(&format!("process {topic}"));
    let processed = by_op(&format!("inbox {topic}"));
    let call = by_op("POST");
    assert_eq!(spans.len(), 3, "{spans:#?}");
    assert_eq!(received.tags["effectively.strategy"], "inbox");
    assert_eq!(received.parent(), Some(producer_span), "{received:#?}");
    assert_eq!(processed.tags["effectively.strategy"], "inbox-processor");
    assert_eq!(processed.parent(), Some(producer_span), "{processed:#?}");
    assert_eq!(processed.tags["effectively.fresh"], 1);
    assert_eq!(call.parent(), Some(processed.span_id.as_str()), "{call:#?}");
    assert_eq!(call.tags["http.response.status_code"], 200);
    assert_eq!(call.tags["effectively.channel"], channel.as_str());
    // The provider itself received the call's context: the trace, and the call span as parent.
    let delivered = stub.messages();
    assert_eq!(
        delivered[0].traceparent.as_deref(),
        Some(format!("00-{trace_id}-{}-01", call.span_id).as_str()),
        "the provider's request carries the POST span's context"
    );
}
