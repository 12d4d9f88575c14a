//! The monitoring endpoint of `effectively run`, `relay` and `send`, on `--metrics-addr`:
//!
//! - `GET /metrics`: the Prometheus text exposition of [`crate::metrics`].
//! - `GET /healthz`: liveness, 200 or 503 with a plain-text body naming the stale or ended
//!   loops ([`Health::liveness`]).
//! - `GET /readyz`: readiness, 200 or 503 with a plain-text body naming each condition that
//!   fails ([`Health::readiness`]).
//!
//! A small axum server rather than the exporter's own listener, which serves only the metrics.
//! It runs on the runtime that started it until that runtime ends, as the exporter's listener
//! did: a test that stops its worker can still scrape the counters it left.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use crate::health::{Health, Verdict};
use crate::metrics::{self, MetricsError};

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    #[error("monitoring endpoint on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

#[derive(Clone)]
struct Served {
    health: Arc<Health>,
    metrics: &'static metrics_exporter_prometheus::PrometheusHandle,
}

/// Binds `addr` and serves `/metrics`, `/healthz` and `/readyz` for `health` on the current
/// runtime. Returns the bound address (`addr` may ask for port 0). Installs the process's
/// metrics recorder if nothing did yet.
pub fn serve(addr: SocketAddr, health: Arc<Health>) -> Result<SocketAddr, EndpointError> {
    let metrics = metrics::recorder()?;
    // Bound here, synchronously, so that an address in use is the caller's error to report.
    let listener = std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(tokio::net::TcpListener::from_std)
        .map_err(|source| EndpointError::Bind { addr, source })?;
    let bound = listener
        .local_addr()
        .map_err(|source| EndpointError::Bind { addr, source })?;
    let app = Router::new()
        .route("/metrics", get(scrape))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(Served { health, metrics });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "monitoring endpoint stopped");
        }
    });
    tracing::info!(addr = %bound, "monitoring endpoint listening on /metrics, /healthz, /readyz");
    Ok(bound)
}

async fn scrape(State(s): State<Served>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
        .into_response()
}

async fn healthz(State(s): State<Served>) -> Response {
    answer(s.health.liveness())
}

async fn readyz(State(s): State<Served>) -> Response {
    answer(s.health.readiness())
}

fn answer(v: Verdict) -> Response {
    let status = match v.ok {
        true => StatusCode::OK,
        false => StatusCode::SERVICE_UNAVAILABLE,
    };
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        v.text,
    )
        .into_response()
}
