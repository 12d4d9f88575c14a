//! OpenTelemetry traces (`[tracing]`): one span per batch transaction, per inbox round, per
//! relayed outbox row and per notification call, exported with OTLP over HTTP/protobuf.
//!
//! One check guards all of it: [`enabled`], a single atomic load of the process's tracer. Off
//! (the default), no `traceparent` header is parsed, no span is made and no statement is added
//! to a transaction; the callers ask for a span with an iterator of the batch's contexts, which
//! is never run when tracing is off.
//!
//! The spans are made with the OpenTelemetry API itself, not through `tracing-opentelemetry`: a
//! batch span has an explicit parent (or none) and up to [`MAX_LINKS`] links chosen by the rule
//! in [`spans`], which the bridge's `tracing` spans cannot say; and the engine's `tracing` spans
//! and events stay what they are, logs, costing nothing more when traces are on.
//!
//! The exporter's batch span processor runs on a thread of its own (its queue holds 2,048
//! spans; beyond that spans are dropped, never waited for). [`flush`] pushes out what it holds:
//! `run`, `relay` and `send` call it as they stop, so a graceful stop loses no span.

pub mod context;
mod export;
pub mod spans;

use std::sync::OnceLock;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

use crate::config::TracingConfig;

pub use spans::{Counts, Publish, Tx};

/// A batch span links to at most this many messages' contexts (the SDK's default limit of
/// links per span); the count of all of them is an attribute.
pub const MAX_LINKS: usize = 128;

/// Which program the spans come from: its `service.name` suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// `effectively run`: the consumers and their inbox processors.
    Worker,
    /// `effectively relay`.
    Relay,
    /// `effectively send`.
    Sender,
}

struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

static TRACING: OnceLock<Tracing> = OnceLock::new();

/// Whether this process traces. The one check every caller makes before any tracing work.
#[inline]
pub fn enabled() -> bool {
    TRACING.get().is_some()
}

fn tracer() -> Option<&'static SdkTracer> {
    TRACING.get().map(|t| &t.tracer)
}

#[derive(Debug, thiserror::Error)]
#[error("tracing: cannot build the OTLP exporter: {0}")]
pub struct TelemetryError(String);

/// Starts tracing for this process as `config` says (nothing when `enabled = false`). The first
/// call that installs wins: a process that runs a worker, a relay and a sender (the tests do)
/// exports them all under the first one's service name.
pub fn install(config: &TracingConfig, component: Component) -> Result<(), TelemetryError> {
    if !config.enabled || enabled() {
        return Ok(());
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(export::Client::new(
            config.export_timeout,
            config.traces_url(),
        ))
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(config.traces_url())
        .with_timeout(config.export_timeout)
        .build()
        .map_err(|e| TelemetryError(e.to_string()))?;
    let service = match component {
        Component::Worker => config.service_name.clone(),
        Component::Relay => format!("{}-relay", config.service_name),
        Component::Sender => format!("{}-sender", config.service_name),
    };
    let resource = Resource::builder()
        .with_service_name(service.clone())
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    let ratio = config.sampling_ratio.0;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            ratio,
        ))))
        .with_resource(resource)
        .build();
    let tracer = provider.tracer("effectively");
    match TRACING.set(Tracing { provider, tracer }) {
        Ok(()) => tracing::info!(service = %service, endpoint = %config.traces_url(), ratio,
            "tracing: exporting spans with OTLP"),
        // Another task installed first: this provider was never used; its thread stops.
        Err(lost) => {
            let _ = std::thread::spawn(move || lost.provider.shutdown());
        }
    }
    Ok(())
}

/// Exports the spans the processor holds, waiting for the collector's answer (at most the
/// export timeout). Off the async threads: the processor's own thread does the export.
pub async fn flush() {
    let Some(t) = TRACING.get() else { return };
    let provider = t.provider.clone();
    match tokio::task::spawn_blocking(move || provider.force_flush()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "tracing: flushing spans failed"),
        Err(e) => tracing::warn!(error = %e, "tracing: flushing spans failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_installs_nothing() {
        install(&TracingConfig::default(), Component::Worker).unwrap();
        assert!(!enabled());
    }
}
