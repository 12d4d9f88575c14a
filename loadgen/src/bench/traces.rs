//! The tracing phase: what OpenTelemetry traces (`[tracing]`) cost the batch drain. Every
//! record carries a `traceparent` of its own (a new trace, sampled by its producer), and one
//! worker drains a pre-filled topic with tracing off, on at a sampling ratio of 0.1 and on at
//! 1.0, exporting to Jaeger (`scripts/stack.sh jaeger-up`, started here): msg/s and the worker's
//! CPU per message side by side. A batch holds messages of many traces, so its span is a root
//! sampled at the ratio, linked to up to 128 of its messages' contexts: at 1.0 every batch
//! exports a span with 128 links, at 0.1 about one batch in ten. Off, no header is parsed.
//!
//! Off and 0.1, the pair closest to production, each drain in two halves, one at each end of
//! the phase (off, 0.1, 1.0, 0.1, off), counted together: a shared machine drifts within
//! minutes, and the halves put them in the same stretch of time.

use std::path::Path;
use std::process::Stdio;

use anyhow::Context;
use serde::Serialize;

use super::drain::{drain_opts, Drain, Opts};
use super::{ratio, BenchArgs};

#[derive(Debug, Default, Serialize)]
pub(super) struct TracingDrain {
    /// `off`, `0.1`, `1.0`.
    pub(super) tracing: String,
    pub(super) records: u64,
    pub(super) msg_s: f64,
    pub(super) cpu_us_per_msg: f64,
    /// Traces Jaeger holds for this run's service name after the worker stopped (it flushes
    /// on a graceful stop): what was exported.
    pub(super) traces_in_jaeger: u64,
    pub(super) verified: bool,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct Tracing {
    /// Payments of each drain (10% resends on top); off's and 0.1's in two halves.
    pub(super) events: u64,
    pub(super) runs: Vec<TracingDrain>,
    /// msg/s on at 0.1 and on at 1.0 over off.
    pub(super) on_10_vs_off_msg_s: f64,
    pub(super) on_100_vs_off_msg_s: f64,
    /// Worker CPU per message on at 0.1 and on at 1.0 over off.
    pub(super) on_10_vs_off_cpu_per_msg: f64,
    pub(super) on_100_vs_off_cpu_per_msg: f64,
    pub(super) verified: bool,
}

/// The OTLP endpoint and the query URL of the stack's Jaeger, started if it is not running.
async fn jaeger() -> anyhow::Result<(String, String)> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/stack.sh");
    let out = tokio::process::Command::new("bash")
        .args([script, "jaeger-up"])
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("running scripts/stack.sh jaeger-up")?;
    anyhow::ensure!(out.status.success(), "scripts/stack.sh jaeger-up failed");
    let text = String::from_utf8(out.stdout)?;
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .map(str::to_string)
            .with_context(|| format!("scripts/stack.sh jaeger-up printed no {name}"))
    };
    Ok((value("JAEGER_OTLP_ENDPOINT")?, value("JAEGER_QUERY_URL")?))
}

/// Traces Jaeger holds for `service` (at most 100,000: its memory store's limit).
async fn traces_of(query: &str, service: &str) -> u64 {
    let url = format!("{query}/api/traces?service={service}&limit=100000&lookback=2h");
    let out = tokio::process::Command::new("curl")
        .args(["-fsS", "-m", "60", &url])
        .output()
        .await;
    let Ok(out) = out else { return 0 };
    serde_json::from_slice::<serde_json::Value>(&out.stdout)
        .ok()
        .and_then(|v| v["data"].as_array().map(|a| a.len() as u64))
        .unwrap_or(0)
}

async fn one(
    bin: &Path,
    args: &BenchArgs,
    events: u64,
    ratio: Option<f64>,
    jaeger: &(String, String),
) -> anyhow::Result<(Drain, u64)> {
    let service = format!("bench-tracing-{:06x}", fastrand::u32(..0xffffff));
    let extra = match ratio {
        None => String::new(),
        Some(r) => format!(
            "[tracing]\nenabled = true\notlp_endpoint = \"{}\"\nsampling_ratio = {r:.1}\n\
             service_name = \"{service}\"\n",
            jaeger.0
        ),
    };
    let opts = Opts {
        traced: true,
        worker_extra: &extra,
        ..Opts::default()
    };
    let d = drain_opts(bin, args, "batch", events, 0, 1, &opts).await?.0;
    let traces = match ratio {
        None => 0,
        Some(_) => traces_of(&jaeger.1, &service).await,
    };
    Ok((d, traces))
}

pub(super) async fn tracing(bin: &Path, args: &BenchArgs, events: u64) -> anyhow::Result<Tracing> {
    let jaeger = jaeger().await?;
    let half = events / 2;
    let off_1 = one(bin, args, half, None, &jaeger).await?;
    let ten_1 = one(bin, args, half, Some(0.1), &jaeger).await?;
    let all = one(bin, args, events, Some(1.0), &jaeger).await?;
    let ten_2 = one(bin, args, events - half, Some(0.1), &jaeger).await?;
    let off_2 = one(bin, args, events - half, None, &jaeger).await?;
    let runs = [
        ("off", Drain::combine(&off_1.0, &off_2.0), 0),
        ("0.1", Drain::combine(&ten_1.0, &ten_2.0), ten_1.1 + ten_2.1),
        ("1.0", all.0, all.1),
    ];
    let mut out = Tracing {
        events,
        verified: true,
        ..Tracing::default()
    };
    for (label, d, traces) in runs {
        eprintln!(
            "   tracing {label:<4} {:>8.0} msg/s, worker CPU {:>6.1} µs/msg, {traces} traces in Jaeger{}",
            d.msg_s,
            d.cpu_us_per_msg,
            if d.verified { "" } else { ", NOT verified" }
        );
        out.verified &= d.verified;
        out.runs.push(TracingDrain {
            tracing: label.to_string(),
            records: d.records,
            msg_s: d.msg_s.round(),
            cpu_us_per_msg: d.cpu_us_per_msg,
            traces_in_jaeger: traces,
            verified: d.verified,
        });
    }
    let (off, ten, hundred) = (&out.runs[0], &out.runs[1], &out.runs[2]);
    out.on_10_vs_off_msg_s = ratio(ten.msg_s, off.msg_s);
    out.on_100_vs_off_msg_s = ratio(hundred.msg_s, off.msg_s);
    out.on_10_vs_off_cpu_per_msg = ratio(ten.cpu_us_per_msg, off.cpu_us_per_msg);
    out.on_100_vs_off_cpu_per_msg = ratio(hundred.cpu_us_per_msg, off.cpu_us_per_msg);
    eprintln!(
        "   against off: 0.1 has {:.2} of the msg/s and {:.2} of the CPU per message, 1.0 has \
         {:.2} and {:.2}",
        out.on_10_vs_off_msg_s,
        out.on_10_vs_off_cpu_per_msg,
        out.on_100_vs_off_msg_s,
        out.on_100_vs_off_cpu_per_msg
    );
    Ok(out)
}
