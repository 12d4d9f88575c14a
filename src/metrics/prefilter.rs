//! The Redis pre-filter's series of one consumer ([`crate::prefilter`]), and its round trips' label.

use std::time::Duration;

use metrics::{counter, histogram, Counter};

use super::*;

/// A pre-filter round trip to Redis, or what failed ([`crate::prefilter`]), for the metrics and the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefilterOp {
    Lookup,
    Set,
    Connect,
}

impl PrefilterOp {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefilterOp::Lookup => "lookup",
            PrefilterOp::Set => "set",
            PrefilterOp::Connect => "connect",
        }
    }
}

/// The pre-filter's series of one consumer, resolved once (every batch moves them).
pub struct PrefilterMetrics {
    hit: Counter,
    miss: Counter,
    error: Counter,
    set_ok: Counter,
    set_error: Counter,
    lookup_seconds: metrics::Histogram,
    set_seconds: metrics::Histogram,
    consumer: String,
}

impl PrefilterMetrics {
    /// Publishes every series at 0, so that rate() and increase() see the first event.
    pub fn new(consumer: &str) -> Self {
        let c = consumer.to_string();
        let lookups =
            |r: &'static str| counter!(PREFILTER_LOOKUPS, "consumer" => c.clone(), "result" => r);
        let sets =
            |r: &'static str| counter!(PREFILTER_SETS, "consumer" => c.clone(), "result" => r);
        let m = PrefilterMetrics {
            hit: lookups("hit"),
            miss: lookups("miss"),
            error: lookups("error"),
            set_ok: sets("ok"),
            set_error: sets("error"),
            lookup_seconds: histogram!(PREFILTER_DURATION, "consumer" => c.clone(), "op" => "lookup"),
            set_seconds: histogram!(PREFILTER_DURATION, "consumer" => c.clone(), "op" => "set"),
            consumer: c,
        };
        for counter in [&m.hit, &m.miss, &m.error, &m.set_ok, &m.set_error] {
            counter.increment(0);
        }
        for op in ["lookup", "set", "connect"] {
            for kind in ["timeout", "error"] {
                counter!(PREFILTER_ERRORS, "consumer" => m.consumer.clone(), "op" => op, "kind" => kind)
                    .increment(0);
            }
        }
        m
    }

    pub fn looked_up(&self, hits: u64, misses: u64) {
        self.hit.increment(hits);
        self.miss.increment(misses);
    }

    /// Keys that went to PostgreSQL without an answer from Redis.
    pub fn fell_through(&self, keys: u64) {
        self.error.increment(keys);
    }

    pub fn set(&self, keys: u64) {
        self.set_ok.increment(keys);
    }

    pub fn not_set(&self, keys: u64) {
        self.set_error.increment(keys);
    }

    pub fn round_trip(&self, op: PrefilterOp, took: Duration) {
        match op {
            PrefilterOp::Lookup => self.lookup_seconds.record(took.as_secs_f64()),
            PrefilterOp::Set => self.set_seconds.record(took.as_secs_f64()),
            PrefilterOp::Connect => {}
        }
    }

    pub fn failed(&self, op: PrefilterOp, timeout: bool) {
        let kind = if timeout { "timeout" } else { "error" };
        counter!(PREFILTER_ERRORS, "consumer" => self.consumer.clone(), "op" => op.as_str(), "kind" => kind)
            .increment(1);
    }
}
