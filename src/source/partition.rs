//! One task per assigned partition: read the partition's own queue, decode, batch, hand the
//! batch to the strategy, and tell Kafka after each PostgreSQL commit.
//!
//! Batches are bounded by count, bytes and linger. A batch is flushed as soon as the partition
//! has nothing more waiting, so a quiet stream is not delayed; under load, records pile up while
//! the previous batch commits, and the next batch is larger (group commit, without a timer).
//! After each PostgreSQL commit the offset is stored for librdkafka's background commit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use rdkafka::consumer::{Consumer, RebalanceProtocol, StreamConsumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::{Offset, TopicPartitionList};
use tokio_util::sync::CancellationToken;

use super::context::RebalanceContext;
use super::control::Gate;
use super::range::{
    self, check, decide, store_move, watermarks, what_a_seek_does, Action, STOP_ACTIONS,
};
use super::schemas;
use super::watch::PartitionWatch;
use crate::batch::{Batch, Raw, Record};
use crate::config::{BatchConfig, ConsumerConfig, OffsetReset};
use crate::envelope::Decoder;
use crate::metrics::{self, PartitionMetrics};
use crate::stats::Stats;
use crate::store::offsets::{End, Move, Refusal};
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
    /// Stuck on a Kafka error, or stalled in a batch (see [`super::watch`]).
    pub watch: PartitionWatch,
    /// Paused by an operator, or throttled (see [`super::control`]).
    pub gate: Gate,
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
        if let Some(exit) = at_start(&mut self).await {
            return exit;
        }
        loop {
            // The last batch is committed: where librdkafka could not fetch on from it.
            if let Some(exit) = after_reset_error(&mut self).await {
                return exit;
            }
            let mut batch = match self.next_batch(&cancel).await {
                Some(b) => b,
                None => return Exit::Stopped,
            };
            if batch.is_empty() {
                continue;
            }
            if let Some(oldest) = batch.oldest_timestamp_ms() {
                self.metrics.batch_cut(oldest);
            }
            batch.stored = self.next_offset;
            let committed = |next: i64| {
                self.stats
                    .committed_offset(&self.ctx.topic, self.ctx.partition, next);
                self.store_offset(next);
            };
            let last = batch.next_offset();
            let started = Instant::now();
            let processed = self.strategy.process(&self.ctx, batch, &committed);
            match self.watch.batch(processed).await {
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
        if !self.gate.wait(cancel).await {
            return None;
        }
        let first = tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            // Paused while waiting: back to the gate, with nothing taken.
            _ = self.gate.until_paused() => return Some(batch),
            m = self.queue.recv() => m,
        };
        self.gate.spend();
        if !self.schemas_ready(&first, cancel).await {
            return None;
        }
        self.take(first, &mut batch);
        let deadline = Instant::now() + bounds.linger;
        let mut drained = false;
        while batch.len() < self.limit
            && batch.bytes < bounds.max_bytes
            && Instant::now() < deadline
        {
            // Paused, or out of tokens: the batch goes as it is.
            if !self.gate.admit_more() {
                break;
            }
            match self.queue.recv().now_or_never() {
                Some(m) => {
                    if !self.schemas_ready(&m, cancel).await {
                        return None;
                    }
                    self.take(m, &mut batch)
                }
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

    /// A record in a Schema Registry format waits here until its schemas are known (see
    /// [`schemas`]); `false`: cancelled meanwhile.
    async fn schemas_ready(
        &self,
        m: &Result<BorrowedMessage<'_>, rdkafka::error::KafkaError>,
        cancel: &CancellationToken,
    ) -> bool {
        schemas::ready(
            &self.decoder,
            m,
            &self.ctx.consumer,
            &self.ctx.topic,
            self.ctx.partition,
            cancel,
        )
        .await
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
                // Nothing of the partition is read while this repeats: counted, gauged, logged.
                self.watch.fetch_failed(&e);
                return;
            }
        };
        self.watch.record_arrived();
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

// What a task does when its partition's stored offset is outside the log (see [`range`]).

/// After an out-of-range error whose cause could not be established (the watermarks could
/// not be read, or show the position inside the log), how long before fetching there again.
const RETRY_FETCH_AFTER: Duration = Duration::from_secs(1);

/// At a partition task's start: `Some` (the task's exit) when the claim left the partition
/// stopped, after holding it until the task is cancelled; `None` to consume.
async fn at_start(task: &mut PartitionTask) -> Option<Exit> {
    let (c, t, p) = (&task.ctx.consumer, &task.ctx.topic, task.ctx.partition);
    let held = task
        .stats
        .held_out_of_range()
        .get(&(t.to_string(), p))
        .copied();
    match held {
        Some((end, epoch)) if epoch == task.ctx.epoch => Some(hold(task, Some(end)).await),
        _ => {
            crate::metrics::offset_range(c, t, p, None);
            None
        }
    }
}

/// Consumes nothing of the partition until the task is cancelled (revoked, or the worker
/// stopping), with the gauge at 1. Its queue is read and dropped: with `auto.offset.reset =
/// error` librdkafka stops fetching the partition at its first out-of-range fetch, and what it
/// fetched before (or after the log grew past the stored offset) is never applied and never
/// moves the stored offset.
async fn hold(task: &PartitionTask, end: Option<End>) -> Exit {
    let (c, t, p, epoch) = (
        Arc::clone(&task.ctx.consumer),
        Arc::clone(&task.ctx.topic),
        task.ctx.partition,
        task.ctx.epoch,
    );
    if let Some(end) = end {
        task.stats.out_of_range(&t, p, Some((end, epoch)));
        crate::metrics::offset_range(&c, &t, p, Some(end.as_str()));
    }
    // Cleared when the task ends, however it ends (aborted too), unless a newer claim of the
    // partition marked it since.
    struct Clear {
        stats: Arc<crate::stats::Stats>,
        key: (Arc<str>, Arc<str>, i32, i64),
    }
    impl Drop for Clear {
        fn drop(&mut self) {
            let (c, t, p, epoch) = &self.key;
            let ours = self
                .stats
                .held_out_of_range()
                .get(&(t.to_string(), *p))
                .is_some_and(|(_, e)| e == epoch);
            if ours {
                self.stats.out_of_range(t, *p, None);
                crate::metrics::offset_range(c, t, *p, None);
            }
        }
    }
    let _clear = Clear {
        stats: Arc::clone(&task.stats),
        key: (c, t, p, epoch),
    };
    let cancel = task.ctx.cancel.clone();
    loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return Exit::Stopped,
            m = task.queue.recv() => drop(m),
        }
    }
}

/// After librdkafka reported the task's fetch position out of range: reads the watermarks,
/// applies the policy and fetches again from where it says (`None`: consume on), or holds the
/// partition (`Some`: the task's exit). librdkafka stopped fetching the partition, and a
/// stopped partition cannot be seeked (`ERR__STATE`): it is taken out of the assignment and
/// put back at the new position (its split queue stays split). Under an eager assignor that
/// would restart every partition, so the partition is held instead, and the policy applies
/// when it is next claimed.
async fn after_reset_error(task: &mut PartitionTask) -> Option<Exit> {
    if !task.out_of_range.take() {
        return None;
    }
    let cancel = task.ctx.cancel.clone();
    let (c, t, p) = (
        Arc::clone(&task.ctx.consumer),
        Arc::clone(&task.ctx.topic),
        task.ctx.partition,
    );
    if !matches!(
        task.consumer.rebalance_protocol(),
        RebalanceProtocol::Cooperative
    ) {
        return Some(eager(task).await);
    }
    let Some(position) = task.next_offset else {
        // Never stored: placed by auto_offset_reset, and that placement is in the log.
        let offset = match task.config.auto_offset_reset {
            OffsetReset::Earliest => Offset::Beginning,
            OffsetReset::Latest => Offset::End,
        };
        tracing::warn!(consumer = %c, topic = %t, partition = p,
            "fetch out of range before anything was stored: placing the partition by auto_offset_reset again");
        return refetch(task, offset).err();
    };
    let log = match watermarks(&task.consumer, &t, p).await {
        Ok(log) => log,
        Err(e) => {
            tracing::warn!(consumer = %c, topic = %t, partition = p, position, error = %e,
                "librdkafka found the fetch position outside the log, and the watermarks cannot be read: fetching there again in 1 s");
            return again(task, position, &cancel).await;
        }
    };
    let Some(out) = check(position, log) else {
        tracing::warn!(consumer = %c, topic = %t, partition = p, position, low = log.low, high = log.high,
            "librdkafka found the fetch position outside the log, but it is inside now: fetching there again in 1 s");
        return again(task, position, &cancel).await;
    };
    let policy = task.config.on_offset_out_of_range;
    let to = match decide(policy, &out) {
        Action::Seek(to) => to,
        Action::Stop => {
            tracing::error!(consumer = %c, topic = %t, partition = p, position, low = log.low, high = log.high,
                "consumer {c}, {t}/{p}: {}; {STOP_ACTIONS}", out.sentence());
            return Some(hold(task, Some(out.end)).await);
        }
    };
    let mv = Move {
        epoch: task.ctx.epoch,
        from: Some(position),
        to,
    };
    let key = (&*c, &*t, p);
    match store_move(&task.ctx.pool, &task.ctx.retry, key, mv, &cancel).await {
        None => Some(Exit::Stopped),
        Some(Err(Refusal::Fenced { .. })) => {
            task.stats.fenced();
            crate::metrics::fenced(&c, &t, p);
            tracing::warn!(consumer = %c, topic = %t, partition = p, epoch = task.ctx.epoch,
                "fenced: another worker claimed this partition before its out-of-range reset was stored");
            Some(Exit::Fenced)
        }
        Some(Err(refusal)) => {
            tracing::error!(consumer = %c, topic = %t, partition = p, ?refusal,
                "the stored offset is not where this worker left it: claiming the partition again");
            Some(Exit::WentBack)
        }
        Some(Ok(())) => {
            tracing::warn!(consumer = %c, topic = %t, partition = p, position, low = log.low, high = log.high,
                "consumer {c}, {t}/{p}: {}; on_offset_out_of_range = \"{}\": {}",
                out.sentence(), policy.as_str(), what_a_seek_does(policy, &out, to));
            task.next_offset = Some(to);
            task.stats.committed_offset(&t, p, to);
            task.stats.offset_reset();
            crate::metrics::offset_range_reset(&c, &t, p, out.end.as_str());
            refetch(task, Offset::Offset(to)).err()
        }
    }
}

/// Under an eager assignor: librdkafka stopped fetching the partition, and restarting one
/// partition's fetch would take `assign()`, which replaces every partition's position. The
/// partition is held (the gauge shows the end when the watermarks say which), and a restart of
/// the worker applies the policy at the claim, before the assignment.
async fn eager(task: &mut PartitionTask) -> Exit {
    let (c, t, p) = (&task.ctx.consumer, &task.ctx.topic, task.ctx.partition);
    let out = match task.next_offset {
        Some(position) => watermarks(&task.consumer, t, p)
            .await
            .ok()
            .and_then(|log| check(position, log)),
        None => None,
    };
    let what = out.map_or_else(
        || "librdkafka found the fetch position outside the log".to_string(),
        |o| o.sentence(),
    );
    tracing::error!(consumer = %c, topic = %t, partition = p, position = ?task.next_offset,
        "consumer {c}, {t}/{p}: {what}; under an eager assignor one partition's fetch cannot be restarted: \
         not consuming the partition until it is claimed again (restart the worker; on_offset_out_of_range applies then)");
    hold(task, out.map(|o| o.end)).await
}

/// Waits [`RETRY_FETCH_AFTER`] (or the cancel), then fetches at `position` again.
async fn again(
    task: &mut PartitionTask,
    position: i64,
    cancel: &CancellationToken,
) -> Option<Exit> {
    tokio::select! {
        _ = cancel.cancelled() => return Some(Exit::Stopped),
        _ = tokio::time::sleep(RETRY_FETCH_AFTER) => {}
    }
    refetch(task, Offset::Offset(position)).err()
}

/// Restarts the partition's fetcher at `offset` (cooperative protocol only): out of the
/// assignment and back in. `Err` (the task's exit) when it cannot: the partition was revoked
/// meanwhile, or librdkafka refused.
///
/// Called outside the rebalance callback. A rebalance of this member that librdkafka started
/// but whose callback has not run yet can take these two calls for the application's answer
/// to it; the partitions then change hands a little early, which the epoch fence covers as it
/// covers any zombie.
fn refetch(task: &PartitionTask, offset: Offset) -> Result<(), Exit> {
    let (t, p) = (&*task.ctx.topic, task.ctx.partition);
    if task.ctx.cancel.is_cancelled() {
        return Err(Exit::Stopped);
    }
    let mut out = TopicPartitionList::new();
    out.add_partition(t, p);
    let mut back = TopicPartitionList::new();
    let restarted = back
        .add_partition_offset(t, p, offset)
        .and_then(|()| task.consumer.incremental_unassign(&out))
        .and_then(|()| task.consumer.incremental_assign(&back));
    match restarted {
        Ok(()) => {
            tracing::info!(consumer = %task.ctx.consumer, topic = t, partition = p, ?offset,
                "partition fetch restarted");
            Ok(())
        }
        Err(e) => {
            tracing::error!(consumer = %task.ctx.consumer, topic = t, partition = p, ?offset, error = %e,
                "could not restart the partition's fetch: leaving it unread until it is claimed again");
            Err(Exit::Stopped)
        }
    }
}
