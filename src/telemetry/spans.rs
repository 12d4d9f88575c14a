//! The spans the engine makes, and the rule that ties a transaction to its messages' traces.
//!
//! **A transaction's parent and links.** A batch transaction applies many messages, each maybe
//! with its own producer's trace, so it has many parents (OpenTelemetry's messaging
//! conventions for batch processing):
//! - it links to the context of every message that carries a sampled one (at most
//!   [`super::MAX_LINKS`]; `effectively.messages_with_context` counts them all);
//! - when every message that carries a context is in one trace (a batch of one message, or a
//!   producer that put its whole burst in one trace), the span is also a *child* of that
//!   context, so the trace runs on from the producer through the engine;
//! - otherwise it is the root of a trace of its own, sampled by `sampling_ratio`.
//!
//! A child follows its parent's sampling decision (`ParentBased`): an unsampled producer's
//! message gives an unsampled transaction span, and the outbox rows that transaction writes
//! carry the unsampled context on, so nothing downstream samples it either.

use std::borrow::Cow;
use std::time::{Instant, SystemTime};

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanKind, Status, TraceContextExt as _, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::Span;

use super::context;

/// What a transaction amounted to, for its span's attributes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub records: u64,
    pub fresh: u64,
    pub effects: u64,
    pub duplicates: u64,
    pub parked: u64,
    pub skipped: u64,
    /// Rows that failed and wait for a retry (an inbox round).
    pub retried: u64,
}

/// Where a transaction's messages come from.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    pub consumer: &'a str,
    pub topic: &'a str,
    /// `None`: several partitions (a commit group, an inbox round).
    pub partition: Option<i32>,
    /// `batch`, `per-message`, `inbox` (the receiver), `inbox-processor`.
    pub strategy: &'static str,
    /// A commit group's transaction: how many partitions' batches it holds.
    pub group: Option<usize>,
}

/// The parent and links of a transaction span, by the rule in the module docs.
#[derive(Debug, Default)]
pub(crate) struct Relations {
    pub parent: Option<SpanContext>,
    pub links: Vec<Link>,
    /// Messages that carried a valid context.
    pub with_context: usize,
}

pub(crate) fn relations(contexts: impl IntoIterator<Item = SpanContext>) -> Relations {
    let mut r = Relations::default();
    let mut one_trace = true;
    for cx in contexts {
        r.with_context += 1;
        match &r.parent {
            None if r.with_context == 1 => r.parent = Some(cx.clone()),
            Some(p) if p.trace_id() != cx.trace_id() => one_trace = false,
            _ => {}
        }
        if cx.is_sampled() && r.links.len() < super::MAX_LINKS {
            r.links.push(Link::with_context(cx));
        }
    }
    if !one_trace {
        r.parent = None;
    }
    r
}

/// A span over one transaction: a batch's (or a segment's, or one message's), a commit
/// group's, an inbox round's. Ends when dropped, if [`Tx::end`] or [`Tx::fail`] did not.
pub struct Tx {
    span: Span,
    /// The span's start on both clocks, so a stage measured with `Instant`s gets its time.
    at: (SystemTime, Instant),
}

impl Tx {
    /// `None` when tracing is off: then `contexts` is never iterated (no header is parsed).
    pub fn start<I>(name: &str, source: Source<'_>, records: usize, contexts: I) -> Option<Tx>
    where
        I: IntoIterator<Item = SpanContext>,
    {
        let tracer = super::tracer()?;
        let rel = relations(contexts);
        let parent = match rel.parent {
            Some(p) => Context::new().with_remote_span_context(p),
            None => Context::new(),
        };
        let mut attributes = vec![
            KeyValue::new("messaging.system", "kafka"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", source.topic.to_string()),
            KeyValue::new("messaging.consumer.group.name", source.consumer.to_string()),
            KeyValue::new("messaging.batch.message_count", records as i64),
            KeyValue::new("effectively.strategy", source.strategy),
            KeyValue::new("effectively.messages_with_context", rel.with_context as i64),
        ];
        if let Some(p) = source.partition {
            attributes.push(KeyValue::new(
                "messaging.destination.partition.id",
                p.to_string(),
            ));
        }
        if let Some(n) = source.group {
            attributes.push(KeyValue::new("effectively.commit_group", n as i64));
        }
        let builder = tracer
            .span_builder(format!("{name} {}", source.topic))
            .with_kind(SpanKind::Consumer)
            .with_links(rel.links)
            .with_attributes(attributes);
        Some(Tx {
            span: tracer.build_with_context(builder, &parent),
            at: (SystemTime::now(), Instant::now()),
        })
    }

    pub fn context(&self) -> &SpanContext {
        self.span.span_context()
    }

    /// `traceparent` and `tracestate` of this span, for the rows its transaction writes.
    pub fn carrier(&self) -> (String, Option<String>) {
        context::format(self.context())
    }

    /// A stage of the transaction (`fence`, `stage`, `dedupe`, `effect`, `commit`), as an event
    /// at its end with its duration. Nothing when the span is not sampled.
    pub fn stage(&mut self, name: &'static str, from: Instant, to: Instant) {
        if !self.span.is_recording() {
            return;
        }
        let when = self.at.0 + to.saturating_duration_since(self.at.1);
        let ms = to.saturating_duration_since(from).as_secs_f64() * 1e3;
        self.span.add_event_with_timestamp(
            Cow::Borrowed(name),
            when,
            vec![KeyValue::new("duration_ms", ms)],
        );
    }

    /// Committed: the outcome as attributes, and the span ends.
    pub fn end(mut self, c: Counts) {
        if self.span.is_recording() {
            self.span.set_attributes([
                KeyValue::new("effectively.records", c.records as i64),
                KeyValue::new("effectively.fresh", c.fresh as i64),
                KeyValue::new("effectively.effects", c.effects as i64),
                KeyValue::new("effectively.duplicates", c.duplicates as i64),
                KeyValue::new("effectively.parked", c.parked as i64),
                KeyValue::new("effectively.skipped", c.skipped as i64),
            ]);
            if c.retried > 0 {
                self.span
                    .set_attribute(KeyValue::new("effectively.retried", c.retried as i64));
            }
        }
        self.span.end();
    }

    /// Rolled back (or refused by the fence): the reason as the span's error.
    pub fn fail(mut self, error: &str) {
        self.span.set_status(Status::error(error.to_string()));
        self.span.end();
    }
}

/// A span of one outgoing call made for one row, child of the context the row keeps: the
/// relay's publish of an outbox row, the sender's HTTP request for a notification.
pub struct Publish {
    span: Span,
}

impl Publish {
    /// The relay's span for an outbox row published to `topic`: only for a row whose context is
    /// sampled (and tracing on).
    pub fn send(
        topic: &str,
        parent: &SpanContext,
        attrs: &[(&'static str, &str)],
    ) -> Option<Publish> {
        Publish::child(
            format!("send {topic}"),
            SpanKind::Producer,
            parent,
            [
                KeyValue::new("messaging.system", "kafka"),
                KeyValue::new("messaging.operation.type", "send"),
                KeyValue::new("messaging.destination.name", topic.to_string()),
            ],
            attrs,
        )
    }

    /// The sender's span for one HTTP request of a notification.
    pub fn http(
        method: &'static str,
        parent: &SpanContext,
        attrs: &[(&'static str, &str)],
    ) -> Option<Publish> {
        Publish::child(
            method.to_string(),
            SpanKind::Client,
            parent,
            [KeyValue::new("http.request.method", method)],
            attrs,
        )
    }

    fn child<const N: usize>(
        name: String,
        kind: SpanKind,
        parent: &SpanContext,
        fixed: [KeyValue; N],
        attrs: &[(&'static str, &str)],
    ) -> Option<Publish> {
        let tracer = super::tracer()?;
        if !parent.is_sampled() {
            return None;
        }
        let mut attributes = fixed.to_vec();
        attributes.extend(attrs.iter().map(|(k, v)| KeyValue::new(*k, v.to_string())));
        let builder = tracer
            .span_builder(name)
            .with_kind(kind)
            .with_attributes(attributes);
        let parent = Context::new().with_remote_span_context(parent.clone());
        Some(Publish {
            span: tracer.build_with_context(builder, &parent),
        })
    }

    /// `traceparent` and `tracestate` of this span, for the record's headers or the request's.
    pub fn carrier(&self) -> (String, Option<String>) {
        context::format(self.span.span_context())
    }

    pub fn attribute(&mut self, key: &'static str, value: i64) {
        self.span.set_attribute(KeyValue::new(key, value));
    }

    /// Ends the span, as an error with `error`'s text if there is one.
    pub fn end(mut self, error: Option<&str>) {
        if let Some(e) = error {
            self.span.set_status(Status::error(e.to_string()));
        }
        self.span.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};

    fn cx(trace: u128, span: u64, sampled: bool) -> SpanContext {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        SpanContext::new(
            TraceId::from(trace),
            SpanId::from(span),
            flags,
            true,
            TraceState::default(),
        )
    }

    #[test]
    fn one_trace_makes_a_child_with_a_link() {
        let r = relations([cx(7, 1, true)]);
        assert_eq!(r.parent.unwrap().span_id(), SpanId::from(1u64));
        assert_eq!(r.links.len(), 1);
        assert_eq!(r.with_context, 1);
        // Several messages of one trace: child of the first, a link to each.
        let r = relations([cx(7, 1, true), cx(7, 2, true)]);
        assert_eq!(r.parent.unwrap().span_id(), SpanId::from(1u64));
        assert_eq!(r.links.len(), 2);
    }

    #[test]
    fn several_traces_make_a_root_with_links_to_the_sampled_ones() {
        let r = relations([cx(7, 1, true), cx(8, 2, false), cx(9, 3, true)]);
        assert!(r.parent.is_none());
        assert_eq!(r.with_context, 3);
        assert_eq!(r.links.len(), 2, "the unsampled one is counted, not linked");
    }

    #[test]
    fn no_context_is_a_root_without_links_and_links_are_capped() {
        let r = relations([]);
        assert!(r.parent.is_none() && r.links.is_empty() && r.with_context == 0);
        let many = (0..1000u64).map(|i| cx(u128::from(i) + 1, i + 1, true));
        let r = relations(many);
        assert_eq!(r.links.len(), crate::telemetry::MAX_LINKS);
        assert_eq!(r.with_context, 1000);
        // An unsampled lone parent: a child (which the sampler will not sample), no link.
        let r = relations([cx(7, 1, false)]);
        assert!(r.parent.is_some() && r.links.is_empty());
    }

    #[test]
    fn off_makes_no_span_and_reads_no_context() {
        assert!(!crate::telemetry::enabled());
        let source = Source {
            consumer: "c",
            topic: "t",
            partition: Some(0),
            strategy: "batch",
            group: None,
        };
        let never = std::iter::from_fn(|| -> Option<SpanContext> {
            panic!("a context was read while tracing is off")
        });
        assert!(Tx::start("process", source, 1, never).is_none());
        assert!(Publish::send("t", &cx(7, 1, true), &[]).is_none());
    }
}
