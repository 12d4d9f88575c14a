//! A stand-in for an SMS provider that honours idempotency keys the way Stripe's API does
//! (<https://docs.stripe.com/api/idempotent_requests>).
//!
//! The notification sender claims that every notification reaches the user once, although the
//! sender may crash, or its request may time out, between asking the provider to send and
//! recording that it did. The claim rests on the provider: a retry under the same key must not
//! send again, and a sender that never heard the answer must be able to ask what became of its
//! request. This stub is that provider for the engine's tests (a dev-dependency of
//! `effectively`, never part of the engine). It is a real HTTP server rather than a mock
//! object, so the sender's timeouts, dropped connections and concurrent retries happen as they
//! would against the real thing.
//!
//! # Protocol
//!
//! `POST /v1/messages` with an `Idempotency-Key` header (at most 255 characters) and a JSON
//! object as body:
//! - a new key is held in flight while the request runs (after the configured latency and any
//!   injected delay); then the message is delivered and the answer is `200 {"id", "status"}`,
//!   or an injected failure answers `500` with the message not delivered ([`Fault::FailBefore`])
//!   or delivered ([`Fault::FailAfter`]: the answer a client cannot tell from the first). Either
//!   way the status and body are saved under the key, 500s included, as Stripe does;
//! - a key in flight: `409`, nothing saved;
//! - a known key with other parameters (compared as JSON values): `400`, nothing saved;
//! - a known key with the same parameters: the saved status and body again, with
//!   `Idempotent-Replayed: true`, and no second delivery.
//!
//! The request runs in a task of its own, so a client that hangs up (its timeout) does not stop
//! it: the message is delivered behind the client's back, which is the case a sender has to
//! reconcile. `GET /v1/messages?idempotency_key=K` is how it does: `200` with the message
//! delivered under `K`, or `404` while none is (in flight, failed before, or never sent).
//! `GET /v1/messages` lists every delivered message.
//!
//! # Faults
//!
//! Injected in-process ([`ProviderStub::inject`], [`ProviderStub::set_fault_rate`],
//! [`ProviderStub::set_latency`]) or over HTTP when the stub runs as a process ([`serve`]):
//! `POST /control/faults [{"fail":"before"},{"fail":"after"},{"delay_ms":2000}]` queues faults
//! for the next new keys, in order; `POST /control/fault_rate
//! {"fail_before":0.05,"fail_after":0.02,"seed":7}` fails new keys at random once the queue is
//! empty; `POST /control/latency {"delay_ms":50}` delays every new key; `GET /control/stats`
//! returns the counters ([`Stats`]).
//!
//! Not modelled: key expiry (24 hours at Stripe), authentication, rate limits.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::net::{TcpListener, ToSocketAddrs};
use tokio::sync::oneshot;

/// The request header that carries the key.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";
/// The response header that marks a replayed answer.
pub const IDEMPOTENT_REPLAYED: &str = "Idempotent-Replayed";
/// Stripe's limit.
const MAX_KEY_LEN: usize = 255;

/// A delivered message: the effect the sender must cause once per notification.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub id: String,
    pub idempotency_key: String,
    /// The request's body, as sent.
    pub body: Value,
    pub created_at: DateTime<Utc>,
    /// The request's W3C `traceparent` header, if it carried one (the sender's trace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// What happens to the next request that arrives with a new key.
///
/// Over HTTP: `{"fail":"before"}`, `{"fail":"after"}`, `{"delay_ms":N}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(from = "FaultSpec")]
pub enum Fault {
    /// Answer 500 without delivering.
    FailBefore,
    /// Deliver, then answer 500: the client believes it failed.
    FailAfter,
    /// Hold the key in flight this long, then deliver and answer 200. Longer than the client's
    /// timeout, it delivers after the client gave up.
    Delay(Duration),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FaultSpec {
    Fail { fail: FailPoint },
    Delay { delay_ms: u64 },
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum FailPoint {
    Before,
    After,
}

impl From<FaultSpec> for Fault {
    fn from(spec: FaultSpec) -> Fault {
        match spec {
            FaultSpec::Fail {
                fail: FailPoint::Before,
            } => Fault::FailBefore,
            FaultSpec::Fail {
                fail: FailPoint::After,
            } => Fault::FailAfter,
            FaultSpec::Delay { delay_ms } => Fault::Delay(Duration::from_millis(delay_ms)),
        }
    }
}

/// Random failures for new keys once the queue of injected faults is empty (a steady
/// background of provider errors).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultRate {
    #[serde(default)]
    pub fail_before: f64,
    #[serde(default)]
    pub fail_after: f64,
    /// Repeats the same sequence of failures from run to run.
    #[serde(default)]
    pub seed: Option<u64>,
}

/// Why the stub refused a setting.
#[derive(Debug, thiserror::Error)]
pub enum StubError {
    #[error(
        "fault rates must lie in [0, 1] and sum to at most 1 \
         (fail_before {fail_before}, fail_after {fail_after})"
    )]
    FaultRate { fail_before: f64, fail_after: f64 },
}

impl FaultRate {
    fn check(&self) -> Result<(), StubError> {
        let unit = 0.0..=1.0;
        if unit.contains(&self.fail_before)
            && unit.contains(&self.fail_after)
            && self.fail_before + self.fail_after <= 1.0
        {
            Ok(())
        } else {
            Err(StubError::FaultRate {
                fail_before: self.fail_before,
                fail_after: self.fail_after,
            })
        }
    }
}

/// The counters, in-process ([`ProviderStub::stats`]) and at `GET /control/stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// `POST /v1/messages` requests, whatever their answer.
    pub requests: usize,
    /// Answers replayed from a saved response.
    pub replays: usize,
    /// 409s: the key was in flight.
    pub conflicts: usize,
    /// 400s: the key was used with other parameters.
    pub mismatches: usize,
    /// `GET /v1/messages?idempotency_key=` requests.
    pub lookups: usize,
    /// Messages delivered.
    pub effects: usize,
    /// Keys being processed now.
    pub in_flight: usize,
    /// Injected faults not consumed yet.
    pub faults_queued: usize,
}

/// A response saved under a key, with the parameters it was first used with.
struct Saved {
    params: Value,
    status: StatusCode,
    body: Value,
}

impl Saved {
    fn respond(&self, replayed: bool) -> Response {
        let mut response = (self.status, Json(self.body.clone())).into_response();
        if replayed {
            response
                .headers_mut()
                .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        response
    }
}

enum KeyState {
    InFlight,
    Done(Saved),
}

/// Everything the provider knows; one lock, never held across an `.await`.
struct Ledger {
    keys: HashMap<String, KeyState>,
    messages: Vec<Message>,
    faults: VecDeque<Fault>,
    rate: FaultRate,
    rng: fastrand::Rng,
    latency: Duration,
    stats: Stats,
}

impl Default for Ledger {
    fn default() -> Ledger {
        Ledger {
            keys: HashMap::new(),
            messages: Vec::new(),
            faults: VecDeque::new(),
            rate: FaultRate::default(),
            rng: fastrand::Rng::new(),
            latency: Duration::ZERO,
            stats: Stats::default(),
        }
    }
}

impl Ledger {
    fn next_fault(&mut self) -> Option<Fault> {
        if let Some(fault) = self.faults.pop_front() {
            return Some(fault);
        }
        if self.rate.fail_before + self.rate.fail_after == 0.0 {
            return None;
        }
        let draw = self.rng.f64();
        if draw < self.rate.fail_before {
            Some(Fault::FailBefore)
        } else if draw < self.rate.fail_before + self.rate.fail_after {
            Some(Fault::FailAfter)
        } else {
            None
        }
    }

    /// The effect: appends the message and returns its id.
    fn deliver(&mut self, key: &str, params: &Value, traceparent: Option<&str>) -> String {
        let id = format!("msg_{}", self.messages.len() + 1);
        self.messages.push(Message {
            id: id.clone(),
            idempotency_key: key.to_owned(),
            body: params.clone(),
            created_at: Utc::now(),
            traceparent: traceparent.map(str::to_owned),
        });
        id
    }

    fn set_fault_rate(&mut self, rate: FaultRate) -> Result<(), StubError> {
        rate.check()?;
        self.rate = rate;
        self.rng = rate
            .seed
            .map_or_else(fastrand::Rng::new, fastrand::Rng::with_seed);
        Ok(())
    }

    fn stats(&self) -> Stats {
        Stats {
            effects: self.messages.len(),
            in_flight: self
                .keys
                .values()
                .filter(|state| matches!(state, KeyState::InFlight))
                .count(),
            faults_queued: self.faults.len(),
            ..self.stats
        }
    }
}

#[derive(Clone, Default)]
struct Shared(Arc<Mutex<Ledger>>);

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // Nothing panics while holding the lock; if something did, the counts are still the
        // best evidence a failing test has.
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A stub serving on a local port until it is stopped or dropped.
pub struct ProviderStub {
    addr: SocketAddr,
    ledger: Shared,
    stop: Option<oneshot::Sender<()>>,
    server: tokio::task::JoinHandle<io::Result<()>>,
}

impl ProviderStub {
    /// Binds `addr` (`"127.0.0.1:0"` for any free port) and serves in a task of this runtime.
    pub async fn start(addr: impl ToSocketAddrs) -> io::Result<ProviderStub> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let ledger = Shared::default();
        let (stop, stopped) = oneshot::channel::<()>();
        let server = tokio::spawn(serve_on(listener, ledger.clone(), async move {
            // Resolves on `stop` and when the sender is dropped with the stub.
            let _ = stopped.await;
        }));
        Ok(ProviderStub {
            addr,
            ledger,
            stop: Some(stop),
            server,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, without a trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues `fault` behind those already queued.
    pub fn inject(&self, fault: Fault) {
        self.ledger.lock().faults.push_back(fault);
    }

    pub fn set_fault_rate(&self, rate: FaultRate) -> Result<(), StubError> {
        self.ledger.lock().set_fault_rate(rate)
    }

    /// How long every new key is held in flight before it runs (on top of an injected delay).
    pub fn set_latency(&self, latency: Duration) {
        self.ledger.lock().latency = latency;
    }

    /// The delivered messages, in delivery order.
    pub fn messages(&self) -> Vec<Message> {
        self.ledger.lock().messages.clone()
    }

    /// Messages delivered under `key`: the stub keeps it at most 1, so a notification delivered
    /// twice shows up as two keys (count by body in [`ProviderStub::messages`]).
    pub fn effects_for(&self, key: &str) -> usize {
        let ledger = self.ledger.lock();
        ledger
            .messages
            .iter()
            .filter(|message| message.idempotency_key == key)
            .count()
    }

    pub fn stats(&self) -> Stats {
        self.ledger.lock().stats()
    }

    pub fn requests(&self) -> usize {
        self.stats().requests
    }

    pub fn replays(&self) -> usize {
        self.stats().replays
    }

    pub fn conflicts(&self) -> usize {
        self.stats().conflicts
    }

    pub fn mismatches(&self) -> usize {
        self.stats().mismatches
    }

    pub fn lookups(&self) -> usize {
        self.stats().lookups
    }

    pub fn in_flight(&self) -> usize {
        self.stats().in_flight
    }

    /// Stops accepting, lets open requests finish, and waits for the server to end.
    pub async fn stop(mut self) -> io::Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match (&mut self.server).await {
            Ok(result) => result,
            Err(e) => Err(io::Error::other(e)),
        }
    }
}

impl Drop for ProviderStub {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Runs a stub on `addr` until `shutdown` resolves (the stub as a process: `src/main.rs`).
pub async fn serve(
    addr: impl ToSocketAddrs,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "provider stub listening");
    serve_on(listener, Shared::default(), shutdown).await
}

async fn serve_on(
    listener: TcpListener,
    ledger: Shared,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let router = Router::new()
        .route("/v1/messages", post(send).get(messages))
        .route("/control/faults", post(inject_faults))
        .route("/control/fault_rate", post(set_fault_rate))
        .route("/control/latency", post(set_latency))
        .route("/control/stats", get(stats))
        .with_state(ledger);
    axum::serve(listener, router)
        .with_graceful_shutdown(shutdown)
        .await
}

/// An error answer, in the provider's shape `{"error": {"type", "message"}}`.
struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl ApiError {
    fn invalid_request(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
        }
    }

    fn idempotency(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind: "idempotency_error",
            message: message.into(),
        }
    }

    /// The same words whether or not the message went out: a client cannot tell.
    fn failed() -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "api_error",
            message: "An unknown error occurred while processing the request.".into(),
        }
    }

    fn body(&self) -> Value {
        json!({ "error": { "type": self.kind, "message": self.message } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

/// Parses a body here rather than with axum's `Json`, so that a bad one gets the provider's
/// error shape (and no `Content-Type` is demanded).
fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid_request(format!("Invalid JSON body: {e}")))
}

fn idempotency_key(headers: &HeaderMap) -> Result<String, ApiError> {
    let key = headers
        .get(IDEMPOTENCY_KEY)
        .and_then(|value| value.to_str().ok())
        .filter(|key| !key.is_empty())
        .ok_or_else(|| {
            ApiError::invalid_request("This endpoint requires an Idempotency-Key header.")
        })?;
    if key.len() > MAX_KEY_LEN {
        return Err(ApiError::invalid_request(format!(
            "Idempotency keys can be at most {MAX_KEY_LEN} characters long."
        )));
    }
    Ok(key.to_owned())
}

async fn send(
    State(ledger): State<Shared>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    ledger.lock().stats.requests += 1;
    let key = idempotency_key(&headers)?;
    let traceparent = (headers.get("traceparent"))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let params = parse::<Value>(&body)?;
    if !params.is_object() {
        return Err(ApiError::invalid_request("The body must be a JSON object."));
    }
    let (fault, latency) = {
        let mut guard = ledger.lock();
        let ledger = &mut *guard;
        match ledger.keys.get(&key) {
            Some(KeyState::InFlight) => {
                ledger.stats.conflicts += 1;
                return Err(ApiError::idempotency(
                    StatusCode::CONFLICT,
                    format!(
                        "Another request with this Idempotency-Key ({key}) is in progress; \
                         try again later."
                    ),
                ));
            }
            Some(KeyState::Done(saved)) if saved.params != params => {
                ledger.stats.mismatches += 1;
                return Err(ApiError::idempotency(
                    StatusCode::BAD_REQUEST,
                    "Keys for idempotent requests can only be used with the same parameters \
                     they were first used with.",
                ));
            }
            Some(KeyState::Done(saved)) => {
                ledger.stats.replays += 1;
                return Ok(saved.respond(true));
            }
            None => {
                ledger.keys.insert(key.clone(), KeyState::InFlight);
                (ledger.next_fault(), ledger.latency)
            }
        }
    };
    // Spawned, so that a client hanging up does not cancel the delivery (see the module docs).
    let call = Call {
        key: key.clone(),
        params,
        traceparent,
    };
    let run = tokio::spawn(run(ledger.clone(), call, fault, latency));
    run.await.map_err(|_| {
        // `run` cannot panic while it holds the key; should it anyway, free the key.
        ledger.lock().keys.remove(&key);
        ApiError::failed()
    })
}

/// Runs a new key's request and saves its answer.
/// A new key's request, as [`run`] delivers it.
struct Call {
    key: String,
    params: Value,
    traceparent: Option<String>,
}

async fn run(ledger: Shared, call: Call, fault: Option<Fault>, latency: Duration) -> Response {
    let Call {
        key,
        params,
        traceparent,
    } = call;
    let delay = match fault {
        Some(Fault::Delay(delay)) => latency + delay,
        _ => latency,
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut ledger = ledger.lock();
    let (status, body) = match fault {
        Some(Fault::FailBefore) => (StatusCode::INTERNAL_SERVER_ERROR, ApiError::failed().body()),
        Some(Fault::FailAfter) => {
            ledger.deliver(&key, &params, traceparent.as_deref());
            (StatusCode::INTERNAL_SERVER_ERROR, ApiError::failed().body())
        }
        Some(Fault::Delay(_)) | None => {
            let id = ledger.deliver(&key, &params, traceparent.as_deref());
            (StatusCode::OK, json!({ "id": id, "status": "sent" }))
        }
    };
    let saved = Saved {
        params,
        status,
        body,
    };
    let response = saved.respond(false);
    ledger.keys.insert(key, KeyState::Done(saved));
    response
}

#[derive(Deserialize)]
struct MessagesQuery {
    idempotency_key: Option<String>,
}

async fn messages(
    State(ledger): State<Shared>,
    Query(query): Query<MessagesQuery>,
) -> Result<Response, ApiError> {
    let mut ledger = ledger.lock();
    let Some(key) = query.idempotency_key else {
        return Ok(Json(&ledger.messages).into_response());
    };
    ledger.stats.lookups += 1;
    match ledger.messages.iter().find(|m| m.idempotency_key == key) {
        Some(message) => Ok(Json(message).into_response()),
        None => Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("No message was sent with idempotency key '{key}'."),
        }),
    }
}

async fn inject_faults(State(ledger): State<Shared>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let faults = parse::<Vec<Fault>>(&body)?;
    let mut ledger = ledger.lock();
    ledger.faults.extend(faults);
    Ok(Json(json!({ "queued": ledger.faults.len() })))
}

async fn set_fault_rate(
    State(ledger): State<Shared>,
    body: Bytes,
) -> Result<Json<FaultRate>, ApiError> {
    let rate = parse::<FaultRate>(&body)?;
    ledger
        .lock()
        .set_fault_rate(rate)
        .map_err(|e| ApiError::invalid_request(e.to_string()))?;
    Ok(Json(rate))
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Latency {
    delay_ms: u64,
}

async fn set_latency(State(ledger): State<Shared>, body: Bytes) -> Result<Json<Latency>, ApiError> {
    let latency = parse::<Latency>(&body)?;
    ledger.lock().latency = Duration::from_millis(latency.delay_ms);
    Ok(Json(latency))
}

async fn stats(State(ledger): State<Shared>) -> Json<Stats> {
    Json(ledger.lock().stats())
}
