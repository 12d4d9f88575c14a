//! What loadgen writes in each registry format, read back with the schema the real registry
//! returns for the id in the bytes (not with loadgen's copy): payments give back the JSON
//! demo's payment object, each kind of poison fails where it should. Needs the stack's registry
//! (SCHEMA_REGISTRY_URL in .stack/env; scripts/stack.sh registry-up).

use std::time::{Duration, Instant};

use apache_avro::reader::datum::GenericDatumReader;
use apache_avro::types::Value as Avro;
use schema_registry_converter::async_impl::schema_registry::{get_schema_by_id, SrSettings};
use schema_registry_converter::prost_reflect::{
    DynamicMessage, MessageDescriptor, SerializeOptions,
};
use schema_registry_converter::schema_registry_common::SchemaType;
use serde_json::{json, Value};

use super::*;
use crate::produce::records::draw;
use crate::produce::{Mix, Run};

fn registry() -> String {
    std::env::var("SCHEMA_REGISTRY_URL").expect(
        "SCHEMA_REGISTRY_URL is not set: source .stack/env, after scripts/stack.sh registry-up",
    )
}

fn run() -> Run {
    Run {
        id: format!("{:08x}", fastrand::u32(..)),
        topic: format!("loadgen-wire-{:08x}", fastrand::u32(..)),
        users: 10,
        started: Instant::now(),
        ids: Default::default(),
        envelope: Default::default(),
        traced: false,
    }
}

/// Every kind of record, poison included (each payment draws all of them).
fn mix() -> Mix {
    Mix {
        resend: 1.0,
        redrive: 1.0,
        redrive_delay: Duration::ZERO,
        double_tap: 1.0,
        poison: 1.0,
    }
}

/// A payment object with its time as an instant: Protobuf's JSON writes as many fractional
/// digits as the time needs, the JSON format always six.
fn normalized(mut doc: Value) -> Value {
    let t = doc["occurred_at"].as_str().expect("occurred_at");
    let t = chrono::DateTime::parse_from_rfc3339(t).expect("RFC 3339");
    doc["occurred_at"] = json!(t.timestamp_micros());
    doc
}

/// The Avro record as the engine is to present it: the uuid a string, the time RFC 3339.
fn avro_json(v: Avro) -> Value {
    let Avro::Record(fields) = v else {
        panic!("not a record: {v:?}")
    };
    let mut doc = serde_json::Map::new();
    for (name, value) in fields {
        let value = match value {
            Avro::Uuid(u) => json!(u.to_string()),
            Avro::String(s) => json!(s),
            Avro::Long(n) => json!(n),
            Avro::TimestampMicros(t) => json!(chrono::DateTime::from_timestamp_micros(t)
                .expect("a time")
                .to_rfc3339()),
            other => panic!("{name}: unexpected {other:?}"),
        };
        doc.insert(name, value);
    }
    Value::Object(doc)
}

fn proto_descriptor(schema: &str) -> MessageDescriptor {
    let mut resolver = protox::file::ChainFileResolver::new();
    resolver.add(InMemory(schema.to_string()));
    resolver.add(protox::file::GoogleFileResolver::new());
    let mut compiler = protox::Compiler::with_file_resolver(resolver);
    compiler
        .open_file("payment.proto")
        .expect("the registry's .proto compiles");
    compiler
        .descriptor_pool()
        .get_message_by_name(PROTO_MESSAGE)
        .expect("the message")
}

struct InMemory(String);

impl protox::file::FileResolver for InMemory {
    fn open_file(&self, name: &str) -> Result<protox::file::File, protox::Error> {
        match name {
            "payment.proto" => protox::file::File::from_source(name, &self.0),
            _ => Err(protox::Error::file_not_found(name)),
        }
    }
}

/// Decodes a framed payment with the registry's schema for `id`; Err when the bytes do not fit.
fn decode(format: Format, schema: &str, body: &[u8]) -> Result<Value, String> {
    match format {
        Format::Avro => {
            let schema = apache_avro::Schema::parse_str(schema).map_err(|e| e.to_string())?;
            let reader = GenericDatumReader::builder(&schema)
                .build()
                .map_err(|e| e.to_string())?;
            let mut rest = body;
            let value = reader.read_value(&mut rest).map_err(|e| e.to_string())?;
            if !rest.is_empty() {
                return Err(format!("{} bytes left over", rest.len()));
            }
            Ok(avro_json(value))
        }
        Format::Protobuf => {
            let (&index, message) = body.split_first().ok_or("no message index")?;
            assert_eq!(
                index, 0,
                "the first message's index list is the single byte 0"
            );
            let m = DynamicMessage::decode(proto_descriptor(schema), message)
                .map_err(|e| e.to_string())?;
            let options = SerializeOptions::new()
                .use_proto_field_name(true)
                .stringify_64_bit_integers(false);
            m.serialize_with_options(serde_json::value::Serializer, &options)
                .map_err(|e| e.to_string())
        }
        Format::JsonSchema | Format::Json => {
            let doc: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
            let fields = [
                "event_id",
                "payment_id",
                "user_id",
                "amount_paise",
                "occurred_at",
            ];
            match fields.iter().find(|f| doc.get(**f).is_none()) {
                Some(f) => Err(format!("required {f:?} is missing")),
                None => Ok(doc),
            }
        }
    }
}

#[tokio::test]
async fn registry_formats_read_back_with_the_registrys_schema() {
    let url = registry();
    let settings = SrSettings::new(url.clone());
    for format in [Format::Avro, Format::Protobuf, Format::JsonSchema] {
        let run = run();
        let wire = Serializer::register(format, Some(&url), &run.topic)
            .await
            .expect("the registry answers (scripts/stack.sh registry-up)")
            .expect("a registry format");
        let registered = get_schema_by_id(wire.schema_id(), &settings)
            .await
            .expect("the registry knows the id it issued");
        let expected_type = match format {
            Format::Avro => SchemaType::Avro,
            Format::Protobuf => SchemaType::Protobuf,
            _ => SchemaType::Json,
        };
        assert_eq!(registered.schema_type, expected_type, "{format:?}");
        let unknown = get_schema_by_id(UNKNOWN_SCHEMA_ID, &settings).await;
        assert!(
            unknown.is_err(),
            "{UNKNOWN_SCHEMA_ID} is unknown to the registry"
        );

        let (mut rng, mut seq, mut seen) = (fastrand::Rng::with_seed(11), 0, Vec::new());
        for _ in 0..60 {
            let mut d = draw(&run, &mix(), &mut rng, &mut seq, true);
            let json = d.original.payload.clone();
            let tap = d.double_tap.as_ref().map(|r| r.payload.clone());
            let poison_json = d.poison.as_ref().map(|r| r.payload.clone());
            wire.encode(&mut d).await.expect("encodes");
            let id = wire.schema_id().to_be_bytes();
            let framed = |bytes: &[u8]| {
                assert_eq!(bytes[0], 0, "{format:?}: magic byte");
                assert_eq!(bytes[1..5], id, "{format:?}: schema id");
                decode(format, &registered.schema, &bytes[5..])
            };
            let read = framed(&d.original.payload).expect("a payment decodes");
            let sent: Value = serde_json::from_slice(&json).unwrap();
            assert_eq!(normalized(read), normalized(sent), "{format:?}");
            let copies = [&d.resend, &d.redrive].map(|r| r.as_ref().unwrap().payload.clone());
            assert_eq!(
                copies,
                [0, 1].map(|_| d.original.payload.clone()),
                "same bytes"
            );
            let read = framed(&d.double_tap.as_ref().unwrap().payload).expect("a double tap");
            let sent: Value = serde_json::from_slice(&tap.unwrap()).unwrap();
            assert_eq!(normalized(read), normalized(sent));

            let poison = d.poison.expect("every payment draws poison here");
            let bytes = &poison.payload;
            assert!(
                bytes.windows(run.id.len()).any(|w| w == run.id.as_bytes()),
                "{:?}: the run's marker is in the bytes",
                poison.sent.kind
            );
            match poison.sent.kind {
                Kind::PoisonUndecodable => assert_ne!(bytes[0], 0, "no magic byte"),
                Kind::PoisonUnknownSchema => {
                    assert_eq!(bytes[0], 0);
                    assert_eq!(bytes[1..5], UNKNOWN_SCHEMA_ID.to_be_bytes());
                }
                Kind::PoisonSchemaMismatch => {
                    let err = framed(bytes).expect_err("bytes that do not fit the schema");
                    assert!(!err.is_empty());
                }
                Kind::PoisonNoEventId | Kind::PoisonBadField => {
                    let read = framed(bytes).expect("a well-formed payment");
                    let sent: Value = serde_json::from_slice(&poison_json.unwrap()).unwrap();
                    assert_eq!(normalized(read), normalized(sent.clone()));
                    let no_header = poison.sent.kind == Kind::PoisonNoEventId;
                    assert_eq!(poison.event_id.is_none(), no_header);
                    assert!(no_header || sent["amount_paise"].as_i64() < Some(0));
                    assert!(sent["payment_id"].as_str().unwrap().starts_with("poison_"));
                }
                other => panic!("not poison: {other:?}"),
            }
            seen.push(poison.sent.kind);
        }
        for kind in [
            Kind::PoisonUndecodable,
            Kind::PoisonUnknownSchema,
            Kind::PoisonSchemaMismatch,
            Kind::PoisonNoEventId,
            Kind::PoisonBadField,
        ] {
            assert!(
                seen.contains(&kind),
                "{format:?}: 60 payments draw {kind:?}"
            );
        }
    }
}

/// Registering again (a second run on the topic, a restarted loadgen) gives the same id.
#[tokio::test]
async fn registering_twice_keeps_the_id() {
    let url = registry();
    let run = run();
    let first = Serializer::register(Format::Avro, Some(&url), &run.topic)
        .await
        .unwrap()
        .unwrap();
    let second = Serializer::register(Format::Avro, Some(&url), &run.topic)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.schema_id(), second.schema_id());
}

/// JSON needs no registry, and a registry format without one says where to get it.
#[tokio::test]
async fn json_needs_no_registry() {
    assert!(Serializer::register(Format::Json, None, "t")
        .await
        .unwrap()
        .is_none());
    let err = Serializer::register(Format::Avro, None, "t")
        .await
        .err()
        .expect("no registry");
    assert!(err.to_string().contains("registry-up"), "{err}");
}
