//! A partition that cannot progress is never silent. Two ways it cannot:
//!
//! - **Stuck**: librdkafka hands the partition's queue an error instead of records (a codec
//!   the client was built without, a corrupt batch, a topic this user may not read), fetch after
//!   fetch. Each error counts (`effectively_partition_errors_total{code}`), and the partition is
//!   stuck (`effectively_partition_stuck` = 1) until a record arrives. A consumer whose every
//!   partition is stuck is not ready ([`crate::health`]).
//! - **Stalled**: a batch has been retrying, not committed, for longer than the consumer's
//!   `stall_after`, whatever the cause (`effectively_partition_stalled` = 1 until the batch
//!   ends).
//!
//! Both are also written to `partition_health` for the console (a process of its own), by a
//! writer task per partition that writes the latest marks, never blocking the partition: a
//! database that does not answer delays the row, not the records.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use deadpool_postgres::Pool;
use rdkafka::error::KafkaError;
use tokio::sync::watch;

use crate::health::{ConsumerHealth, PartitionHealth};
use crate::metrics;
use crate::store::partition_health::{self as table, Key, Marks};

/// After a failed write of the marks, how long before writing the latest ones again.
const REWRITE_AFTER: Duration = Duration::from_secs(1);

/// One partition task's stuck and stalled state.
pub struct PartitionWatch {
    consumer: Arc<str>,
    topic: Arc<str>,
    partition: i32,
    stall_after: Duration,
    health: PartitionHealth,
    marks: watch::Sender<Marks>,
    /// The last marks sent, to send only changes (the stuck flag is read per record).
    stuck: Mutex<bool>,
}

impl PartitionWatch {
    /// Starts watching a claimed partition: gauges at 0, readiness counts it, and a writer of
    /// its `partition_health` row (spawned on the current runtime; it ends after the watch).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        consumer: Arc<str>,
        topic: Arc<str>,
        partition: i32,
        epoch: i64,
        stall_after: Duration,
        health: &ConsumerHealth,
        pool: Pool,
        deadline: Duration,
    ) -> PartitionWatch {
        metrics::partition_watched(&consumer, &topic, partition);
        let (tx, rx) = watch::channel(Marks::default());
        tokio::spawn(write_marks(
            pool,
            deadline,
            (Arc::clone(&consumer), Arc::clone(&topic), partition, epoch),
            rx,
        ));
        PartitionWatch {
            health: health.partition(&topic, partition),
            consumer,
            topic,
            partition,
            stall_after,
            marks: tx,
            stuck: Mutex::new(false),
        }
    }

    /// The partition's queue returned `e` instead of a record.
    pub fn fetch_failed(&self, e: &KafkaError) {
        let code = e
            .rdkafka_error_code()
            .map_or_else(|| "unknown".to_string(), |c| format!("{c:?}"));
        let (c, t, p) = (&*self.consumer, &*self.topic, self.partition);
        metrics::partition_fetch_error(c, t, p, &code);
        let error = e.to_string();
        let mut stuck = self.stuck.lock().unwrap_or_else(|p| p.into_inner());
        if !*stuck {
            *stuck = true;
            tracing::error!(consumer = c, topic = t, partition = p, code = %code, error = %error,
                "consumer {c}, {t}/{p}: the partition's fetch fails, nothing of it is consumed until it \
                 succeeds (effectively_partition_stuck = 1; docs/OPERATIONS.md \"A partition is stuck\")");
            metrics::partition_stuck(c, t, p, true);
        } else {
            tracing::warn!(consumer = c, topic = t, partition = p, code = %code, error = %error,
                "kafka error on partition queue: the partition is still stuck");
        }
        self.health.stuck(Some(&error));
        // The row is written again only when the error changes, not at every failed fetch.
        self.marks.send_if_modified(|m| {
            let since = match &m.stuck {
                Some((_, last)) if *last == error => return false,
                Some((since, _)) => *since,
                None => Utc::now(),
            };
            m.stuck = Some((since, error));
            true
        });
    }

    /// A record arrived: the partition is not stuck (if it was).
    pub fn record_arrived(&self) {
        let mut stuck = self.stuck.lock().unwrap_or_else(|p| p.into_inner());
        if !*stuck {
            return;
        }
        *stuck = false;
        let (c, t, p) = (&*self.consumer, &*self.topic, self.partition);
        tracing::info!(
            consumer = c,
            topic = t,
            partition = p,
            "the partition's fetch succeeds again: no longer stuck"
        );
        metrics::partition_stuck(c, t, p, false);
        self.health.stuck(None);
        self.marks.send_modify(|m| m.stuck = None);
    }

    /// Runs a batch's `work`, marking the partition stalled while it runs past `stall_after`.
    pub async fn batch<F: Future>(&self, work: F) -> F::Output {
        tokio::pin!(work);
        tokio::select! {
            out = &mut work => return out,
            _ = tokio::time::sleep(self.stall_after) => {}
        }
        let (c, t, p) = (&*self.consumer, &*self.topic, self.partition);
        tracing::error!(consumer = c, topic = t, partition = p,
            "consumer {c}, {t}/{p}: a batch has been retrying for longer than stall_after ({}), not \
             committed (effectively_partition_stalled = 1; docs/OPERATIONS.md \"A partition is stalled\")",
            humantime_serde::re::humantime::format_duration(self.stall_after));
        metrics::partition_stalled(c, t, p, true);
        self.marks
            .send_modify(|m| m.stalled_since = Some(Utc::now()));
        // Cleared however the batch ends: committed, failed, or the task aborted.
        struct Unstall<'a>(&'a PartitionWatch);
        impl Drop for Unstall<'_> {
            fn drop(&mut self) {
                let w = self.0;
                metrics::partition_stalled(&w.consumer, &w.topic, w.partition, false);
                w.marks.send_modify(|m| m.stalled_since = None);
            }
        }
        let _unstall = Unstall(self);
        let out = work.await;
        tracing::info!(
            consumer = c,
            topic = t,
            partition = p,
            "the stalled batch ended"
        );
        out
    }
}

impl Drop for PartitionWatch {
    fn drop(&mut self) {
        // The partition is no longer this task's: its gauges say nothing wrong here. The
        // writer clears the row once the sender is gone.
        metrics::partition_watched(&self.consumer, &self.topic, self.partition);
    }
}

/// Writes each change of the marks to `partition_health`, the latest only; deletes this
/// claim's row when the watch ends. Writes nothing for a partition that never had a mark.
async fn write_marks(
    pool: Pool,
    deadline: Duration,
    (consumer, topic, partition, epoch): (Arc<str>, Arc<str>, i32, i64),
    mut rx: watch::Receiver<Marks>,
) {
    let key = Key {
        consumer: &consumer,
        topic: &topic,
        partition,
        epoch,
    };
    let mut written = Marks::default();
    let mut ended = false;
    loop {
        if !ended && rx.changed().await.is_err() {
            ended = true;
        }
        let latest = match ended {
            true => Marks::default(),
            false => rx.borrow_and_update().clone(),
        };
        if latest == written {
            if ended {
                return;
            }
            continue;
        }
        let write = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            table::write(&**client, &key, &latest)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(deadline, write).await {
            Ok(Ok(())) => written = latest,
            failed => {
                let error = match failed {
                    Ok(Err(e)) => e,
                    _ => format!("no answer within {deadline:?}"),
                };
                tracing::debug!(consumer = %consumer, topic = %topic, partition, error = %error,
                    "writing the partition's health row failed; trying again");
                if ended {
                    // Once more after a pause, then leave it: the next claim's epoch outdates it.
                    tokio::time::sleep(REWRITE_AFTER).await;
                    let client = pool.get().await;
                    if let Ok(client) = client {
                        let _ = tokio::time::timeout(
                            deadline,
                            table::write(&**client, &key, &Marks::default()),
                        )
                        .await;
                    }
                    return;
                }
                tokio::time::sleep(REWRITE_AFTER).await;
                // Write the latest again, even if unchanged since.
                rx.mark_changed();
            }
        }
    }
}
