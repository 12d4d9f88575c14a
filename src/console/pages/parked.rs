//! `/parked`: dead letters still parked and FAILED inbox rows in one list, newest first,
//! filtered by consumer, reason, topic, partition and time, with capped counts and the
//! "every row matching" actions.
//!
//! The two sources page by their own keys (a dead letter's id, an inbox row's seq), so the
//! list carries two cursors: each page reads up to a page of each after its cursor, merges
//! them by time and shows a page; a cursor moves only past the rows shown.

use std::sync::Arc;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::Uri;
use axum::response::Response;
use chrono::{DateTime, Datelike, NaiveDateTime, Utc};
use serde::Deserialize;

use crate::console::render::{ago, capped, short, time};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::browse::{self, CAP, WINDOW_CAP};
use crate::store::parked::{self, Filter, INBOX_REASON};

use super::{encode, given, query};

/// The filter's fields as a form sends them (also the actions' hidden fields).
#[derive(Debug, Deserialize, Default, Clone)]
pub struct FilterForm {
    pub consumer: Option<String>,
    pub reason: Option<String>,
    pub topic: Option<String>,
    pub partition: Option<String>,
    pub since: Option<String>,
    pub until: Option<String>,
}

/// `since`/`until`: an RFC 3339 time, a form's `2026-12-05T23:00` (UTC), or a duration back
/// from now (`2h`, `3days`).
///
/// Only years 0000 to 9999: a reset's confirmation carries the time to its second step as
/// RFC 3339, which has no other years, so a time outside them (a form's year -1 or 10000, a
/// duration of 3000 years) would be planned and then refused (found by tests/fuzz.rs).
pub(crate) fn parse_time(field: &str, s: &str) -> Result<DateTime<Utc>, ConsoleError> {
    let t = match NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M") {
        Ok(t) => t.and_utc(),
        Err(_) => crate::inbox::admin::parse_since(s, Utc::now())
            .map_err(|e| ConsoleError::BadRequest(e.replace("--since", field)))?,
    };
    if !(0..=9999).contains(&t.year()) {
        return Err(ConsoleError::BadRequest(format!(
            "{field} {s:?} is in the year {}: times are between the years 0000 and 9999",
            t.year()
        )));
    }
    Ok(t)
}

impl FilterForm {
    pub fn filter(&self) -> Result<Filter, ConsoleError> {
        Ok(Filter {
            consumer: given(&self.consumer).map(str::to_string),
            reason: given(&self.reason).map(str::to_string),
            topic: given(&self.topic).map(str::to_string),
            partition: given(&self.partition)
                .map(str::parse)
                .transpose()
                .map_err(|_| ConsoleError::BadRequest("partition must be a number".into()))?,
            since: given(&self.since)
                .map(|s| parse_time("since", s))
                .transpose()?,
            until: given(&self.until)
                .map(|s| parse_time("until", s))
                .transpose()?,
        })
    }

    /// The fields as given, for links and hidden form fields.
    pub fn pairs(&self) -> Vec<(&'static str, Option<String>)> {
        vec![
            ("consumer", self.consumer.clone()),
            ("reason", self.reason.clone()),
            ("topic", self.topic.clone()),
            ("partition", self.partition.clone()),
            ("since", self.since.clone()),
            ("until", self.until.clone()),
        ]
    }
}

/// A filter in words, for headings and confirmations.
pub(crate) fn describe(f: &Filter) -> String {
    let mut parts = Vec::new();
    if let Some(c) = &f.consumer {
        parts.push(format!("consumer {c}"));
    }
    if let Some(r) = &f.reason {
        parts.push(format!("reason {r}"));
    }
    if let Some(t) = &f.topic {
        parts.push(format!("topic {t}"));
    }
    if let Some(p) = f.partition {
        parts.push(format!("partition {p}"));
    }
    if let Some(t) = f.since {
        parts.push(format!("parked since {}", time(t)));
    }
    if let Some(t) = f.until {
        parts.push(format!("parked before {}", time(t)));
    }
    match parts.is_empty() {
        true => "no filter (every consumer)".into(),
        false => parts.join(", "),
    }
}

#[derive(Debug, Deserialize, Default)]
pub struct Params {
    #[serde(flatten)]
    filter: FilterForm,
    dl_before: Option<String>,
    ib_before: Option<String>,
    /// With a time window, the cursors' times (the last rows shown were parked then).
    dl_at: Option<String>,
    ib_at: Option<String>,
}

#[derive(Template)]
#[template(path = "console/parked.html")]
struct Page {
    c: Chrome,
    form: FilterForm,
    consumers: Vec<String>,
    reasons: Vec<String>,
    description: String,
    dead_letters: String,
    failed: String,
    takes_inbox: bool,
    rows: Vec<Row>,
    next: Option<String>,
    hidden: Vec<(&'static str, String)>,
}

struct Row {
    kind: &'static str,
    href: String,
    what: String,
    consumer: String,
    reason: String,
    detail: String,
    coordinates: String,
    attempts: i32,
    parked: String,
}

/// What the list's query asks for: the filter and the two cursors.
pub(crate) struct ListQuery {
    pub filter: Filter,
    pub dl_before: Option<i64>,
    pub ib_before: Option<i64>,
    pub dl_at: Option<DateTime<Utc>>,
    pub ib_at: Option<DateTime<Utc>>,
}

impl Params {
    /// The filter and the cursors, checked: the whole of the list's input checking, apart
    /// from the database (fuzzed by [`crate::console::fuzzing`]).
    pub(crate) fn parse(&self) -> Result<ListQuery, ConsoleError> {
        let at = |v: &Option<String>, name: &str| {
            given(v)
                .map(|t| DateTime::parse_from_rfc3339(t).map(|t| t.with_timezone(&Utc)))
                .transpose()
                .map_err(|_| ConsoleError::BadRequest(format!("{name} is malformed")))
        };
        Ok(ListQuery {
            filter: self.filter.filter()?,
            dl_before: number(&self.dl_before, "dl_before")?,
            ib_before: number(&self.ib_before, "ib_before")?,
            dl_at: at(&self.dl_at, "dl_at")?,
            ib_at: at(&self.ib_at, "ib_at")?,
        })
    }
}

fn number(v: &Option<String>, name: &str) -> Result<Option<i64>, ConsoleError> {
    given(v)
        .map(str::parse)
        .transpose()
        .map_err(|_| ConsoleError::BadRequest(format!("{name} must be a number")))
}

pub async fn list(
    State(s): State<Arc<Shared>>,
    Query(p): Query<Params>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let ListQuery {
        filter: f,
        dl_before,
        ib_before,
        dl_at,
        ib_at,
    } = p.parse()?;
    let limit = s.settings.page_size as i64;
    let db = s.db().await?;
    let now = Utc::now();
    // A time window pages by time (see `browse::dead_letters_in_window`), else by id and seq.
    let window = f.since.is_some() || f.until.is_some();
    let (dls, fails) = match window {
        false => (
            parked::dead_letters(&**db, &f, dl_before, limit).await?,
            parked::failed_inbox(&**db, &f, ib_before, limit).await?,
        ),
        true => (
            browse::dead_letters_in_window(&**db, &f, dl_at.zip(dl_before), limit).await?,
            browse::failed_inbox_in_window(&**db, &f, ib_at.zip(ib_before), limit).await?,
        ),
    };
    let cap = if window { WINDOW_CAP } else { CAP };
    let dl_count = parked::count_dead_letters(&**db, &f, cap).await?;
    let ib_count = parked::count_failed_inbox(&**db, &f, cap).await?;
    // Merge by time, newest first, one page.
    enum Item {
        D(parked::DeadLetterSummary),
        I(parked::FailedSummary),
    }
    let more_behind = dls.len() as i64 == limit || fails.len() as i64 == limit;
    let mut items: Vec<(DateTime<Utc>, Item)> = (dls.into_iter())
        .map(|d| (d.last_seen, Item::D(d)))
        .chain(fails.into_iter().map(|i| (i.received_at, Item::I(i))))
        .collect();
    items.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
    let cut = items.len() > limit as usize;
    items.truncate(limit as usize);
    let (mut next_dl, mut next_ib) = (dl_before, ib_before);
    let (mut next_dl_at, mut next_ib_at) = (dl_at, ib_at);
    let mut rows = Vec::with_capacity(items.len());
    let errors_hidden = s.mask.is_active();
    for (at, item) in items {
        rows.push(match item {
            Item::D(d) => {
                next_dl = Some(d.id);
                next_dl_at = Some(d.last_seen);
                Row {
                    kind: "dead letter",
                    href: format!("/parked/dead-letters/{}", d.id),
                    what: format!("#{}", d.id),
                    consumer: d.consumer,
                    reason: d.reason,
                    detail: match errors_hidden {
                        true => "(open the message: details are masked there)".into(),
                        false => short(&d.detail, 160),
                    },
                    coordinates: format!("{} [{}] @{}", d.topic, d.partition, d.offset),
                    attempts: d.attempts,
                    parked: format!("{} ago", ago(at, now)),
                }
            }
            Item::I(i) => {
                next_ib = Some(i.seq);
                next_ib_at = Some(i.received_at);
                Row {
                    kind: "inbox FAILED",
                    href: format!("/parked/inbox/{}/{}", encode(&i.consumer), i.message_id),
                    what: i.message_id.to_string(),
                    consumer: i.consumer,
                    reason: INBOX_REASON.into(),
                    detail: super::inbox::error_cell(&s, i.last_error.as_deref()),
                    coordinates: format!("{} [{}] @{}", i.topic, i.partition, i.offset),
                    attempts: i.attempts,
                    parked: format!("{} ago", ago(at, now)),
                }
            }
        });
    }
    let next = (more_behind || cut).then(|| {
        let mut pairs = p.filter.pairs();
        pairs.push(("dl_before", next_dl.map(|v| v.to_string())));
        pairs.push(("ib_before", next_ib.map(|v| v.to_string())));
        if window {
            let stamp = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            pairs.push(("dl_at", next_dl_at.map(stamp)));
            pairs.push(("ib_at", next_ib_at.map(stamp)));
        }
        format!("/parked{}", query(&pairs))
    });
    let mut reasons = Vec::new();
    for c in &s.consumers {
        for (r, _) in browse::dead_letters_by_reason(&**db, &c.name, 1).await? {
            reasons.push(r);
        }
    }
    reasons.push(INBOX_REASON.into());
    reasons.sort();
    reasons.dedup();
    let hidden = (p.filter.pairs().into_iter())
        .filter_map(|(k, v)| v.filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
        .collect();
    html(Page {
        c: Chrome::new(&s, "Parked messages", "parked", &uri, true),
        description: describe(&f),
        dead_letters: capped(dl_count.count, dl_count.more),
        failed: capped(ib_count.count, ib_count.more),
        takes_inbox: f.takes_inbox(),
        consumers: s.consumers.iter().map(|c| c.name.clone()).collect(),
        reasons,
        form: p.filter,
        rows,
        next,
        hidden,
    })
}
