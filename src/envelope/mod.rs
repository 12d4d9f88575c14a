//! Decoding one Kafka record into what the engine needs to dedupe and apply it.
//!
//! Every record becomes either an [`Envelope`] or a [`Rejection`]. The dedupe key is
//! `(consumer, message_id, event_date)`, so both parts must come from the message itself: a
//! redelivered copy has to decode to the same key, or it would be applied twice. That is why the
//! processing clock and the Kafka record timestamp (which a re-produce changes) never feed
//! `event_date`.
//!
//! This module knows nothing about rdkafka: the caller builds a [`RawRecord`] view, which keeps
//! decoding testable without a broker.
//!
//! A consumer whose `[consumer.payload]` names a Schema Registry format reads the Confluent wire
//! format ([`mod@format`]) with the writer's schema from the registry ([`registry`]): the caller
//! makes sure the record's schemas are looked up first ([`Decoder::prepare`], the one await),
//! then [`Decoder::decode`] turns the record into the same JSON object a JSON topic carries, so
//! everything after decoding (message ids, event dates, handlers, the SQL handler's `payload`)
//! sees JSON whatever the topic's format.

mod cloudevents;
pub mod format;
pub mod registry;
mod rejection;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Days, NaiveDate, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::config::{
    EnvelopeKind, EventDateSource, MessageIdConfig, MessageIdSource, OnTombstone, PayloadConfig,
    TemplatePart,
};
use format::Kind;
use registry::{Lookup, Registry, Unavailable};
pub use rejection::{Reason, Rejection};

/// The namespace of the name-based (v5) UUIDs that text message ids become:
/// `65666665-6374-6976-656c-792d6b657973` (the ASCII of "effectively-keys"). Fixed for good: a
/// different namespace would give every text id a new key, and old copies would pass.
pub const KEY_NAMESPACE: Uuid = Uuid::from_u128(0x6566_6665_6374_6976_656c_792d_6b65_7973);

/// The payload field [`EventDateSource::Auto`] reads first.
const OCCURRED_AT: &str = "/occurred_at";

/// How much of an offending value a detail quotes: enough to recognise it, bounded so a
/// garbage header cannot bloat the dead-letter table or the logs.
const QUOTE_CHARS: usize = 64;

/// A borrowed view of one Kafka record, built by the caller from rdkafka's message.
#[derive(Debug, Clone, Copy)]
pub struct RawRecord<'a> {
    pub partition: i32,
    pub offset: i64,
    /// The record's timestamp (CreateTime or LogAppendTime), in Unix milliseconds.
    pub timestamp_ms: Option<i64>,
    pub key: Option<&'a [u8]>,
    pub payload: Option<&'a [u8]>,
    pub headers: &'a [(&'a str, Option<&'a [u8]>)],
}

/// A decoded record. Owned, because it outlives the rdkafka message it came from.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub partition: i32,
    pub offset: i64,
    pub message_id: Uuid,
    /// The text the message id was made from, when it was not a UUID (a Stripe-like id, a
    /// template's business key): for people (dead letters, logs), never for the ledger.
    pub message_key: Option<String>,
    pub event_date: NaiveDate,
    /// Informational only (lag, logs): it differs between redeliveries, so it never dates the
    /// event.
    pub kafka_ts: Option<DateTime<Utc>>,
    pub key: Option<Bytes>,
    pub payload: Bytes,
    /// Some when the payload was parsed (needed for a pointer, for `Auto`, or by the handler), so
    /// the handler never parses it a second time.
    pub json: Option<Value>,
    /// A CloudEvent's context attributes (`id`, `source`, `type`, `time`, extensions...) as a
    /// JSON object, under `envelope = "cloudevents"`; the payload is then the event's data.
    pub cloudevent: Option<Arc<Value>>,
    /// Key + payload + header bytes, for batch byte bounds.
    pub size: usize,
}

impl Envelope {
    /// A message rebuilt from what the engine stored of it (an inbox row), as a handler sees it;
    /// `needs_json`: parse the payload, which must then be a JSON object.
    #[allow(clippy::too_many_arguments)]
    pub fn from_stored(
        partition: i32,
        offset: i64,
        message_id: Uuid,
        event_date: NaiveDate,
        kafka_ts: Option<DateTime<Utc>>,
        key: Option<&[u8]>,
        payload: &[u8],
        needs_json: bool,
    ) -> Result<Envelope, Rejection> {
        let payload = Bytes::copy_from_slice(payload);
        let json = if needs_json {
            Some(parse_object(&payload)?)
        } else {
            None
        };
        Ok(Envelope {
            partition,
            offset,
            message_id,
            message_key: None,
            event_date,
            kafka_ts,
            size: key.map_or(0, |k| k.len()) + payload.len(),
            key: key.map(Bytes::copy_from_slice),
            payload,
            json,
            cloudevent: None,
        })
    }
}

/// The decoding rules of one consumer, built once from its config.
///
/// JSON pointers are used as given: one that does not start with `/` matches nothing, so the
/// config loader is expected to validate them.
#[derive(Debug, Clone)]
pub struct Decoder {
    message_id: IdSource,
    /// Text that is not a UUID becomes a v5 UUID (else it is parked as `invalid_event_id`).
    any_string: bool,
    event_date: DateSource,
    max_payload_bytes: usize,
    needs_json: bool,
    on_tombstone: OnTombstone,
    /// `envelope = "cloudevents"`: the key is the event's source and id, the date its time.
    cloudevents: bool,
    /// Set when the value or the key is read through a Schema Registry.
    registered: Option<Registered>,
}

/// What of a record goes through the registry, and which registry.
#[derive(Debug, Clone)]
struct Registered {
    value: Option<Kind>,
    key: Option<Kind>,
    registry: Arc<Registry>,
}

/// Private copies of the config enums, so `Decoder` does not depend on which traits the config
/// types derive.
#[derive(Debug, Clone)]
enum IdSource {
    Header(String),
    Pointer(String),
    Key,
    Template {
        text: String,
        parts: Vec<TemplatePart>,
    },
}

#[derive(Debug, Clone)]
enum DateSource {
    Auto,
    Uuid7,
    Pointer(String),
}

/// A message id and, when it was not a UUID, the text it was made from.
#[derive(Debug, Clone)]
struct Key {
    id: Uuid,
    text: Option<String>,
}

impl Decoder {
    pub fn new(
        message_id: &MessageIdConfig,
        event_date: &EventDateSource,
        max_payload_bytes: usize,
        needs_json: bool,
    ) -> Decoder {
        Decoder {
            message_id: match &message_id.source {
                MessageIdSource::Header(name) => IdSource::Header(name.clone()),
                MessageIdSource::JsonPointer(p) => IdSource::Pointer(p.clone()),
                MessageIdSource::Key => IdSource::Key,
                MessageIdSource::Template(t) => IdSource::Template {
                    text: t.text.clone(),
                    parts: t.parts.clone(),
                },
            },
            any_string: message_id.is_text(),
            event_date: match event_date {
                EventDateSource::Auto => DateSource::Auto,
                EventDateSource::Uuid7 => DateSource::Uuid7,
                EventDateSource::JsonPointer(p) => DateSource::Pointer(p.clone()),
            },
            max_payload_bytes,
            needs_json,
            on_tombstone: OnTombstone::Park,
            cloudevents: false,
            registered: None,
        }
    }

    /// Reads every record as a CloudEvent (`envelope = "cloudevents"`, see the `cloudevents` module).
    pub fn with_envelope(mut self, envelope: EnvelopeKind) -> Decoder {
        self.cloudevents = envelope == EnvelopeKind::CloudEvents;
        self
    }

    /// What a record with a null value becomes: parked (the default) or skipped.
    pub fn with_tombstones(mut self, on_tombstone: OnTombstone) -> Decoder {
        self.on_tombstone = on_tombstone;
        self
    }

    /// Reads values (and keys, if `key_format` says so) as `[consumer.payload]` says. `Err`:
    /// the registry's settings cannot be used (a credential file missing, a CA that does not
    /// parse), which stops the worker before it takes any partition.
    pub fn with_payload(mut self, payload: &PayloadConfig) -> Result<Decoder, String> {
        if !payload.uses_registry() {
            return Ok(self);
        }
        self.registered = Some(Registered {
            value: Kind::of(payload.format),
            key: payload.key_format.and_then(Kind::of),
            registry: Registry::shared(payload)?,
        });
        Ok(self)
    }

    /// The registry this decoder reads schemas from, if any.
    pub fn registry(&self) -> Option<&Registry> {
        self.registered.as_ref().map(|r| &*r.registry)
    }

    /// Looks up the schemas `key` and `payload` name that are not known yet (one request per
    /// new id, then never again). `Err` when the registry does not answer: the caller retries
    /// and must not decode the record meanwhile. Bytes that are not in the wire format, and
    /// ids the registry does not know, are left for [`Decoder::decode`] to reject.
    pub async fn prepare(
        &self,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
    ) -> Result<(), Unavailable> {
        let Some(r) = &self.registered else {
            return Ok(());
        };
        let ids = [
            r.key.and(key).and_then(format::schema_id),
            r.value.and(payload).and_then(format::schema_id),
        ];
        for id in ids.into_iter().flatten() {
            if r.registry.cached(id).is_none() {
                r.registry.fetch(id).await?;
            }
        }
        Ok(())
    }

    /// Decodes one record. `needs_json`: the handler reads payload fields, so the payload must
    /// parse as a JSON object (else `undecodable_payload`) and is kept in [`Envelope::json`].
    ///
    /// The payload checks come first, but a header id is read before them so that even an empty
    /// or oversized record is parked with its id. The payload is parsed at most once, and only
    /// when something needs it.
    pub fn decode(&self, raw: &RawRecord<'_>) -> Result<Envelope, Rejection> {
        if self.cloudevents {
            return self.decode_cloudevent(raw);
        }
        // An id that needs neither the payload nor a decoded key (a header, a key taken as it
        // is) is read first, so that even an empty or oversized record is parked with its id.
        let early = (!self.id_reads_payload() && !self.id_reads_decoded_key())
            .then(|| self.message_key(raw, None, None));
        let known = match &early {
            Some(Ok(k)) => Some(k.clone()),
            _ => None,
        };
        let reject = |r: Rejection| match &known {
            Some(k) => r.with_key(k.id, k.text.clone()),
            None => r,
        };

        // A tombstone (null value) is parked unless the consumer chose to skip them: an effect
        // without content is almost always a producer bug, and a consumer that did not choose
        // is told. Zero bytes are not a tombstone but an empty payload.
        let payload = match raw.payload {
            None => return Err(reject(self.tombstone())),
            Some([]) => {
                return Err(reject(Rejection::new(
                    Reason::EmptyPayload,
                    "record has an empty payload (zero bytes, not a null tombstone)",
                )))
            }
            Some(p) => p,
        };
        self.check_size(payload).map_err(reject)?;

        let early = early.transpose()?;
        let (payload, json) = match self
            .registered
            .as_ref()
            .and_then(|r| r.value.map(|k| (r, k)))
        {
            Some((r, kind)) => {
                let value = registered(r, kind, payload, "value").map_err(reject)?;
                if !value.is_object() && self.reads_fields() {
                    return Err(reject(Rejection::new(
                        Reason::UndecodablePayload,
                        format!(
                            "the value decodes to a JSON {}, but this consumer reads fields and \
                             needs an object (a record)",
                            json_type(&value)
                        ),
                    )));
                }
                let text = serde_json::to_vec(&value).expect("a JSON value serialises");
                (Bytes::from(text), Some(value))
            }
            None => {
                let json = if self.wants_json(payload) {
                    Some(parse_object(payload).map_err(reject)?)
                } else {
                    None
                };
                (Bytes::copy_from_slice(payload), json)
            }
        };
        let (key, key_value) = self.record_key(raw.key).map_err(reject)?;
        let Key {
            id: message_id,
            text: message_key,
        } = match early {
            Some(k) => k,
            None => self.message_key(raw, json.as_ref(), key_value.as_ref())?,
        };

        let event_date = self
            .event_date(&message_id, json.as_ref())
            .map_err(|r| r.with_key(message_id, message_key.clone()))?;

        Ok(Envelope {
            partition: raw.partition,
            offset: raw.offset,
            message_id,
            message_key,
            event_date,
            kafka_ts: kafka_ts(raw),
            key,
            payload,
            json,
            cloudevent: None,
            size: record_size(raw),
        })
    }

    /// The record key as handlers see it: through the registry when `key_format` says so
    /// (then also its decoded value, for `{key}`), else its bytes.
    fn record_key(&self, key: Option<&[u8]>) -> Result<(Option<Bytes>, Option<Value>), Rejection> {
        match (
            self.registered.as_ref().and_then(|r| r.key.map(|k| (r, k))),
            key,
        ) {
            (Some((r, kind)), Some(k)) => {
                let value = registered(r, kind, k, "key")?;
                let bytes = serde_json::to_vec(&value).expect("a JSON value serialises");
                Ok((Some(Bytes::from(bytes)), Some(value)))
            }
            (_, k) => Ok((k.map(Bytes::copy_from_slice), None)),
        }
    }

    /// [`Decoder::decode`] under `envelope = "cloudevents"`.
    fn decode_cloudevent(&self, raw: &RawRecord<'_>) -> Result<Envelope, Rejection> {
        let keyed = |event: &cloudevents::Event, r: Rejection| {
            let text = event.key_text();
            r.with_key(Uuid::new_v5(&KEY_NAMESPACE, text.as_bytes()), Some(text))
        };
        let Some(value) = raw.payload else {
            let r = self.tombstone();
            return Err(match cloudevents::read(raw.headers, None) {
                Ok(event) => keyed(&event, r),
                Err(_) => r,
            });
        };
        self.check_size(value)?;
        let event = cloudevents::read(raw.headers, Some(value))?;
        let reject = |r: Rejection| keyed(&event, r);
        let event_date = event.date().map_err(reject)?;
        let data = match &event.data {
            Some(d) if !d.is_empty() => d.as_slice(),
            _ => {
                return Err(reject(Rejection::new(
                    Reason::EmptyPayload,
                    "the CloudEvent has no data for the handler",
                )))
            }
        };
        let (payload, json) = match self
            .registered
            .as_ref()
            .and_then(|r| r.value.map(|k| (r, k)))
        {
            Some(_) if !event.binary => {
                return Err(reject(Rejection::new(
                    Reason::NotWireFormat,
                    "a structured CloudEvent's data is JSON, not the registry's wire format: \
                     send CloudEvents in binary mode to a consumer with a registry format",
                )))
            }
            Some((r, kind)) => {
                let value = registered(r, kind, data, "value").map_err(reject)?;
                let text = serde_json::to_vec(&value).expect("a JSON value serialises");
                (Bytes::from(text), Some(value))
            }
            None if self.needs_json => {
                let json = parse_object(data).map_err(|r| {
                    reject(Rejection {
                        detail: r.detail.replacen("payload", "the CloudEvent's data", 1),
                        ..r
                    })
                })?;
                (Bytes::copy_from_slice(data), Some(json))
            }
            None => (Bytes::copy_from_slice(data), None),
        };
        let (key, _) = self.record_key(raw.key).map_err(reject)?;
        let text = event.key_text();
        Ok(Envelope {
            partition: raw.partition,
            offset: raw.offset,
            message_id: Uuid::new_v5(&KEY_NAMESPACE, text.as_bytes()),
            message_key: Some(text),
            event_date,
            kafka_ts: kafka_ts(raw),
            key,
            payload,
            json,
            cloudevent: Some(Arc::new(Value::Object(event.attributes))),
            size: record_size(raw),
        })
    }

    fn tombstone(&self) -> Rejection {
        match self.on_tombstone {
            OnTombstone::Park => Rejection::new(
                Reason::Tombstone,
                "record is a tombstone (a null value: a compacted topic's delete); this consumer \
                 parks them (on_tombstone = \"park\", the default); on_tombstone = \"skip\" \
                 passes them over",
            ),
            OnTombstone::Skip => Rejection {
                skip: true,
                ..Rejection::new(
                    Reason::Tombstone,
                    "tombstone skipped (on_tombstone = \"skip\")",
                )
            },
        }
    }

    /// Whether something reads fields of the payload (so it must be an object).
    fn reads_fields(&self) -> bool {
        self.needs_json
            || self.id_reads_payload()
            || matches!(self.event_date, DateSource::Pointer(_))
    }

    /// Whether the message id comes (in part) from a payload field.
    fn id_reads_payload(&self) -> bool {
        match &self.message_id {
            IdSource::Pointer(_) => true,
            IdSource::Template { parts, .. } => {
                parts.iter().any(|p| matches!(p, TemplatePart::Pointer(_)))
            }
            IdSource::Header(_) | IdSource::Key => false,
        }
    }

    /// Whether the message id comes (in part) from the record key as the registry decodes it.
    fn id_reads_decoded_key(&self) -> bool {
        let decodes_key = self.registered.as_ref().is_some_and(|r| r.key.is_some());
        decodes_key
            && match &self.message_id {
                IdSource::Key => true,
                IdSource::Template { parts, .. } => {
                    parts.iter().any(|p| matches!(p, TemplatePart::Key))
                }
                IdSource::Header(_) | IdSource::Pointer(_) => false,
            }
    }

    /// A payload over `max_payload_bytes` is parked as oversized.
    fn check_size(&self, payload: &[u8]) -> Result<(), Rejection> {
        if payload.len() <= self.max_payload_bytes {
            return Ok(());
        }
        Err(Rejection::new(
            Reason::OversizedPayload,
            format!(
                "payload of {} bytes exceeds the limit of {}",
                payload.len(),
                self.max_payload_bytes
            ),
        ))
    }

    /// The message id, from whatever its source reads: the record's headers and key, the parsed
    /// payload (`json`), the decoded key (`key_value`).
    fn message_key(
        &self,
        raw: &RawRecord<'_>,
        json: Option<&Value>,
        key_value: Option<&Value>,
    ) -> Result<Key, Rejection> {
        match &self.message_id {
            IdSource::Pointer(p) => {
                let text = text_from_json(json, p, self.any_string, "message id")?;
                self.key_from_text(&text, || format!("payload {p}"))
            }
            IdSource::Header(name) => {
                let text = text_from_header(raw.headers, name, "message id")?;
                self.key_from_text(&text, || format!("header {name:?}"))
            }
            IdSource::Key => {
                let text = key_text(raw.key, key_value)?;
                self.key_from_text(&text, || "the record key".into())
            }
            IdSource::Template {
                text: template,
                parts,
            } => {
                let mut out = String::new();
                for part in parts {
                    let piece = match part {
                        TemplatePart::Literal(l) => {
                            out.push_str(l);
                            continue;
                        }
                        TemplatePart::Pointer(p) => {
                            text_from_json(json, p, true, "message id part")
                        }
                        TemplatePart::Header(h) => {
                            text_from_header(raw.headers, h, "message id part")
                        }
                        TemplatePart::Key => key_text(raw.key, key_value),
                    }
                    .map_err(|r| Rejection {
                        detail: format!("message_id template {template:?}: {}", r.detail),
                        ..r
                    })?;
                    if piece.trim().is_empty() {
                        return Err(Rejection::new(
                            Reason::MissingEventId,
                            format!(
                                "message_id template {template:?}: {} is empty; a key is never \
                                 made from an empty part",
                                describe(part)
                            ),
                        ));
                    }
                    out.push_str(&piece);
                }
                self.key_from_text(&out, || format!("template {template:?}"))
            }
        }
    }

    /// A UUID stays that UUID (ledgers written before text ids keep their keys); other text
    /// becomes a v5 UUID in [`KEY_NAMESPACE`] when this consumer takes text ids.
    fn key_from_text(&self, text: &str, from: impl Fn() -> String) -> Result<Key, Rejection> {
        let trimmed = text.trim_ascii();
        if trimmed.is_empty() {
            return Err(Rejection::new(
                Reason::MissingEventId,
                format!("{} is empty: a message id is never empty", from()),
            ));
        }
        match parse_id(trimmed) {
            Ok(id) => Ok(Key { id, text: None }),
            Err(why) if !self.any_string || Uuid::try_parse(trimmed).is_ok_and(|u| u.is_nil()) => {
                let hint = if self.any_string {
                    ""
                } else {
                    " (a consumer whose ids are not UUIDs sets any_string = true on message_id)"
                };
                Err(Rejection::new(
                    Reason::InvalidEventId,
                    format!("{} holds {:?}: {why}{hint}", from(), quote(trimmed)),
                ))
            }
            Err(_) => Ok(Key {
                id: Uuid::new_v5(&KEY_NAMESPACE, trimmed.as_bytes()),
                text: Some(trimmed.to_string()),
            }),
        }
    }

    /// Whether this record's payload must be parsed. `Auto` parses only what looks like a JSON
    /// object, so opaque payloads (Avro, protobuf, text) with UUIDv7 ids still decode. A body
    /// that looks like JSON but does not parse is rejected rather than dated by its id: its
    /// `occurred_at` may be in there, and silently switching date source would hide the bug.
    fn wants_json(&self, payload: &[u8]) -> bool {
        self.needs_json
            || self.id_reads_payload()
            || match self.event_date {
                DateSource::Pointer(_) => true,
                DateSource::Uuid7 => false,
                DateSource::Auto => looks_like_json_object(payload),
            }
    }

    fn event_date(&self, id: &Uuid, json: Option<&Value>) -> Result<NaiveDate, Rejection> {
        match &self.event_date {
            DateSource::Uuid7 => uuid7_date(id).ok_or_else(|| {
                Rejection::new(
                    Reason::NoEventDate,
                    format!(
                        "event_date comes from the UUIDv7 message id, but {id} is a version {} \
                         UUID; the producer must send UUIDv7 ids or the consumer must date \
                         events from a payload field",
                        id.get_version_num()
                    ),
                )
            }),
            DateSource::Pointer(p) => match json.and_then(|j| j.pointer(p)) {
                None | Some(Value::Null) => Err(Rejection::new(
                    Reason::NoEventDate,
                    format!("payload has no event date at JSON pointer {p}"),
                )),
                Some(v) => date_from_value(v, p, true),
            },
            // A null occurred_at is treated as absent, like a missing field.
            DateSource::Auto => match json.and_then(|j| j.pointer(OCCURRED_AT)) {
                Some(v) if !v.is_null() => date_from_value(v, OCCURRED_AT, false),
                _ => uuid7_date(id).ok_or_else(|| {
                    Rejection::new(
                        Reason::NoEventDate,
                        format!(
                            "payload has no {OCCURRED_AT} and message id {id} is a version {} \
                             UUID, which carries no timestamp; send an RFC 3339 occurred_at or \
                             UUIDv7 ids",
                            id.get_version_num()
                        ),
                    )
                }),
            },
        }
    }
}

/// The record's timestamp, when it has a sensible one.
fn kafka_ts(raw: &RawRecord<'_>) -> Option<DateTime<Utc>> {
    raw.timestamp_ms
        .filter(|ms| *ms >= 0)
        .and_then(DateTime::from_timestamp_millis)
}

/// Key, value and header bytes, for the batch's byte bound.
fn record_size(raw: &RawRecord<'_>) -> usize {
    let headers: usize = (raw.headers.iter())
        .map(|(name, value)| name.len() + value.map_or(0, <[u8]>::len))
        .sum();
    raw.key.map_or(0, <[u8]>::len) + raw.payload.map_or(0, <[u8]>::len) + headers
}

/// Decodes a value or key in the wire format with its (already looked up) schema.
fn registered(
    r: &Registered,
    kind: Kind,
    bytes: &[u8],
    what: &str,
) -> Result<serde_json::Value, Rejection> {
    let (id, body) = format::split(bytes)
        .map_err(|e| Rejection::new(Reason::NotWireFormat, format!("the record's {what}: {e}")))?;
    match r.registry.cached(id) {
        Some(Lookup::Found(schema)) if schema.kind() != kind => Err(Rejection::new(
            Reason::SchemaMismatch,
            format!(
                "the record's {what} names schema id {id}, a {} schema, but this consumer reads {}",
                schema.kind().as_str(),
                kind.as_str()
            ),
        )),
        Some(Lookup::Found(schema)) => schema.decode(body).map_err(|e| {
            Rejection::new(
                Reason::SchemaMismatch,
                format!("the record's {what} does not fit schema id {id}: {e}"),
            )
        }),
        Some(Lookup::Refused(why)) => Err(Rejection::new(
            Reason::UnknownSchema,
            format!("the record's {what}: {why}"),
        )),
        // Decoder::prepare looks every id up first; reaching this is a bug in the caller, and
        // parking would turn a good record into a dead letter, so it says so loudly.
        None => Err(Rejection::new(
            Reason::UnknownSchema,
            format!(
                "the record's {what} names schema id {id}, which was never looked up in {} \
                 (Decoder::prepare was not called: a bug; redrive this record)",
                r.registry.url()
            ),
        )),
    }
}

/// The UTC date inside a UUIDv7 (its 48-bit millisecond timestamp); None for other versions,
/// whose bits are random or use another epoch and so cannot date an event.
pub fn uuid7_date(id: &Uuid) -> Option<NaiveDate> {
    if id.get_version_num() != 7 || id.get_variant() != uuid::Variant::RFC4122 {
        return None;
    }
    let b = id.as_bytes();
    let ms = b[..6]
        .iter()
        .fold(0i64, |acc, &x| (acc << 8) | i64::from(x));
    DateTime::from_timestamp_millis(ms).map(|t| t.date_naive())
}

/// The retention guard, separate from decode so the caller passes "today" (tests simulate dates).
///
/// A message older than `retention` may have had its dedupe key dropped with its partition, so
/// applying it could apply it twice: `older_than_retention`. A message dated more than
/// `future_tolerance` ahead would land in a partition that may not exist yet and points at a
/// producer clock bug: `future_event_date`. Accepted: `today - retention_days <= event_date <=
/// today + future_days`, with retention rounded down to whole days (at least 1) and the tolerance
/// rounded up.
pub fn check_window(
    event_date: NaiveDate,
    today: NaiveDate,
    retention: Duration,
    future_tolerance: Duration,
) -> Result<(), Rejection> {
    const DAY: u64 = 86_400;
    let retention_days = (retention.as_secs() / DAY).max(1);
    let tolerance_secs = future_tolerance
        .as_secs()
        .saturating_add(u64::from(future_tolerance.subsec_nanos() > 0));
    let future_days = tolerance_secs.div_ceil(DAY);

    // Bounds outside chrono's calendar mean "no bound on that side".
    if let Some(oldest) = today.checked_sub_days(Days::new(retention_days)) {
        if event_date < oldest {
            let age = (today - event_date).num_days();
            return Err(Rejection::new(
                Reason::OlderThanRetention,
                format!(
                    "event_date {event_date} is {age} days before today ({today}), beyond the \
                     {retention_days}-day dedupe retention; its dedupe key may already be dropped, \
                     so it cannot be applied exactly once"
                ),
            ));
        }
    }
    if let Some(latest) = today.checked_add_days(Days::new(future_days)) {
        if event_date > latest {
            let ahead = (event_date - today).num_days();
            return Err(Rejection::new(
                Reason::FutureEventDate,
                format!(
                    "event_date {event_date} is {ahead} days after today ({today}), beyond the \
                     future tolerance of {future_days} days; check the producer's clock"
                ),
            ));
        }
    }
    Ok(())
}

/// Reads `what` from the last header named `name` (Kafka allows repeats; the last one is the
/// most recently added, e.g. by a forwarding proxy), as UTF-8 text.
fn text_from_header(
    headers: &[(&str, Option<&[u8]>)],
    name: &str,
    what: &str,
) -> Result<String, Rejection> {
    let value = headers
        .iter()
        .rev()
        .find(|(n, _)| *n == name)
        .and_then(|(_, v)| *v)
        .ok_or_else(|| {
            Rejection::new(
                Reason::MissingEventId,
                format!("record has no header {name:?} (or it is null) to read the {what} from"),
            )
        })?;
    match std::str::from_utf8(value) {
        Ok(text) => Ok(text.to_string()),
        Err(_) => Err(Rejection::new(
            Reason::InvalidEventId,
            format!(
                "header {name:?} is not UTF-8 text (starts with {:?}); the {what} must be text",
                quote(&String::from_utf8_lossy(value))
            ),
        )),
    }
}

/// Reads `what` from the JSON value at `pointer`: a string, or (when `numbers`, for text ids)
/// a number or boolean as its JSON text. `null` counts as missing, as producers often
/// serialize an absent optional field that way.
fn text_from_json(
    json: Option<&Value>,
    pointer: &str,
    numbers: bool,
    what: &str,
) -> Result<String, Rejection> {
    match json.and_then(|j| j.pointer(pointer)) {
        None | Some(Value::Null) => Err(Rejection::new(
            Reason::MissingEventId,
            format!("payload has no {what} at JSON pointer {pointer}"),
        )),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v @ (Value::Number(_) | Value::Bool(_))) if numbers => Ok(v.to_string()),
        Some(other) => Err(Rejection::new(
            Reason::InvalidEventId,
            format!(
                "payload {pointer} is a JSON {}, expected a string{}",
                json_type(other),
                if numbers {
                    " or a number"
                } else {
                    " holding a UUID"
                }
            ),
        )),
    }
}

/// The record key as text: the decoded key's string (or its JSON text) when the key goes
/// through the registry, else the key's bytes as UTF-8.
fn key_text(key: Option<&[u8]>, decoded: Option<&Value>) -> Result<String, Rejection> {
    if let Some(v) = decoded {
        return match v {
            Value::Null => Err(Rejection::new(
                Reason::MissingEventId,
                "the record key decodes to null",
            )),
            Value::String(s) => Ok(s.clone()),
            other => Ok(other.to_string()),
        };
    }
    match key {
        None | Some([]) => Err(Rejection::new(
            Reason::MissingEventId,
            "record has no key (null or zero bytes) to read the message id from",
        )),
        Some(k) => std::str::from_utf8(k).map(str::to_string).map_err(|_| {
            Rejection::new(
                Reason::InvalidEventId,
                format!(
                    "the record key is not UTF-8 text (starts with {:?}); a message id from the \
                     key must be text",
                    quote(&String::from_utf8_lossy(k))
                ),
            )
        }),
    }
}

/// A template part, as the operator wrote it.
fn describe(part: &TemplatePart) -> String {
    match part {
        TemplatePart::Literal(l) => format!("{l:?}"),
        TemplatePart::Pointer(p) => format!("{{{p}}}"),
        TemplatePart::Header(h) => format!("{{header:{h}}}"),
        TemplatePart::Key => "{key}".into(),
    }
}

/// Accepts only the hyphenated and simple forms (36 or 32 characters), so producers converge on
/// one spelling; the nil UUID is refused because every buggy producer would share it as a key.
fn parse_id(text: &str) -> Result<Uuid, &'static str> {
    let text = text.trim_ascii();
    match Uuid::try_parse(text) {
        Ok(id) if id.is_nil() => Err("the nil UUID cannot identify an event"),
        Ok(id) if text.len() == 36 || text.len() == 32 => Ok(id),
        _ => Err("expected a UUID in hyphenated or simple (32 hex digits) form"),
    }
}

/// Parses the payload into a JSON object, the only shape fields can be read from.
/// Parses a payload that must be a JSON object (what a handler reading fields needs).
pub fn parse_object(payload: &[u8]) -> Result<Value, Rejection> {
    match serde_json::from_slice::<Value>(payload) {
        Ok(v @ Value::Object(_)) => Ok(v),
        Ok(other) => Err(Rejection::new(
            Reason::UndecodablePayload,
            format!(
                "payload is a JSON {}, but this consumer reads fields and needs a JSON object",
                json_type(&other)
            ),
        )),
        Err(e) => Err(Rejection::new(
            Reason::UndecodablePayload,
            format::json_error("payload", &e),
        )),
    }
}

/// Dates an event from a JSON value: an RFC 3339 timestamp converted to UTC, or (when
/// `allow_date`) a plain `YYYY-MM-DD` date, taken as is.
fn date_from_value(v: &Value, pointer: &str, allow_date: bool) -> Result<NaiveDate, Rejection> {
    let expected = if allow_date {
        "an RFC 3339 timestamp (2024-05-01T12:00:00Z) or a YYYY-MM-DD date"
    } else {
        "an RFC 3339 timestamp (2024-05-01T12:00:00Z)"
    };
    let Value::String(s) = v else {
        return Err(Rejection::new(
            Reason::InvalidEventDate,
            format!(
                "payload {pointer} is a JSON {}, expected {expected}",
                json_type(v)
            ),
        ));
    };
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc).date_naive());
    }
    if allow_date && s.len() == 10 {
        if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
            return Ok(d);
        }
    }
    Err(Rejection::new(
        Reason::InvalidEventDate,
        format!(
            "payload {pointer} holds {:?}, expected {expected}",
            quote(s)
        ),
    ))
}

/// Whether the first non-whitespace byte opens a JSON object.
fn looks_like_json_object(payload: &[u8]) -> bool {
    payload
        .iter()
        .find(|b| !matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
        == Some(&b'{')
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// At most [`QUOTE_CHARS`] characters of `s`, marked when cut.
fn quote(s: &str) -> String {
    match s.char_indices().nth(QUOTE_CHARS) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests;
