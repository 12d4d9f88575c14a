//! Protobuf: the registry's `.proto` text compiled at run time (`protox`, a protobuf compiler
//! in Rust: no `protoc` on the machine), the record decoded as a `prost-reflect` dynamic message
//! of the type its message-index list names, then written as JSON.
//!
//! The JSON is proto3's JSON mapping with three choices made for a handler reading fields:
//! field names as the `.proto` writes them (`amount_paise`, not `amountPaise`), 64-bit integers
//! as numbers (not strings), and every field present, defaults included (a handler reading
//! `/amount_paise` of a zero amount finds 0, not nothing). Well-known types map as proto3 says:
//! `google.protobuf.Timestamp` is an RFC 3339 string, wrappers their value, enums their name,
//! `bytes` base64.
//!
//! Bytes that leave unknown fields behind did not come from this schema (the writer's schema
//! knows every field it wrote), so they are refused rather than half-read.

use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};
use serde_json::Value;

use super::SchemaText;

/// The name the schema's own file gets in the compiler (its imports keep theirs).
const MAIN_FILE: &str = "effectively/registry-schema.proto";

/// How a decoded message is written as JSON.
const JSON: SerializeOptions = SerializeOptions::new()
    .stringify_64_bit_integers(false)
    .use_proto_field_name(true)
    .skip_default_fields(false);

/// prost's recursion limit (its default, `RECURSION_LIMIT`), which bounds how deep a record's
/// messages may nest.
const PROST_DEPTH: usize = 100;

pub struct ProtoSchema {
    /// The file's top-level messages, in order: the message-index list starts here.
    messages: Vec<MessageDescriptor>,
}

/// The registry's schema and its references, by import name.
struct Sources {
    files: Vec<(String, String)>,
}

impl FileResolver for Sources {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        match self.files.iter().find(|(n, _)| n == name) {
            Some((n, text)) => File::from_source(n, text),
            None => Err(protox::Error::file_not_found(name)),
        }
    }
}

impl ProtoSchema {
    pub fn compile(s: &SchemaText) -> Result<ProtoSchema, String> {
        let mut files = vec![(MAIN_FILE.to_string(), s.text.clone())];
        files.extend(
            s.references
                .iter()
                .map(|r| (r.name.clone(), r.text.clone())),
        );
        let mut resolver = ChainFileResolver::new();
        resolver.add(Sources { files });
        // The well-known types (timestamp.proto, wrappers.proto, ...) when the registry did not
        // list them as references, as Confluent's serializers do not.
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler.include_imports(true);
        compiler
            .open_file(MAIN_FILE)
            .map_err(|e| format!("the Protobuf schema does not compile: {e}"))?;
        let pool: DescriptorPool = compiler.descriptor_pool();
        let file = pool
            .get_file_by_name(MAIN_FILE)
            .ok_or("the Protobuf schema's file is missing after compiling")?;
        let messages: Vec<MessageDescriptor> = file.messages().collect();
        if messages.is_empty() {
            return Err("the Protobuf schema defines no message".into());
        }
        Ok(ProtoSchema { messages })
    }

    pub fn decode(&self, body: &[u8]) -> Result<Value, String> {
        let (path, rest) = indexes(body)?;
        let desc = self.message(&path)?;
        let msg = DynamicMessage::decode(desc.clone(), rest).map_err(|e| {
            let name = desc.full_name();
            match e.to_string() {
                // prost's own bound (prost-reflect decodes with prost's DecodeContext).
                t if t.contains("recursion limit") => format!(
                    "Protobuf: {name} nests messages deeper than {PROST_DEPTH} levels, the most \
                     the decoder follows ({t})"
                ),
                t => format!("Protobuf: {name} does not decode: {t}"),
            }
        })?;
        if let Some(f) = unknown(&msg) {
            return Err(format!(
                "Protobuf: {} has no field number {f}: the bytes were written with another schema",
                desc.full_name()
            ));
        }
        msg.serialize_with_options(serde_json::value::Serializer, &JSON)
            .map_err(|e| format!("Protobuf: {} as JSON: {e}", desc.full_name()))
    }

    /// The message a message-index list names: the first index among the file's top-level
    /// messages, each next one among the previous one's nested messages.
    fn message(&self, path: &[i64]) -> Result<MessageDescriptor, String> {
        let out_of_range =
            || format!("Protobuf: the message indexes {path:?} name no message of the schema");
        let index = |i: i64| usize::try_from(i).map_err(|_| out_of_range());
        let mut desc = self
            .messages
            .get(index(path[0])?)
            .ok_or_else(out_of_range)?
            .clone();
        for &i in &path[1..] {
            let child = desc.child_messages().nth(index(i)?);
            desc = child.ok_or_else(out_of_range)?;
        }
        Ok(desc)
    }
}

/// The first unknown field's number, if decoding left any (recursively through nested
/// messages).
fn unknown(msg: &DynamicMessage) -> Option<u32> {
    if let Some(f) = msg.unknown_fields().next() {
        return Some(f.number());
    }
    msg.fields().find_map(|(_, v)| nested_unknown(v))
}

fn nested_unknown(v: &prost_reflect::Value) -> Option<u32> {
    use prost_reflect::Value as V;
    match v {
        V::Message(m) => unknown(m),
        V::List(items) => items.iter().find_map(nested_unknown),
        V::Map(entries) => entries.values().find_map(nested_unknown),
        _ => None,
    }
}

/// Reads the message-index list (zigzag varints: a count, then that many indexes; a count of
/// 0 is the common case of the first message, `[0]`).
fn indexes(body: &[u8]) -> Result<(Vec<i64>, &[u8]), String> {
    let mut rest = body;
    let count = zigzag(&mut rest)?;
    if count == 0 {
        return Ok((vec![0], rest));
    }
    if !(1..=32).contains(&count) {
        return Err(format!(
            "Protobuf: the message-index list claims {count} indexes (a corrupt record?)"
        ));
    }
    let path = (0..count)
        .map(|_| zigzag(&mut rest))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((path, rest))
}

fn zigzag(buf: &mut &[u8]) -> Result<i64, String> {
    let mut value: u64 = 0;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf
            .split_first()
            .ok_or("Protobuf: the message-index list is cut short")?;
        *buf = rest;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(((value >> 1) as i64) ^ -((value & 1) as i64));
        }
    }
    Err("Protobuf: a message index is not a valid varint".into())
}

#[cfg(test)]
mod tests {
    use super::super::Kind;
    use super::*;
    use prost::Message as _;

    fn compile(text: &str) -> ProtoSchema {
        ProtoSchema::compile(&SchemaText {
            kind: Kind::Protobuf,
            text: text.into(),
            references: vec![],
        })
        .unwrap()
    }

    #[test]
    fn the_demo_payment_maps_to_the_json_demo_s_object() {
        let s = compile(include_str!("../../../loadgen/schemas/payment.proto"));
        let desc = s.messages[0].clone();
        let json = serde_json::json!({
            "event_id": "0190a5c2-7e1f-7c3a-8b1e-0123456789ab",
            "payment_id": "pay_1",
            "user_id": "u_1",
            "amount_paise": 12300,
            "occurred_at": "2023-11-14T22:13:20.000001Z",
        });
        let msg = DynamicMessage::deserialize(desc, json.clone()).unwrap();
        let mut body = vec![0u8]; // the message-index list of the first message
        body.extend(msg.encode_to_vec());
        assert_eq!(s.decode(&body).unwrap(), json);
        // A zero amount is there, as 0.
        let zero = DynamicMessage::new(s.messages[0].clone());
        let mut body = vec![0u8];
        body.extend(zero.encode_to_vec());
        assert_eq!(s.decode(&body).unwrap()["amount_paise"], 0);
        // Field 9 is not in the schema.
        let mut body = vec![0u8, 9 << 3, 1];
        body.extend(msg.encode_to_vec());
        assert!(s.decode(&body).unwrap_err().contains("field number 9"));
    }

    #[test]
    fn message_indexes_pick_nested_and_later_messages() {
        let s = compile(
            "syntax = \"proto3\"; message A { int32 a = 1; message Inner { string x = 1; } } \
             message B { string b = 1; }",
        );
        // [1]: B. Count 1 (zigzag 2), index 1 (zigzag 2); then field 1 = "hi".
        assert_eq!(
            s.decode(&[2, 2, 0x0a, 2, b'h', b'i']).unwrap(),
            serde_json::json!({"b": "hi"})
        );
        // [0, 0]: A.Inner.
        assert_eq!(
            s.decode(&[4, 0, 0, 0x0a, 1, b'y']).unwrap(),
            serde_json::json!({"x": "y"})
        );
        assert!(s.decode(&[2, 6]).unwrap_err().contains("name no message"));
        assert!(s.decode(&[]).unwrap_err().contains("cut short"));
    }
}
