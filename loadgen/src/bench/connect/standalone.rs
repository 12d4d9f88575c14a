//! The standalone Kafka Connect worker the benchmark runs: its JVM options, its properties
//! files, its REST API (are the tasks running, or did one fail).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{Tuning, DATABASE};
use crate::bench::peer::Jdbc;
use crate::bench::worker::PARTITIONS;

/// The JVM options of Kafka's `connect-standalone.sh` (`kafka-run-class.sh`'s defaults).
pub(super) const JVM: &[&str] = &[
    "-Xms256M",
    "-Xmx2G",
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    "-Djava.awt.headless=true",
];

/// The worker's, the connector's and log4j2's properties files, in that order.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_config(
    dir: &Path,
    brokers: &str,
    pg: &tokio_postgres::Config,
    topic: &str,
    name: &str,
    table: &str,
    port: u16,
    tuning: &Tuning,
) -> anyhow::Result<[PathBuf; 3]> {
    let jdbc = Jdbc::new(pg, DATABASE)?;
    // offset.flush.interval.ms: the 10 s of Kafka's own config/connect-standalone.properties.
    let worker = format!(
        "bootstrap.servers={brokers}\n\
         key.converter=org.apache.kafka.connect.storage.StringConverter\n\
         value.converter=org.apache.kafka.connect.json.JsonConverter\n\
         value.converter.schemas.enable=true\n\
         offset.storage.file.filename={offsets}\n\
         offset.flush.interval.ms=10000\n\
         listeners=http://127.0.0.1:{port}\n\
         rest.advertised.host.name=127.0.0.1\n\
         plugin.discovery=service_load\n\
         consumer.max.poll.records={poll}\n",
        offsets = dir.join("connect.offsets").display(),
        poll = tuning.max_poll_records,
    );
    let connector = format!(
        "name={name}\n\
         connector.class=io.debezium.connector.jdbc.JdbcSinkConnector\n\
         tasks.max={PARTITIONS}\n\
         topics={topic}\n\
         connection.url={url}\n\
         connection.username={user}\n\
         connection.password={password}\n\
         insert.mode=upsert\n\
         primary.key.mode=record_value\n\
         primary.key.fields=event_id\n\
         schema.evolution=none\n\
         collection.name.format={table}\n\
         batch.size={batch}\n",
        batch = tuning.batch_size,
        url = jdbc.url,
        user = jdbc.user,
        password = jdbc.password,
    );
    let log4j = format!(
        "status = warn\n\
         appender.file.type = File\n\
         appender.file.name = FILE\n\
         appender.file.fileName = {}\n\
         appender.file.layout.type = PatternLayout\n\
         appender.file.layout.pattern = [%d] %p %m (%c)%n\n\
         rootLogger.level = INFO\n\
         rootLogger.appenderRef.file.ref = FILE\n",
        dir.join("connect.log").display()
    );
    let files = [
        dir.join("worker.properties"),
        dir.join("sink.properties"),
        dir.join("log4j2.properties"),
    ];
    for (f, text) in files.iter().zip([worker, connector, log4j]) {
        std::fs::write(f, text)?;
    }
    Ok(files)
}

/// How many tasks run; an error with the trace if the connector or a task failed.
pub(super) fn tasks_running(status: &serde_json::Value) -> anyhow::Result<usize> {
    let failed = |s: &serde_json::Value| s["state"] == "FAILED";
    if failed(&status["connector"]) {
        bail!(
            "Connect's connector failed: {}",
            status["connector"]["trace"]
        );
    }
    let tasks = status["tasks"].as_array().cloned().unwrap_or_default();
    if let Some(t) = tasks.iter().find(|t| failed(t)) {
        let trace = t["trace"].as_str().unwrap_or("");
        bail!(
            "Connect's task {} failed: {}",
            t["id"],
            &trace[..trace.len().min(2000)]
        );
    }
    Ok(tasks.iter().filter(|t| t["state"] == "RUNNING").count())
}

/// A GET of Connect's REST API on the loopback: one request, HTTP/1.0, the JSON body.
pub(super) async fn rest_get(port: u16, path: &str) -> anyhow::Result<serde_json::Value> {
    let request = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        anyhow::Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(5), request).await??;
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("an HTTP answer without a body")?;
    ensure!(
        head.split_whitespace().nth(1) == Some("200"),
        "GET {path}: {}",
        head.lines().next().unwrap_or("")
    );
    Ok(serde_json::from_str(body)?)
}

pub(super) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_task_is_an_error_with_its_trace() {
        let running = serde_json::json!({"connector": {"state": "RUNNING"},
            "tasks": [{"id": 0, "state": "RUNNING"}, {"id": 1, "state": "UNASSIGNED"}]});
        assert_eq!(tasks_running(&running).unwrap(), 1);
        let failed = serde_json::json!({"connector": {"state": "RUNNING"},
            "tasks": [{"id": 3, "state": "FAILED", "trace": "boom"}]});
        let e = tasks_running(&failed).unwrap_err().to_string();
        assert!(e.contains("task 3") && e.contains("boom"), "{e}");
    }
}
