//! What a run measured, as its [`Report`]: latency percentiles and per-second series from the
//! verifier's latencies, the rates offered and acknowledged, the verdict's counts and examples,
//! and how far the wall clock stepped.

use std::time::Instant;

use crate::produce::{self, Kind};
use crate::report::{self, LagPoint, LatencyPoint, RatePoint, Report};
use crate::verify;

/// Seconds the wall clock advanced since `wall` beyond what the monotonic clock did since
/// `mono` (both read at the run's start), to a tenth of a second.
pub fn clock_step(wall: chrono::DateTime<chrono::Utc>, mono: Instant) -> f64 {
    let step = (chrono::Utc::now() - wall).as_seconds_f64() - mono.elapsed().as_secs_f64();
    let tenths = (step * 10.0).round() / 10.0;
    // Not "-0.0" in the report for a few microseconds between the two readings.
    if tenths == 0.0 {
        0.0
    } else {
        tenths
    }
}

/// (a description, the mean offered rate) of a plan.
pub fn plan_summary(plan: &[produce::Step]) -> (String, f64) {
    let parts: Vec<String> = plan
        .iter()
        .map(|s| match s.rate {
            Some(r) => format!("{r}/s for {}", humantime::format_duration(s.duration)),
            None => format!("max for {}", humantime::format_duration(s.duration)),
        })
        .collect();
    let total: f64 = plan.iter().map(|s| s.duration.as_secs_f64()).sum();
    let rated: f64 = plan
        .iter()
        .filter_map(|s| s.rate.map(|r| r * s.duration.as_secs_f64()))
        .sum();
    (
        parts.join(" -> "),
        if total > 0.0 { rated / total } else { 0.0 },
    )
}

pub fn build_report(
    offered: &(String, f64),
    duration_s: f64,
    log: &[produce::Sent],
    expected: &verify::Expected,
    verdict: &verify::Verdict,
    latencies: &[(f64, f64)],
    lag: Vec<LagPoint>,
) -> Report {
    let pct = |h: &hdrhistogram::Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    // Per second of commit time.
    let mut per_second: std::collections::BTreeMap<i64, hdrhistogram::Histogram<u64>> =
        Default::default();
    for (t, ms) in latencies {
        per_second
            .entry(t.floor() as i64)
            .or_insert_with(latency_histogram)
            .saturating_record((ms * 1000.0) as u64);
    }
    let latency_series = per_second
        .iter()
        .map(|(t, h)| LatencyPoint {
            t_s: *t as f64,
            p50: pct(h, 0.5),
            p99: pct(h, 0.99),
            p999: pct(h, 0.999),
            max: h.max() as f64 / 1000.0,
        })
        .collect();
    let throughput = per_second
        .iter()
        .map(|(t, h)| RatePoint {
            t_s: *t as f64,
            per_s: h.len() as f64,
        })
        .collect();
    let mut acked_per_s: std::collections::BTreeMap<i64, u64> = Default::default();
    for s in log.iter().filter(|s| s.acked) {
        *acked_per_s.entry(s.acked_at_s.floor() as i64).or_default() += 1;
    }
    let produced = acked_per_s
        .iter()
        .map(|(t, n)| RatePoint {
            t_s: *t as f64,
            per_s: *n as f64,
        })
        .collect();
    let span = match (
        latencies.iter().map(|l| l.0).reduce(f64::min),
        latencies.iter().map(|l| l.0).reduce(f64::max),
    ) {
        (Some(a), Some(b)) => (b - a).max(1e-3),
        _ => 0.0,
    };
    let first20 = |v: &[String]| v.iter().take(20).cloned().collect::<Vec<_>>();
    let ms: Vec<f64> = latencies.iter().map(|l| l.1).collect();
    Report {
        offered_rate: offered.1,
        rate_plan: offered.0.clone(),
        duration_s,
        sent: log.len() as u64,
        acked: log.iter().filter(|s| s.acked).count() as u64,
        unique_events: expected.payments.len() as u64,
        duplicates_sent: report::DuplicatesSent {
            resend: verify::count_kind(log, Kind::Resend),
            redrive: verify::count_kind(log, Kind::Redrive),
            double_tap: verify::count_kind(log, Kind::DoubleTap),
        },
        poison_sent: expected.poison,
        effects: verdict.effects,
        lost: verdict.lost.len() as u64,
        duplicated: verdict.duplicated.len() as u64,
        unexpected: verdict.unexpected.len() as u64,
        parked: verdict.parked,
        wallet_mismatches: verdict.wallet_mismatches.len() as u64,
        throughput_msg_s: if span > 0.0 {
            latencies.len() as f64 / span
        } else {
            0.0
        },
        commit_span_s: span,
        latency_ms: latency_of(latencies.iter().map(|l| l.1)),
        clock_step_s: 0.0,
        verified: verdict.verified,
        anomalies: report::Anomalies {
            lost: first20(&verdict.lost),
            duplicated: first20(&verdict.duplicated),
            unexpected: first20(&verdict.unexpected),
            wallets: first20(&verdict.wallet_mismatches),
            parked_not_poison: first20(&verdict.parked_not_poison),
        },
        partitions: Vec::new(),
        series: report::Series {
            latency: latency_series,
            histogram: report::histogram_buckets(&ms),
            throughput,
            produced,
            lag,
        },
    }
}

/// The percentiles of latencies in ms, as every report counts them (microseconds, 3
/// significant digits).
pub fn latency_of(ms: impl IntoIterator<Item = f64>) -> report::Latency {
    let mut hist = latency_histogram();
    for ms in ms {
        hist.saturating_record((ms * 1000.0) as u64);
    }
    let pct = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
    report::Latency {
        p50: pct(0.5),
        p90: pct(0.9),
        p99: pct(0.99),
        p999: pct(0.999),
        max: hist.max() as f64 / 1000.0,
    }
}

/// Microseconds from 1 µs to an hour, 3 significant digits. Fixed bounds: an auto-resizing
/// histogram's `saturating_record` saturates at its initial tiny bound instead of growing.
fn latency_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wall_clock_ahead_of_the_monotonic_one_is_a_step() {
        let (wall, mono) = (chrono::Utc::now(), Instant::now());
        assert_eq!(clock_step(wall, mono).to_string(), "0");
        let stepped = wall - chrono::Duration::seconds(58);
        assert_eq!(clock_step(stepped, mono), 58.0);
    }
}
