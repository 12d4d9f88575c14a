//! `/inbox`: one consumer's inbox rows by status (PENDING, IN_PROGRESS, FAILED, HELD) with
//! attempts, next attempt and last error, keyset-paginated; and its held version gaps.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::Uri;
use axum::response::Response;
use chrono::Utc;
use serde::Deserialize;

use crate::console::render::{age_s, ago, capped, short, time};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::browse::{self, InboxCursor, CAP, INBOX_STATUSES};
use crate::store::versions;

use super::{encode, given, query};

#[derive(Debug, Deserialize, Default)]
pub struct Params {
    consumer: Option<String>,
    status: Option<String>,
    after_seq: Option<String>,
    after_aggregate: Option<String>,
    after_version: Option<String>,
}

#[derive(Template)]
#[template(path = "console/inbox.html")]
struct Page {
    c: Chrome,
    consumer: String,
    consumers: Vec<(String, bool)>,
    status: String,
    tabs: Vec<(String, String, String, bool)>,
    rows: Vec<Row>,
    next: Option<String>,
    gaps: Option<Vec<[String; 5]>>,
    gaps_of: i64,
}

struct Row {
    href: String,
    message_id: String,
    seq: i64,
    key: String,
    attempts: i32,
    next_attempt: String,
    last_error: String,
    coordinates: String,
    received: String,
    version: String,
}

/// A last error in a list. An error may quote the field it choked on, and only the message page
/// has the payload to know which values are masked: with masking on, lists leave errors out.
pub(crate) fn error_cell(s: &Shared, e: Option<&str>) -> String {
    match e {
        None => String::new(),
        Some(_) if s.mask.is_active() => "(open the message: errors are masked there)".into(),
        Some(e) => short(e, 160),
    }
}

fn number<T: std::str::FromStr>(v: &Option<String>, name: &str) -> Result<Option<T>, ConsoleError> {
    given(v)
        .map(|s| s.parse::<T>())
        .transpose()
        .map_err(|_| ConsoleError::BadRequest(format!("{name} must be a number")))
}

impl Params {
    /// The status tab and the cursor, as the query gives them (the consumer defaults to the
    /// first inbox consumer, which the page knows).
    pub(crate) fn parse(&self) -> Result<(String, InboxCursor), ConsoleError> {
        let status = given(&self.status).unwrap_or("FAILED").to_uppercase();
        if !INBOX_STATUSES.contains(&status.as_str()) {
            return Err(ConsoleError::BadRequest(format!(
                "status must be one of {INBOX_STATUSES:?}"
            )));
        }
        let cursor = InboxCursor {
            seq: number(&self.after_seq, "after_seq")?,
            aggregate: given(&self.after_aggregate).map(str::to_string),
            version: number(&self.after_version, "after_version")?,
        };
        Ok((status, cursor))
    }
}

pub async fn page(
    State(s): State<Arc<Shared>>,
    Query(p): Query<Params>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let inbox_consumers: Vec<&str> = (s.consumers.iter())
        .filter(|c| c.uses_inbox)
        .map(|c| c.name.as_str())
        .collect();
    let consumer = given(&p.consumer)
        .or(inbox_consumers.first().copied())
        .unwrap_or_default()
        .to_string();
    let (status, cursor) = p.parse()?;
    let db = s.db().await?;
    let now = Utc::now();
    let limit = s.settings.page_size as i64;
    let (mut rows, mut tabs, mut next, mut gaps, mut gaps_of) =
        (Vec::new(), Vec::new(), None, None, 0);
    if !consumer.is_empty() {
        let counts = browse::inbox_counts(&**db, &consumer, CAP).await?;
        for (st, n) in INBOX_STATUSES.iter().zip([
            counts.pending,
            counts.in_progress,
            counts.failed,
            counts.held,
        ]) {
            let href = format!("/inbox?consumer={}&status={st}", encode(&consumer));
            tabs.push((st.to_string(), capped(n.count, n.more), href, *st == status));
        }
        let items = browse::inbox_page(&**db, &consumer, &status, &cursor, limit).await?;
        if items.len() as i64 == limit {
            let last = items.last().expect("a full page");
            let after = match status.as_str() {
                "HELD" => query(&[
                    ("consumer", Some(consumer.clone())),
                    ("status", Some(status.clone())),
                    ("after_aggregate", last.aggregate.clone()),
                    ("after_version", last.version.map(|v| v.to_string())),
                ]),
                _ => query(&[
                    ("consumer", Some(consumer.clone())),
                    ("status", Some(status.clone())),
                    ("after_seq", Some(last.seq.to_string())),
                ]),
            };
            next = Some(format!("/inbox{after}"));
        }
        rows = items
            .into_iter()
            .map(|i| Row {
                href: format!("/parked/inbox/{}/{}", encode(&consumer), i.message_id),
                message_id: i.message_id.to_string(),
                seq: i.seq,
                key: i.ordering_key,
                attempts: i.attempts,
                next_attempt: match i.status.as_str() {
                    "PENDING" if i.next_attempt_at > now => {
                        format!("in {}", ago(now, i.next_attempt_at))
                    }
                    "PENDING" => "due".into(),
                    "IN_PROGRESS" => i
                        .lease_until
                        .map_or_else(|| "locked".into(), |t| format!("lease until {}", time(t))),
                    _ => "-".into(),
                },
                last_error: error_cell(&s, i.last_error.as_deref()),
                coordinates: format!("{} [{}] @{}", i.topic, i.partition, i.offset),
                received: format!("{} ago", ago(i.received_at, now)),
                version: match (&i.aggregate, i.version) {
                    (Some(a), Some(v)) => format!("{a} v{v}"),
                    _ => "-".into(),
                },
            })
            .collect();
        if status == "HELD" {
            gaps_of = versions::gap_count(&**db, &consumer).await?;
            gaps = Some(
                versions::gaps(&**db, &consumer, 20)
                    .await?
                    .into_iter()
                    .map(|g| {
                        let applied = g.stored.unwrap_or(0);
                        let held: Vec<String> = g.held.iter().map(i64::to_string).collect();
                        [
                            g.aggregate,
                            applied.to_string(),
                            (applied + 1).to_string(),
                            held.join(", "),
                            age_s(g.oldest_s),
                        ]
                    })
                    .collect(),
            );
        }
    }
    let consumers = (inbox_consumers.iter())
        .map(|c| (c.to_string(), *c == consumer))
        .collect();
    html(Page {
        c: Chrome::new(&s, format!("Inbox: {consumer}"), "inbox", &uri, true),
        consumer,
        consumers,
        status,
        tabs,
        rows,
        next,
        gaps,
        gaps_of,
    })
}
