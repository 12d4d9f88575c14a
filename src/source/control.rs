//! What an operator set on a running consumer, applied by each of its workers within about a
//! second ([`PERIOD`]), with no restart and no rebalance:
//!
//! - **Paused** scopes (`consumer_pauses`): a paused partition stays assigned and claimed, its
//!   fetcher is paused in librdkafka (nothing is fetched) and its task takes no record, so its
//!   lag grows; readiness is not affected. A batch already taken commits first.
//! - **Throttle** (`consumer_throttles`, else the config's `max_rate`): one token bucket per
//!   consumer and worker, shared by its partition tasks; each record takes a token.
//! - **Resets** (`effectively offsets reset`): a partition whose row says `reset:<actor>` with
//!   an epoch above the one its task holds is claimed again at once, from the new offset. The
//!   epoch bump alone already fences the old task (its next commit rolls back); this only saves
//!   the wait, and wakes a partition with no traffic, which would never commit.
//!
//! The state is polled rather than sent with `LISTEN/NOTIFY`: a notification is lost while the
//! connection is down, a poll of three small indexed reads a second is not, and it needs no
//! connection held outside the pool.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use tokio::sync::watch;
use tokio_postgres::GenericClient;
use tokio_util::sync::CancellationToken;

use crate::store::control::{self, Scope, Throttle};
use crate::store::offsets::RESET_OWNER_PREFIX;
use crate::store::StoreError;

/// A partition of a topic, as the source keys its tasks.
pub type TopicPartition = (String, i32);

/// How often a worker reads its consumers' control state.
pub const PERIOD: Duration = Duration::from_secs(1);

/// What PostgreSQL says about one consumer's control.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub pauses: Vec<Scope>,
    /// The run-time rate, if one is set.
    pub throttle: Option<Throttle>,
    /// Partitions an operator reset and no worker claimed since: their epochs now.
    pub resets: HashMap<TopicPartition, i64>,
}

impl Snapshot {
    pub fn paused(&self, tp: &TopicPartition) -> bool {
        self.pauses.iter().any(|s| s.covers(&tp.0, tp.1))
    }
}

const RESETS: &str = "\
SELECT topic, partition, epoch FROM consumer_offsets
WHERE consumer = $1 AND starts_with(owner, $2)";

/// Reads `consumer`'s control state.
pub async fn read<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<Snapshot, StoreError> {
    let pauses = control::pauses(client, consumer).await?;
    let throttle = control::throttle(client, consumer).await?;
    let resets = client
        .query(RESETS, &[&consumer, &RESET_OWNER_PREFIX])
        .await?
        .iter()
        .map(|r| {
            (
                (r.get::<_, String>(0), r.get::<_, i32>(1)),
                r.get::<_, i64>(2),
            )
        })
        .collect();
    Ok(Snapshot {
        pauses: pauses.into_iter().map(|p| p.scope).collect(),
        throttle,
        resets,
    })
}

/// The latest snapshot of one consumer, refreshed every [`PERIOD`] by [`Reader::run`] and on
/// demand (before partitions start, so a paused partition never takes a record).
pub struct Reader {
    consumer: String,
    pool: deadpool_postgres::Pool,
    deadline: Duration,
    tx: watch::Sender<Snapshot>,
}

impl Reader {
    pub fn new(consumer: &str, pool: deadpool_postgres::Pool, deadline: Duration) -> Arc<Reader> {
        Arc::new(Reader {
            consumer: consumer.to_string(),
            pool,
            deadline,
            tx: watch::Sender::new(Snapshot::default()),
        })
    }

    pub fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.tx.subscribe()
    }

    pub fn latest(&self) -> Snapshot {
        self.tx.borrow().clone()
    }

    /// Reads the state now; on failure the last snapshot stays (logged, retried next period).
    pub async fn refresh(&self) {
        let read = async {
            let client = self.pool.get().await.map_err(|e| e.to_string())?;
            read(&**client, &self.consumer)
                .await
                .map_err(|e| e.to_string())
        };
        match tokio::time::timeout(self.deadline, read).await {
            Ok(Ok(s)) => {
                self.tx.send_if_modified(|old| {
                    let changed = *old != s;
                    *old = s;
                    changed
                });
            }
            Ok(Err(e)) => {
                tracing::debug!(consumer = %self.consumer, error = %e, "reading the consumer's control state failed; keeping the last")
            }
            Err(_) => {
                tracing::debug!(consumer = %self.consumer, "reading the consumer's control state timed out; keeping the last")
            }
        }
    }

    /// Refreshes every [`PERIOD`] until `stop`.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => self.refresh().await,
            }
        }
    }
}

/// One consumer's control in this worker: its reader, its rate, and which of its partitions
/// are paused here now (the lag gauge reads those from Kafka itself, see [`paused_lag`]).
pub struct SourceControl {
    pub reader: Arc<Reader>,
    pub rate: Arc<Rate>,
    pub paused: Arc<std::sync::Mutex<std::collections::HashSet<TopicPartition>>>,
}

impl SourceControl {
    pub fn new(
        consumer: &crate::config::ConsumerConfig,
        pool: deadpool_postgres::Pool,
        deadline: Duration,
    ) -> Arc<SourceControl> {
        let rate = Rate::default();
        rate.set(consumer.rate_limit());
        Arc::new(SourceControl {
            reader: Reader::new(&consumer.name, pool, deadline),
            rate: Arc::new(rate),
            paused: Default::default(),
        })
    }

    /// Records whether `tp` is paused here now.
    pub fn mark_paused(&self, tp: &TopicPartition, paused: bool) {
        let mut set = self.paused.lock().unwrap_or_else(|p| p.into_inner());
        if paused {
            set.insert(tp.clone());
        } else {
            set.remove(tp);
        }
    }

    pub fn is_paused(&self, tp: &TopicPartition) -> bool {
        self.paused
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(tp)
    }
}

/// One consumer's rate limit in this worker, shared by its partition tasks. `None` inside:
/// unlimited, and a task pays one read of a lock per record.
#[derive(Default)]
pub struct Rate {
    limiter: RwLock<Option<(Throttle, Arc<DefaultDirectRateLimiter>)>>,
}

impl Rate {
    /// Sets the limit (`None`: none); a change starts a new bucket, full.
    pub fn set(&self, limit: Option<Throttle>) -> bool {
        let mut l = self.limiter.write().unwrap_or_else(|p| p.into_inner());
        if l.as_ref().map(|(t, _)| *t) == limit {
            return false;
        }
        *l = limit.map(|t| (t, Arc::new(RateLimiter::direct(quota(t)))));
        true
    }

    pub fn limit(&self) -> Option<Throttle> {
        let l = self.limiter.read().unwrap_or_else(|p| p.into_inner());
        l.as_ref().map(|(t, _)| *t)
    }

    fn current(&self) -> Option<Arc<DefaultDirectRateLimiter>> {
        let l = self.limiter.read().unwrap_or_else(|p| p.into_inner());
        l.as_ref().map(|(_, r)| Arc::clone(r))
    }

    /// Takes a token if one is there (always, when unlimited).
    pub fn try_take(&self) -> bool {
        self.current().is_none_or(|r| r.check().is_ok())
    }

    /// Waits for a batch's worth of tokens at once (half the burst): how many it got, `None`
    /// when unlimited, `Some(0)` when cancelled first. Taking them one at a time, a task that
    /// waited would wake at the first token and commit a batch of one, and under a tight rate
    /// the transactions, not the rate, would set the pace.
    pub async fn take(&self, cancel: &CancellationToken) -> Option<u32> {
        let (t, r) = {
            let l = self.limiter.read().unwrap_or_else(|p| p.into_inner());
            let (t, r) = l.as_ref()?;
            (*t, Arc::clone(r))
        };
        let n = (t.burst / 2).max(1);
        let chunk = NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN);
        tokio::select! {
            _ = cancel.cancelled() => Some(0),
            got = r.until_n_ready(chunk) => Some(if got.is_ok() { n } else { 0 }),
        }
    }
}

/// A token bucket of `t.burst` tokens refilled at `t.max_rate` a second.
fn quota(t: Throttle) -> Quota {
    let period = Duration::from_secs_f64(1.0 / t.max_rate.max(1e-3));
    let burst = NonZeroU32::new(t.burst.max(1)).unwrap_or(NonZeroU32::MIN);
    Quota::with_period(period)
        .unwrap_or_else(|| Quota::per_second(NonZeroU32::MIN))
        .allow_burst(burst)
}

/// What a partition task asks before it takes a record: is the partition paused, is there a
/// token.
#[derive(Clone)]
pub struct Gate {
    pub paused: watch::Receiver<bool>,
    pub rate: Arc<Rate>,
    /// Tokens this task holds, taken in a chunk by [`Gate::wait`].
    pub credit: u32,
}

impl Gate {
    /// A gate that is always open (tests, tools).
    pub fn open() -> Gate {
        Gate {
            paused: watch::Sender::new(false).subscribe(),
            rate: Arc::new(Rate::default()),
            credit: 0,
        }
    }

    /// Waits until the partition is not paused and this task holds a token (one of a chunk);
    /// `false` when cancelled. The caller then takes one record and calls [`Gate::spend`].
    pub async fn wait(&mut self, cancel: &CancellationToken) -> bool {
        loop {
            if *self.paused.borrow_and_update() {
                tokio::select! {
                    _ = cancel.cancelled() => return false,
                    changed = self.paused.changed() => {
                        if changed.is_err() {
                            // The coordinator is gone: the task is about to be stopped.
                            cancel.cancelled().await;
                            return false;
                        }
                    }
                }
                continue;
            }
            if self.credit > 0 {
                return true;
            }
            match self.rate.take(cancel).await {
                None => return true,
                Some(0) if cancel.is_cancelled() => return false,
                Some(n) => self.credit = n,
            }
        }
    }

    /// One record taken after [`Gate::wait`].
    pub fn spend(&mut self) {
        self.credit = self.credit.saturating_sub(1);
    }

    /// Whether one more record may go into the batch now (not paused, a token held or there),
    /// and if so spends its token.
    pub fn admit_more(&mut self) -> bool {
        if *self.paused.borrow() {
            return false;
        }
        if self.credit > 0 {
            self.credit -= 1;
            return true;
        }
        self.rate.try_take()
    }

    /// Resolves when the partition is paused (for the wait on its first record).
    pub async fn until_paused(&mut self) {
        if self.paused.wait_for(|p| *p).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(topic: Option<&str>, partition: Option<i32>) -> Scope {
        Scope {
            consumer: "c".into(),
            topic: topic.map(str::to_string),
            partition,
        }
    }

    #[test]
    fn a_partition_is_paused_by_any_scope_that_covers_it() {
        let s = Snapshot {
            pauses: vec![scope(Some("a"), None), scope(Some("b"), Some(2))],
            ..Default::default()
        };
        assert!(s.paused(&("a".into(), 7)));
        assert!(s.paused(&("b".into(), 2)));
        assert!(!s.paused(&("b".into(), 1)));
        assert!(!s.paused(&("c".into(), 2)));
    }

    #[test]
    fn a_rate_change_starts_a_new_bucket_and_the_same_rate_keeps_it() {
        let r = Rate::default();
        assert!(r.try_take(), "unlimited");
        let t = Throttle {
            max_rate: 10.0,
            burst: 3,
        };
        assert!(r.set(Some(t)));
        assert!(!r.set(Some(t)));
        let taken = (0..10).filter(|_| r.try_take()).count();
        assert_eq!(taken, 3, "the burst, then nothing until the bucket refills");
        assert!(r.set(None));
        assert!(r.try_take());
    }

    #[tokio::test]
    async fn a_throttled_gate_hands_out_tokens_in_chunks() {
        let (_tx, rx) = watch::channel(false);
        let rate = Arc::new(Rate::default());
        rate.set(Some(Throttle {
            max_rate: 1000.0,
            burst: 10,
        }));
        let mut gate = Gate {
            paused: rx,
            rate,
            credit: 0,
        };
        let cancel = CancellationToken::new();
        assert!(gate.wait(&cancel).await);
        assert_eq!(gate.credit, 5, "half the burst at once");
        gate.spend();
        let more = (0..10).filter(|_| gate.admit_more()).count();
        assert!(
            (4..=9).contains(&more),
            "the chunk's 4 left, then what the bucket still has: {more}"
        );
    }

    #[tokio::test]
    async fn a_paused_gate_waits_until_resumed() {
        let (tx, rx) = watch::channel(true);
        let mut gate = Gate {
            paused: rx,
            rate: Arc::new(Rate::default()),
            credit: 0,
        };
        let cancel = CancellationToken::new();
        let waiting = tokio::time::timeout(Duration::from_millis(100), gate.wait(&cancel)).await;
        assert!(waiting.is_err(), "still paused");
        assert!(!gate.admit_more());
        tx.send(false).unwrap();
        assert!(gate.wait(&cancel).await);
        assert!(gate.admit_more());
        tx.send(true).unwrap();
        cancel.cancel();
        assert!(!gate.wait(&cancel).await, "cancelled while paused");
    }
}
