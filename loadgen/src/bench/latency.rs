//! End-to-end latency at an offered rate, in steady state.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::worker::{resends_only, spec, Worker, PARTITIONS};
use super::BenchArgs;
use crate::produce::{Mix, Step};
use crate::{finish_stage, produce_stage, Session};

#[derive(Debug, Default, Serialize)]
pub(super) struct Percentiles {
    pub(super) p50: f64,
    pub(super) p99: f64,
    pub(super) p999: f64,
    /// Non-zero when the system clock was stepped during the phase (see loadgen's report):
    /// then the percentiles include records whose latency is off by that much.
    pub(super) clock_step_s: f64,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct LatencyAt {
    pub(super) at_500: Percentiles,
    pub(super) at_2000: Percentiles,
    /// The steady-state target for p99 at both rates (issue 17), and whether both met it.
    pub(super) p99_target: f64,
    pub(super) p99_target_met: bool,
}

/// p99 at 500 and at 2,000 msg/s, in steady state, in ms.
pub(super) const P99_TARGET_MS: f64 = 50.0;

/// One worker (batch strategy) running; loadgen offers 500/s, then 2,000/s.
pub(super) async fn latency(
    bin: &Path,
    args: &BenchArgs,
    each: Duration,
) -> anyhow::Result<(Percentiles, Percentiles, bool)> {
    let name = format!("bench-latency-{:06x}", fastrand::u32(..0xffffff));
    let mut s = spec(
        args,
        &name,
        PARTITIONS,
        Vec::new(),
        None,
        Mix {
            resend: 0.10,
            ..resends_only()
        },
    );
    let session = Session::open(&s).await?;
    let worker = Worker::start(bin, args, &name, "batch").await?;
    // Measure the steady state, not the group's first join.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut out = Vec::new();
    let mut ok = true;
    for rate in [500.0, 2000.0] {
        s.plan = vec![Step {
            rate: Some(rate),
            duration: each,
        }];
        s.report_dir = args.out.join(format!("{name}-{rate}"));
        let produced = produce_stage(&session, &s).await?;
        let r = finish_stage(&session, &s, &produced).await?;
        eprintln!(
            "   at {rate}/s: p50 {:.1} ms, p99 {:.1} ms, p99.9 {:.1} ms, verified: {}",
            r.latency_ms.p50, r.latency_ms.p99, r.latency_ms.p999, r.verified
        );
        ok &= r.verified;
        out.push(Percentiles {
            p50: r.latency_ms.p50,
            p99: r.latency_ms.p99,
            p999: r.latency_ms.p999,
            clock_step_s: r.clock_step_s,
        });
    }
    worker.stop().await?;
    let l2000 = out.pop().unwrap_or_default();
    let l500 = out.pop().unwrap_or_default();
    Ok((l500, l2000, ok))
}
