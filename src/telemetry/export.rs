//! The OTLP/HTTP exporter's client: the engine's own reqwest (0.12, rustls), not the
//! exporter's built-in one (reqwest 0.13: a second HTTP client in the binary).
//!
//! The SDK's batch span processor exports from a thread of its own, blocking on each export,
//! so the blocking client fits: no tokio runtime is involved, and an export never waits for (or
//! holds up) a partition task. The client is built on that thread at its first export: a
//! blocking reqwest client must not be created or dropped inside an async context.
//!
//! A failed export is logged here, at most once a minute: the SDK reports its own errors only
//! through its `internal-logs` feature, which would log every span processor event.

use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

#[derive(Debug)]
pub(super) struct Client {
    timeout: Duration,
    inner: OnceLock<Result<reqwest::blocking::Client, String>>,
    /// When a failed export was last logged.
    warned: Mutex<Option<Instant>>,
    url: String,
}

impl Client {
    pub(super) fn new(timeout: Duration, url: String) -> Client {
        Client {
            timeout,
            inner: OnceLock::new(),
            warned: Mutex::new(None),
            url,
        }
    }

    /// Logs a failed export, unless one was logged less than a minute ago.
    fn failed(&self, why: &str) {
        let mut last = self.warned.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
            *last = Some(Instant::now());
            tracing::warn!(endpoint = %self.url, error = why,
                "tracing: exporting spans failed; they are dropped (logged at most once a minute)");
        }
    }
}

#[async_trait]
impl HttpClient for Client {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let client = self.inner.get_or_init(|| {
            reqwest::blocking::Client::builder()
                .timeout(self.timeout)
                .build()
                .map_err(|e| format!("cannot build the OTLP HTTP client: {e}"))
        });
        let client = client.as_ref().map_err(|e| HttpError::from(e.clone()))?;
        let response = match client.execute(request.try_into()?) {
            Ok(r) => r,
            Err(e) => {
                self.failed(&e.to_string());
                return Err(e.into());
            }
        };
        if !response.status().is_success() {
            self.failed(&format!("the collector answered {}", response.status()));
        }
        let mut out = Response::builder().status(response.status().as_u16());
        for (k, v) in response.headers() {
            out = out.header(k.as_str(), v.as_bytes());
        }
        Ok(out.body(response.bytes()?)?)
    }
}
