//! Micro-benchmarks of the per-record hot paths (criterion): decoding an envelope with the id
//! in a header or behind a JSON pointer, a text id, a template and a binary CloudEvent, admitting a batch (decode, window and handler
//! checks), and encoding a batch for binary COPY. `cargo bench --bench hot_paths`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use effectively::batch::{Batch, Raw, Record};
use effectively::config::{Config, EventDateSource, MessageIdConfig, MessageIdSource};
use effectively::envelope::Decoder;
use effectively::handler::cashback::Cashback;

fn payment(i: usize) -> (String, Vec<u8>) {
    let id = uuid::Uuid::now_v7();
    let payload = serde_json::to_vec(&serde_json::json!({
        "event_id": id,
        "payment_id": format!("pay_{i}"),
        "user_id": format!("u_{}", i % 1000),
        "amount_paise": 120_000,
        "occurred_at": chrono::Utc::now().to_rfc3339(),
    }))
    .unwrap();
    (id.to_string(), payload)
}

fn raw(i: usize) -> Raw {
    let (id, payload) = payment(i);
    Raw {
        partition: 0,
        offset: i as i64,
        timestamp_ms: Some(1_800_000_000_000),
        key: Some(Bytes::from(format!("u_{}", i % 1000))),
        payload: Some(Bytes::from(payload)),
        headers: vec![("event_id".into(), Some(Bytes::from(id)))],
    }
}

fn decode(c: &mut Criterion) {
    let r = raw(1);
    let mut g = c.benchmark_group("decode");
    g.throughput(Throughput::Elements(1));
    let by_header = Decoder::new(
        &MessageIdConfig::header("event_id"),
        &EventDateSource::Auto,
        1 << 20,
        true,
    );
    g.bench_function("header_id", |b| {
        b.iter(|| r.with_view(|v| black_box(by_header.decode(v)).is_ok()))
    });
    let by_pointer = Decoder::new(
        &MessageIdConfig {
            source: MessageIdSource::JsonPointer("/event_id".into()),
            any_string: false,
        },
        &EventDateSource::Auto,
        1 << 20,
        true,
    );
    g.bench_function("json_pointer_id", |b| {
        b.iter(|| r.with_view(|v| black_box(by_pointer.decode(v)).is_ok()))
    });
    // A text id: the same header, read as any string (a UUID stays one: the parse, no hash).
    let text_ids = |source| {
        Decoder::new(
            &MessageIdConfig {
                source,
                any_string: true,
            },
            &EventDateSource::JsonPointer("/occurred_at".into()),
            1 << 20,
            true,
        )
    };
    let stripe = Raw {
        headers: vec![(
            "event_id".into(),
            Some(Bytes::from_static(b"evt_1NxYzAbCdEfGhIjKlMnOpQr")),
        )],
        ..raw(1)
    };
    let by_text = text_ids(MessageIdSource::Header("event_id".into()));
    g.bench_function("text_id_v5", |b| {
        b.iter(|| stripe.with_view(|v| black_box(by_text.decode(v)).is_ok()))
    });
    let template = text_ids(MessageIdSource::Template(
        "{/payment_id}:{/user_id}".parse().unwrap(),
    ));
    g.bench_function("template_id", |b| {
        b.iter(|| r.with_view(|v| black_box(template.decode(v)).is_ok()))
    });
    let cloudevent = Raw {
        headers: vec![
            ("ce_specversion".into(), Some(Bytes::from_static(b"1.0"))),
            ("ce_id".into(), Some(Bytes::from_static(b"evt_1"))),
            ("ce_source".into(), Some(Bytes::from_static(b"/billing"))),
            (
                "ce_type".into(),
                Some(Bytes::from_static(b"payment.succeeded")),
            ),
            (
                "ce_time".into(),
                Some(Bytes::from_static(b"2026-12-07T10:00:00Z")),
            ),
        ],
        ..raw(1)
    };
    let ce = Decoder::new(
        &MessageIdConfig::default(),
        &EventDateSource::Auto,
        1 << 20,
        true,
    )
    .with_envelope(effectively::config::EnvelopeKind::CloudEvents);
    g.bench_function("cloudevents_binary", |b| {
        b.iter(|| cloudevent.with_view(|v| black_box(ce.decode(v)).is_ok()))
    });
    g.finish();
}

fn batch(c: &mut Criterion) {
    let config = Config::from_toml_str(
        "[[consumer]]\nname = \"b\"\ntopics = [\"t\"]\nhandler = { kind = \"cashback\" }\n",
    )
    .unwrap();
    let consumer = &config.consumers[0];
    let decoder = Decoder::new(
        &consumer.message_id,
        &consumer.event_date,
        consumer.max_payload_bytes,
        true,
    );
    let handler = Cashback::new(200);
    let raws: Vec<Raw> = (0..1000).map(raw).collect();
    let today = chrono::Utc::now().date_naive();
    let mut g = c.benchmark_group("batch");
    g.throughput(Throughput::Elements(1000));
    g.bench_function("admit_1000", |b| {
        b.iter(|| {
            let mut batch = Batch::default();
            for r in &raws {
                batch.push(Record::admit(
                    r.clone(),
                    &decoder,
                    &handler,
                    consumer,
                    today,
                ));
            }
            black_box(batch.len())
        })
    });
    let mut admitted = Batch::default();
    for r in &raws {
        admitted.push(Record::admit(
            r.clone(),
            &decoder,
            &handler,
            consumer,
            today,
        ));
    }
    let envs: Vec<_> = admitted
        .records
        .iter()
        .filter_map(|r| r.decoded.as_ref().ok())
        .collect();
    g.bench_function("copy_encode_1000", |b| {
        b.iter(|| black_box(effectively::store::copy::encode(&envs, false, false, None)).len())
    });
    g.bench_function("copy_encode_1000_with_payload", |b| {
        b.iter(|| black_box(effectively::store::copy::encode(&envs, true, false, None)).len())
    });
    g.finish();
}

criterion_group!(benches, decode, batch);
criterion_main!(benches);
