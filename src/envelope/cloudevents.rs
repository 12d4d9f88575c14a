//! CloudEvents 1.0 over Kafka (the Kafka protocol binding), for `envelope = "cloudevents"`.
//!
//! Each record is read in the mode it is in:
//! - **structured**: a `content-type` header of `application/cloudevents+json` (parameters such
//!   as `; charset=utf-8` allowed); the value is a JSON object with the attributes and the
//!   event's `data` (or `data_base64`);
//! - **binary**: anything else; the attributes are `ce_`-prefixed headers (`ce_id`,
//!   `ce_source`, `ce_specversion`, `ce_type`, `ce_time`, ...), `content-type` is
//!   `datacontenttype`, and the value is the data.
//!
//! The spec makes `id` unique per `source`, so the dedupe key is the pair: the text
//! `["<source>","<id>"]` (JSON, so no source and id can run into each other) as a v5 UUID in
//! [`super::KEY_NAMESPACE`]. The event date is `time`, required: the record is parked without
//! it, never dated by the processing clock or the record's timestamp. Handlers see the data as
//! the payload, and the attributes as a JSON object ([`super::Envelope::cloudevent`]).
//! Batched mode (`application/cloudevents-batch+json`) is parked: one record must be one event
//! for a partition's offsets to mean anything.

use base64::Engine as _;
use serde_json::{Map, Value};

use super::{date_from_value, json_type, quote, Reason, Rejection};

/// The header that carries the content type in both modes.
const CONTENT_TYPE: &str = "content-type";
/// Binary mode's attribute headers start with this.
const PREFIX: &str = "ce_";

/// One event's parts, before the engine's checks (size, JSON, registry) run on the data.
#[derive(Debug)]
pub(super) struct Event {
    /// Every context attribute (`id`, `source`, `specversion`, `type`, `time`, extensions...),
    /// `datacontenttype` included when known.
    pub attributes: Map<String, Value>,
    pub source: String,
    pub id: String,
    /// The data's bytes: the record value (binary), or `data` / `data_base64` (structured).
    pub data: Option<Vec<u8>>,
    /// Whether `data` came from a record value that is still as the producer wrote it (binary
    /// mode), so a Schema Registry format may apply to it.
    pub binary: bool,
}

impl Event {
    /// The dedupe key's text: `["<source>","<id>"]`.
    pub fn key_text(&self) -> String {
        serde_json::to_string(&[&self.source, &self.id]).expect("two strings serialise")
    }

    /// `time`, as the ledger's event date.
    pub fn date(&self) -> Result<chrono::NaiveDate, Rejection> {
        match self.attributes.get("time") {
            None | Some(Value::Null) => Err(Rejection::new(
                Reason::NoEventDate,
                "the CloudEvent has no time attribute; a CloudEvents consumer dates events by \
                 their time (required), never by when they arrive",
            )),
            Some(v) => date_from_value(v, "time", false).map_err(|r| Rejection {
                detail: format!(
                    "the CloudEvent's {}",
                    r.detail.trim_start_matches("payload ")
                ),
                ..r
            }),
        }
    }
}

/// Reads a record as a CloudEvent, in the mode its `content-type` says.
pub(super) fn read(
    headers: &[(&str, Option<&[u8]>)],
    value: Option<&[u8]>,
) -> Result<Event, Rejection> {
    let content_type = header_text(headers, CONTENT_TYPE)?;
    match content_type.as_deref().map(media_type) {
        Some(t) if t.starts_with("application/cloudevents-batch") => Err(Rejection::new(
            Reason::UndecodablePayload,
            format!(
                "content-type {t}: batched CloudEvents are not taken (one record must be one \
                 event, so that the partition's offset means it is applied)"
            ),
        )),
        Some(t) if t.starts_with("application/cloudevents") => structured(value, &t),
        _ => binary(headers, value, content_type),
    }
}

fn binary(
    headers: &[(&str, Option<&[u8]>)],
    value: Option<&[u8]>,
    content_type: Option<String>,
) -> Result<Event, Rejection> {
    let mut attributes = Map::new();
    // The last header of a name wins, as for the message id header.
    for (name, v) in headers {
        let Some(attr) = name.strip_prefix(PREFIX) else {
            continue;
        };
        match v {
            None => {
                attributes.remove(attr);
            }
            Some(bytes) => {
                let text = std::str::from_utf8(bytes).map_err(|_| {
                    Rejection::new(
                        Reason::InvalidEventId,
                        format!(
                            "header {name:?} is not UTF-8 text; CloudEvents attributes are text"
                        ),
                    )
                })?;
                attributes.insert(attr.to_string(), Value::String(text.to_string()));
            }
        }
    }
    if let Some(ct) = content_type {
        attributes.insert("datacontenttype".into(), Value::String(ct));
    }
    if !attributes.contains_key("id") && !attributes.contains_key("source") {
        return Err(Rejection::new(
            Reason::MissingEventId,
            "record is not a CloudEvent: no ce_id and ce_source headers (binary mode) and no \
             content-type application/cloudevents+json (structured mode)",
        ));
    }
    let (source, id) = identity(&attributes, "header ce_")?;
    Ok(Event {
        attributes,
        source,
        id,
        data: value.map(<[u8]>::to_vec),
        binary: true,
    })
}

fn structured(value: Option<&[u8]>, content_type: &str) -> Result<Event, Rejection> {
    let body = value.filter(|v| !v.is_empty()).ok_or_else(|| {
        Rejection::new(
            Reason::EmptyPayload,
            format!(
                "content-type {content_type} but the record has no value to read the event from"
            ),
        )
    })?;
    let mut attributes = match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => m,
        Ok(other) => {
            return Err(Rejection::new(
                Reason::UndecodablePayload,
                format!(
                    "a structured CloudEvent must be a JSON object, this is a JSON {}",
                    json_type(&other)
                ),
            ))
        }
        Err(e) => {
            return Err(Rejection::new(
                Reason::UndecodablePayload,
                super::format::json_error("a structured CloudEvent", &e),
            ))
        }
    };
    let data = match (attributes.remove("data"), attributes.remove("data_base64")) {
        (Some(_), Some(_)) => {
            return Err(Rejection::new(
                Reason::UndecodablePayload,
                "the CloudEvent has both data and data_base64; the spec allows one",
            ))
        }
        (None, Some(Value::String(b64))) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|e| {
                    Rejection::new(
                        Reason::UndecodablePayload,
                        format!("the CloudEvent's data_base64 is not base64: {e}"),
                    )
                })?,
        ),
        (None, Some(other)) => {
            return Err(Rejection::new(
                Reason::UndecodablePayload,
                format!(
                    "the CloudEvent's data_base64 is a JSON {}, expected a string",
                    json_type(&other)
                ),
            ))
        }
        // A string under a content type that is not JSON is the data's text; anything else
        // (an object, a JSON string under a JSON content type) is JSON.
        (Some(Value::String(s)), None) if !json_content(attributes.get("datacontenttype")) => {
            Some(s.into_bytes())
        }
        (Some(Value::Null), None) | (None, None) => None,
        (Some(v), None) => Some(serde_json::to_vec(&v).expect("a JSON value serialises")),
    };
    let (source, id) = identity(&attributes, "attribute ")?;
    Ok(Event {
        attributes,
        source,
        id,
        data,
        binary: false,
    })
}

/// `source` and `id`, both required non-empty strings, and `specversion` 1.x.
fn identity(attributes: &Map<String, Value>, how: &str) -> Result<(String, String), Rejection> {
    let text = |name: &str| -> Result<String, Rejection> {
        match attributes.get(name) {
            None | Some(Value::Null) => Err(Rejection::new(
                Reason::MissingEventId,
                format!(
                    "the CloudEvent has no {name} ({how}{name}); its dedupe key is source and id"
                ),
            )),
            Some(Value::String(s)) if s.trim().is_empty() => Err(Rejection::new(
                Reason::MissingEventId,
                format!("the CloudEvent's {name} is empty; its dedupe key is source and id"),
            )),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(Rejection::new(
                Reason::InvalidEventId,
                format!(
                    "the CloudEvent's {name} is a JSON {}, expected a string",
                    json_type(other)
                ),
            )),
        }
    };
    match attributes.get("specversion") {
        Some(Value::String(v)) if v == "1.0" || v.starts_with("1.") => {}
        Some(Value::String(v)) => {
            return Err(Rejection::new(
                Reason::InvalidEventId,
                format!(
                    "the CloudEvent's specversion is {:?}; this consumer reads 1.0",
                    quote(v)
                ),
            ))
        }
        _ => {
            return Err(Rejection::new(
                Reason::MissingEventId,
                format!("the CloudEvent has no specversion ({how}specversion)"),
            ))
        }
    }
    Ok((text("source")?, text("id")?))
}

fn header_text(headers: &[(&str, Option<&[u8]>)], name: &str) -> Result<Option<String>, Rejection> {
    match headers
        .iter()
        .rev()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
    {
        None | Some((_, None)) => Ok(None),
        Some((_, Some(v))) => std::str::from_utf8(v)
            .map(|s| Some(s.to_string()))
            .map_err(|_| {
                Rejection::new(
                    Reason::UndecodablePayload,
                    format!("header {name:?} is not UTF-8 text"),
                )
            }),
    }
}

/// The media type without parameters, lower case: `application/cloudevents+json`.
fn media_type(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// Whether a `datacontenttype` is JSON (absent counts: the spec's default for structured JSON).
fn json_content(ct: Option<&Value>) -> bool {
    match ct {
        None | Some(Value::Null) => true,
        Some(Value::String(s)) => {
            let t = media_type(s);
            t == "application/json" || t == "text/json" || t.ends_with("+json")
        }
        Some(_) => false,
    }
}
