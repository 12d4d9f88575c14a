//! The Schema Registry side of the format tests: registering schemas through the registry's
//! Confluent-compatible API (the stack's Apicurio, `SCHEMA_REGISTRY_URL`; `scripts/stack.sh
//! registry-up` starts it) and writing payments in the Confluent wire format with real encoders
//! (apache-avro's datum writer, prost-reflect's dynamic messages), independent of the engine's
//! decoding path.

use std::time::Duration;

use apache_avro::types::{Record, Value as Avro};
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor};
use serde_json::json;

use super::Payment;

pub const PAYMENT_AVSC: &str = include_str!("../../loadgen/schemas/payment.avsc");
pub const PAYMENT_PROTO: &str = include_str!("../../loadgen/schemas/payment.proto");
pub const PAYMENT_JSON_SCHEMA: &str = include_str!("../../loadgen/schemas/payment.schema.json");

/// The registry's Confluent-compatible base URL, checked to answer.
pub async fn url() -> String {
    let url = super::setting("SCHEMA_REGISTRY_URL", "");
    assert!(
        !url.is_empty(),
        "SCHEMA_REGISTRY_URL is not set: run `scripts/stack.sh registry-up` (make test does)"
    );
    let ok = reqwest::Client::new()
        .get(format!("{url}/subjects"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .is_ok_and(|r| r.status().is_success());
    assert!(
        ok,
        "the schema registry at {url} does not answer: run `scripts/stack.sh registry-up`"
    );
    url
}

/// Registers `schema` (`AVRO`, `PROTOBUF` or `JSON`) under `subject`; its id.
pub async fn register(url: &str, subject: &str, kind: &str, schema: &str) -> u32 {
    let resp = reqwest::Client::new()
        .post(format!("{url}/subjects/{subject}/versions"))
        .header("Content-Type", "application/vnd.schemaregistry.v1+json")
        .json(&json!({"schemaType": kind, "schema": schema}))
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("the registry answers");
    let status = resp.status();
    let body: serde_json::Value = resp.json().await.expect("a JSON answer");
    assert!(
        status.is_success(),
        "registering {subject}: {status} {body}"
    );
    body["id"].as_u64().expect("an id") as u32
}

/// Magic byte 0 and the schema id, then `body`.
pub fn framed(id: u32, body: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend(id.to_be_bytes());
    out.extend(body);
    out
}

/// A payment in Avro, with `payment.avsc` (or another schema with the same fields and more,
/// filled by `extra`).
pub fn avro(id: u32, schema: &apache_avro::Schema, p: &Payment, extra: &[(&str, Avro)]) -> Vec<u8> {
    let mut r = Record::new(schema).expect("a record schema");
    r.put("event_id", Avro::Uuid(p.event_id));
    r.put("payment_id", p.payment_id.as_str());
    r.put("user_id", p.user_id.as_str());
    r.put("amount_paise", p.amount_paise);
    r.put(
        "occurred_at",
        Avro::TimestampMicros(p.occurred_at.timestamp_micros()),
    );
    for (name, v) in extra {
        r.put(name, v.clone());
    }
    framed(id, &datum(schema, r))
}

/// One Avro datum, as a Confluent serializer writes it after the header.
pub fn datum(schema: &apache_avro::Schema, value: impl Into<Avro>) -> Vec<u8> {
    apache_avro::writer::datum::GenericDatumWriter::builder(schema)
        .build()
        .expect("a writer")
        .write_value_to_vec(value)
        .expect("encodes")
}

/// `payment.proto`'s message, compiled.
pub fn proto_payment() -> MessageDescriptor {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("loadgen/schemas");
    let mut c = protox::Compiler::new([dir]).expect("compiler");
    c.include_imports(true);
    c.open_file("payment.proto")
        .expect("payment.proto compiles");
    let pool: DescriptorPool = c.descriptor_pool();
    pool.get_message_by_name("effectively.payments.PaymentSucceeded")
        .expect("the payment message")
}

/// A payment in Protobuf: the message-index list of the file's first message (one 0 byte).
pub fn protobuf(id: u32, desc: &MessageDescriptor, p: &Payment) -> Vec<u8> {
    let msg = DynamicMessage::deserialize(desc.clone(), payment_json(p)).expect("fits the schema");
    let mut body = vec![0u8];
    body.extend(msg.encode_to_vec());
    framed(id, &body)
}

/// A payment in the JSON Schema wire format.
pub fn json_schema(id: u32, p: &Payment) -> Vec<u8> {
    framed(id, payment_json(p).to_string().as_bytes())
}

/// The payment as the JSON demo writes it (and as the engine must decode every format into).
pub fn payment_json(p: &Payment) -> serde_json::Value {
    json!({
        "event_id": p.event_id.to_string(),
        "payment_id": p.payment_id,
        "user_id": p.user_id,
        "amount_paise": p.amount_paise,
        "occurred_at": p.occurred_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    })
}
