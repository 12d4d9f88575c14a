//! `/notifications`: notifications by status and channel, newest first; payloads masked.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::Uri;
use axum::response::Response;
use chrono::{DateTime, Utc};
use serde::Deserialize;

use crate::console::render::{ago, capped, time_opt};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::browse::{self, NotificationCursor, CAP, NOTIFICATION_STATUSES};

use super::inbox::error_cell;
use super::outbox::json_cell;
use super::{given, query};

#[derive(Debug, Deserialize, Default)]
pub struct Params {
    status: Option<String>,
    channel: Option<String>,
    after_created: Option<String>,
    after_event: Option<String>,
    after_channel: Option<String>,
}

#[derive(Template)]
#[template(path = "console/notifications.html")]
struct Page {
    c: Chrome,
    status: String,
    channel: String,
    channels: Vec<(String, bool)>,
    tabs: Vec<(String, String, String, bool)>,
    rows: Vec<[String; 9]>,
    next: Option<String>,
}

impl Params {
    /// The status tab, the channel and the cursor, as the query gives them.
    pub(crate) fn parse(
        &self,
    ) -> Result<(String, Option<String>, NotificationCursor), ConsoleError> {
        let status = given(&self.status).unwrap_or("FAILED").to_uppercase();
        if !NOTIFICATION_STATUSES.contains(&status.as_str()) {
            return Err(ConsoleError::BadRequest(format!(
                "status must be one of {NOTIFICATION_STATUSES:?}"
            )));
        }
        let channel = given(&self.channel).map(str::to_string);
        let bad = |what: &str| ConsoleError::BadRequest(format!("{what} is malformed"));
        let cursor = NotificationCursor {
            created_at: given(&self.after_created)
                .map(|t| DateTime::parse_from_rfc3339(t).map(|t| t.with_timezone(&Utc)))
                .transpose()
                .map_err(|_| bad("after_created"))?,
            event_id: given(&self.after_event)
                .map(str::parse)
                .transpose()
                .map_err(|_| bad("after_event"))?,
            channel: given(&self.after_channel).map(str::to_string),
        };
        Ok((status, channel, cursor))
    }
}

pub async fn page(
    State(s): State<Arc<Shared>>,
    Query(p): Query<Params>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let (status, channel, cursor) = p.parse()?;
    let limit = s.settings.page_size as i64;
    let db = s.db().await?;
    let now = Utc::now();
    let tabs = browse::notifications_by_status(&**db, CAP)
        .await?
        .into_iter()
        .map(|(st, n)| {
            let href = format!(
                "/notifications{}",
                query(&[("status", Some(st.clone())), ("channel", channel.clone())])
            );
            let on = st == status;
            (st, capped(n.count, n.more), href, on)
        })
        .collect();
    let items =
        browse::notifications_page(&**db, &status, channel.as_deref(), &cursor, limit).await?;
    let next = (items.len() as i64 == limit).then(|| {
        let last = items.last().expect("a full page");
        format!(
            "/notifications{}",
            query(&[
                ("status", Some(status.clone())),
                ("channel", channel.clone()),
                ("after_created", Some(last.created_at.to_rfc3339())),
                ("after_event", Some(last.event_id.to_string())),
                ("after_channel", Some(last.channel.clone())),
            ])
        )
    });
    let rows = items
        .into_iter()
        .map(|n| {
            [
                n.event_id.to_string(),
                n.channel,
                n.attempts.to_string(),
                format!("{} ago", ago(n.created_at, now)),
                match n.status.as_str() {
                    "PENDING" => time_opt(Some(n.next_attempt_at)),
                    _ => time_opt(n.sent_at),
                },
                n.provider_id.unwrap_or_default(),
                error_cell(&s, n.last_error.as_deref()),
                json_cell(&s, n.payload),
                n.status,
            ]
        })
        .collect();
    let channels = browse::notification_channels(&**db)
        .await?
        .into_iter()
        .map(|c| {
            let on = Some(&c) == channel.as_ref();
            (c, on)
        })
        .collect();
    html(Page {
        c: Chrome::new(
            &s,
            format!("Notifications: {status}"),
            "notifications",
            &uri,
            true,
        ),
        status,
        channel: channel.unwrap_or_default(),
        channels,
        tabs,
        rows,
        next,
    })
}
