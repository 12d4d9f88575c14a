//! One task per assigned partition: read the partition's own queue, decode, batch, hand the
//! batch to the strategy, and tell Kafka after each PostgreSQL commit.
//!
//! Batches are bounded by count, bytes and linger. A batch is flushed as soon as the partition
//! has nothing more waiting, so a quiet stream is not delayed; under load, records pile up while
//! the previous batch commits, and the next batch is larger (group commit, without a timer).
//! After each PostgreSQL commit the offset is stored for librdkafka's background commit.

use std::sync::Arc;
use std::time::Instant;

use futures::FutureExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::consumer::RebalanceContext;
use super::range;
use crate::batch::{Batch, Raw, Record};
use crate::config::{BatchConfig, ConsumerConfig};
use crate::envelope::Decoder;
use crate::metrics::{self, PartitionMetrics};
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
    pub metrics: PartitionMetrics,
    /// Where PostgreSQL says this partition resumes; records below it were applied already.
    pub next_offset: Option<i64>,
    /// The count bound of the next batch: `batch.max_messages`, grown while catching up.
    pub limit: usize,
    /// Set when librdkafka reports the fetch position outside the log (see [`range`]).
    pub out_of_range: range::Seen,
}

/// How a partition task ended.
#[derive(Debug, Clone)]
pub enum Exit {
    /// Revoked or stopping: whatever was committed is in PostgreSQL.
    Stopped,
    /// Another worker owns the partition now; this one rolled back.
    Fenced,
    /// PostgreSQL went back past this worker's commits (a failover that lost them, a restore):
    /// the partition must be claimed again and read from the offset it holds now.
    WentBack,
    /// The handler or schema cannot work: the worker must stop.
    Fatal(String),
}

impl PartitionTask {
    pub async fn run(mut self) -> Exit {
        let cancel = self.ctx.cancel.clone();
        // Stopped by the claim: its stored offset is outside the log.
        if let Some(exit) = range::at_start(&mut self).await {
            return exit;
        }
        loop {
            // The last batch is committed: where librdkafka could not fetch on from it.
            if let Some(exit) = range::after_reset_error(&mut self).await {
                return exit;
            }
            let mut batch = match self.next_batch(&cancel).await {
                Some(b) => b,
                None => return Exit::Stopped,
            };
            if batch.is_empty() {
                continue;
            }
            batch.stored = self.next_offset;
            let committed = |next: i64| {
                self.stats
                    .committed_offset(&self.ctx.topic, self.ctx.partition, next);
                self.store_offset(next);
            };
            let last = batch.next_offset();
            let started = Instant::now();
            match self.strategy.process(&self.ctx, batch, &committed).await {
                Ok(outcome) => {
                    self.next_offset = last;
                    self.stats.batch(&outcome);
                    metrics::batch_committed(
                        &self.ctx.consumer,
                        &self.ctx.topic,
                        &outcome,
                        started.elapsed(),
                    );
                }
                Err(BatchError::Cancelled) => return Exit::Stopped,
                Err(BatchError::Fenced) => {
                    self.stats.fenced();
                    metrics::fenced(&self.ctx.consumer, &self.ctx.topic, self.ctx.partition);
                    tracing::warn!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                        partition = self.ctx.partition, epoch = self.ctx.epoch,
                        "fenced: another worker claimed this partition; batch rolled back");
                    return Exit::Fenced;
                }
                Err(BatchError::WentBack { from, stored }) => {
                    self.stats.went_back();
                    metrics::offset_store_went_back(
                        &self.ctx.consumer,
                        &self.ctx.topic,
                        self.ctx.partition,
                        from,
                        stored,
                    );
                    tracing::error!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                        partition = self.ctx.partition, epoch = self.ctx.epoch,
                        committed = ?from, stored = ?stored,
                        "PostgreSQL no longer holds this partition's last commits (a failover to a \
                         standby that lacked them, or a restore): batch refused; claiming the \
                         partition again and reading it from the stored offset");
                    return Exit::WentBack;
                }
                Err(BatchError::Fatal(t)) => return Exit::Fatal(t),
            }
        }
    }

    /// Hands the offset PostgreSQL just committed to librdkafka, which commits it to Kafka in
    /// the background (`auto.commit.interval.ms`), on revocation and on close. Kafka's committed
    /// offset only serves lag monitoring and tools, and is never ahead of PostgreSQL's. (A
    /// commit request per batch would queue the group coordinator's heartbeats behind hundreds
    /// of commits a second, and the member would lose its session under load.)
    fn store_offset(&self, next: i64) {
        let mut tpl = TopicPartitionList::new();
        if tpl
            .add_partition_offset(&self.ctx.topic, self.ctx.partition, Offset::Offset(next))
            .is_ok()
        {
            if let Err(e) = self.consumer.store_offsets(&tpl) {
                tracing::debug!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                    partition = self.ctx.partition, error = %e, "storing the kafka offset failed");
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
        let mut drained = false;
        while batch.len() < self.limit
            && batch.bytes < bounds.max_bytes
            && Instant::now() < deadline
        {
            match self.queue.recv().now_or_never() {
                Some(m) => self.take(m, &mut batch),
                None => {
                    drained = true;
                    break;
                }
            }
        }
        // A batch that filled up with records still waiting means a backlog: let the next one
        // be larger. One that emptied the queue means we are caught up: back to the base.
        self.limit = if drained {
            bounds.max_messages
        } else if batch.len() >= self.limit {
            (self.limit * 2).min(bounds.backlog_max_messages.max(bounds.max_messages))
        } else {
            self.limit
        };
        Some(batch)
    }

    fn take(&self, m: Result<BorrowedMessage<'_>, rdkafka::error::KafkaError>, batch: &mut Batch) {
        let m = match m {
            Ok(m) => m,
            Err(e) if range::is_out_of_range(&e) => {
                // librdkafka stopped fetching the partition; the task handles it once the
                // batch collected so far is committed.
                tracing::warn!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                    partition = self.ctx.partition, error = %e, "the fetch position is outside the partition's log");
                self.out_of_range.set();
                return;
            }
            Err(e) => {
                tracing::warn!(consumer = %self.ctx.consumer, topic = %self.ctx.topic,
                    partition = self.ctx.partition, error = %e, "kafka error on partition queue");
                return;
            }
        };
        let raw = Raw::from_message(&m);
        drop(m);
        self.metrics.received();
        // Below the stored offset: applied already (a fetch that raced the seek).
        if self.next_offset.is_some_and(|next| raw.offset < next) {
            self.stats.below_stored_offset();
            self.metrics.below_stored_offset();
            return;
        }
        let today = chrono::Utc::now().date_naive();
        let check = self.strategy.checks_messages();
        let record = Record::admit_with(
            raw,
            &self.decoder,
            check.then_some(self.ctx.handler.as_ref()),
            &self.config,
            today,
        );
        batch.push(record);
    }
}
