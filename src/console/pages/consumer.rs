//! `/consumer?name=C`: one consumer as `effectively offsets show` prints it (each partition's
//! stored offset, epoch and owner beside Kafka's log, the lag, whether it is paused), its
//! pauses, its rate, and the audit rows that name it. With writes on, the controls
//! ([`crate::console::control`]): pause, resume, and an offset reset behind a confirmation.
//!
//! PostgreSQL has the consumer's side, Kafka the log's. When Kafka does not answer, the page
//! shows PostgreSQL's side and says so, at once: the cached watermark probe the overview uses
//! ([`crate::console::lag`]) is asked first, and [`op::show`] (whose Kafka calls each wait up
//! to ten seconds) gets [`SHOW_WITHIN`] at most.

use std::sync::Arc;
use std::time::Duration;

use askama::Template;
use axum::extract::{Query, State};
use axum::http::Uri;
use axum::response::Response;
use chrono::Utc;
use serde::Deserialize;
use tokio_postgres::GenericClient;

use crate::console::render::{ago, thousands};
use crate::console::{html, Chrome, ConsoleError, ConsumerInfo, Shared};
use crate::operator::control::{self as op, ConsumerView, PartitionView};
use crate::store::control::{self, Pause, Scope};
use crate::store::{browse, offsets};

use super::{encode, given};

/// How long the page waits for Kafka's side before it shows PostgreSQL's alone.
pub const SHOW_WITHIN: Duration = Duration::from_secs(5);

/// How many of the consumer's audit rows the page lists.
const AUDIT_ROWS: i64 = 20;

#[derive(Debug, Deserialize, Default)]
pub struct Params {
    name: Option<String>,
    /// The action just done from this page (its audit id): the page says what it did.
    action: Option<String>,
}

#[derive(Template)]
#[template(path = "console/consumer.html")]
struct Page {
    c: Chrome,
    name: String,
    strategy: &'static str,
    topics: Vec<String>,
    kafka_error: Option<String>,
    done: Option<String>,
    /// Wider pauses still covering what was just resumed.
    still: Vec<String>,
    done_href: String,
    partitions: Vec<Row>,
    lag: String,
    pauses: Vec<PauseRow>,
    rate: String,
    rate_source: &'static str,
    audit: Vec<[String; 7]>,
    audit_more: bool,
}

struct Row {
    topic: String,
    partition: i32,
    stored: String,
    low: String,
    high: String,
    lag: String,
    lag_class: &'static str,
    epoch: String,
    owner: String,
    /// "paused", or "paused (topic)", "paused (consumer)" when a wider pause covers it.
    paused: Option<String>,
}

struct PauseRow {
    scope: String,
    topic: String,
    partition: String,
    since: String,
    by: String,
    note: String,
}

/// The consumer `name` of the config, or 404.
impl Params {
    /// The action just done, as the query gives it (the consumer's name is looked up among
    /// the configured ones by [`find`]).
    pub(crate) fn parse(&self) -> Result<Option<uuid::Uuid>, ConsoleError> {
        given(&self.action)
            .map(str::parse)
            .transpose()
            .map_err(|_| ConsoleError::BadRequest("action is malformed".into()))
    }
}

pub(crate) fn find<'a>(
    s: &'a Shared,
    name: Option<&str>,
) -> Result<&'a ConsumerInfo, ConsoleError> {
    let name = name.ok_or_else(|| ConsoleError::BadRequest("which consumer? (?name=…)".into()))?;
    s.consumers.iter().find(|c| c.name == name).ok_or_else(|| {
        ConsoleError::NotFound(match s.elsewhere.get(name) {
            Some(db) => format!(
                "Consumer {name:?} is on database {db:?}, which another console shows: \
                 effectively console --database {db}."
            ),
            None => format!("This config has no consumer {name:?}."),
        })
    })
}

/// A scope as a table cell: "consumer", "topic t", "t [3]".
fn scope_words(scope: &Scope) -> String {
    match (&scope.topic, scope.partition) {
        (None, _) => "the whole consumer".into(),
        (Some(t), None) => format!("topic {t}"),
        (Some(t), Some(p)) => format!("{t} [{p}]"),
    }
}

/// PostgreSQL's side alone: what the page shows when Kafka does not answer (`why`).
async fn from_postgres<C: GenericClient + Sync>(
    db: &C,
    consumer: &ConsumerInfo,
    why: &str,
) -> Result<ConsumerView, ConsoleError> {
    let pauses = control::pauses(db, &consumer.name).await?;
    let mut partitions = Vec::new();
    for t in &consumer.topics {
        for row in offsets::load(db, &consumer.name, t).await? {
            partitions.push(PartitionView {
                topic: t.clone(),
                partition: row.partition,
                stored: row.next_offset,
                epoch: Some(row.epoch),
                owner: Some(row.owner),
                log: Err(why.to_string()),
                lag: None,
                paused: pauses.iter().any(|x| x.scope.covers(t, row.partition)),
            });
        }
    }
    Ok(ConsumerView {
        consumer: consumer.name.clone(),
        partitions,
        throttle: control::throttle(db, &consumer.name).await?,
        pauses,
    })
}

/// The consumer's view, and why Kafka's side is missing when it is. Holds no pooled
/// connection while [`op::show`] takes its own (four pages at once would wait on each other).
async fn view(
    s: &Shared,
    consumer: &ConsumerInfo,
) -> Result<(ConsumerView, Option<String>), ConsoleError> {
    let stored = browse::offsets(&**s.db().await?, &consumer.name).await?;
    let keys: Vec<(String, i32)> = (stored.into_iter())
        .map(|o| (o.topic, o.partition))
        .collect();
    let kafka = match (&s.kafka, s.watermarks.highs(&keys).await) {
        (Err(e), _) => Err(e.clone()),
        (Ok(_), Err(e)) => Err(e),
        (Ok(k), Ok(_)) => Ok(k),
    };
    let why = match kafka {
        Ok(k) => {
            match tokio::time::timeout(SHOW_WITHIN, op::show(&s.pool, k, &consumer.config, None))
                .await
            {
                Ok(v) => {
                    let v = v?;
                    let why = (v.partitions.iter()).find_map(|p| p.log.as_ref().err().cloned());
                    return Ok((v, why));
                }
                Err(_) => format!("Kafka did not answer within {}s", SHOW_WITHIN.as_secs()),
            }
        }
        Err(e) => e,
    };
    let v = from_postgres(&**s.db().await?, consumer, &why).await?;
    Ok((v, Some(why)))
}

/// What the action `a` did, in words, and the wider pauses still covering a resumed scope.
async fn done<C: GenericClient + Sync>(
    db: &C,
    a: uuid::Uuid,
    consumer: &str,
    pauses: &[Pause],
) -> Result<(String, Vec<String>), ConsoleError> {
    let chunks = crate::store::audit::of_action(db, a).await?;
    let Some(first) = chunks.first() else {
        return Ok((format!("No action {a} is recorded."), Vec::new()));
    };
    let n: i64 = chunks.iter().map(|c| c.count).sum();
    let f = &first.filter;
    let scope = Scope {
        consumer: consumer.to_string(),
        topic: f["topic"].as_str().map(str::to_string),
        partition: f["partition"].as_i64().and_then(|p| i32::try_from(p).ok()),
    };
    let words = scope_words(&scope);
    Ok(match (first.verb.as_str(), n) {
        ("pause", 0) => (
            format!("Paused already: {words}; nothing changed."),
            Vec::new(),
        ),
        ("pause", _) => (
            format!("Paused {words}: its workers stop fetching within about a second."),
            Vec::new(),
        ),
        ("resume", n) => (
            format!("Resumed {words}: {n} pause(s) lifted."),
            (control::covering(pauses, &scope).into_iter())
                .map(|p| scope_words(&p.scope))
                .collect(),
        ),
        (verb, n) => (
            format!("Done: {verb} of {}, {} row(s).", first.target, thousands(n)),
            Vec::new(),
        ),
    })
}

/// The Chrome of a consumer page. With writes on its forms hold what the operator types, which
/// a reload would wipe: it reloads itself only after "Resume" in the header (`refresh=on`).
fn chrome(s: &Shared, title: String, uri: &Uri) -> Chrome {
    let query = uri.query().unwrap_or_default();
    let on = query.split('&').any(|p| p == "refresh=on");
    if !s.settings.writes || on {
        return Chrome::new(s, title, "overview", uri, true);
    }
    let mut c = Chrome::new(s, title, "overview", uri, false);
    if s.settings.refresh.as_secs() > 0 {
        let kept: Vec<&str> = (query.split('&'))
            .filter(|p| !p.is_empty() && !p.starts_with("refresh="))
            .chain(["refresh=on"])
            .collect();
        c.resume = Some(format!("{}?{}", uri.path(), kept.join("&")));
    }
    c
}

pub async fn page(
    State(s): State<Arc<Shared>>,
    Query(p): Query<Params>,
    uri: Uri,
) -> Result<Response, ConsoleError> {
    let consumer = find(&s, given(&p.name))?;
    let action = p.parse()?;
    let (v, kafka_error) = view(&s, consumer).await?;
    let db = s.db().await?;
    let now = Utc::now();

    // Which pause covers each partition: its own, else the widest.
    let pause_of = |topic: &str, partition: i32| -> Option<String> {
        let covering: Vec<&Pause> = (v.pauses.iter())
            .filter(|x| x.scope.covers(topic, partition))
            .collect();
        let widest = covering.first()?;
        Some(match (&widest.scope.topic, widest.scope.partition) {
            (None, _) => "paused (consumer)".into(),
            (Some(_), None) => "paused (topic)".into(),
            _ => "paused".into(),
        })
    };
    let (mut lag_sum, mut lag_known) = (0i64, true);
    let partitions: Vec<Row> = (v.partitions.iter())
        .map(|pv| {
            match pv.lag {
                Some(l) => lag_sum += l,
                None => lag_known = false,
            }
            let (low, high) = match &pv.log {
                Ok(l) => (thousands(l.low), thousands(l.high)),
                Err(_) => ("?".into(), "?".into()),
            };
            Row {
                topic: pv.topic.clone(),
                partition: pv.partition,
                stored: pv.stored.map_or_else(|| "-".into(), thousands),
                low,
                high,
                lag: pv.lag.map_or_else(|| "?".into(), thousands),
                lag_class: match pv.lag {
                    Some(0) => "ok",
                    Some(l) if l > 10_000 => "bad",
                    Some(_) => "warn",
                    None => "muted",
                },
                epoch: pv.epoch.map_or_else(|| "-".into(), |e| e.to_string()),
                owner: pv.owner.clone().unwrap_or_else(|| "-".into()),
                paused: pv
                    .paused
                    .then(|| pause_of(&pv.topic, pv.partition))
                    .flatten(),
            }
        })
        .collect();
    let pauses = (v.pauses.iter())
        .map(|x| PauseRow {
            scope: scope_words(&x.scope),
            topic: x.scope.topic.clone().unwrap_or_default(),
            partition: x.scope.partition.map(|p| p.to_string()).unwrap_or_default(),
            since: format!(
                "{} ({} ago)",
                crate::console::render::time(x.paused_at),
                ago(x.paused_at, now)
            ),
            by: x.paused_by.clone(),
            note: x.note.clone().unwrap_or_default(),
        })
        .collect();
    let (rate, rate_source) = match (v.throttle, consumer.config.rate_limit()) {
        (Some(t), _) => (
            format!("{} msg/s, burst {}", t.max_rate, t.burst),
            "set at run time (effectively throttle); it replaces the config's max_rate",
        ),
        (None, Some(t)) => (
            format!("{} msg/s, burst {}", t.max_rate, t.burst),
            "the config's max_rate",
        ),
        (None, None) => (
            "unlimited".into(),
            "no max_rate in the config, none set at run time",
        ),
    };
    let (done, still) = match action {
        Some(a) => {
            let (words, still) = done(&**db, a, &consumer.name, &v.pauses).await?;
            (Some(words), still)
        }
        None => (None, Vec::new()),
    };
    let rows = crate::store::audit::of_consumer(&**db, &consumer.name, AUDIT_ROWS + 1).await?;
    let audit_more = rows.len() as i64 > AUDIT_ROWS;
    let audit = (rows.into_iter().take(AUDIT_ROWS as usize))
        .map(super::audit::cells)
        .collect();
    html(Page {
        c: chrome(&s, format!("Consumer {}", consumer.name), &uri),
        name: consumer.name.clone(),
        strategy: consumer.strategy,
        topics: consumer.topics.clone(),
        kafka_error,
        done,
        still,
        done_href: action
            .map(|a| format!("/audit?action={}", encode(&a.to_string())))
            .unwrap_or_default(),
        lag: match (lag_known, partitions.is_empty()) {
            (_, true) => "-".into(),
            (true, false) => thousands(lag_sum),
            (false, false) => "?".into(),
        },
        partitions,
        pauses,
        rate,
        rate_source,
        audit,
        audit_more,
    })
}
