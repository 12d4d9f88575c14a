//! The actions: redrive, replay, discard and retry, for one row or every row matching a
//! filter, each in two POSTs so nothing changes without a number typed by a person.
//!
//! 1. `POST /actions/confirm` changes nothing: the server runs the selection (the row, or the
//!    filter again, as submitted) through the operator's exact count and shows it, with a form
//!    that asks to type that number.
//! 2. `POST /actions/do` counts again. If the typed number is not the count now (rows were
//!    parked or resolved in between, or a typo), nothing happens and the confirmation is shown
//!    again with the new count. Otherwise the operator function runs (the same one the CLI
//!    calls, which writes the audit row in the change's own transaction) and the browser is
//!    sent to the audit page of that action (303, so a reload does not repeat it).
//!
//! Both are POSTs, so [`super::auth`] has already refused them unless writes are on and the
//! request is same-origin.

use std::sync::Arc;

use askama::Template;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use serde::Deserialize;

use super::auth::Who;
use super::pages::parked::{describe, parse_time, FilterForm};
use super::pages::{encode, given};
use super::render::thousands;
use super::{html, Chrome, ConsoleError, Shared};
use crate::operator::{self, Actor, DeadLetters, InboxRows, Notifications, OperatorError};

/// What a confirmation or action form carries.
#[derive(Debug, Deserialize, Default, Clone)]
pub struct ActionForm {
    verb: String,
    /// One dead letter.
    id: Option<String>,
    /// One inbox row (with `consumer`).
    message_id: Option<String>,
    /// One notification (with `channel`).
    event_id: Option<String>,
    channel: Option<String>,
    #[serde(flatten)]
    filter: FilterForm,
    typed: Option<String>,
    note: Option<String>,
}

/// The operator's selection a form stands for.
pub(super) enum Selection {
    DeadLetters(DeadLetters),
    Inbox(InboxRows),
    Notifications(Notifications),
}

struct Verb {
    name: &'static str,
    title: &'static str,
    danger: bool,
}

const VERBS: [Verb; 6] = [
    Verb {
        name: "redrive",
        title: "Redrive dead letters",
        danger: false,
    },
    Verb {
        name: "discard-dead-letters",
        title: "Discard dead letters",
        danger: true,
    },
    Verb {
        name: "replay",
        title: "Replay FAILED inbox rows",
        danger: false,
    },
    Verb {
        name: "discard-inbox",
        title: "Discard FAILED inbox rows",
        danger: true,
    },
    Verb {
        name: "retry-notifications",
        title: "Retry FAILED notifications",
        danger: false,
    },
    Verb {
        name: "discard-notifications",
        title: "Discard FAILED notifications",
        danger: true,
    },
];

impl ActionForm {
    fn verb(&self) -> Result<&'static Verb, ConsoleError> {
        VERBS
            .iter()
            .find(|v| v.name == self.verb)
            .ok_or_else(|| ConsoleError::BadRequest(format!("no action {:?}", self.verb)))
    }

    /// The selection, and how the confirmation names it.
    pub(super) fn selection(&self) -> Result<(Selection, String), ConsoleError> {
        let bad = |what: &str| ConsoleError::BadRequest(format!("{what} is malformed"));
        Ok(match self.verb()?.name {
            "redrive" | "discard-dead-letters" => match given(&self.id) {
                Some(id) => {
                    let id = id.parse().map_err(|_| bad("id"))?;
                    (
                        Selection::DeadLetters(DeadLetters::Id(id)),
                        format!("dead letter #{id}"),
                    )
                }
                None => {
                    let f = self.filter.filter()?;
                    let words = format!("every parked dead letter matching {}", describe(&f));
                    (Selection::DeadLetters(DeadLetters::Matching(f)), words)
                }
            },
            "replay" | "discard-inbox" => match given(&self.message_id) {
                Some(m) => {
                    let message_id = m.parse().map_err(|_| bad("message_id"))?;
                    let consumer = given(&self.filter.consumer)
                        .ok_or_else(|| bad("consumer"))?
                        .to_string();
                    let words = format!("inbox row {message_id} of {consumer}");
                    (
                        Selection::Inbox(InboxRows::Id {
                            consumer,
                            message_id,
                        }),
                        words,
                    )
                }
                None => {
                    let f = self.filter.filter()?;
                    let words = format!("every FAILED inbox row matching {}", describe(&f));
                    (Selection::Inbox(InboxRows::Matching(f)), words)
                }
            },
            _ => {
                let channel = given(&self.channel).map(str::to_string);
                match given(&self.event_id) {
                    Some(e) => {
                        let event_id = e.parse().map_err(|_| bad("event_id"))?;
                        let channel = channel.ok_or_else(|| bad("channel"))?;
                        let words = format!("notification {event_id} on {channel}");
                        (
                            Selection::Notifications(Notifications::Id { event_id, channel }),
                            words,
                        )
                    }
                    None => {
                        let since = given(&self.filter.since)
                            .map(|s| parse_time("since", s))
                            .transpose()?;
                        let words = format!(
                            "every FAILED notification{}{}",
                            channel
                                .as_deref()
                                .map(|c| format!(" on {c}"))
                                .unwrap_or_default(),
                            since
                                .map(|t| format!(" recorded since {t}"))
                                .unwrap_or_default()
                        );
                        (
                            Selection::Notifications(Notifications::Matching { channel, since }),
                            words,
                        )
                    }
                }
            }
        })
    }

    /// The fields to carry into the next step (not the typed number).
    pub(super) fn hidden(&self) -> Vec<(&'static str, String)> {
        let mut pairs = vec![
            ("verb", Some(self.verb.clone())),
            ("id", self.id.clone()),
            ("message_id", self.message_id.clone()),
            ("event_id", self.event_id.clone()),
            ("channel", self.channel.clone()),
        ];
        pairs.extend(self.filter.pairs());
        (pairs.into_iter())
            .filter_map(|(k, v)| v.filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
            .collect()
    }
}

impl From<OperatorError> for ConsoleError {
    fn from(e: OperatorError) -> Self {
        match e {
            OperatorError::Store(s) => ConsoleError::Store(s),
            OperatorError::Pool(p) => ConsoleError::Store(crate::store::StoreError::Pool(p)),
            other => ConsoleError::Config(other.to_string()),
        }
    }
}

async fn count(s: &Shared, sel: &Selection) -> Result<u64, ConsoleError> {
    Ok(match sel {
        Selection::DeadLetters(d) => operator::count_dead_letters(&s.pool, d).await?,
        Selection::Inbox(i) => operator::count_inbox(&s.pool, i).await?,
        Selection::Notifications(n) => operator::count_notifications(&s.pool, n).await?,
    })
}

/// The confirmation step of every two-step change: what it takes, the number to type, the
/// fields the second POST carries. Also the offset reset's ([`super::control`]), with its plan.
#[derive(Template)]
#[template(path = "console/confirm.html")]
pub(crate) struct Confirm {
    pub c: Chrome,
    /// The sentence before the count: "This takes every parked dead letter matching …".
    pub words: String,
    pub count: u64,
    pub count_text: String,
    /// What is counted: "row(s)", "partition(s)".
    pub unit: &'static str,
    /// Each partition's move (topic, partition, from, to, log, what it means); empty but for
    /// a reset.
    pub plan: Vec<[String; 6]>,
    pub problem: Option<String>,
    /// Where the second step posts.
    pub post_to: &'static str,
    pub hidden: Vec<(&'static str, String)>,
    pub danger: bool,
    pub note: String,
    /// Where "Cancel" goes.
    pub back: String,
    pub back_label: &'static str,
}

impl Confirm {
    /// The page, 409 when it comes back with a problem (nothing was done).
    pub fn respond(self) -> Result<Response, ConsoleError> {
        let status = match self.problem {
            Some(_) => StatusCode::CONFLICT,
            None => StatusCode::OK,
        };
        let mut r = html(self)?;
        *r.status_mut() = status;
        Ok(r)
    }
}

fn confirm_page(
    s: &Shared,
    form: &ActionForm,
    words: String,
    count: u64,
    problem: Option<String>,
) -> Result<Response, ConsoleError> {
    let verb = form.verb()?;
    Confirm {
        c: Chrome::still(s, verb.title, "parked"),
        words: format!("This takes {words}"),
        count,
        count_text: thousands(count as i64),
        unit: "row(s)",
        plan: Vec::new(),
        problem,
        post_to: "/actions/do",
        hidden: form.hidden(),
        danger: verb.danger,
        note: form.note.clone().unwrap_or_default(),
        back: "/parked".into(),
        back_label: "Back to parked messages",
    }
    .respond()
}

/// `POST /actions/confirm`: counts, changes nothing.
pub async fn confirm(
    State(s): State<Arc<Shared>>,
    Form(form): Form<ActionForm>,
) -> Result<Response, ConsoleError> {
    let (sel, words) = form.selection()?;
    let n = count(&s, &sel).await?;
    confirm_page(&s, &form, words, n, None)
}

/// `POST /actions/do`: counts again, and acts only if the typed number is that count.
pub async fn act(
    State(s): State<Arc<Shared>>,
    Extension(who): Extension<Who>,
    Form(form): Form<ActionForm>,
) -> Result<Response, ConsoleError> {
    let (sel, words) = form.selection()?;
    let n = count(&s, &sel).await?;
    let typed = given(&form.typed).map(|t| t.replace([',', ' '], ""));
    if n == 0 {
        return confirm_page(
            &s,
            &form,
            words,
            n,
            Some("Nothing matches now: nothing was done.".into()),
        );
    }
    if typed.as_deref() != Some(n.to_string().as_str()) {
        let problem = format!(
            "Nothing was done: the confirmation must be the number of rows this takes now, {}{}.",
            thousands(n as i64),
            typed.map(|t| format!(" (typed: {t})")).unwrap_or_default()
        );
        return confirm_page(&s, &form, words, n, Some(problem));
    }
    let actor = Actor(who.0);
    let note = given(&form.note);
    let done = match (&sel, form.verb()?.name) {
        (Selection::DeadLetters(d), "redrive") => {
            let r = s
                .redriver
                .as_ref()
                .ok_or_else(|| ConsoleError::Config("no Kafka producer for redrives".into()))?;
            operator::redrive(&s.pool, r, d, &actor, note).await?
        }
        (Selection::DeadLetters(d), _) => {
            operator::discard_dead_letters(&s.pool, d, &actor, note).await?
        }
        (Selection::Inbox(i), "replay") => operator::replay_inbox(&s.pool, i, &actor, note).await?,
        (Selection::Inbox(i), _) => operator::discard_inbox(&s.pool, i, &actor, note).await?,
        (Selection::Notifications(n), "retry-notifications") => {
            operator::retry_notifications(&s.pool, n, &actor, note).await?
        }
        (Selection::Notifications(n), _) => {
            operator::discard_notifications(&s.pool, n, &actor, note).await?
        }
    };
    tracing::info!(
        actor = %actor.0,
        verb = %form.verb,
        count = done.count,
        action = %done.action,
        "console action"
    );
    Ok((
        StatusCode::SEE_OTHER,
        [(
            header::LOCATION,
            format!("/audit?action={}", encode(&done.action.to_string())),
        )],
    )
        .into_response())
}
