//! The record decoder under generated records: a key, headers and a payload, read under one of
//! the settings a consumer can choose (message id source, event date source, tombstones,
//! CloudEvents, the payload limit, whether the handler reads fields).
//!
//! Shared by the libFuzzer target (`fuzz/fuzz_targets/decode_record.rs`) and the stable
//! property test (`tests/fuzz.rs`), so both check one set of properties:
//! - decoding never panics;
//! - a rejection always says why (a reason code and a sentence);
//! - decoding is a function of the record: twice gives the same answer (a redelivered copy
//!   must get the same key, or be parked for the same reason);
//! - a payload over `max_payload_bytes` is parked as oversized, before anything parses it;
//! - an accepted record keeps its coordinates, and a handler that reads fields gets an object.
//!
//! Payloads are generated raw, or shaped (JSON objects with the fields the settings read, deep
//! nesting, long strings), since random bytes alone seldom reach past the first parse error.

use arbitrary::{Arbitrary, Unstructured};
use effectively::config::{
    EnvelopeKind, EventDateSource, MessageIdConfig, MessageIdSource, OnTombstone,
};
use effectively::envelope::{Decoder, Envelope, RawRecord, Reason, Rejection};

/// The consumer's settings a record is read under.
#[derive(Debug, Arbitrary)]
pub struct Settings {
    id: IdChoice,
    any_string: bool,
    date: DateChoice,
    needs_json: bool,
    skip_tombstones: bool,
    cloudevents: bool,
    /// A limit small enough for generated payloads to cross (else the default 1 MiB).
    small_limit: bool,
}

#[derive(Debug, Arbitrary)]
enum IdChoice {
    Header,
    Pointer,
    Key,
    Template,
}

#[derive(Debug, Arbitrary)]
enum DateChoice {
    Auto,
    Uuid7,
    Pointer,
}

/// Header names the settings read, and others.
#[derive(Debug, Arbitrary)]
enum Name {
    EventId,
    Shard,
    ContentType,
    CeId,
    CeSource,
    CeTime,
    CeSpecversion,
    Other(String),
}

/// Header values: text the readers look for, or anything.
#[derive(Debug, Arbitrary)]
enum Text {
    Uuid7([u8; 10]),
    Uuid4([u8; 16]),
    Nil,
    Time(i64),
    CloudEventsJson,
    Raw(Vec<u8>),
}

/// A JSON value built from a small grammar, so that objects with the fields the decoder reads
/// are common.
#[derive(Debug, Arbitrary)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Text(Text),
    Array(Vec<Json>),
    Object(Vec<(Field, Json)>),
}

#[derive(Debug, Arbitrary)]
enum Field {
    EventId,
    OccurredAt,
    Order,
    Id,
    Source,
    Time,
    Data,
    DataBase64,
    Specversion,
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Payload {
    Tombstone,
    Raw(Vec<u8>),
    Json(Json),
    /// `depth` brackets (or braces) opened, maybe closed.
    Nested {
        depth: u32,
        braces: bool,
        closed: bool,
    },
    /// An object whose one field holds a string of `len` bytes.
    Long {
        len: u32,
        field: Field,
    },
}

/// One generated record and the settings it is read under.
#[derive(Debug, Arbitrary)]
pub struct Input {
    settings: Settings,
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
    key: Option<Text>,
    headers: Vec<(Name, Option<Text>)>,
    payload: Payload,
}

/// The payload limit of `small_limit`.
const SMALL_LIMIT: usize = 4096;
/// The default `max_payload_bytes`.
const DEFAULT_LIMIT: usize = 1 << 20;
/// The deepest and longest shaped payloads: past serde_json's 128 levels and past the 1 MiB
/// default, by a margin.
const MAX_NESTING: u32 = 200_000;
const MAX_LONG: u32 = (DEFAULT_LIMIT as u32) + 4096;

/// Builds the input from fuzzer bytes and checks every property; panics on a violation.
pub fn run(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    check(&input);
}

pub fn check(input: &Input) {
    let s = &input.settings;
    let decoder = decoder(s);
    let limit = if s.small_limit {
        SMALL_LIMIT
    } else {
        DEFAULT_LIMIT
    };
    let key = input.key.as_ref().map(Text::bytes);
    let header_bytes: Vec<(String, Option<Vec<u8>>)> = (input.headers.iter())
        .map(|(n, v)| (n.text(), v.as_ref().map(Text::bytes)))
        .collect();
    let headers: Vec<(&str, Option<&[u8]>)> = (header_bytes.iter())
        .map(|(n, v)| (n.as_str(), v.as_deref()))
        .collect();
    let payload = input.payload.bytes();
    let raw = RawRecord {
        partition: input.partition,
        offset: input.offset,
        timestamp_ms: input.timestamp_ms,
        key: key.as_deref(),
        payload: payload.as_deref(),
        headers: &headers,
    };

    let first = decoder.decode(&raw);
    let again = decoder.decode(&raw);
    assert_eq!(
        summary(&first),
        summary(&again),
        "the same record decoded twice differently"
    );
    match &first {
        Err(r) => {
            assert!(!r.reason.as_str().is_empty());
            assert!(
                !r.detail.trim().is_empty(),
                "a rejection without a reason: {r:?}"
            );
            assert!(!r.skip || r.reason == Reason::Tombstone, "{r:?}");
        }
        Ok(env) => {
            assert_eq!((env.partition, env.offset), (raw.partition, raw.offset));
            assert!(!env.message_id.is_nil(), "the nil UUID as a key");
            assert!(env.payload.len() <= limit, "an oversized payload accepted");
            if s.needs_json {
                assert!(
                    env.json.as_ref().is_some_and(|j| j.is_object()),
                    "a handler that reads fields got no object"
                );
            }
        }
    }
    if let Some(p) = payload.as_deref().filter(|p| p.len() > limit) {
        match &first {
            Err(r) => assert_eq!(
                r.reason,
                Reason::OversizedPayload,
                "a {}-byte payload over the {limit}-byte limit parked as {r}",
                p.len()
            ),
            Ok(_) => panic!("a {}-byte payload over the {limit}-byte limit", p.len()),
        }
    }
}

fn decoder(s: &Settings) -> Decoder {
    let source = match s.id {
        IdChoice::Header => MessageIdSource::Header("event_id".into()),
        IdChoice::Pointer => MessageIdSource::JsonPointer("/event_id".into()),
        IdChoice::Key => MessageIdSource::Key,
        IdChoice::Template => match "{/order}:{header:shard}:{key}".parse() {
            Ok(t) => MessageIdSource::Template(t),
            Err(e) => panic!("the fuzz target's template does not parse: {e}"),
        },
    };
    let date = match s.date {
        DateChoice::Auto => EventDateSource::Auto,
        DateChoice::Uuid7 => EventDateSource::Uuid7,
        DateChoice::Pointer => EventDateSource::JsonPointer("/occurred_at".into()),
    };
    let limit = if s.small_limit {
        SMALL_LIMIT
    } else {
        DEFAULT_LIMIT
    };
    let id = MessageIdConfig {
        source,
        any_string: s.any_string,
    };
    Decoder::new(&id, &date, limit, s.needs_json)
        .with_tombstones(if s.skip_tombstones {
            OnTombstone::Skip
        } else {
            OnTombstone::Park
        })
        .with_envelope(if s.cloudevents {
            EnvelopeKind::CloudEvents
        } else {
            EnvelopeKind::Plain
        })
}

/// What two decodings must agree on.
fn summary(r: &Result<Envelope, Rejection>) -> Result<String, Rejection> {
    r.as_ref()
        .map(|e| {
            format!(
                "{} {:?} {} {:?} {:?} {:?} {}",
                e.message_id, e.message_key, e.event_date, e.key, e.payload, e.cloudevent, e.size
            )
        })
        .map_err(Clone::clone)
}

impl Name {
    fn text(&self) -> String {
        match self {
            Name::EventId => "event_id".into(),
            Name::Shard => "shard".into(),
            Name::ContentType => "content-type".into(),
            Name::CeId => "ce_id".into(),
            Name::CeSource => "ce_source".into(),
            Name::CeTime => "ce_time".into(),
            Name::CeSpecversion => "ce_specversion".into(),
            Name::Other(s) => s.clone(),
        }
    }
}

impl Text {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Text::Uuid7(rand) => {
                let mut b = [0u8; 16];
                // 2026-12-07 in Unix milliseconds, big-endian, then version 7 and variant bits.
                b[..6].copy_from_slice(&1_796_601_600_000u64.to_be_bytes()[2..]);
                b[6..].copy_from_slice(rand);
                b[6] = 0x70 | (b[6] & 0x0f);
                b[8] = 0x80 | (b[8] & 0x3f);
                uuid::Uuid::from_bytes(b).to_string().into_bytes()
            }
            Text::Uuid4(b) => uuid::Uuid::from_bytes(*b).to_string().into_bytes(),
            Text::Nil => uuid::Uuid::nil().to_string().into_bytes(),
            Text::Time(s) => chrono::DateTime::from_timestamp(s % 300_000_000_000, 0)
                .map_or_else(|| "2026-12-07T10:00:00Z".into(), |t| t.to_rfc3339())
                .into_bytes(),
            Text::CloudEventsJson => b"application/cloudevents+json; charset=utf-8".to_vec(),
            Text::Raw(b) => b.clone(),
        }
    }
}

impl Field {
    fn name(&self) -> String {
        match self {
            Field::EventId => "event_id".into(),
            Field::OccurredAt => "occurred_at".into(),
            Field::Order => "order".into(),
            Field::Id => "id".into(),
            Field::Source => "source".into(),
            Field::Time => "time".into(),
            Field::Data => "data".into(),
            Field::DataBase64 => "data_base64".into(),
            Field::Specversion => "specversion".into(),
            Field::Other(s) => s.clone(),
        }
    }
}

impl Json {
    fn value(&self) -> serde_json::Value {
        use serde_json::Value as V;
        match self {
            Json::Null => V::Null,
            Json::Bool(b) => V::Bool(*b),
            Json::Int(n) => (*n).into(),
            Json::Float(x) => serde_json::Number::from_f64(*x).map_or(V::Null, V::Number),
            Json::Str(s) => V::String(s.clone()),
            Json::Text(t) => V::String(String::from_utf8_lossy(&t.bytes()).into_owned()),
            Json::Array(items) => V::Array(items.iter().map(Json::value).collect()),
            Json::Object(fields) => {
                V::Object(fields.iter().map(|(f, v)| (f.name(), v.value())).collect())
            }
        }
    }
}

impl Payload {
    fn bytes(&self) -> Option<Vec<u8>> {
        Some(match self {
            Payload::Tombstone => return None,
            Payload::Raw(b) => b.clone(),
            Payload::Json(j) => j.value().to_string().into_bytes(),
            Payload::Nested {
                depth,
                braces,
                closed,
            } => {
                let depth = (*depth % MAX_NESTING) as usize;
                let (open, close) = if *braces {
                    ("{\"a\":", "}")
                } else {
                    ("[", "]")
                };
                let mut s = String::with_capacity(depth * (open.len() + close.len()) + 2);
                s.push_str(&open.repeat(depth));
                s.push('1');
                if *closed {
                    s.push_str(&close.repeat(depth));
                }
                s.into_bytes()
            }
            Payload::Long { len, field } => {
                let len = (*len % MAX_LONG) as usize;
                serde_json::json!({ field.name(): "x".repeat(len) })
                    .to_string()
                    .into_bytes()
            }
        })
    }
}

/// Hand-made records: the shapes a fuzzer takes long to reach and production meets first.
pub fn seeds() -> Vec<Input> {
    let settings = |id, date, needs_json, cloudevents| Settings {
        id,
        any_string: false,
        date,
        needs_json,
        skip_tombstones: false,
        cloudevents,
        small_limit: false,
    };
    let record = |settings, key, headers, payload| Input {
        settings,
        partition: 0,
        offset: 7,
        timestamp_ms: Some(1_796_601_600_000),
        key,
        headers,
        payload,
    };
    let event = |fields: Vec<(Field, Json)>| Payload::Json(Json::Object(fields));
    let id_header = || vec![(Name::EventId, Some(Text::Uuid7([7; 10])))];
    vec![
        // A valid record, read by header and by payload field.
        record(
            settings(IdChoice::Header, DateChoice::Auto, true, false),
            Some(Text::Raw(b"pay_1".to_vec())),
            id_header(),
            event(vec![
                (Field::Order, Json::Str("o-1".into())),
                (Field::OccurredAt, Json::Text(Text::Time(1_796_601_600))),
            ]),
        ),
        record(
            settings(IdChoice::Pointer, DateChoice::Pointer, false, false),
            None,
            vec![],
            event(vec![
                (Field::EventId, Json::Text(Text::Uuid4([4; 16]))),
                (Field::OccurredAt, Json::Text(Text::Time(0))),
            ]),
        ),
        // Deep nesting, arrays and objects, closed and not.
        record(
            settings(IdChoice::Pointer, DateChoice::Auto, true, false),
            None,
            id_header(),
            Payload::Nested {
                depth: 100_000,
                braces: false,
                closed: true,
            },
        ),
        record(
            settings(IdChoice::Header, DateChoice::Auto, false, false),
            None,
            id_header(),
            Payload::Nested {
                depth: 100_000,
                braces: true,
                closed: false,
            },
        ),
        // A 1 MiB string: over the default limit once quoted, and just under it.
        record(
            settings(IdChoice::Header, DateChoice::Auto, true, false),
            None,
            id_header(),
            Payload::Long {
                len: 1 << 20,
                field: Field::Data,
            },
        ),
        record(
            settings(IdChoice::Header, DateChoice::Uuid7, true, false),
            None,
            id_header(),
            Payload::Long {
                len: (1 << 20) - 64,
                field: Field::Order,
            },
        ),
        // Invalid UTF-8 in the id header, the key and the payload.
        record(
            settings(IdChoice::Header, DateChoice::Auto, false, false),
            None,
            vec![(Name::EventId, Some(Text::Raw(vec![0xff, 0xfe, b'a'])))],
            Payload::Raw(vec![0xc3, 0x28]),
        ),
        record(
            settings(IdChoice::Key, DateChoice::Auto, true, false),
            Some(Text::Raw(vec![0x80; 70])),
            vec![],
            Payload::Raw(b"{\"a\": \"\xff\"}".to_vec()),
        ),
        // Broken headers: a null id, repeats (the last wins), a nil UUID, an empty name.
        record(
            settings(IdChoice::Header, DateChoice::Auto, false, false),
            None,
            vec![
                (Name::EventId, Some(Text::Uuid7([1; 10]))),
                (Name::EventId, None),
                (Name::Other(String::new()), Some(Text::Raw(vec![]))),
            ],
            Payload::Raw(b"opaque".to_vec()),
        ),
        record(
            settings(IdChoice::Header, DateChoice::Uuid7, false, false),
            None,
            vec![(Name::EventId, Some(Text::Nil))],
            Payload::Raw(b"opaque".to_vec()),
        ),
        // A template whose parts are missing, empty, or not text.
        record(
            settings(IdChoice::Template, DateChoice::Auto, false, false),
            Some(Text::Raw(vec![])),
            vec![(Name::Shard, Some(Text::Raw(vec![0xff])))],
            event(vec![(Field::Order, Json::Array(vec![]))]),
        ),
        // CloudEvents: binary with a non-UTF-8 id, structured with bad base64, a tombstone.
        record(
            settings(IdChoice::Header, DateChoice::Auto, true, true),
            None,
            vec![
                (Name::CeSpecversion, Some(Text::Raw(b"1.0".to_vec()))),
                (Name::CeId, Some(Text::Raw(vec![0xff]))),
                (Name::CeSource, Some(Text::Raw(b"/billing".to_vec()))),
                (Name::CeTime, Some(Text::Time(1_796_601_600))),
            ],
            event(vec![(Field::Order, Json::Int(1))]),
        ),
        record(
            settings(IdChoice::Header, DateChoice::Auto, true, true),
            None,
            vec![(Name::ContentType, Some(Text::CloudEventsJson))],
            event(vec![
                (Field::Specversion, Json::Str("1.0".into())),
                (Field::Id, Json::Str("evt_1".into())),
                (Field::Source, Json::Str("/billing".into())),
                (Field::Time, Json::Text(Text::Time(1_796_601_600))),
                (Field::DataBase64, Json::Str("not base64!".into())),
            ]),
        ),
        record(
            Settings {
                skip_tombstones: true,
                ..settings(IdChoice::Header, DateChoice::Auto, true, true)
            },
            None,
            vec![(Name::CeId, Some(Text::Raw(b"evt_2".to_vec())))],
            Payload::Tombstone,
        ),
    ]
}
