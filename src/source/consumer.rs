//! Group membership and rebalances for one configured consumer.
//!
//! - The main consumer queue is polled on a dedicated thread, because librdkafka runs the
//!   rebalance callback inside that poll and our callback *blocks*: on assignment it waits for
//!   PostgreSQL to hand out the partitions' epochs and stored offsets, on revocation it waits
//!   for the partitions' in-flight batches. Blocking a tokio worker instead could starve the
//!   very tasks it waits for.
//! - On assignment the callback assigns with the offsets read from PostgreSQL (never Kafka's
//!   committed ones), then the coordinator splits each partition's queue, seeks it to the same
//!   offset (anything fetched before the split is discarded by librdkafka's seek barrier and
//!   fetched again through the partition's own queue) and starts one task per partition.
//! - On revocation the callback waits, up to `worker.revoke_deadline` (checked at start-up to
//!   be below the session timeout), for the revoked partitions' tasks to finish or abandon
//!   their batch; a task still running then is aborted, and the epoch fence makes anything it
//!   might still try roll back.
//! - Assignment is cooperative-sticky by default: a rebalance revokes and assigns only the
//!   partitions that change owner, and the callbacks get just those, so the other partitions'
//!   tasks run on through it. (An eager assignor set in `kafka.options` works the same way,
//!   with every partition revoked and claimed again at each rebalance.)
//! - A partition task that was fenced is claimed again a few seconds later if the group still
//!   assigns the partition here (`FENCED_RECLAIM_AFTER`); with the cooperative protocol no
//!   rebalance would otherwise restart it.
//! - A partition task whose batch found the offset store gone back (PostgreSQL lost its last
//!   commits) is claimed again at once, and its new task seeks to the offset the claim reads.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::{ClientConfig, Offset};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::context::{Event, RebalanceContext, TopicPartition};
use super::control::{Gate, Snapshot, SourceControl};
use super::partition::{Exit, PartitionTask};
use crate::config::{ConsumerConfig, OffsetReset};
use crate::envelope::Decoder;
use crate::handler::Handler;
use crate::health::ConsumerHealth;
use crate::stats::Stats;
use crate::store::offsets::{self, Claim};
use crate::store::partitions::Known;
use crate::strategy::{PartitionCtx, Strategy};

/// How long a fenced partition waits before this worker claims it again, if Kafka still
/// assigns it here then. Fenced means another worker claimed the partition in PostgreSQL: the
/// group gave it away (this worker missed its session, and hears so at its next heartbeat,
/// then loses the partition), or someone claimed it outside the group. With the cooperative
/// protocol no later rebalance re-assigns a partition that did not move, so without this a
/// partition the group still gives this worker would stay unread.
const FENCED_RECLAIM_AFTER: Duration = Duration::from_secs(3);

/// The coordinator's heartbeat period. Its loop wakes every second, but starting a partition
/// splits and seeks its queue synchronously (librdkafka calls, up to 10 s in the worst case):
/// 10 s, so `/healthz` calls it stale after 30 s without a turn. Drains and claims wait longer
/// than that, bounded by their own deadlines, and beat meanwhile.
const COORDINATOR_PERIOD: Duration = Duration::from_secs(10);

/// How often the lag of a paused partition is read from Kafka (librdkafka's statistics stop
/// following a partition it does not fetch).
const PAUSED_LAG_EVERY: Duration = Duration::from_secs(5);

/// One configured consumer, wired: what its partition tasks share.
pub struct Source {
    pub config: Arc<ConsumerConfig>,
    pub kafka: crate::config::KafkaConfig,
    pub worker_id: String,
    pub revoke_deadline: Duration,
    /// `database.transaction_deadline`: the longest a claim or a batch waits for PostgreSQL.
    pub transaction_deadline: Duration,
    pub pool: deadpool_postgres::Pool,
    pub handler: Arc<dyn Handler>,
    pub strategy: Arc<dyn Strategy>,
    pub partitions: Arc<Known>,
    pub stats: Arc<Stats>,
    pub health: ConsumerHealth,
    /// Pauses, throttle and resets set by an operator (see [`super::control`]).
    pub control: Arc<SourceControl>,
}

/// Errors that stop a consumer.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("consumer {consumer:?}: {reason}")]
    Fatal { consumer: String, reason: String },
}

struct Running {
    cancel: CancellationToken,
    handle: JoinHandle<Exit>,
    /// The epoch its claim took: an operator's reset leaves a higher one.
    epoch: i64,
    /// Whether the task is paused (it reads this before each record).
    paused: tokio::sync::watch::Sender<bool>,
}

/// A partition task never outlives its coordinator: if the coordinator is dropped (the worker
/// aborted, as in a crash), its tasks stop instead of consuming their queues unsupervised.
impl Drop for Running {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

impl Source {
    /// The engine's consumer properties, handed to [`crate::config::KafkaConfig::client_config`], which adds
    /// the brokers and security settings first and `kafka.options` last (they win).
    fn client_config(&self) -> Result<ClientConfig, SourceError> {
        let properties = [
            ("group.id", self.config.group_id().to_string()),
            ("client.id", format!("effectively-{}", self.worker_id)),
            // Offsets are stored by hand after each PostgreSQL commit, and only those are
            // committed to Kafka, in the background, on revocation and on close.
            ("enable.auto.commit", "true".into()),
            ("auto.commit.interval.ms", "1000".into()),
            ("enable.auto.offset.store", "false".into()),
            // With split partition queues these bound each partition's prefetch (librdkafka's
            // defaults, 100,000 messages and 64 MiB, would let a backlog of 6 partitions take
            // 384 MiB). 4 MiB is still several full batches ahead of the transaction.
            ("queued.min.messages", "20000".into()),
            ("queued.max.messages.kbytes", "4096".into()),
            // Incremental rebalances: a member joining or leaving moves only the partitions
            // that change owner, and the others keep committing through it (the eager
            // protocols revoke every partition of every member first). The rebalance callback
            // handles both; `kafka.options` may still pick another assignor.
            ("partition.assignment.strategy", "cooperative-sticky".into()),
            // Feeds the consumer lag gauge (see `RebalanceContext::stats`).
            ("statistics.interval.ms", "5000".into()),
            // Every partition is assigned at an explicit position (the stored offset, or
            // Beginning/End by `auto_offset_reset` for one never stored), so librdkafka resets
            // only when that position is outside the log: it must not jump by itself, but
            // report it, for `on_offset_out_of_range` to decide (see `range`).
            ("auto.offset.reset", "error".into()),
            (
                "session.timeout.ms",
                self.kafka.session_timeout.as_millis().to_string(),
            ),
            // How soon a member hears of a rebalance (librdkafka's default is 3 s): a member
            // that left or joined waits for the others' next heartbeat, twice with the
            // cooperative protocol, and the partitions that move stand still meanwhile. A
            // heartbeat is a few dozen bytes: four a second per member cost the coordinator
            // nothing noticeable.
            ("heartbeat.interval.ms", "250".into()),
            // How long the broker holds a fetch that finds nothing new (librdkafka's default
            // is 500 ms). A partition that changes owner is stopped only once its fetcher's
            // request in flight returns, and the cooperative protocol's second round waits for
            // that: with 500 ms a join stalled the moving partitions for about a second
            // (`make bench`, joins phase). An idle fetch every 100 ms per broker is a few
            // hundred bytes.
            ("fetch.wait.max.ms", "100".into()),
            (
                "max.poll.interval.ms",
                self.kafka.max_poll_interval.as_millis().to_string(),
            ),
        ];
        // Static membership (KIP-345): the same id after a restart takes the member's place
        // and its assignment, with no rebalance, if it comes back within the session timeout.
        let properties = properties.into_iter().chain(
            self.kafka
                .static_membership
                .then(|| ("group.instance.id", self.instance_id())),
        );
        // Kafka's consumer group protocol (KIP-848, `kafka.options."group.protocol" =
        // "consumer"`): the coordinator assigns, and the session and heartbeat are the broker's
        // (`group.consumer.*`); librdkafka refuses a client that sets the classic protocol's.
        let classic_only = [
            "partition.assignment.strategy",
            "session.timeout.ms",
            "heartbeat.interval.ms",
        ];
        let new_protocol =
            self.kafka.options.get("group.protocol").map(String::as_str) == Some("consumer");
        let properties: Vec<(&str, String)> = properties
            .filter(|(k, _)| !(new_protocol && classic_only.contains(k)))
            .collect();
        self.kafka
            .client_config(&properties)
            .map_err(|reason| SourceError::Fatal {
                consumer: self.config.name.clone(),
                reason,
            })
    }

    /// `group.instance.id` with static membership: the worker id and the consumer, unique in
    /// the group as long as worker ids are unique.
    fn instance_id(&self) -> String {
        format!("{}-{}", self.worker_id, self.config.name)
    }

    /// Consumes until `shutdown` is cancelled, or a partition hits a fatal error.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), SourceError> {
        let (events_tx, mut events) = mpsc::unbounded_channel();
        let context = RebalanceContext {
            name: self.config.name.clone(),
            stats: Arc::clone(&self.stats),
            events: events_tx,
            revoke_deadline: self.revoke_deadline,
            reset: self.config.auto_offset_reset,
            health: self.health.clone(),
            control: Arc::clone(&self.control),
        };
        let consumer: Arc<StreamConsumer<RebalanceContext>> =
            Arc::new(self.client_config()?.create_with_context(context)?);
        // The operator's control state, read before the first claim and every second after.
        let control_stop = CancellationToken::new();
        let _control_guard = control_stop.clone().drop_guard();
        self.control.reader.refresh().await;
        tokio::spawn(Arc::clone(&self.control.reader).run(control_stop.clone()));
        let mut control = self.control.reader.subscribe();
        // Applied once at the start too: a throttle set before this worker started.
        control.mark_changed();
        let mut paused_lag_at = tokio::time::Instant::now();
        let topics: Vec<&str> = self.config.topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topics)?;

        let driver_stop = CancellationToken::new();
        // If this future is dropped (the worker aborted, as in a crash), the main-queue thread
        // stops too and the consumer leaves the group instead of holding partitions no task
        // reads.
        let _driver_guard = driver_stop.clone().drop_guard();
        let driver = spawn_main_queue_driver(
            Arc::clone(&consumer),
            driver_stop.clone(),
            self.config.name.clone(),
        );

        let decoder = Arc::new(
            Decoder::new(
                &self.config.message_id,
                &self.config.event_date,
                self.config.max_payload_bytes,
                self.handler.needs_json() || self.config.version.is_some(),
            )
            .with_tombstones(self.config.on_tombstone)
            .with_envelope(self.config.envelope)
            .with_payload(&self.config.payload)
            .map_err(|reason| SourceError::Fatal {
                consumer: self.config.name.clone(),
                reason,
            })?,
        );
        let (exit_tx, mut exits) = mpsc::unbounded_channel::<(TopicPartition, Exit)>();
        // Fenced partitions, sent back after FENCED_RECLAIM_AFTER to be claimed again if Kafka
        // still assigns them to this worker.
        let (reclaim_tx, mut reclaims) = mpsc::unbounded_channel::<TopicPartition>();
        let mut running: HashMap<TopicPartition, Running> = HashMap::new();
        let mut failure = None;
        let beat = self.health.heartbeat("source", COORDINATOR_PERIOD);
        let mut tick = tokio::time::interval(Duration::from_secs(1));

        loop {
            beat.beat();
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                Some((tp, exit)) = exits.recv() => match exit {
                    Exit::Fatal(reason) => {
                        tracing::error!(consumer = %self.config.name, topic = %tp.0, partition = tp.1, %reason, "fatal error; stopping the worker");
                        failure = Some(reason);
                        break;
                    }
                    Exit::Fenced => {
                        let reclaim = reclaim_tx.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(FENCED_RECLAIM_AFTER).await;
                            let _ = reclaim.send(tp);
                        });
                    }
                    Exit::WentBack => {
                        // At once: the partition is still ours, only PostgreSQL forgot our last
                        // commits. The task has returned (its exit is sent last); the new claim
                        // reads where PostgreSQL stands and the new task seeks there.
                        let _recovering = self.health.recovering();
                        beat.during(async {
                            if let Some(mut old) = running.remove(&tp) {
                                let _ = (&mut old.handle).await;
                            }
                            if assigned(&consumer, &tp) {
                                self.reclaim(&consumer, &decoder, &tp, &exit_tx, &shutdown, &mut running).await;
                            }
                        }).await;
                    }
                    Exit::Stopped => {}
                },
                Some(tp) = reclaims.recv() => {
                    // Only if its task is still the fenced one (no rebalance restarted it since)
                    // and Kafka still has the partition with us.
                    let fenced = running.get(&tp).is_some_and(|r| r.handle.is_finished());
                    if fenced && assigned(&consumer, &tp) {
                        tracing::warn!(consumer = %self.config.name, topic = %tp.0, partition = tp.1,
                            "the group still assigns a fenced partition to this worker: claiming it again");
                        let _recovering = self.health.recovering();
                        beat.during(self.reclaim(&consumer, &decoder, &tp, &exit_tx, &shutdown, &mut running)).await;
                    }
                }
                Some(event) = events.recv() => match event {
                    Event::Claim { partitions, reply } => {
                        let claims = beat.during(async {
                            let claims = self.claim_all(&partitions, &shutdown).await;
                            super::range::at_claim(&self.config, &self.pool, &self.stats, &consumer, claims, &shutdown).await
                        }).await;
                        let _ = reply.send(claims);
                    }
                    Event::Start { claims, done } => {
                        let n = claims.len();
                        // A pause set since the last read must hold from the first record.
                        beat.during(self.control.reader.refresh()).await;
                        for (tp, claim) in claims {
                            if let Some(old) = running.remove(&tp) {
                                old.cancel.cancel();
                                old.handle.abort();
                            }
                            match self.start_partition(&consumer, &decoder, &tp, claim, &exit_tx) {
                                Some(r) => { running.insert(tp, r); }
                                None => tracing::error!(consumer = %self.config.name, topic = %tp.0, partition = tp.1, "could not split the partition queue"),
                            }
                        }
                        self.stats.rebalance();
                        crate::metrics::partitions_assigned(&self.config.name, n, running.len());
                        drop(done);
                    }
                    Event::Revoke { partitions, done } => {
                        let stopping: Vec<Running> = partitions.iter().filter_map(|tp| running.remove(tp)).collect();
                        for tp in &partitions {
                            // Not ours any more: stop reporting its lag (the new owner does).
                            self.stats.released(&tp.0, tp.1);
                            crate::metrics::lag(&self.config.name, &tp.0, tp.1, 0);
                        }
                        crate::metrics::partitions_revoked(&self.config.name, partitions.len(), running.len());
                        beat.during(drain(stopping, self.revoke_deadline)).await;
                        drop(done);
                    }
                },
                Ok(()) = control.changed() => {
                    let snapshot = control.borrow_and_update().clone();
                    beat.during(self.apply_control(&consumer, &decoder, &snapshot, &exit_tx, &shutdown, &mut running)).await;
                }
                _ = tick.tick() => {
                    if paused_lag_at.elapsed() >= PAUSED_LAG_EVERY {
                        paused_lag_at = tokio::time::Instant::now();
                        self.paused_lag(&consumer);
                    }
                }
            }
        }

        // Stop: finish in-flight batches, then leave the group.
        let all: Vec<Running> = running.drain().map(|(_, r)| r).collect();
        drain(all, self.revoke_deadline).await;
        if self.kafka.static_membership && failure.is_none() {
            // A static member does not leave: it closes, and the group keeps its partitions
            // for it until the session times out (KIP-345), so a restart within that gets them
            // back without a rebalance. Unsubscribing would leave the group. The close's own
            // revocation finds no coordinator to ask (the channel is closed) and returns.
            drop(events);
            driver_stop.cancel();
            let _ = tokio::task::spawn_blocking(move || driver.join()).await;
            let name = self.config.name.clone();
            let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
            tracing::info!(consumer = %name, "closed as a static member: the group keeps the partitions until the session timeout");
            return Ok(());
        }
        // Leaving the group revokes the assignment through the callback, which still needs the
        // coordinator to answer: serve it (there is nothing left to drain) until it is done.
        // The channel never closes (the context holds its sender): the wait ends when the
        // assignment is empty, that is when the revocation went through.
        consumer.unsubscribe();
        let serve = async {
            loop {
                let tick = tokio::time::sleep(Duration::from_millis(20));
                tokio::select! {
                    Some(event) = events.recv() => match event {
                        Event::Claim { reply, .. } => drop(reply),
                        Event::Start { done, .. } | Event::Revoke { done, .. } => drop(done),
                    },
                    _ = tick => {
                        if consumer.assignment().is_ok_and(|a| a.count() == 0) {
                            break;
                        }
                    }
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), serve).await;
        driver_stop.cancel();
        let _ = tokio::task::spawn_blocking(move || driver.join()).await;
        match failure {
            Some(reason) => Err(SourceError::Fatal {
                consumer: self.config.name.clone(),
                reason,
            }),
            None => Ok(()),
        }
    }

    /// Applies an operator's control state to the partitions running here: pauses and resumes
    /// them, sets the rate, and claims again a partition an operator reset.
    async fn apply_control(
        &self,
        consumer: &Arc<StreamConsumer<RebalanceContext>>,
        decoder: &Arc<Decoder>,
        snapshot: &Snapshot,
        exits: &mpsc::UnboundedSender<(TopicPartition, Exit)>,
        shutdown: &CancellationToken,
        running: &mut HashMap<TopicPartition, Running>,
    ) {
        let name = &self.config.name;
        let limit = snapshot.throttle.or(self.config.rate_limit());
        if self.control.rate.set(limit) {
            match limit {
                Some(t) => {
                    tracing::info!(consumer = %name, max_rate = t.max_rate, burst = t.burst, "rate limit set")
                }
                None => tracing::info!(consumer = %name, "rate limit lifted"),
            }
        }
        crate::metrics::max_rate(name, limit.map(|t| t.max_rate));
        for (tp, r) in running.iter() {
            self.set_paused(consumer, tp, r, snapshot.paused(tp));
        }
        // Resets: the task's epoch is below the one an operator's reset left.
        let reset: Vec<TopicPartition> = (snapshot.resets.iter())
            .filter(|(tp, epoch)| running.get(*tp).is_some_and(|r| r.epoch < **epoch))
            .map(|(tp, _)| tp.clone())
            .collect();
        for tp in reset {
            tracing::info!(consumer = %name, topic = %tp.0, partition = tp.1,
                "an operator reset this partition's offset: claiming it again from the new offset");
            if let Some(old) = running.remove(&tp) {
                drain(vec![old], self.revoke_deadline).await;
            }
            if assigned(consumer, &tp) {
                self.reclaim(consumer, decoder, &tp, exits, shutdown, running)
                    .await;
            }
        }
    }

    /// Pauses or resumes one running partition, if that changes it: its task's gate, and its
    /// fetcher in librdkafka.
    fn set_paused(
        &self,
        consumer: &StreamConsumer<RebalanceContext>,
        tp: &TopicPartition,
        r: &Running,
        paused: bool,
    ) {
        self.control.mark_paused(tp, paused);
        if *r.paused.borrow() == paused {
            return;
        }
        r.paused.send_replace(paused);
        self.pause_fetcher(consumer, tp, paused);
    }

    /// Pauses or resumes the partition's fetcher in librdkafka, with the gauge and a log line.
    fn pause_fetcher(
        &self,
        consumer: &StreamConsumer<RebalanceContext>,
        tp: &TopicPartition,
        paused: bool,
    ) {
        let mut tpl = rdkafka::TopicPartitionList::new();
        tpl.add_partition(&tp.0, tp.1);
        let done = if paused {
            consumer.pause(&tpl)
        } else {
            consumer.resume(&tpl)
        };
        let (name, verb) = (&self.config.name, if paused { "paused" } else { "resumed" });
        match done {
            Ok(()) => {
                tracing::info!(consumer = %name, topic = %tp.0, partition = tp.1, "{verb} by an operator")
            }
            Err(e) => tracing::warn!(consumer = %name, topic = %tp.0, partition = tp.1, error = %e,
                "{verb} by an operator, but librdkafka refused to {verb} the fetcher (the task's gate holds anyway)"),
        }
        crate::metrics::partition_paused(name, &tp.0, tp.1, paused);
    }

    /// Sets the lag gauge of each paused partition from Kafka's high watermark, in the
    /// background (a watermark read blocks).
    fn paused_lag(&self, consumer: &Arc<StreamConsumer<RebalanceContext>>) {
        let paused: Vec<TopicPartition> = self
            .control
            .paused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect();
        if paused.is_empty() {
            return;
        }
        let (consumer, stats, name) = (
            Arc::clone(consumer),
            Arc::clone(&self.stats),
            self.config.name.clone(),
        );
        tokio::spawn(async move {
            let stored = stats.committed_offsets();
            for tp in paused {
                let Some(next) = stored.get(&tp).copied() else {
                    continue;
                };
                if let Ok(log) = super::range::watermarks(&consumer, &tp.0, tp.1).await {
                    crate::metrics::lag(&name, &tp.0, tp.1, log.high - next);
                }
            }
        });
    }

    /// Claims one partition again and restarts its task from the offset the claim reads.
    async fn reclaim(
        &self,
        consumer: &Arc<StreamConsumer<RebalanceContext>>,
        decoder: &Arc<Decoder>,
        tp: &TopicPartition,
        exits: &mpsc::UnboundedSender<(TopicPartition, Exit)>,
        shutdown: &CancellationToken,
        running: &mut HashMap<TopicPartition, Running>,
    ) {
        let claims = self.claim_all(std::slice::from_ref(tp), shutdown).await;
        for (tp, claim) in super::range::at_claim(
            &self.config,
            &self.pool,
            &self.stats,
            consumer,
            claims,
            shutdown,
        )
        .await
        {
            running.remove(&tp);
            if let Some(r) = self.start_partition(consumer, decoder, &tp, claim, exits) {
                running.insert(tp, r);
            }
        }
    }

    /// Claims every partition, retrying while PostgreSQL is unreachable. Empty when stopping.
    async fn claim_all(
        &self,
        partitions: &[TopicPartition],
        shutdown: &CancellationToken,
    ) -> Vec<(TopicPartition, Claim)> {
        let mut attempt = 0;
        loop {
            match self.try_claim_all(partitions).await {
                Ok(c) => return c,
                Err(e) => {
                    attempt += 1;
                    tracing::warn!(consumer = %self.config.name, error = %e, attempt, "claiming partitions failed; retrying");
                    let pause = crate::strategy::backoff(&self.config.retry, attempt);
                    tokio::select! {
                        _ = shutdown.cancelled() => return Vec::new(),
                        _ = tokio::time::sleep(pause) => {}
                    }
                }
            }
        }
    }

    async fn try_claim_all(
        &self,
        partitions: &[TopicPartition],
    ) -> Result<Vec<(TopicPartition, Claim)>, crate::store::StoreError> {
        let client = self.pool.get().await?;
        let claims = async {
            let mut out = Vec::with_capacity(partitions.len());
            for tp in partitions {
                let claim =
                    offsets::claim(&**client, &self.config.name, &tp.0, tp.1, &self.worker_id)
                        .await?;
                tracing::info!(consumer = %self.config.name, topic = %tp.0, partition = tp.1,
                    epoch = claim.epoch, next_offset = ?claim.next_offset, "claimed partition");
                out.push((tp.clone(), claim));
            }
            Ok(out)
        };
        let result = tokio::time::timeout(self.transaction_deadline, claims)
            .await
            .unwrap_or(Err(crate::store::StoreError::Timeout(
                self.transaction_deadline,
            )));
        if result.is_err() {
            // Closed, frozen or read-only: not for the next claim (see `pool::discard`).
            crate::store::pool::discard(client);
        }
        result
    }

    fn start_partition(
        &self,
        consumer: &Arc<StreamConsumer<RebalanceContext>>,
        decoder: &Arc<Decoder>,
        tp: &TopicPartition,
        claim: Claim,
        exits: &mpsc::UnboundedSender<(TopicPartition, Exit)>,
    ) -> Option<Running> {
        let queue = consumer.split_partition_queue(&tp.0, tp.1)?;
        if let Some(next) = claim.next_offset {
            self.stats.committed_offset(&tp.0, tp.1, next);
        }
        let offset = match claim.next_offset {
            Some(o) => Offset::Offset(o),
            None => match self.config.auto_offset_reset {
                OffsetReset::Earliest => Offset::Beginning,
                OffsetReset::Latest => Offset::End,
            },
        };
        if let Err(e) = consumer.seek(&tp.0, tp.1, offset, Duration::from_secs(10)) {
            tracing::warn!(consumer = %self.config.name, topic = %tp.0, partition = tp.1, error = %e, "seek after split failed; relying on the assigned offset");
        }
        let cancel = CancellationToken::new();
        let paused = self.control.reader.latest().paused(tp);
        let (paused_tx, paused_rx) = tokio::sync::watch::channel(paused);
        let task = PartitionTask {
            ctx: PartitionCtx {
                consumer: Arc::from(self.config.name.as_str()),
                topic: Arc::from(tp.0.as_str()),
                partition: tp.1,
                epoch: claim.epoch,
                pool: self.pool.clone(),
                handler: Arc::clone(&self.handler),
                retry: self.config.retry.clone(),
                partitions: Arc::clone(&self.partitions),
                cancel: cancel.clone(),
                version: self.config.version.clone().map(Arc::new),
                deadline: self.transaction_deadline,
                dedupe: self.config.dedupe,
            },
            queue,
            consumer: Arc::clone(consumer),
            decoder: Arc::clone(decoder),
            config: Arc::clone(&self.config),
            strategy: Arc::clone(&self.strategy),
            stats: Arc::clone(&self.stats),
            metrics: crate::metrics::PartitionMetrics::new(&self.config.name, &tp.0, tp.1),
            next_offset: claim.next_offset,
            limit: self.config.batch.max_messages,
            out_of_range: Default::default(),
            watch: super::watch::PartitionWatch::new(
                Arc::from(self.config.name.as_str()),
                Arc::from(tp.0.as_str()),
                tp.1,
                claim.epoch,
                self.config.stall_after,
                &self.health,
                self.pool.clone(),
                self.transaction_deadline,
            ),
            gate: Gate {
                paused: paused_rx,
                rate: Arc::clone(&self.control.rate),
                credit: 0,
            },
        };
        let exits = exits.clone();
        let key = tp.clone();
        let handle = tokio::spawn(async move {
            let exit = task.run().await;
            let _ = exits.send((key, exit.clone()));
            exit
        });
        let running = Running {
            cancel,
            handle,
            epoch: claim.epoch,
            paused: paused_tx,
        };
        // Paused from its first record: the task waits at its gate, librdkafka fetches nothing.
        self.control.mark_paused(tp, paused);
        match paused {
            true => self.pause_fetcher(consumer, tp, true),
            false => crate::metrics::partition_paused(&self.config.name, &tp.0, tp.1, false),
        }
        Some(running)
    }
}

/// Whether Kafka assigns `tp` to this worker now.
fn assigned(consumer: &StreamConsumer<RebalanceContext>, tp: &TopicPartition) -> bool {
    consumer
        .assignment()
        .is_ok_and(|a| a.find_partition(&tp.0, tp.1).is_some())
}

/// Cancels the tasks and waits for them up to `deadline`; aborts what is still running then.
async fn drain(tasks: Vec<Running>, deadline: Duration) {
    for t in &tasks {
        t.cancel.cancel();
    }
    let until = tokio::time::Instant::now() + deadline;
    for mut t in tasks {
        if tokio::time::timeout_at(until, &mut t.handle).await.is_err() {
            tracing::error!(
                "a partition task did not stop within the revoke deadline; aborting it"
            );
            t.handle.abort();
        }
    }
}

/// Polls the main queue on its own thread: it serves rebalance callbacks and events. With every
/// partition's queue split off, records never arrive here; one that does was fetched before its
/// partition's seek, and is fetched again through the partition's queue.
fn spawn_main_queue_driver(
    consumer: Arc<StreamConsumer<RebalanceContext>>,
    stop: CancellationToken,
    name: String,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name(format!("kafka-main-{name}"))
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start the main-queue runtime");
                    return;
                }
            };
            rt.block_on(async move {
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        m = consumer.recv() => match m {
                            Ok(m) => tracing::debug!(consumer = %name, partition = rdkafka::Message::partition(&m),
                                offset = rdkafka::Message::offset(&m), "record on the main queue; it is re-fetched after the seek"),
                            Err(e) => tracing::warn!(consumer = %name, error = %e, "kafka consumer error"),
                        }
                    }
                }
            });
        })
        .expect("spawning a thread")
}
