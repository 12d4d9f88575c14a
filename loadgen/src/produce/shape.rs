//! How records carry their ids: `--ids` (UUIDv7, or Stripe-like text such as
//! `evt_0193c1...`) and `--envelope` (plain: an `event_id` header and the payment as the value;
//! cloudevents: CloudEvents 1.0, originals and double taps in binary mode, resends and redrives
//! in structured mode, so every duplicate the engine must catch crosses the two modes).

use super::{Kind, Record, Run};

/// What a payment's event id looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Ids {
    /// A UUIDv7 (the engine's default `message_id`).
    #[default]
    Uuid,
    /// `evt_` and 32 hex digits: text a consumer takes with `any_string = true` (its event date
    /// then comes from `/occurred_at`).
    Stripe,
}

impl Ids {
    /// The id's text for the payment whose log identity is `id`.
    pub fn text(self, id: uuid::Uuid) -> String {
        match self {
            Ids::Uuid => id.to_string(),
            Ids::Stripe => format!("evt_{}", id.simple()),
        }
    }
}

/// How a record wraps its payment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Envelope {
    #[default]
    Plain,
    #[value(name = "cloudevents")]
    CloudEvents,
}

/// The CloudEvents source of a run's events: every copy of one event carries the same.
fn source(run: &Run) -> String {
    format!("/loadgen/{}", run.id)
}

/// Rewrites `rec` as a CloudEvent (module docs): its id moves from the `event_id` header to the
/// event's `id`; a value that is not JSON (undecodable poison) stays binary mode.
pub(super) fn as_cloudevent(run: &Run, mut rec: Record) -> Record {
    let data: Option<serde_json::Value> = serde_json::from_slice(&rec.payload).ok();
    let time = data
        .as_ref()
        .and_then(|d| d.get("occurred_at"))
        .and_then(|t| t.as_str())
        .map(str::to_string)
        .unwrap_or_else(|| chrono::Utc::now().to_rfc3339());
    let id = rec.event_id.take();
    let structured = matches!(rec.sent.kind, Kind::Resend | Kind::Redrive) && data.is_some();
    if structured {
        let mut event = serde_json::json!({
            "specversion": "1.0",
            "source": source(run),
            "type": "payment.succeeded",
            "time": time,
            "datacontenttype": "application/json",
            "data": data,
        });
        if let Some(id) = id {
            event["id"] = id.into();
        }
        rec.payload = serde_json::to_vec(&event).expect("a JSON object serialises");
        rec.headers
            .push(("content-type", "application/cloudevents+json".into()));
    } else {
        rec.headers.push(("ce_specversion", "1.0".into()));
        if let Some(id) = id {
            rec.headers.push(("ce_id", id));
        }
        rec.headers.push(("ce_source", source(run)));
        rec.headers.push(("ce_type", "payment.succeeded".into()));
        rec.headers.push(("ce_time", time));
        rec.headers
            .push(("content-type", "application/json".into()));
    }
    rec
}
