//! The registry formats' cost (`formats`): one batch worker draining the same kind and size of
//! pre-filled topic (6 partitions, 10% resends; 100,000 payments, 50,000 at quick scale) in JSON, then Avro, Protobuf and JSON Schema in
//! the Confluent wire format (loadgen --format, the consumer's `[consumer.payload]`), one
//! after the other: msg/s and the worker's CPU per message side by side, and each against JSON.
//! What differs between the runs is the decode (a schema fetched once per id, then the bytes
//! turned into the same JSON payment), so the difference is its cost. Each run is verified
//! exactly-once like the demo.
//!
//! The registry: `SCHEMA_REGISTRY_URL` if it answers, else the stack's (`scripts/stack.sh
//! registry-up`, started if it is not running).

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use schema_registry_converter::async_impl::schema_registry::{get_all_subjects, SrSettings};
use serde::Serialize;

use super::worker::{resends_only, spec, Worker, PARTITIONS};
use super::{ratio, round1, BenchArgs};
use crate::produce::wire::Format;
use crate::produce::Step;
use crate::{finish_stage, produce_stage, Session};

/// One format's drain.
#[derive(Debug, Default, Serialize)]
pub(super) struct FormatRun {
    pub(super) format: String,
    pub(super) records: u64,
    /// Records per second, first to last commit.
    pub(super) msg_s: f64,
    /// The worker's CPU time (user and system) per record.
    pub(super) cpu_us_per_msg: f64,
    pub(super) rss_mb_peak: f64,
    /// Each record's bytes on the wire, on average (the payload only).
    pub(super) payload_bytes: f64,
    pub(super) verified: bool,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct Formats {
    pub(super) runs: Vec<FormatRun>,
    /// Each registry format's msg/s over JSON's.
    pub(super) msg_s_vs_json: std::collections::BTreeMap<String, f64>,
    /// Each registry format's worker CPU per message over JSON's.
    pub(super) cpu_vs_json: std::collections::BTreeMap<String, f64>,
    pub(super) registry: String,
}

impl Formats {
    pub(super) fn verified(&self) -> bool {
        !self.runs.is_empty() && self.runs.iter().all(|r| r.verified)
    }
}

pub(super) async fn formats(bin: &Path, args: &BenchArgs, events: u64) -> anyhow::Result<Formats> {
    let registry = registry().await?;
    let mut out = Formats {
        registry: registry.clone(),
        ..Formats::default()
    };
    for format in [
        Format::Json,
        Format::Avro,
        Format::Protobuf,
        Format::JsonSchema,
    ] {
        let run = drain(bin, args, format, &registry, events).await?;
        eprintln!(
            "   {:<11} {:.0} msg/s, {:.1} µs CPU/msg, {:.0} payload bytes/msg, verified: {}",
            run.format, run.msg_s, run.cpu_us_per_msg, run.payload_bytes, run.verified
        );
        out.runs.push(run);
    }
    let json = &out.runs[0];
    for r in &out.runs[1..] {
        (out.msg_s_vs_json).insert(r.format.clone(), ratio(r.msg_s, json.msg_s));
        (out.cpu_vs_json).insert(
            r.format.clone(),
            ratio(r.cpu_us_per_msg, json.cpu_us_per_msg),
        );
    }
    eprintln!(
        "   against JSON: msg/s {:?}, CPU per message {:?}",
        out.msg_s_vs_json, out.cpu_vs_json
    );
    Ok(out)
}

/// Pre-fills a topic in `format`, then one batch worker drains it.
async fn drain(
    bin: &Path,
    args: &BenchArgs,
    format: Format,
    registry: &str,
    events: u64,
) -> anyhow::Result<FormatRun> {
    let name = format!("bench-{}-{:06x}", format.name(), fastrand::u32(..0xffffff));
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let spec = spec(args, &name, PARTITIONS, plan, Some(events), resends_only());
    let session = Session::open(&spec).await?;
    let session = session.in_format(format, Some(registry), &name).await?;
    let produced = produce_stage(&session, &spec).await?;
    let records = produced.acked();
    let payload_bytes = payload_bytes(&session.brokers, &name).await;
    let extra = match format {
        Format::Json => String::new(),
        _ => format!(
            "[consumer.payload]\nformat = \"{}\"\nregistry = \"{registry}\"\n",
            format.name()
        ),
    };
    let worker = Worker::start_on(bin, args, &name, &name, "batch", &extra, &name).await?;
    let report = finish_stage(&session, &spec, &produced).await?;
    let (rss_mb, cpu_s) = worker.usage();
    worker.stop().await?;
    let span = if report.commit_span_s > 0.0 {
        report.commit_span_s
    } else {
        f64::INFINITY
    };
    Ok(FormatRun {
        format: format.name().to_string(),
        records,
        msg_s: (records as f64 / span).round(),
        cpu_us_per_msg: round1(cpu_s * 1e6 / records.max(1) as f64),
        rss_mb_peak: round1(rss_mb),
        payload_bytes,
        verified: report.verified,
    })
}

/// The average payload size of the first 1,000 records of `topic`.
async fn payload_bytes(brokers: &str, topic: &str) -> f64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::Message;
    let consumer: BaseConsumer = match rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}-sizes"))
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .create()
    {
        Ok(c) => c,
        Err(_) => return 0.0,
    };
    if consumer.subscribe(&[topic]).is_err() {
        return 0.0;
    }
    let (mut n, mut bytes) = (0u64, 0u64);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while n < 1000 && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            n += 1;
            bytes += m.payload().map_or(0, |p| p.len() as u64);
        }
    }
    if n == 0 {
        0.0
    } else {
        round1(bytes as f64 / n as f64)
    }
}

/// `SCHEMA_REGISTRY_URL` if a registry answers there, else the stack's, started if need be.
async fn registry() -> anyhow::Result<String> {
    if let Ok(url) = std::env::var("SCHEMA_REGISTRY_URL") {
        let settings = SrSettings::new_builder(url.clone())
            .set_timeout(Duration::from_secs(5))
            .build()?;
        if get_all_subjects(&settings).await.is_ok() {
            return Ok(url);
        }
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/stack.sh");
    let out = tokio::process::Command::new("bash")
        .args([script, "registry-up"])
        .stderr(Stdio::inherit())
        .output()
        .await
        .context("running scripts/stack.sh registry-up")?;
    anyhow::ensure!(out.status.success(), "scripts/stack.sh registry-up failed");
    let text = String::from_utf8(out.stdout)?;
    text.lines()
        .last()
        .map(|l| l.trim().to_string())
        .filter(|l| l.starts_with("http"))
        .context("scripts/stack.sh registry-up printed no URL")
}
