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
//! format ([`format`]) with the writer's schema from the registry ([`registry`]): the caller
//! makes sure the record's schemas are looked up first ([`Decoder::prepare`], the one await),
//! then [`Decoder::decode`] turns the record into the same JSON object a JSON topic carries, so
//! everything after decoding (message ids, event dates, handlers, the SQL handler's `payload`)
//! sees JSON whatever the topic's format.

pub mod format;
pub mod registry;
mod rejection;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Days, NaiveDate, Utc};
use serde_json::Value;
use uuid::Uuid;

use crate::config::{EventDateSource, MessageIdSource, PayloadConfig};
use format::Kind;
use registry::{Lookup, Registry, Unavailable};
pub use rejection::{Reason, Rejection};

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
    pub event_date: NaiveDate,
    /// Informational only (lag, logs): it differs between redeliveries, so it never dates the
    /// event.
    pub kafka_ts: Option<DateTime<Utc>>,
    pub key: Option<Bytes>,
    pub payload: Bytes,
    /// Some when the payload was parsed (needed for a pointer, for `Auto`, or by the handler), so
    /// the handler never parses it a second time.
    pub json: Option<Value>,
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
            event_date,
            kafka_ts,
            size: key.map_or(0, |k| k.len()) + payload.len(),
            key: key.map(Bytes::copy_from_slice),
            payload,
            json,
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
    event_date: DateSource,
    max_payload_bytes: usize,
    needs_json: bool,
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
}

#[derive(Debug, Clone)]
enum DateSource {
    Auto,
    Uuid7,
    Pointer(String),
}

/// Where decoding stands on the message id before the payload is looked at.
enum IdLookup<'a> {
    Found(Uuid),
    InPayload(&'a str),
}

impl Decoder {
    pub fn new(
        message_id: &MessageIdSource,
        event_date: &EventDateSource,
        max_payload_bytes: usize,
        needs_json: bool,
    ) -> Decoder {
        Decoder {
            message_id: match message_id {
                MessageIdSource::Header(name) => IdSource::Header(name.clone()),
                MessageIdSource::JsonPointer(p) => IdSource::Pointer(p.clone()),
            },
            event_date: match event_date {
                EventDateSource::Auto => DateSource::Auto,
                EventDateSource::Uuid7 => DateSource::Uuid7,
                EventDateSource::JsonPointer(p) => DateSource::Pointer(p.clone()),
            },
            max_payload_bytes,
            needs_json,
            registered: None,
        }
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
        let lookup = match &self.message_id {
            IdSource::Header(name) => id_from_header(raw.headers, name).map(IdLookup::Found),
            IdSource::Pointer(p) => Ok(IdLookup::InPayload(p)),
        };
        let known_id = match lookup {
            Ok(IdLookup::Found(id)) => Some(id),
            _ => None,
        };
        let reject = |r: Rejection| match known_id {
            Some(id) => r.with_message_id(id),
            None => r,
        };

        // Tombstones are refused even when nothing reads the body: an effect without content
        // is almost always a producer bug, and compaction semantics do not apply here.
        let payload = match raw.payload {
            Some(p) if !p.is_empty() => p,
            _ => {
                return Err(reject(Rejection::new(
                    Reason::EmptyPayload,
                    "record has no payload (null or zero bytes); tombstones cannot be applied",
                )))
            }
        };
        if payload.len() > self.max_payload_bytes {
            return Err(reject(Rejection::new(
                Reason::OversizedPayload,
                format!(
                    "payload of {} bytes exceeds the limit of {}",
                    payload.len(),
                    self.max_payload_bytes
                ),
            )));
        }

        let lookup = lookup?;
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
        let key = match (
            self.registered.as_ref().and_then(|r| r.key.map(|k| (r, k))),
            raw.key,
        ) {
            (Some((r, kind)), Some(k)) => {
                let value = registered(r, kind, k, "key").map_err(reject)?;
                Some(Bytes::from(
                    serde_json::to_vec(&value).expect("a JSON value serialises"),
                ))
            }
            (_, k) => k.map(Bytes::copy_from_slice),
        };
        let message_id = match lookup {
            IdLookup::Found(id) => id,
            IdLookup::InPayload(pointer) => id_from_json(json.as_ref(), pointer)?,
        };

        let event_date = self
            .event_date(&message_id, json.as_ref())
            .map_err(|r| r.with_message_id(message_id))?;

        let header_bytes: usize = raw
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.map_or(0, <[u8]>::len))
            .sum();
        let key_len = raw.key.map_or(0, <[u8]>::len);
        let raw_len = raw.payload.map_or(0, <[u8]>::len);

        Ok(Envelope {
            partition: raw.partition,
            offset: raw.offset,
            message_id,
            event_date,
            kafka_ts: raw
                .timestamp_ms
                .filter(|ms| *ms >= 0)
                .and_then(DateTime::from_timestamp_millis),
            key,
            payload,
            json,
            size: key_len + raw_len + header_bytes,
        })
    }

    /// Whether this record's payload must be parsed. `Auto` parses only what looks like a JSON
    /// object, so opaque payloads (Avro, protobuf, text) with UUIDv7 ids still decode. A body
    /// that looks like JSON but does not parse is rejected rather than dated by its id: its
    /// `occurred_at` may be in there, and silently switching date source would hide the bug.
    /// Whether something reads fields of the payload (so it must be an object).
    fn reads_fields(&self) -> bool {
        self.needs_json
            || matches!(self.message_id, IdSource::Pointer(_))
            || matches!(self.event_date, DateSource::Pointer(_))
    }

    fn wants_json(&self, payload: &[u8]) -> bool {
        self.needs_json
            || matches!(self.message_id, IdSource::Pointer(_))
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

/// Reads the id from the last header named `name` (Kafka allows repeats; the last one is the
/// most recently added, e.g. by a forwarding proxy).
fn id_from_header(headers: &[(&str, Option<&[u8]>)], name: &str) -> Result<Uuid, Rejection> {
    let value = headers
        .iter()
        .rev()
        .find(|(n, _)| *n == name)
        .and_then(|(_, v)| *v)
        .ok_or_else(|| {
            Rejection::new(
                Reason::MissingEventId,
                format!(
                    "record has no header {name:?} (or it is null) to read the message id from"
                ),
            )
        })?;
    let text = std::str::from_utf8(value).map_err(|_| {
        Rejection::new(
            Reason::InvalidEventId,
            format!(
                "header {name:?} is not UTF-8 text (starts with {:?}); expected a UUID",
                quote(&String::from_utf8_lossy(value))
            ),
        )
    })?;
    parse_id(text).map_err(|why| {
        Rejection::new(
            Reason::InvalidEventId,
            format!("header {name:?} holds {:?}: {why}", quote(text)),
        )
    })
}

/// Reads the id from a JSON string at `pointer`. `null` counts as missing, as producers often
/// serialize an absent optional field that way.
fn id_from_json(json: Option<&Value>, pointer: &str) -> Result<Uuid, Rejection> {
    match json.and_then(|j| j.pointer(pointer)) {
        None | Some(Value::Null) => Err(Rejection::new(
            Reason::MissingEventId,
            format!("payload has no message id at JSON pointer {pointer}"),
        )),
        Some(Value::String(s)) => parse_id(s).map_err(|why| {
            Rejection::new(
                Reason::InvalidEventId,
                format!("payload {pointer} holds {:?}: {why}", quote(s)),
            )
        }),
        Some(other) => Err(Rejection::new(
            Reason::InvalidEventId,
            format!(
                "payload {pointer} is a JSON {}, expected a string holding a UUID",
                json_type(other)
            ),
        )),
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
            format!("payload is not valid JSON: {e}"),
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
