//! The registry formats (`loadgen --format avro|protobuf|json-schema`): each payment in the
//! Confluent wire format (magic byte 0, the schema id as 4 big-endian bytes, for Protobuf the
//! message-index list, then the encoded bytes), its schema (`loadgen/schemas/payment.*`, the
//! ones the engine's tests use) registered under the topic's `<topic>-value` subject
//! (TopicNameStrategy) through the registry's Confluent-compatible API.
//!
//! The serializers and the registry client are `schema_registry_converter`'s: an implementation
//! of the wire format of its own, not the engine's, so a misreading of the format on one side
//! shows instead of cancelling out. JSON Schema needs only its registration and framing from
//! it: the payload is the JSON object as the JSON format writes it.
//!
//! Poison keeps the mix's share, drawn as kinds a registry consumer meets
//! ([`super::records`]): no magic byte, a schema id the registry never issued, bytes that do
//! not fit their schema, and, where the format carries them, a payment without an `event_id`
//! header or with a negative amount.

use std::time::Duration;

use anyhow::Context;
use apache_avro::types::Value as Avro;
use schema_registry_converter::async_impl::avro::AvroEncoder;
use schema_registry_converter::async_impl::proto_encoder::ProtoEncoder;
use schema_registry_converter::async_impl::schema_registry::{post_schema, SrSettings};
use schema_registry_converter::schema_registry_common::{
    get_payload, SchemaType, SubjectNameStrategy, SuppliedSchema,
};
use serde_json::Value;

use super::records::{Draw, Record};
use super::Kind;

/// The payload format of the records loadgen writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// The JSON object, as the seed always wrote it (no registry).
    #[default]
    Json,
    Avro,
    Protobuf,
    /// JSON with its JSON Schema's id in front.
    JsonSchema,
}

impl Format {
    /// The name in the engine's `[consumer.payload] format`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Avro => "avro",
            Format::Protobuf => "protobuf",
            Format::JsonSchema => "json-schema",
        }
    }
}

pub const AVRO_SCHEMA: &str = include_str!("../../schemas/payment.avsc");
pub const PROTO_SCHEMA: &str = include_str!("../../schemas/payment.proto");
pub const JSON_SCHEMA: &str = include_str!("../../schemas/payment.schema.json");
/// The message payment.proto declares (the first, so its message index is the single byte 0).
pub const PROTO_MESSAGE: &str = "effectively.payments.PaymentSucceeded";
/// A schema id no registry of the stack issues (its ids count up from 1): the registry answers
/// 404 for it.
pub const UNKNOWN_SCHEMA_ID: u32 = 2_000_000_000;

enum Codec {
    Avro(AvroEncoder),
    Protobuf(ProtoEncoder),
    JsonSchema,
}

/// Encodes one run's records for one topic, its schema registered.
pub struct Serializer {
    format: Format,
    codec: Codec,
    strategy: SubjectNameStrategy,
    id: u32,
}

impl Serializer {
    /// Registers `format`'s payment schema under `<topic>-value` at `registry` (the Confluent-
    /// compatible base URL) and keeps its id. None for JSON, which needs no registry.
    pub async fn register(
        format: Format,
        registry: Option<&str>,
        topic: &str,
    ) -> anyhow::Result<Option<Serializer>> {
        let (schema_type, schema) = match format {
            Format::Json => return Ok(None),
            Format::Avro => (SchemaType::Avro, AVRO_SCHEMA),
            Format::Protobuf => (SchemaType::Protobuf, PROTO_SCHEMA),
            Format::JsonSchema => (SchemaType::Json, JSON_SCHEMA),
        };
        let url = registry.with_context(|| {
            format!(
                "--format {} needs a schema registry: --schema-registry or SCHEMA_REGISTRY_URL \
                 (the stack's: scripts/stack.sh registry-up)",
                format.name()
            )
        })?;
        let settings = || {
            SrSettings::new_builder(url.trim_end_matches('/').to_string())
                .set_timeout(Duration::from_secs(10))
                .build()
                .context("the schema registry's client")
        };
        let supplied = SuppliedSchema::new(None, schema_type, schema.to_string());
        let strategy = SubjectNameStrategy::TopicNameStrategyWithSchema(
            topic.to_string(),
            false,
            supplied.clone(),
        );
        let codec = match format {
            Format::Avro => Codec::Avro(AvroEncoder::new(settings()?)),
            Format::Protobuf => Codec::Protobuf(ProtoEncoder::new(settings()?)),
            _ => Codec::JsonSchema,
        };
        let mut serializer = Serializer {
            format,
            codec,
            strategy,
            id: 0,
        };
        let registering = || format!("registering the {} schema at {url}", format.name());
        serializer.id = match serializer.codec {
            // The JSON Schema serializer only frames: the schema is registered by hand.
            Codec::JsonSchema => {
                post_schema(&settings()?, format!("{topic}-value"), supplied)
                    .await
                    .with_context(registering)?
                    .id
            }
            // The encoders register on their first use and cache the id: a sample payment, whose
            // framing names the id.
            _ => {
                let sample = serde_json::json!({
                    "event_id": uuid::Uuid::nil(),
                    "payment_id": "sample",
                    "user_id": "sample",
                    "amount_paise": 1,
                    "occurred_at": "2026-12-01T00:00:00Z",
                });
                let bytes = serializer
                    .payment(&serde_json::to_vec(&sample)?)
                    .await
                    .with_context(registering)?;
                u32::from_be_bytes(bytes[1..5].try_into().expect("4 bytes"))
            }
        };
        Ok(Some(serializer))
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// The id the registry issued for the payment schema.
    pub fn schema_id(&self) -> u32 {
        self.id
    }

    /// Turns the draw's JSON records into this format. The resend and the redrive are copies of
    /// the original's bytes, as they are on the wire.
    pub(super) async fn encode(&self, d: &mut Draw) -> anyhow::Result<()> {
        self.record(&mut d.original).await?;
        for copy in [&mut d.resend, &mut d.redrive].into_iter().flatten() {
            copy.payload = d.original.payload.clone();
        }
        for r in [&mut d.double_tap, &mut d.poison].into_iter().flatten() {
            self.record(r).await?;
        }
        Ok(())
    }

    async fn record(&self, r: &mut Record) -> anyhow::Result<()> {
        let json = std::mem::take(&mut r.payload);
        r.payload = match r.sent.kind {
            // No magic byte: the text as it is (its first byte is 1).
            Kind::PoisonUndecodable => json,
            Kind::PoisonUnknownSchema => get_payload(UNKNOWN_SCHEMA_ID, json),
            Kind::PoisonSchemaMismatch => get_payload(self.id, self.mismatch(json)),
            _ => self.payment(&json).await?,
        };
        Ok(())
    }

    /// Bytes that the registered schema cannot read, the run's marker (in `json`) inside.
    fn mismatch(&self, json: Vec<u8>) -> Vec<u8> {
        let prefix: &[u8] = match self.format {
            // The first field, a string, with the length -1 (zigzag 1).
            Format::Avro => &[1],
            // Message index 0, then field 1 with wire type 7, which does not exist.
            Format::Protobuf => &[0, 0x0f],
            // JSON that breaks the schema: no payment field, one it does not allow.
            Format::Json | Format::JsonSchema => &[],
        };
        [prefix, &json].concat()
    }

    /// A payment (the JSON object of the JSON format) in this format, framed.
    async fn payment(&self, json: &[u8]) -> anyhow::Result<Vec<u8>> {
        let doc: Value = serde_json::from_slice(json).context("a payment is JSON")?;
        Ok(match &self.codec {
            Codec::Avro(encoder) => encoder.encode_value(avro(&doc)?, &self.strategy).await?,
            Codec::Protobuf(encoder) => {
                encoder
                    .encode_json(&doc, PROTO_MESSAGE, &self.strategy)
                    .await?
            }
            Codec::JsonSchema => get_payload(self.id, json.to_vec()),
        })
    }
}

/// The payment as payment.avsc's record: the event id a `uuid`, the time `timestamp-micros`.
fn avro(doc: &Value) -> anyhow::Result<Avro> {
    let text = |name: &str| -> anyhow::Result<String> {
        doc[name]
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("a payment's {name} is a string"))
    };
    let event_id: uuid::Uuid = text("event_id")?.parse()?;
    let occurred_at = chrono::DateTime::parse_from_rfc3339(&text("occurred_at")?)?;
    Ok(Avro::Record(vec![
        ("event_id".into(), Avro::Uuid(event_id)),
        ("payment_id".into(), Avro::String(text("payment_id")?)),
        ("user_id".into(), Avro::String(text("user_id")?)),
        (
            "amount_paise".into(),
            Avro::Long(doc["amount_paise"].as_i64().context("amount_paise")?),
        ),
        (
            "occurred_at".into(),
            Avro::TimestampMicros(occurred_at.timestamp_micros()),
        ),
    ]))
}

#[cfg(test)]
mod tests;
