//! The consumer page's controls, through [`crate::operator::control`] (the functions the CLI's
//! `pause`, `resume` and `offsets reset` call, which write the audit row in the change's own
//! transaction). Each answers 303 so a reload does not repeat it.
//!
//! - `POST /consumer/pause`, `POST /consumer/resume`: one POST each, for the whole consumer, a
//!   topic or one partition. Both are undone by the other, so they ask for no confirmation;
//!   the browser goes back to the consumer's page, which says what was done.
//! - An offset reset takes two, as the parked rows' actions do ([`super::actions`]):
//!   `POST /consumer/reset/confirm` plans it and changes nothing: each partition's move (from,
//!   to, the log), and a form that asks to type the number of partitions. `POST
//!   /consumer/reset/do` plans again; if the typed number is not the plan's now, nothing
//!   happens and the plan is shown again, else [`op::reset`] runs and the browser goes to the
//!   action's audit page. A time target is carried to the second step as the time it stood for
//!   in the first (`2h` back from now would otherwise move between the two).
//!
//! All are POSTs, so [`super::auth`] has refused them unless writes are on and the request is
//! same-origin.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Form};
use chrono::SecondsFormat;
use serde::Deserialize;

use super::actions::Confirm;
use super::auth::Who;
use super::pages::consumer::find;
use super::pages::parked::parse_time;
use super::pages::{encode, given};
use super::render::{thousands, time};
use super::{Chrome, ConsoleError, ConsumerInfo, Shared};
use crate::operator::control::{self as op, KafkaLookup, Move, Target};
use crate::operator::{Actor, OperatorError};
use crate::store::control::Scope;

/// Which of a consumer's partitions, as the forms send it.
#[derive(Debug, Deserialize, Default, Clone)]
pub struct ScopeForm {
    consumer: Option<String>,
    /// One of its topics; empty: all of them.
    topic: Option<String>,
    /// One partition of `topic`.
    partition: Option<String>,
    note: Option<String>,
}

impl ScopeForm {
    /// The consumer and the scope, checked against its topics.
    fn scope<'a>(&self, s: &'a Shared) -> Result<(&'a ConsumerInfo, Scope), ConsoleError> {
        let c = find(s, given(&self.consumer))?;
        let (topic, partition) = self.parse()?;
        op::topics(&c.config, topic.as_deref()).map_err(ConsoleError::BadRequest)?;
        Ok((
            c,
            Scope {
                consumer: c.name.clone(),
                topic,
                partition,
            },
        ))
    }

    /// The topic and partition as the form gives them, before they are checked against the
    /// consumer's topics (fuzzed by [`super::fuzzing`]).
    pub(super) fn parse(&self) -> Result<(Option<String>, Option<i32>), ConsoleError> {
        let topic = given(&self.topic).map(str::to_string);
        let partition = given(&self.partition)
            .map(|p| match p.parse::<i32>() {
                Ok(n) if n >= 0 => Ok(n),
                _ => Err(ConsoleError::BadRequest(format!(
                    "partition {p:?}: a partition is a number, 0 or more"
                ))),
            })
            .transpose()?;
        if let (Some(p), None) = (partition, &topic) {
            return Err(ConsoleError::BadRequest(format!(
                "partition {p} needs its topic"
            )));
        }
        Ok((topic, partition))
    }
}

/// 303 to `to`.
fn see(to: String) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// Back to the consumer's page, which says what action `a` did.
fn back_to(c: &ConsumerInfo, a: uuid::Uuid) -> Response {
    see(format!(
        "/consumer?name={}&action={}",
        encode(&c.name),
        encode(&a.to_string())
    ))
}

/// `POST /consumer/pause`.
pub async fn pause(
    State(s): State<Arc<Shared>>,
    Extension(who): Extension<Who>,
    Form(form): Form<ScopeForm>,
) -> Result<Response, ConsoleError> {
    let (c, scope) = form.scope(&s)?;
    let actor = Actor(who.0);
    let done = op::pause(&s.pool, &scope, &actor, given(&form.note)).await?;
    tracing::info!(actor = %actor.0, %scope, count = done.count, action = %done.action, "console pause");
    Ok(back_to(c, done.action))
}

/// `POST /consumer/resume`.
pub async fn resume(
    State(s): State<Arc<Shared>>,
    Extension(who): Extension<Who>,
    Form(form): Form<ScopeForm>,
) -> Result<Response, ConsoleError> {
    let (c, scope) = form.scope(&s)?;
    let actor = Actor(who.0);
    let r = op::resume(&s.pool, &scope, &actor, given(&form.note)).await?;
    tracing::info!(actor = %actor.0, %scope, count = r.done.count, action = %r.done.action, "console resume");
    Ok(back_to(c, r.done.action))
}

/// What the reset forms carry: the scope, the target (from the page: `kind` and `value`; from
/// the confirmation: `to` or `shift_by`, as the CLI's flags), the typed number and the note.
#[derive(Debug, Deserialize, Default, Clone)]
pub struct ResetForm {
    #[serde(flatten)]
    pub(super) scope: ScopeForm,
    /// `earliest`, `latest`, `time`, `offset` or `shift`.
    kind: Option<String>,
    /// The time, the offset or the shift.
    value: Option<String>,
    to: Option<String>,
    shift_by: Option<String>,
    typed: Option<String>,
}

impl ResetForm {
    pub(super) fn target(&self) -> Result<Target, ConsoleError> {
        let bad = ConsoleError::BadRequest;
        if let Some(to) = given(&self.to) {
            return to
                .parse()
                .map_err(|e: String| bad(e.replace("--to", "to").replace("--shift-by", "shift")));
        }
        if let Some(n) = given(&self.shift_by) {
            return (n.parse().map(Target::ShiftBy))
                .map_err(|_| bad(format!("shift {n:?}: a number of records")));
        }
        let value = given(&self.value);
        let needs = |what: &str| bad(format!("a reset to {what} needs a value"));
        match given(&self.kind).unwrap_or_default() {
            "earliest" => Ok(Target::Earliest),
            "latest" => Ok(Target::Latest),
            "time" => Ok(Target::Time(parse_time(
                "time",
                value.ok_or_else(|| needs("a time"))?,
            )?)),
            "offset" => match value.ok_or_else(|| needs("an offset"))?.parse::<i64>() {
                Ok(o) if o >= 0 => Ok(Target::Offset(o)),
                _ => Err(bad(
                    "an offset is a number, 0 or more (to move back by N records, shift by -N)"
                        .into(),
                )),
            },
            "shift" => {
                let v = value.ok_or_else(|| needs("a shift"))?;
                (v.parse().map(Target::ShiftBy))
                    .map_err(|_| bad(format!("shift {v:?}: a number of records (negative: back)")))
            }
            k => Err(bad(format!(
                "reset to {k:?}? earliest, latest, time, offset or shift"
            ))),
        }
    }

    /// The fields the confirmation carries to the second step: the scope and the target as
    /// it was resolved in the first.
    pub(super) fn hidden(&self, target: Target) -> Vec<(&'static str, String)> {
        let f = &self.scope;
        let target = match target {
            Target::Earliest => ("to", "earliest".to_string()),
            Target::Latest => ("to", "latest".to_string()),
            Target::Time(t) => ("to", t.to_rfc3339_opts(SecondsFormat::AutoSi, true)),
            Target::Offset(o) => ("to", o.to_string()),
            Target::ShiftBy(n) => ("shift_by", n.to_string()),
        };
        [
            ("consumer", f.consumer.clone()),
            ("topic", f.topic.clone()),
            ("partition", f.partition.clone()),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.filter(|v| !v.trim().is_empty()).map(|v| (k, v)))
        .chain([target])
        .collect()
    }
}

/// A plan's or reset's error as a page: the operator's input (an offset outside the log,
/// nothing stored to shift, a topic Kafka does not know) is a 400, Kafka not answering a 503.
fn refused(e: OperatorError) -> ConsoleError {
    match e {
        OperatorError::KafkaSettings(why) => ConsoleError::BadRequest(why),
        OperatorError::Kafka(e) => {
            ConsoleError::Unavailable(format!("Kafka: {e}. Nothing was changed."))
        }
        other => other.into(),
    }
}

fn kafka(s: &Shared) -> Result<&KafkaLookup, ConsoleError> {
    s.kafka
        .as_ref()
        .map_err(|e| ConsoleError::Unavailable(format!("{e}: a reset needs Kafka's logs")))
}

/// The reset's words: "This moves the stored offsets of …".
fn words(c: &ConsumerInfo, scope: &Scope, target: Target) -> String {
    let which = match (&scope.topic, scope.partition) {
        (None, _) => format!("every partition of its topics ({})", c.topics.join(", ")),
        (Some(t), None) => format!("every partition of topic {t}"),
        (Some(t), Some(p)) => format!("partition {p} of topic {t}"),
    };
    let whither = match target {
        Target::Earliest => "to the log's start (earliest)".to_string(),
        Target::Latest => "to the log's end (latest): nothing left to read".to_string(),
        Target::Time(t) => format!(
            "to the first record at or after {} (by record timestamp; the log's end where none is)",
            time(t)
        ),
        Target::Offset(o) => format!("to offset {o}"),
        Target::ShiftBy(n) => format!("by {n} record(s) from the stored offset, inside the log"),
    };
    format!(
        "This moves the stored offsets of consumer {}, {which}, {whither}",
        c.name
    )
}

/// One planned move as the confirmation's table row.
fn plan_row(m: &Move) -> [String; 6] {
    let effect = match m.from {
        None => "nothing stored yet: it starts here".to_string(),
        Some(f) if m.to < f => format!(
            "{} record(s) read again (deduplicated)",
            thousands(f - m.to)
        ),
        Some(f) if m.to > f => format!("{} record(s) skipped, never applied", thousands(m.to - f)),
        Some(_) => "no change".to_string(),
    };
    [
        m.topic.clone(),
        m.partition.to_string(),
        m.from.map_or_else(|| "-".into(), thousands),
        thousands(m.to),
        format!("{}..{}", thousands(m.log.low), thousands(m.log.high)),
        effect,
    ]
}

fn confirm_page(
    s: &Shared,
    c: &ConsumerInfo,
    form: &ResetForm,
    scope: &Scope,
    target: Target,
    plan: &[Move],
    problem: Option<String>,
) -> Result<Response, ConsoleError> {
    Confirm {
        c: Chrome::still(s, format!("Reset offsets of {}", c.name), "overview"),
        words: words(c, scope, target),
        count: plan.len() as u64,
        count_text: thousands(plan.len() as i64),
        unit: "partition(s)",
        plan: plan.iter().map(plan_row).collect(),
        problem,
        post_to: "/consumer/reset/do",
        hidden: form.hidden(target),
        danger: true,
        note: form.scope.note.clone().unwrap_or_default(),
        back: format!("/consumer?name={}", encode(&c.name)),
        back_label: "Back to the consumer",
    }
    .respond()
}

impl ResetForm {
    /// The consumer, the scope, the target and the plan of the reset this form asks for.
    async fn plan<'a>(
        &self,
        s: &'a Shared,
    ) -> Result<(&'a ConsumerInfo, Scope, Target, Vec<Move>), ConsoleError> {
        let (c, scope) = self.scope.scope(s)?;
        let target = self.target()?;
        let plan = op::plan_reset(
            &s.pool,
            kafka(s)?,
            &c.config,
            scope.topic.as_deref(),
            scope.partition,
            target,
        )
        .await
        .map_err(refused)?;
        Ok((c, scope, target, plan))
    }
}

/// `POST /consumer/reset/confirm`: the plan; changes nothing.
pub async fn plan(
    State(s): State<Arc<Shared>>,
    Form(form): Form<ResetForm>,
) -> Result<Response, ConsoleError> {
    let (c, scope, target, plan) = form.plan(&s).await?;
    confirm_page(&s, c, &form, &scope, target, &plan, None)
}

/// `POST /consumer/reset/do`: plans again, and resets only if the typed number is the plan's.
pub async fn reset(
    State(s): State<Arc<Shared>>,
    Extension(who): Extension<Who>,
    Form(form): Form<ResetForm>,
) -> Result<Response, ConsoleError> {
    let (c, scope, target, plan) = form.plan(&s).await?;
    let typed = given(&form.typed).map(|t| t.replace([',', ' '], ""));
    if plan.is_empty() {
        let problem = "Nothing to move now: nothing was done.".to_string();
        return confirm_page(&s, c, &form, &scope, target, &plan, Some(problem));
    }
    if typed.as_deref() != Some(plan.len().to_string().as_str()) {
        let problem = format!(
            "Nothing was done: the confirmation must be the number of partitions this moves now, {}{}.",
            plan.len(),
            typed.map(|t| format!(" (typed: {t})")).unwrap_or_default()
        );
        return confirm_page(&s, c, &form, &scope, target, &plan, Some(problem));
    }
    let actor = Actor(who.0);
    let (done, moved) = op::reset(
        &s.pool,
        &c.name,
        target,
        &plan,
        &actor,
        given(&form.scope.note),
    )
    .await
    .map_err(refused)?;
    tracing::info!(
        actor = %actor.0,
        consumer = %c.name,
        %target,
        partitions = moved.len(),
        action = %done.action,
        "console offset reset"
    );
    Ok(see(format!(
        "/audit?action={}",
        encode(&done.action.to_string())
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(pairs: &[(&str, &str)]) -> ResetForm {
        let map: serde_json::Map<String, serde_json::Value> = (pairs.iter())
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        serde_json::from_value(map.into()).expect("a form")
    }

    #[test]
    fn every_target_the_page_offers_parses() {
        let t = |pairs: &[(&str, &str)]| form(pairs).target();
        assert_eq!(t(&[("kind", "earliest")]).unwrap(), Target::Earliest);
        assert_eq!(
            t(&[("kind", "latest"), ("value", "ignored")]).unwrap(),
            Target::Latest
        );
        assert_eq!(
            t(&[("kind", "offset"), ("value", "42")]).unwrap(),
            Target::Offset(42)
        );
        assert!(t(&[("kind", "offset"), ("value", "-1")]).is_err());
        assert!(t(&[("kind", "offset")]).is_err());
        assert_eq!(
            t(&[("kind", "shift"), ("value", "-50")]).unwrap(),
            Target::ShiftBy(-50)
        );
        assert_eq!(
            t(&[("kind", "time"), ("value", "2026-12-05T23:00")]).unwrap(),
            Target::Time("2026-12-05T23:00:00Z".parse().unwrap())
        );
        assert!(t(&[("kind", "sideways")]).is_err());
    }

    #[test]
    fn the_second_step_gets_the_target_the_first_resolved() {
        let f = form(&[
            ("consumer", "c"),
            ("topic", ""),
            ("kind", "time"),
            ("value", "2h"),
        ]);
        let target = f.target().unwrap();
        let hidden = f.hidden(target);
        assert_eq!(hidden[0], ("consumer", "c".to_string()));
        let (k, v) = hidden.last().unwrap();
        assert_eq!(*k, "to");
        // An absolute time now, which the second step parses back to the same target.
        let again = form(&[("to", v.as_str())]).target().unwrap();
        assert_eq!(again, target);
        let shift = form(&[("kind", "shift"), ("value", "-3")]);
        let back = shift.hidden(shift.target().unwrap());
        assert_eq!(back.last().unwrap(), &("shift_by", "-3".to_string()));
        let n = form(&[("shift_by", "-3")]).target().unwrap();
        assert_eq!(n, Target::ShiftBy(-3));
    }
}
