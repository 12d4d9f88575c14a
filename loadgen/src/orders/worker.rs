//! The run's worker process: its config (the `order-status` handler, versions in a mode), its
//! bounce mid-stream (`--bounce`), and the end of its log when it died.

use std::path::Path;
use std::time::{Duration, Instant};

use super::ModeArg;
use crate::chaos::{worker_settings, Proc, StrategyArg};

/// The worker config: the `order-status` handler, versions in `mode`.
pub(super) fn worker_config(topic: &str, strategy: StrategyArg, mode: ModeArg) -> String {
    let mut text = worker_settings(8);
    text.push_str(&format!(
        "[[consumer]]\nname = \"{topic}\"\ntopics = [\"{topic}\"]\n\
         handler = {{ kind = \"order-status\" }}\n\
         batch = {{ max_messages = 200 }}\nretry = {{ initial_backoff = \"50ms\", max_backoff = \"1s\" }}\n"
    ));
    if strategy == StrategyArg::Inbox {
        text.push_str("strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 4\n");
    }
    text.push_str(&format!(
        "[consumer.version]\naggregate = \"/order_id\"\nversion = \"/version\"\nmode = \"{}\"\n",
        mode.as_str()
    ));
    text
}

/// The last `n` lines of a worker's log.
pub(super) fn tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// SIGKILLs `worker` once `consumer` has stored offsets past `records` records (a third of the
/// stream: mid-way through the work, whether or not producing is over), and starts another.
pub(super) async fn bounce(
    db: &tokio_postgres::Client,
    consumer: &str,
    records: i64,
    worker: Proc,
    restart: impl FnOnce() -> anyhow::Result<Proc>,
) -> anyhow::Result<Proc> {
    let (started, mut worker) = (Instant::now(), worker);
    loop {
        anyhow::ensure!(
            !worker.exited(0).await,
            "the first worker exited on its own before the bounce"
        );
        let stored: i64 = db
            .query_one(
                "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offsets
                 WHERE consumer = $1 AND topic = $1",
                &[&consumer],
            )
            .await?
            .get(0);
        if stored >= records {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the worker took only {stored} of {records} records within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker.kill().await;
    restart()
}
