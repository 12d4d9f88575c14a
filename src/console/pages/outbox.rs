//! `/outbox`: unpublished rows in the order the relay sends them, or published ones newest
//! first; payloads masked.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::Uri;
use axum::response::Response;
use chrono::Utc;
use serde::Deserialize;

use crate::console::render::{ago, short, time_opt};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::browse;

use super::given;

#[derive(Debug, Deserialize, Default)]
pub struct Params {
    published: Option<String>,
    after: Option<String>,
}

#[derive(Template)]
#[template(path = "console/outbox.html")]
struct Page {
    c: Chrome,
    published: bool,
    rows: Vec<[String; 7]>,
    next: Option<String>,
}

/// A JSON payload for a table cell: masked, compact, cut.
pub(crate) fn json_cell(s: &Shared, mut v: serde_json::Value) -> String {
    s.mask.value(&mut v);
    short(&v.to_string(), 200)
}

impl Params {
    /// Which list, and the cursor, as the query gives them.
    pub(crate) fn parse(&self) -> Result<(bool, Option<i64>), ConsoleError> {
        let published = given(&self.published).is_some_and(|v| v == "1" || v == "true");
        let after = given(&self.after)
            .map(str::parse::<i64>)
            .transpose()
            .map_err(|_| ConsoleError::BadRequest("after must be a number".into()))?;
        Ok((published, after))
    }
}

pub async fn page(
    State(s): State<Arc<Shared>>,
    Query(p): Query<Params>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let (published, after) = p.parse()?;
    let limit = s.settings.page_size as i64;
    let db = s.db().await?;
    let items = browse::outbox_page(&**db, published, after, limit).await?;
    let now = Utc::now();
    let next = (items.len() as i64 == limit).then(|| {
        let last = items.last().expect("a full page").seq;
        format!("/outbox?published={}&after={last}", published as u8)
    });
    let rows = items
        .into_iter()
        .map(|o| {
            [
                o.seq.to_string(),
                o.id.to_string(),
                o.aggregate_id,
                o.event_type,
                format!("{} ago", ago(o.created_at, now)),
                time_opt(o.published_at),
                json_cell(&s, o.payload),
            ]
        })
        .collect();
    let title = if published {
        "Outbox: published"
    } else {
        "Outbox: unpublished"
    };
    html(Page {
        c: Chrome::new(&s, title, "outbox", &uri, true),
        published,
        rows,
        next,
    })
}
