//! Schema Registry payloads: the Confluent wire format, and each schema kind's decoding into
//! the JSON object the engine already handles.
//!
//! A record in the wire format is `0x00`, the writer's schema id (4 bytes, big-endian), then
//! the encoded value (for Protobuf, first the message-index list naming which message of the
//! schema's file it is). The writer's schema decodes it: no reader schema, so a stream whose
//! schema evolves (a v1 producer still writing beside a v2 one) decodes every record with the
//! schema it was written with.
//!
//! Nothing here talks to the registry or knows a record's topic: [`super::registry`] fetches
//! and compiles schemas, [`super`] turns what fails here into a parked record's reason.

pub mod avro;
mod avro_bounds;
pub mod json_schema;
pub mod protobuf;

use serde_json::Value;

use crate::config::PayloadFormat;

/// The magic byte that opens every record in the Confluent wire format.
pub const MAGIC: u8 = 0;
/// Magic byte and schema id.
pub const HEADER: usize = 5;

/// How deep a payload's values may nest (objects and arrays; Avro records, arrays and maps),
/// in every format: serde_json's own recursion limit, which JSON and JSON Schema payloads meet
/// in the parser, and the bound [`avro_bounds`] puts on Avro (Protobuf's decoder has its own
/// limit of 100 nested messages). Deeper payloads are parked as undecodable, with this number
/// in the reason, rather than followed down the worker's stack.
pub const MAX_DEPTH: usize = 128;

/// Why `what` did not parse as JSON, in the operator's words: serde_json's "recursion limit
/// exceeded" says which limit.
pub fn json_error(what: &str, e: &serde_json::Error) -> String {
    let text = e.to_string();
    if text.starts_with("recursion limit exceeded") {
        format!(
            "{what} is nested deeper than {MAX_DEPTH} levels (objects and arrays within each \
             other), the most the engine parses ({text})"
        )
    } else {
        format!("{what} is not valid JSON: {text}")
    }
}

/// A schema's kind, as the registry names it (`schemaType`, absent for Avro).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Avro,
    Protobuf,
    Json,
}

impl Kind {
    /// From the registry's `schemaType` (absent means Avro, as in Confluent's API).
    pub fn from_registry(schema_type: Option<&str>) -> Result<Kind, String> {
        match schema_type.map(str::to_ascii_uppercase).as_deref() {
            None | Some("AVRO") => Ok(Kind::Avro),
            Some("PROTOBUF") => Ok(Kind::Protobuf),
            Some("JSON") => Ok(Kind::Json),
            Some(other) => Err(format!(
                "the registry's schemaType {other:?} is not one this engine reads"
            )),
        }
    }

    pub fn as_str(&self) -> &'static str {
        match self {
            Kind::Avro => "AVRO",
            Kind::Protobuf => "PROTOBUF",
            Kind::Json => "JSON",
        }
    }

    /// The kind a consumer's `format` reads; `None` for plain JSON (no registry).
    pub fn of(format: PayloadFormat) -> Option<Kind> {
        match format {
            PayloadFormat::Json => None,
            PayloadFormat::Avro => Some(Kind::Avro),
            PayloadFormat::Protobuf => Some(Kind::Protobuf),
            PayloadFormat::JsonSchema => Some(Kind::Json),
        }
    }
}

/// A schema as the registry holds it: its text, and the schemas it references (resolved
/// recursively, each with the name the text imports it by), dependencies first.
#[derive(Debug, Clone)]
pub struct SchemaText {
    pub kind: Kind,
    pub text: String,
    pub references: Vec<Reference>,
}

#[derive(Debug, Clone)]
pub struct Reference {
    /// The name the referencing schema uses: an Avro full name, a `.proto` import path, a
    /// JSON Schema `$ref` URI.
    pub name: String,
    pub text: String,
}

/// A schema ready to decode records.
pub enum Compiled {
    Avro(avro::AvroSchema),
    Protobuf(protobuf::ProtoSchema),
    Json(json_schema::JsonSchema),
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Compiled({})", self.kind().as_str())
    }
}

impl Compiled {
    /// Parses a schema and what it references. `validate`: JSON Schema records are checked
    /// against their schema (Avro and Protobuf are checked by decoding itself).
    pub fn compile(s: &SchemaText, validate: bool) -> Result<Compiled, String> {
        match s.kind {
            Kind::Avro => avro::AvroSchema::compile(s).map(Compiled::Avro),
            Kind::Protobuf => protobuf::ProtoSchema::compile(s).map(Compiled::Protobuf),
            Kind::Json => json_schema::JsonSchema::compile(s, validate).map(Compiled::Json),
        }
    }

    pub fn kind(&self) -> Kind {
        match self {
            Compiled::Avro(_) => Kind::Avro,
            Compiled::Protobuf(_) => Kind::Protobuf,
            Compiled::Json(_) => Kind::Json,
        }
    }

    /// Decodes the bytes after the 5-byte header into JSON. `Err`: the bytes do not fit the
    /// schema (the reason, for the operator).
    pub fn decode(&self, body: &[u8]) -> Result<Value, String> {
        match self {
            Compiled::Avro(s) => s.decode(body),
            Compiled::Protobuf(s) => s.decode(body),
            Compiled::Json(s) => s.decode(body),
        }
    }
}

/// The schema id of a record in the wire format, and the bytes after the header.
pub fn split(bytes: &[u8]) -> Result<(u32, &[u8]), String> {
    match bytes {
        [MAGIC, a, b, c, d, body @ ..] => Ok((u32::from_be_bytes([*a, *b, *c, *d]), body)),
        [MAGIC, ..] => Err(format!(
            "{} bytes, too short for the Confluent wire format's 5-byte header",
            bytes.len()
        )),
        [first, ..] => Err(format!(
            "not in the Confluent wire format: the first byte is 0x{first:02x}, not the magic \
             byte 0x00 (was it written without a Schema Registry serializer?)"
        )),
        [] => Err("no bytes".into()),
    }
}

/// The schema id when `bytes` opens with the wire format's header.
pub fn schema_id(bytes: &[u8]) -> Option<u32> {
    split(bytes).ok().map(|(id, _)| id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_gives_the_id_and_the_rest() {
        assert_eq!(split(&[0, 0, 0, 1, 2, 9, 9]), Ok((258, &[9u8, 9][..])));
        assert_eq!(split(&[0, 0, 0, 0, 7]), Ok((7, &[][..])));
        assert!(split(&[0, 0, 1]).unwrap_err().contains("too short"));
        assert!(split(b"{\"a\":1}").unwrap_err().contains("0x7b"));
        assert!(split(&[]).is_err());
        assert_eq!(schema_id(&[1, 0, 0, 0, 1]), None);
    }

    #[test]
    fn the_registry_names_its_kinds() {
        assert_eq!(Kind::from_registry(None), Ok(Kind::Avro));
        assert_eq!(Kind::from_registry(Some("PROTOBUF")), Ok(Kind::Protobuf));
        assert_eq!(Kind::from_registry(Some("json")), Ok(Kind::Json));
        assert!(Kind::from_registry(Some("XML")).is_err());
    }
}
