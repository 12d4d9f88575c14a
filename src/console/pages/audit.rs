//! `/audit`: the operators' actions, newest first (one row per committed chunk), and after an
//! action the chunks of that action.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::Uri;
use axum::response::Response;
use serde::Deserialize;

use crate::console::render::{thousands, time};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::audit::{self, AuditRow};

use super::given;

#[derive(Debug, Deserialize, Default)]
pub struct Params {
    action: Option<String>,
    before: Option<String>,
}

#[derive(Template)]
#[template(path = "console/audit.html")]
struct Page {
    c: Chrome,
    done: Option<String>,
    rows: Vec<[String; 7]>,
    next: Option<String>,
}

impl Params {
    /// The action to report and the page's cursor, as the query gives them: the whole of the
    /// page's input checking, apart from the database (fuzzed by [`crate::console::fuzzing`]).
    pub(crate) fn parse(&self) -> Result<(Option<uuid::Uuid>, Option<i64>), ConsoleError> {
        let bad = |w: &str| ConsoleError::BadRequest(format!("{w} is malformed"));
        let action = given(&self.action)
            .map(str::parse)
            .transpose()
            .map_err(|_| bad("action"))?;
        let before = given(&self.before)
            .map(str::parse)
            .transpose()
            .map_err(|_| bad("before"))?;
        Ok((action, before))
    }
}

/// An audit row's cells, as the audit page and a consumer's page list them.
pub(crate) fn cells(r: AuditRow) -> [String; 7] {
    [
        time(r.at),
        r.actor,
        r.verb,
        r.target,
        r.filter.to_string(),
        thousands(r.count),
        format!(
            "{}{}",
            r.action,
            r.note.map(|n| format!(" — {n}")).unwrap_or_default()
        ),
    ]
}

pub async fn page(
    State(s): State<Arc<Shared>>,
    Query(p): Query<Params>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let (action, before) = p.parse()?;
    let limit = s.settings.page_size as i64;
    let db = s.db().await?;
    let done = match action {
        None => None,
        Some(a) => {
            let chunks = audit::of_action(&**db, a).await?;
            let n: i64 = chunks.iter().map(|c| c.count).sum();
            let verb = chunks
                .first()
                .map(|c| format!("{} of {}", c.verb, c.target))
                .unwrap_or_default();
            Some(format!(
                "Done: {verb}, {} row(s) (action {a}).",
                thousands(n)
            ))
        }
    };
    let rows = audit::recent(&**db, before, limit).await?;
    let next = (rows.len() as i64 == limit)
        .then(|| format!("/audit?before={}", rows.last().expect("a full page").id));
    html(Page {
        c: Chrome::new(
            &s,
            "Audit: operator actions",
            "audit",
            &uri,
            action.is_none(),
        ),
        done,
        rows: rows.into_iter().map(cells).collect(),
        next,
    })
}
