//! Kafka Connect with Debezium's JDBC sink, the peer of the batch drain: a standalone Connect
//! worker (the broker's version, `scripts/connect.sh fetch` brings its jars) sinks the same
//! kind of payments topic into a PostgreSQL table upserted by event id. It does less than the
//! engine (no dedupe ledger, no effect, no outbox row; idempotent by its primary key alone) and
//! is measured the way the drains are: records over the span from the first to the last row
//! inserted (`loaded_at DEFAULT clock_timestamp()`, as the engine's `credited_at`).
//!
//! Debezium's sink needs a `Struct` value: a schemaless JSON value (`JsonConverter` with
//! `schemas.enable=false`) fails in the task (`NullPointerException: ... "payload" is null`),
//! and neither Kafka nor Debezium ships a transform that gives schemaless JSON a schema. So
//! Connect reads a copy of the payments topic, made record by record (same partition, order,
//! key, headers and payload), each value wrapped in `JsonConverter`'s schema envelope: the
//! usual way to feed JSON to a JDBC sink without a schema registry. The schema travels in
//! every record; `connect.value_bytes_per_record` says how much that adds.
//!
//! Running the Connect worker's process (its JVM options, properties files, REST status and
//! consumer group) is in [`standalone`]; this file measures it.

mod standalone;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use uuid::Uuid;

use super::peer::{self, check_table, create_table, delete_topics, group_reader, highs, lag};
use super::worker::{resends_only, spec, PARTITIONS};
use super::{procfs, round1, BenchArgs};
use crate::produce::Step;
use crate::{produce_stage, Session};
use standalone::{free_port, rest_get, tasks_running, write_config, JVM};

const SINK: &str = "io.debezium:debezium-connector-jdbc:3.3.1.Final";
const RUNTIME: &str = "org.apache.kafka:connect-runtime:4.1.1 (standalone)";
/// The database of Connect's tables, next to the engine's (created if missing).
const DATABASE: &str = "connect_bench";
/// JsonConverter's schema for the payment's fields as loadgen writes them. The two logical
/// names are Debezium's, so its PostgreSQL dialect binds a `uuid` and a `timestamptz` as a
/// hand-made table would hold them (and as the engine parses them).
const SCHEMA: &str = concat!(
    r#"{"type":"struct","name":"payment","optional":false,"fields":["#,
    r#"{"field":"event_id","type":"string","optional":false,"name":"io.debezium.data.Uuid"},"#,
    r#"{"field":"payment_id","type":"string","optional":false},"#,
    r#"{"field":"user_id","type":"string","optional":false},"#,
    r#"{"field":"amount_paise","type":"int64","optional":false},"#,
    r#"{"field":"occurred_at","type":"string","optional":false,"#,
    r#""name":"io.debezium.time.ZonedTimestamp"}]}"#
);
/// One tuning of the sink: Debezium's `batch.size` and the consumer's `max.poll.records`.
struct Tuning {
    name: &'static str,
    batch_size: u32,
    max_poll_records: u32,
}

/// The defaults of both (500 each), then both raised four- and tenfold. The best is reported.
const TUNINGS: [Tuning; 3] = [
    Tuning {
        name: "default",
        batch_size: 500,
        max_poll_records: 500,
    },
    Tuning {
        name: "batch2000",
        batch_size: 2000,
        max_poll_records: 2000,
    },
    Tuning {
        name: "batch5000",
        batch_size: 5000,
        max_poll_records: 5000,
    },
];

#[derive(Debug, Default, Serialize)]
pub(super) struct ConnectReport {
    /// The best run's records/s, first to last row inserted.
    pub(super) msg_s: f64,
    pub(super) best: String,
    pub(super) verified: bool,
    pub(super) runtime: String,
    pub(super) sink: String,
    pub(super) events: u64,
    pub(super) records: u64,
    pub(super) span: String,
    pub(super) data: String,
    /// Mean value bytes per record: the payments topic's, and the copy's Connect reads.
    pub(super) value_bytes_per_record: [f64; 2],
    pub(super) runs: Vec<ConnectRun>,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct ConnectRun {
    pub(super) tuning: String,
    pub(super) tasks_max: i32,
    pub(super) batch_size: u32,
    pub(super) consumer_max_poll_records: u32,
    pub(super) insert_mode: String,
    pub(super) primary_key: String,
    pub(super) msg_s: f64,
    pub(super) seconds: f64,
    pub(super) rows: u64,
    pub(super) verified: bool,
    /// What the table holds that it should not, or lacks (the first few).
    pub(super) problems: Vec<String>,
    /// From the JVM's start until every task runs.
    pub(super) startup_s: f64,
    /// The JVM's CPU seconds until every task ran, and after that.
    pub(super) cpu_s_startup: f64,
    pub(super) cpu_s_drain: f64,
    pub(super) cpu_us_per_msg: f64,
    pub(super) rss_mb_peak: f64,
}

/// Pre-fills a payments topic like the batch drain's, copies it with a schema, and sinks the
/// copy with each tuning in turn (a fresh connector, consumer group and table each time).
pub(super) async fn connect(args: &BenchArgs, events: u64) -> anyhow::Result<ConnectReport> {
    let lib = &args.connect_lib;
    ensure!(
        lib.join("connect-runtime-4.1.1.jar").exists(),
        "no Kafka Connect jars in {}: run `scripts/connect.sh fetch` first",
        lib.display()
    );
    let brokers = args.services.brokers.as_str();
    let name = format!("bench-connect-{:06x}", fastrand::u32(..0xffffff));
    let plan = vec![Step {
        rate: None,
        duration: Duration::from_secs(3600),
    }];
    let spec = spec(args, &name, PARTITIONS, plan, Some(events), resends_only());
    let session = Session::open(&spec).await?;
    let produced = produce_stage(&session, &spec).await?;
    produced.stop_sampling();
    let expected = produced.amounts_by_event();
    let records = produced.acked();
    let copy = format!("{name}-schema");
    crate::create_topic(brokers, &copy, PARTITIONS, 1).await?;
    let (b, from, to) = (brokers.to_string(), name.clone(), copy.clone());
    let (copied, bytes_in, bytes_out) =
        tokio::task::spawn_blocking(move || copy_with_schema(&b, &from, &to)).await??;
    let highs = highs(brokers, &copy)?;
    ensure!(
        copied == records && highs.iter().sum::<i64>() as u64 == records,
        "copying {name} with a schema: {records} records acknowledged, {copied} read, {} in the copy",
        highs.iter().sum::<i64>()
    );
    eprintln!(
        "   topic pre-filled: {records} records ({} payments), copied with a schema for Connect",
        expected.len()
    );
    let db = peer::database(&args.services.database_url, DATABASE).await?;
    let mut report = ConnectReport {
        verified: true,
        runtime: RUNTIME.into(),
        sink: SINK.into(),
        events: expected.len() as u64,
        records,
        span: "records over the span from the first to the last row inserted (loaded_at, \
               clock_timestamp() per row, like the engine's credited_at)"
            .into(),
        data: format!(
            "a copy of a payments topic pre-filled like the batch drain's ({PARTITIONS} \
             partitions, 10% resends), same partition, order, key, headers and payload per \
             record, each value in JsonConverter's schema envelope: Debezium's JDBC sink needs \
             a schema, and schemaless JSON fails in its task"
        ),
        value_bytes_per_record: [
            round1(bytes_in as f64 / records.max(1) as f64),
            round1(bytes_out as f64 / records.max(1) as f64),
        ],
        ..ConnectReport::default()
    };
    for tuning in &TUNINGS {
        let run = sink(args, &db.0, &db.1, &copy, &highs, &expected, tuning).await?;
        eprintln!(
            "   {}: batch.size {}, max.poll.records {}: {:.0} msg/s ({} records in {:.1} s, first \
             to last row), verified: {}, JVM start {:.1} s, {:.1} µs CPU/msg, peak RSS {:.0} MB",
            run.tuning,
            run.batch_size,
            run.consumer_max_poll_records,
            run.msg_s,
            records,
            run.seconds,
            run.verified,
            run.startup_s,
            run.cpu_us_per_msg,
            run.rss_mb_peak
        );
        report.verified &= run.verified;
        if run.msg_s > report.msg_s {
            report.msg_s = run.msg_s;
            report.best = run.tuning.clone();
        }
        report.runs.push(run);
    }
    delete_topics(brokers, &[&name, &copy]).await;
    Ok(report)
}

/// One Connect worker sinking `topic` into a fresh table with `tuning`, until its consumer
/// group has committed the topic's ends; then the table is checked and dropped.
async fn sink(
    args: &BenchArgs,
    db: &tokio_postgres::Client,
    pg: &tokio_postgres::Config,
    topic: &str,
    highs: &[i64],
    expected: &HashMap<Uuid, i64>,
    tuning: &Tuning,
) -> anyhow::Result<ConnectRun> {
    let name = format!("{topic}-{}", tuning.name);
    let table = name.replace('-', "_");
    create_table(db, &table, "").await?;
    let dir = std::path::absolute(args.out.join(&name))?;
    std::fs::create_dir_all(&dir)?;
    let port = free_port()?;
    let files = write_config(
        &dir,
        &args.services.brokers,
        pg,
        topic,
        &name,
        &table,
        port,
        tuning,
    )?;
    let started = Instant::now();
    let mut java = tokio::process::Command::new("java")
        .args(JVM)
        .arg("-cp")
        .arg(format!("{}/*", args.connect_lib.display()))
        .arg(format!("-Dlog4j2.configurationFile={}", files[2].display()))
        .arg("org.apache.kafka.connect.cli.ConnectStandalone")
        .args(&files[..2])
        .stdout(std::fs::File::create(dir.join("stdout.log"))?)
        .stderr(Stdio::from(std::fs::File::create(dir.join("stderr.log"))?))
        .kill_on_drop(true)
        .spawn()
        .context("starting java (Kafka Connect)")?;
    let pid = java.id().context("Connect exited at once")?;
    let log = dir.join("connect.log");
    let status = format!("/connectors/{name}/status");
    let watch = |running: &mut tokio::process::Child| -> anyhow::Result<()> {
        if let Some(s) = running.try_wait()? {
            bail!("Kafka Connect exited: {s} (see {})", log.display());
        }
        Ok(())
    };
    // Started: every task RUNNING. A slow machine takes tens of seconds to start the JVM.
    loop {
        watch(&mut java)?;
        ensure!(
            started.elapsed() < Duration::from_secs(300),
            "Connect's tasks did not all run within 300 s (see {})",
            log.display()
        );
        if let Ok(v) = rest_get(port, &status).await {
            if tasks_running(&v)? == PARTITIONS as usize {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let startup_s = started.elapsed().as_secs_f64();
    let cpu_s_startup = procfs::usage(pid).1;
    // Done: the group's committed offsets (which Connect moves only after the sink flushed)
    // at the topic's ends.
    // Connect's sink tasks consume as the group `connect-` and the connector's name.
    let group = group_reader(&args.services.brokers, &format!("connect-{name}"))?;
    loop {
        watch(&mut java)?;
        ensure!(
            started.elapsed() < Duration::from_secs(1800),
            "Connect did not sink {topic} within 30 minutes (see {})",
            log.display()
        );
        if let Ok(v) = rest_get(port, &status).await {
            tasks_running(&v)?;
        }
        if lag(&group, topic, highs)? == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (rss_mb, cpu_s) = procfs::usage(pid);
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    match tokio::time::timeout(Duration::from_secs(60), java.wait()).await {
        Ok(s) => eprintln!("   Connect stopped ({})", s?),
        Err(_) => {
            eprintln!("   Connect did not stop within 60 s of SIGTERM: killed");
            java.kill().await?;
        }
    }
    let row = db
        .query_one(
            &format!(
                "SELECT count(*), coalesce(extract(epoch FROM max(loaded_at) - min(loaded_at)), 0)::float8 \
                 FROM {table}"
            ),
            &[],
        )
        .await?;
    let (rows, span): (i64, f64) = (row.get(0), row.get(1));
    let checked = check_table(db, &table, expected, None).await?;
    db.batch_execute(&format!("DROP TABLE {table}")).await?;
    let records: i64 = highs.iter().sum();
    let drain_cpu = cpu_s - cpu_s_startup;
    Ok(ConnectRun {
        tuning: tuning.name.into(),
        tasks_max: PARTITIONS,
        batch_size: tuning.batch_size,
        consumer_max_poll_records: tuning.max_poll_records,
        insert_mode: "upsert".into(),
        primary_key: "record_value: event_id".into(),
        msg_s: if span > 0.0 {
            records as f64 / span
        } else {
            0.0
        },
        seconds: span,
        rows: rows as u64,
        verified: checked.verified,
        problems: checked.problems,
        startup_s: round1(startup_s),
        cpu_s_startup: round1(cpu_s_startup),
        cpu_s_drain: round1(drain_cpu),
        cpu_us_per_msg: round1(drain_cpu * 1e6 / records.max(1) as f64),
        rss_mb_peak: round1(rss_mb),
    })
}

/// Copies `from` into `to` record by record (same partition, order, key and headers), each
/// value wrapped in JsonConverter's envelope with [`SCHEMA`]. Returns the records copied and
/// the value bytes read and written.
fn copy_with_schema(brokers: &str, from: &str, to: &str) -> anyhow::Result<(u64, u64, u64)> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("loadgen-connect-copy-{}", Uuid::new_v4()),
        )
        .set("enable.auto.commit", "false")
        .create()
        .context("creating the copy's consumer")?;
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "5")
        .set("queue.buffering.max.messages", "1000000")
        .create()
        .context("creating the copy's producer")?;
    let mut assignment = TopicPartitionList::new();
    let mut left = HashMap::new();
    for p in 0..PARTITIONS {
        let (low, high) = consumer.fetch_watermarks(from, p, Duration::from_secs(10))?;
        if high > low {
            assignment.add_partition_offset(from, p, Offset::Offset(low))?;
            left.insert(p, high);
        }
    }
    consumer.assign(&assignment)?;
    let deadline = Instant::now() + Duration::from_secs(900);
    let (mut n, mut bytes_in, mut bytes_out) = (0u64, 0u64, 0u64);
    while !left.is_empty() {
        ensure!(
            Instant::now() < deadline,
            "copying {from}: not done in 900 s"
        );
        let Some(msg) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let msg = msg.with_context(|| format!("reading {from}"))?;
        let p = msg.partition();
        if left.get(&p).is_some_and(|end| msg.offset() + 1 >= *end) {
            left.remove(&p);
        }
        let payload = msg.payload().unwrap_or_default();
        let value = [
            b"{\"schema\":".as_slice(),
            SCHEMA.as_bytes(),
            b",\"payload\":",
            payload,
            b"}",
        ]
        .concat();
        let mut headers = OwnedHeaders::new();
        for h in msg.headers().into_iter().flat_map(|h| h.iter()) {
            headers = headers.insert(Header {
                key: h.key,
                value: h.value,
            });
        }
        let mut record = BaseRecord::<[u8], [u8]>::to(to)
            .partition(p)
            .payload(value.as_slice())
            .headers(headers);
        if let Some(k) = msg.key() {
            record = record.key(k);
        }
        loop {
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    producer.poll(Duration::from_millis(100));
                }
                Err((e, _)) => return Err(e).with_context(|| format!("copying into {to}")),
            }
        }
        producer.poll(Duration::ZERO);
        n += 1;
        bytes_in += payload.len() as u64;
        bytes_out += value.len() as u64;
    }
    producer
        .flush(Duration::from_secs(120))
        .with_context(|| format!("flushing the copy into {to}"))?;
    Ok((n, bytes_in, bytes_out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schema_names_every_field_of_the_payload() {
        let schema: serde_json::Value = serde_json::from_str(SCHEMA).unwrap();
        let names: Vec<&str> = schema["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["field"].as_str().unwrap())
            .collect();
        // The fields of produce/records.rs's payment payload, in any order.
        let mut want = [
            "event_id",
            "payment_id",
            "user_id",
            "amount_paise",
            "occurred_at",
        ];
        let mut got = names.clone();
        want.sort_unstable();
        got.sort_unstable();
        assert_eq!(got, want);
    }
}
