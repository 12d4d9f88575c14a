//! The console's request parsing, reachable without a server or a database: the fuzz targets
//! (`fuzz/`, and `tests/fuzz.rs` on stable) feed it generated query strings and form bodies.
//!
//! Each page checks its input in one place (its `Params::parse`, a form's `selection`,
//! `parse` or `target`) before it touches the database, and the handlers call exactly those
//! functions; this module runs them behind axum's own extractors (`Query::try_from_uri`,
//! `Form::from_request`), so what is fuzzed is what a request meets. Nothing here is used by
//! the console itself: it is public (and hidden from the docs) only because integration tests
//! and the fuzz crate are other crates, and a cargo feature would leave `cargo test` without
//! it.

use axum::body::Body;
use axum::extract::{FromRequest, Query};
use axum::http::{header, Method, Request, Uri};
use axum::Form;
use serde::de::DeserializeOwned;

use super::actions::ActionForm;
use super::control::{ResetForm, ScopeForm};
use super::pages;

/// The GET pages whose query the console reads.
pub const GET_PATHS: [&str; 6] = [
    "/parked",
    "/audit",
    "/consumer",
    "/inbox",
    "/outbox",
    "/notifications",
];

/// The forms the console accepts, each the first or second step of an action.
pub const POST_PATHS: [&str; 6] = [
    "/actions/confirm",
    "/actions/do",
    "/consumer/pause",
    "/consumer/resume",
    "/consumer/reset/confirm",
    "/consumer/reset/do",
];

/// What a form amounted to: the fields its confirmation carries into the second step, and
/// what it asks for in words (the selection, or the reset's target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    pub hidden: Vec<(&'static str, String)>,
    pub meaning: String,
}

/// Checks a GET page's query as the page does. `Err`: the 400 page's sentence.
pub fn get(uri: &Uri) -> Result<(), String> {
    match uri.path() {
        "/parked" => query::<pages::parked::Params>(uri)?.parse().map(drop),
        "/audit" => query::<pages::audit::Params>(uri)?.parse().map(drop),
        "/consumer" => query::<pages::consumer::Params>(uri)?.parse().map(drop),
        "/inbox" => query::<pages::inbox::Params>(uri)?.parse().map(drop),
        "/outbox" => query::<pages::outbox::Params>(uri)?.parse().map(drop),
        "/notifications" => query::<pages::notifications::Params>(uri)?
            .parse()
            .map(drop),
        other => return Err(format!("no page at {other}")),
    }
    .map_err(|e| e.to_string())
}

/// Checks a form body posted to `path` as its handler does, up to the database.
pub fn post(path: &str, body: &[u8]) -> Result<Parsed, String> {
    match path {
        "/actions/confirm" | "/actions/do" => {
            let f: ActionForm = form(path, body)?;
            let (_, words) = f.selection().map_err(|e| e.to_string())?;
            Ok(Parsed {
                hidden: f.hidden(),
                meaning: words,
            })
        }
        "/consumer/pause" | "/consumer/resume" => {
            let f: ScopeForm = form(path, body)?;
            let (topic, partition) = f.parse().map_err(|e| e.to_string())?;
            Ok(Parsed {
                hidden: Vec::new(),
                meaning: format!("{topic:?} {partition:?}"),
            })
        }
        "/consumer/reset/confirm" | "/consumer/reset/do" => {
            let f: ResetForm = form(path, body)?;
            f.scope.parse().map_err(|e| e.to_string())?;
            let target = f.target().map_err(|e| e.to_string())?;
            Ok(Parsed {
                hidden: f.hidden(target),
                meaning: target.to_string(),
            })
        }
        other => Err(format!("no form at {other}")),
    }
}

/// The step a confirmation's form posts to.
pub fn second_step(path: &str) -> Option<&'static str> {
    match path {
        "/actions/confirm" => Some("/actions/do"),
        "/consumer/reset/confirm" => Some("/consumer/reset/do"),
        _ => None,
    }
}

fn query<T: DeserializeOwned>(uri: &Uri) -> Result<T, String> {
    Query::<T>::try_from_uri(uri)
        .map(|Query(t)| t)
        .map_err(|e| e.body_text())
}

fn form<T: DeserializeOwned + Send>(path: &str, body: &[u8]) -> Result<T, String> {
    let request = Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(body.to_vec()))
        .map_err(|e| format!("not a request: {e}"))?;
    // The body is in memory, so the extractor's future is ready at its first poll.
    futures::executor::block_on(Form::<T>::from_request(request, &()))
        .map(|Form(t)| t)
        .map_err(|e| e.body_text())
}
