//! A parked message's page: everything `effectively dead-letters show` / `inbox show` prints
//! (coordinates, reason, detail, key, headers, the payload as UTF-8, pretty JSON and hex), all
//! masked, and the actions for this one row.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Path, State};
use axum::http::Uri;
use axum::response::Response;
use chrono::Utc;

use crate::console::mask::scrub;
use crate::console::render::{ago, bytes_text, payload, time, time_opt, Payload};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::parked::{self, Message};

/// The actions' hidden fields (which row) and verbs (verb, button label, dangerous).
type Actions = (
    Vec<(&'static str, String)>,
    Vec<(&'static str, &'static str, bool)>,
);

#[derive(Template)]
#[template(path = "console/message.html")]
struct Page {
    c: Chrome,
    facts: Vec<(&'static str, String)>,
    detail_label: &'static str,
    detail: String,
    key: String,
    headers: Vec<(String, String)>,
    payload: Payload,
    actions: Option<Actions>,
    resolved: Option<String>,
}

/// The message's key, headers and payload, masked; and the masked values, to scrub the rest.
fn message_views(s: &Shared, m: &Message) -> (String, Vec<(String, String)>, Payload, Vec<String>) {
    let (p, secrets) = payload(m.payload.as_deref(), &s.mask);
    let key = bytes_text(m.key.as_deref(), &secrets);
    let headers = (m.headers.iter())
        .map(|(k, v)| (k.clone(), bytes_text(v.as_deref(), &secrets)))
        .collect();
    (key, headers, p, secrets)
}

pub async fn dead_letter(
    State(s): State<Arc<Shared>>,
    Path(id): Path<i64>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let db = s.db().await?;
    let d = parked::dead_letter(&**db, id)
        .await?
        .ok_or_else(|| ConsoleError::NotFound(format!("No dead letter {id}.")))?;
    let now = Utc::now();
    let (key, headers, payload, secrets) = message_views(&s, &d.message);
    let m = &d.summary;
    let message_id = match (&m.message_id, &m.message_key) {
        (Some(id), Some(text)) => format!("{id} (made from {text:?})"),
        (Some(id), None) => id.to_string(),
        (None, _) => "(none readable)".into(),
    };
    let facts = vec![
        ("id", m.id.to_string()),
        ("consumer", m.consumer.clone()),
        ("topic", m.topic.clone()),
        ("partition", m.partition.to_string()),
        ("offset", m.offset.to_string()),
        ("message id", message_id),
        ("reason", m.reason.clone()),
        ("attempts", m.attempts.to_string()),
        (
            "first seen",
            format!("{} ({} ago)", time(m.first_seen), ago(m.first_seen, now)),
        ),
        (
            "last seen",
            format!("{} ({} ago)", time(m.last_seen), ago(m.last_seen, now)),
        ),
        ("kafka timestamp", time_opt(d.message.kafka_ts)),
    ];
    let resolved = d.resolution.as_ref().map(|r| {
        let to = r
            .redriven_to
            .as_deref()
            .map(|t| format!(" to {t}"))
            .unwrap_or_default();
        format!(
            "{}{to} at {} by {} (action {})",
            r.what,
            time(r.at),
            r.by,
            r.action
        )
    });
    let actions = (s.settings.writes && d.resolution.is_none()).then(|| {
        (
            vec![("id", m.id.to_string())],
            vec![
                ("redrive", "Redrive…", false),
                ("discard-dead-letters", "Discard…", true),
            ],
        )
    });
    html(Page {
        c: Chrome::new(&s, format!("Dead letter #{id}"), "parked", &uri, false),
        facts,
        detail_label: "detail",
        detail: scrub(&m.detail, &secrets),
        key,
        headers,
        payload,
        actions,
        resolved,
    })
}

pub async fn inbox_row(
    State(s): State<Arc<Shared>>,
    Path((consumer, message_id)): Path<(String, uuid::Uuid)>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let db = s.db().await?;
    let r = parked::inbox_row(&**db, &consumer, message_id)
        .await?
        .ok_or_else(|| {
            ConsoleError::NotFound(format!("No inbox row {message_id} of {consumer}."))
        })?;
    let now = Utc::now();
    let (key, headers, payload, secrets) = message_views(&s, &r.message);
    let m = &r.summary;
    let facts = vec![
        ("consumer", m.consumer.clone()),
        ("message id", m.message_id.to_string()),
        ("event date", m.event_date.to_string()),
        ("status", r.status.clone()),
        ("seq", m.seq.to_string()),
        ("ordering key", m.ordering_key.clone()),
        ("attempts", m.attempts.to_string()),
        ("next attempt", time(r.next_attempt_at)),
        ("topic", m.topic.clone()),
        ("partition", m.partition.to_string()),
        ("offset", m.offset.to_string()),
        (
            "received",
            format!("{} ({} ago)", time(m.received_at), ago(m.received_at, now)),
        ),
        ("kafka timestamp", time_opt(r.message.kafka_ts)),
    ];
    let actions = (s.settings.writes && r.status == "FAILED").then(|| {
        (
            vec![
                ("consumer", m.consumer.clone()),
                ("message_id", m.message_id.to_string()),
            ],
            vec![
                ("replay", "Replay…", false),
                ("discard-inbox", "Discard…", true),
            ],
        )
    });
    html(Page {
        c: Chrome::new(&s, format!("Inbox row {message_id}"), "parked", &uri, false),
        facts,
        detail_label: "last error",
        detail: scrub(m.last_error.as_deref().unwrap_or("(none)"), &secrets),
        key,
        headers,
        payload,
        actions,
        resolved: None,
    })
}
