//! The librdkafka context of a consumer: the rebalance callback, which blocks while the
//! coordinator ([`super::consumer`]) claims the assigned partitions in PostgreSQL, starts their
//! tasks, or drains the revoked ones (the `Event`s it sends), and librdkafka's statistics,
//! which feed the lag gauge from the offsets PostgreSQL stores.

use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;

use crate::config::OffsetReset;
use crate::health::ConsumerHealth;
use crate::stats::Stats;
use crate::store::offsets::Claim;

pub(super) use super::control::TopicPartition;

/// What the rebalance callback asks of the coordinator. The callback blocks on `reply`/`done`
/// until the coordinator answers or drops it.
pub(super) enum Event {
    /// Claim these partitions in PostgreSQL and say where each resumes.
    Claim {
        partitions: Vec<TopicPartition>,
        reply: SyncSender<Vec<(TopicPartition, Claim)>>,
    },
    /// They are assigned: split their queues and start their tasks.
    Start {
        claims: Vec<(TopicPartition, Claim)>,
        done: SyncSender<()>,
    },
    /// Stop these partitions' tasks; drop `done` when they have.
    Revoke {
        partitions: Vec<TopicPartition>,
        done: SyncSender<()>,
    },
}

/// The librdkafka context: it routes rebalances to the coordinator.
pub struct RebalanceContext {
    pub(super) name: String,
    /// Where PostgreSQL has each partition (for the lag gauge).
    pub(super) stats: Arc<Stats>,
    pub(super) events: mpsc::UnboundedSender<Event>,
    pub(super) revoke_deadline: Duration,
    pub(super) reset: OffsetReset,
    /// Readiness: in the group once an assignment went through, not ready while draining.
    pub(super) health: ConsumerHealth,
    /// Paused partitions: librdkafka stops fetching them, so its statistics' high watermark
    /// stands still; their lag is read from Kafka by the coordinator instead.
    pub(super) control: Arc<super::control::SourceControl>,
}

impl ClientContext for RebalanceContext {
    /// librdkafka's statistics (every `statistics.interval.ms`) carry each partition's high
    /// watermark; the lag that matters is from the offset stored in PostgreSQL, not Kafka's.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let stored = self.stats.committed_offsets();
        for (topic, t) in &statistics.topics {
            for (p, part) in &t.partitions {
                if *p < 0 || !part.desired || part.hi_offset < 0 {
                    continue;
                }
                let tp = (topic.clone(), *p);
                if self.control.is_paused(&tp) {
                    continue;
                }
                if let Some(next) = stored.get(&tp) {
                    crate::metrics::lag(&self.name, topic, *p, part.hi_offset - next);
                }
            }
        }
    }

    /// librdkafka also reports a fetch outside the log (`auto.offset.reset = error`) here, as
    /// a "global" error; the partition's task gets it on its queue and says what it does
    /// about it (see `range`), so this copy is only worth a debug line.
    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        if matches!(
            error.rdkafka_error_code(),
            Some(rdkafka::types::RDKafkaErrorCode::AutoOffsetReset)
        ) {
            tracing::debug!(consumer = %self.name, %error, reason, "librdkafka: fetch outside the log");
        } else {
            tracing::error!(consumer = %self.name, %error, reason, "librdkafka error");
        }
    }
}

impl ConsumerContext for RebalanceContext {
    fn rebalance(
        &self,
        base: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        self.stats.group_rebalance();
        crate::metrics::group_rebalance(&self.name);
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => self.assign(base, tpl),
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => self.revoke(base, tpl),
            other => {
                tracing::error!(consumer = %self.name, error = ?other, "rebalance error; dropping the assignment");
                self.health.left();
                let _ = base.unassign();
            }
        }
    }
}

fn partitions_of(tpl: &TopicPartitionList) -> Vec<TopicPartition> {
    tpl.elements()
        .iter()
        .map(|e| (e.topic().to_string(), e.partition()))
        .collect()
}

impl RebalanceContext {
    fn assign(&self, base: &BaseConsumer<Self>, tpl: &mut TopicPartitionList) {
        let partitions = partitions_of(tpl);
        let cooperative = matches!(base.rebalance_protocol(), RebalanceProtocol::Cooperative);
        let mut claims = Vec::new();
        if !partitions.is_empty() {
            let (reply, answer) = sync_channel(1);
            if self
                .events
                .send(Event::Claim {
                    partitions: partitions.clone(),
                    reply,
                })
                .is_ok()
            {
                claims = answer.recv().unwrap_or_default();
            }
            if claims.len() != partitions.len() {
                // Stopping: take nothing. The group gives the partitions to someone else.
                tracing::warn!(consumer = %self.name, "could not claim the assigned partitions; not consuming them");
                let _ = if cooperative { Ok(()) } else { base.unassign() };
                return;
            }
            for ((topic, partition), claim) in &claims {
                let offset = match claim.next_offset {
                    Some(o) => Offset::Offset(o),
                    None => match self.reset {
                        OffsetReset::Earliest => Offset::Beginning,
                        OffsetReset::Latest => Offset::End,
                    },
                };
                let _ = tpl.set_partition_offset(topic, *partition, offset);
            }
        }
        let result = if cooperative {
            base.incremental_assign(tpl)
        } else {
            base.assign(tpl)
        };
        if let Err(e) = result {
            tracing::error!(consumer = %self.name, error = %e, "assign failed");
            return;
        }
        tracing::info!(consumer = %self.name, partitions = ?partitions, "partitions assigned");
        if !claims.is_empty() {
            let (done, wait) = sync_channel(0);
            if self.events.send(Event::Start { claims, done }).is_ok() {
                // Returns when the coordinator drops `done`: every queue split and seeked.
                while wait.recv().is_ok() {}
            }
        }
        // A member of the group with its assignment started, even an empty one.
        self.health.joined();
    }

    fn revoke(&self, base: &BaseConsumer<Self>, tpl: &TopicPartitionList) {
        let partitions = partitions_of(tpl);
        tracing::info!(consumer = %self.name, partitions = ?partitions, "partitions revoked");
        let _draining = self.health.draining();
        let (done, wait) = sync_channel(0);
        if self.events.send(Event::Revoke { partitions, done }).is_ok() {
            let deadline = Instant::now() + self.revoke_deadline + Duration::from_secs(1);
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match wait.recv_timeout(left) {
                    Ok(()) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                    Err(RecvTimeoutError::Timeout) => {
                        tracing::error!(consumer = %self.name, "revocation did not drain in time");
                        break;
                    }
                }
            }
        }
        let result = if matches!(base.rebalance_protocol(), RebalanceProtocol::Cooperative) {
            base.incremental_unassign(tpl)
        } else {
            base.unassign()
        };
        if let Err(e) = result {
            tracing::error!(consumer = %self.name, error = %e, "unassign failed");
        }
    }
}
