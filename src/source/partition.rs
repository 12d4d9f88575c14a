//! One task per assigned partition: read the partition's own queue, decode, batch, hand the
//! batch to the strategy, and tell Kafka after each PostgreSQL commit.
//!
//! Batches are bounded by count, bytes and linger. A batch is flushed as soon as the partition
//! has nothing more waiting, so a quiet stream is not delayed; under load, records pile up while
//! the previous batch commits, and the next batch is larger (group commit, without a timer).

use std::sync::atomic::{AtomicI64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::consumer::RebalanceContext;
use crate::batch::{Batch, Raw, Record};
use crate::config::{BatchConfig, ConsumerConfig};
use crate::envelope::{check_window, Decoder};
use crate::stats::Stats;
use crate::strategy::{BatchError, PartitionCtx, Strategy};

pub type PartitionQueue =
    rdkafka::consumer::stream_consumer::StreamPartitionQueue<RebalanceContext>;

/// Everything one partition task owns.
pub struct PartitionTask {
    pub ctx: PartitionCtx,
    pub queue: PartitionQueue,
    pub consumer: Arc<StreamConsumer<RebalanceContext>>,
    pub decoder: Arc<Decoder>,
    pub config: Arc<ConsumerConfig>,
    pub strategy: Arc<dyn Strategy>,
    pub stats: Arc<Stats>,
    /// Where PostgreSQL says this partition resumes; records below it were applied already.
    pub next_offset: Option<i64>,
}

/// How a partition task ended.
#[derive(Debug)]
pub enum Exit {
    /// Revoked or stopping: whatever was committed is in PostgreSQL.
    Stopped,
    /// Another worker owns the partition now; this one rolled back.
    Fenced,
    /// The handler or schema cannot work: the worker must stop.
    Fatal(String),
}

impl PartitionTask {
    pub async fn run(mut self) -> Exit {
        let cancel = self.ctx.cancel.clone();
        // The last offset committed to PostgreSQL by this task, committed to Kafka once more,
        // synchronously, when the task stops: async commits may still be in flight then.
        let last_committed = Arc::new(AtomicI64::new(-1));
        let exit = loop {
            let batch = match self.next_batch(&cancel).await {
                Some(b) => b,
                None => break Exit::Stopped,
            };
            if batch.is_empty() {
                continue;
            }
            let committed = |next: i64| {
                last_committed.store(next, Relaxed);
                self.stats.committed_offset(self.ctx.partition, next);
                // Kafka's committed offset only serves lag monitoring and tools; PostgreSQL is
                // the truth. Async: a lost commit costs nothing but a stale lag figure.
                self.commit_to_kafka(next, CommitMode::Async);
            };
            let last = batch.next_offset();
            let started = Instant::now();
            match self.strategy.process(&self.ctx, batch, &committed).await {
                Ok(outcome) => {
                    self.next_offset = last;
                    self.stats.batch(&outcome, started.elapsed());
                }
                Err(BatchError::Cancelled) => break Exit::Stopped,
                Err(BatchError::Fenced) => {
                    self.stats.fenced();
                    tracing::warn!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                        partition = self.ctx.partition, epoch = self.ctx.epoch,
                        "fenced: another worker claimed this partition; batch rolled back");
                    break Exit::Fenced;
                }
                Err(BatchError::Fatal(t)) => break Exit::Fatal(t),
            }
        };
        let last = last_committed.load(Relaxed);
        if matches!(exit, Exit::Stopped) && last >= 0 {
            self.commit_to_kafka(last, CommitMode::Sync);
        }
        exit
    }

    fn commit_to_kafka(&self, next: i64, mode: CommitMode) {
        let mut tpl = TopicPartitionList::new();
        if tpl
            .add_partition_offset(&self.ctx.topic, self.ctx.partition, Offset::Offset(next))
            .is_ok()
        {
            if let Err(e) = self.consumer.commit(&tpl, mode) {
                tracing::debug!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                    partition = self.ctx.partition, error = %e, "kafka offset commit failed");
            }
        }
    }

    /// Waits for the first record, then takes what is ready up to the bounds. `None` when the
    /// partition is cancelled; an unfinished batch is dropped then (nothing of it committed, and
    /// the next owner resumes at the stored offset).
    async fn next_batch(&mut self, cancel: &CancellationToken) -> Option<Batch> {
        let config = Arc::clone(&self.config);
        let bounds: &BatchConfig = &config.batch;
        let mut batch = Batch::default();
        let first = tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            m = self.queue.recv() => m,
        };
        self.take(first, &mut batch);
        let deadline = Instant::now() + bounds.linger;
        while batch.len() < bounds.max_messages
            && batch.bytes < bounds.max_bytes
            && Instant::now() < deadline
        {
            match self.queue.recv().now_or_never() {
                Some(m) => self.take(m, &mut batch),
                None => break,
            }
        }
        Some(batch)
    }

    fn take(&self, m: Result<BorrowedMessage<'_>, rdkafka::error::KafkaError>, batch: &mut Batch) {
        let m = match m {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                    partition = self.ctx.partition, error = %e, "kafka error on partition queue");
                return;
            }
        };
        let raw = Raw::from_message(&m);
        drop(m);
        // Below the stored offset: applied already (a fetch that raced the seek).
        if self.next_offset.is_some_and(|next| raw.offset < next) {
            self.stats.below_stored_offset();
            return;
        }
        let today = chrono::Utc::now().date_naive();
        let handler = &self.ctx.handler;
        let config = &self.config;
        let decoded = raw
            .with_view(|view| self.decoder.decode(view))
            .and_then(|env| {
                check_window(
                    env.event_date,
                    today,
                    config.retention,
                    config.future_tolerance,
                )
                .map_err(|mut r| {
                    r.message_id = Some(env.message_id);
                    r
                })?;
                handler.check(&env).map_err(|mut r| {
                    r.message_id = Some(env.message_id);
                    r
                })?;
                Ok(env)
            });
        batch.push(Record { raw, decoded });
    }
}
