//! The OTLP/HTTP exporter's client: the engine's own reqwest (0.12, rustls), not the
//! exporter's built-in one (reqwest 0.13: a second HTTP client in the binary).
//!
//! The SDK's batch span processor exports from a thread of its own, blocking on each export,
//! so the blocking client fits: no tokio runtime is involved, and an export never waits for (or
//! holds up) a partition task. The client is built on that thread at its first export: a
//! blocking reqwest client must not be created or dropped inside an async context.

use std::sync::OnceLock;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError, Request, Response};

#[derive(Debug)]
pub(super) struct Client {
    timeout: Duration,
    inner: OnceLock<Result<reqwest::blocking::Client, String>>,
}

impl Client {
    pub(super) fn new(timeout: Duration) -> Client {
        Client {
            timeout,
            inner: OnceLock::new(),
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
        let response = client.execute(request.try_into()?)?;
        let mut out = Response::builder().status(response.status().as_u16());
        for (k, v) in response.headers() {
            out = out.header(k.as_str(), v.as_bytes());
        }
        Ok(out.body(response.bytes()?)?)
    }
}
