//! Liveness and readiness of one process (a worker, a relay, a sender), as `/healthz` and
//! `/readyz` report them ([`crate::endpoint`] serves them beside `/metrics`).
//!
//! They answer two different questions, and an orchestrator acts on each differently:
//!
//! - **Alive** ([`Health::liveness`]): every long-running loop of the process still turns. Each
//!   loop registers a [`Heartbeat`] with its *period*, the longest gap between two beats when
//!   nothing is wrong with the process (its wait plus the deadline of one round); a loop that
//!   did not beat for [`STALE_AFTER_PERIODS`] periods is stale, and a loop whose task ended
//!   (its heartbeat dropped) is dead. A loop waiting for PostgreSQL or Kafka within its
//!   deadlines is alive: an outage of a service the process depends on is not something a
//!   restart mends, and restarting every worker during one would only add rebalances.
//! - **Ready** ([`Health::readiness`]): the process does its job now: each PostgreSQL it uses
//!   (one per database its consumers are on) answered the last probe ([`watch_database`]) as
//!   a writable primary and has not failed one for [`DATABASE_SETTLE`]; every consumer is a member of its group (its first assignment went
//!   through the rebalance callback, even with 0 partitions); no revocation is draining; no
//!   partition is being claimed again after a failover; and not every partition a consumer
//!   holds is stuck on a Kafka error (a worker that can read none of its partitions does no
//!   work; one stuck partition among others is the partition's alert, not the pod's). A
//!   rolling update waits for it, and a disruption budget counts it.
//!
//! The state is per process part ([`Health`], shared as an `Arc`), never a global, so that
//! tests can run several workers in one process, each with its own endpoint.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::DatabaseConfig;

/// A loop is stale when it has not beaten for this many of its periods.
pub const STALE_AFTER_PERIODS: u32 = 3;

/// How often [`watch_database`] probes PostgreSQL, and the longest one probe may take.
pub const DATABASE_PROBE_EVERY: Duration = Duration::from_secs(2);

/// A probe result older than this says nothing any more (the probe loop is stuck or gone).
pub const DATABASE_FRESH: Duration = Duration::from_secs(10);

/// After PostgreSQL was last seen unavailable or read-only, the process stays not ready this
/// long: a failover settles (the pool's old connections fail one by one, batches retry) for a
/// few seconds after the first probe that succeeds, and a flapping database should not flap
/// the pods' readiness with it.
pub const DATABASE_SETTLE: Duration = Duration::from_secs(5);

/// The liveness and readiness state of one process.
#[derive(Debug, Default)]
pub struct Health {
    state: Mutex<State>,
    /// Set when the process is shutting down: loops end on purpose then.
    stopping: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    loops: BTreeMap<u64, Loop>,
    consumers: BTreeMap<String, Membership>,
    /// By the database's name (`default` for `[database]`).
    databases: BTreeMap<String, Database>,
}

#[derive(Debug)]
struct Loop {
    name: String,
    period: Duration,
    last: Instant,
    ended: bool,
}

#[derive(Debug, Default)]
struct Membership {
    /// The rebalance callback has handed this consumer an assignment (possibly empty).
    joined: bool,
    /// Revocations whose drain is under way.
    draining: usize,
    /// Partitions being claimed again after a failover (the offset store went back) or a
    /// fence, or claims retried while PostgreSQL does not answer.
    recovering: usize,
    /// Partition tasks running now.
    partitions: usize,
    /// Those whose last fetch failed with a Kafka error, no record since: the error.
    stuck: BTreeMap<(String, i32), String>,
}

#[derive(Debug, Default)]
struct Database {
    last_ok: Option<Instant>,
    last_failure: Option<(Instant, String)>,
}

/// What an endpoint answers: 200 with `text`, or 503 with `text` saying what fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub ok: bool,
    pub text: String,
}

impl Health {
    pub fn new() -> Arc<Health> {
        Arc::new(Health::default())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock leaves nothing half-written that matters: go on.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a loop that promises to beat at least every `period`; it counts as beaten now.
    pub fn register(self: &Arc<Self>, name: impl Into<String>, period: Duration) -> Heartbeat {
        let mut s = self.state();
        let id = s.next_id;
        s.next_id += 1;
        s.loops.insert(
            id,
            Loop {
                name: name.into(),
                period,
                last: Instant::now(),
                ended: false,
            },
        );
        Heartbeat {
            health: Arc::clone(self),
            id,
            period,
        }
    }

    /// The readiness handle of one consumer; the consumer is not ready until it
    /// [joined](ConsumerHealth::joined).
    pub fn consumer(self: &Arc<Self>, name: &str) -> ConsumerHealth {
        self.state().consumers.entry(name.to_string()).or_default();
        ConsumerHealth {
            health: Arc::clone(self),
            name: Arc::from(name),
        }
    }

    /// The process is shutting down: loops that end now end on purpose, and it is not ready.
    pub fn stopping(&self) {
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// The database called `name` answered a probe as a writable primary.
    pub fn database_ok(&self, name: &str) {
        let mut s = self.state();
        s.databases.entry(name.to_string()).or_default().last_ok = Some(Instant::now());
    }

    /// The database called `name` did not answer a probe, or answered as a standby.
    pub fn database_unavailable(&self, name: &str, reason: impl Into<String>) {
        let mut s = self.state();
        let db = s.databases.entry(name.to_string()).or_default();
        db.last_failure = Some((Instant::now(), reason.into()));
    }

    /// A database this process will probe: not ready until its first probe answers.
    pub fn database(&self, name: &str) {
        self.state().databases.entry(name.to_string()).or_default();
    }

    /// `/healthz`: alive while every registered loop beats within its bound.
    pub fn liveness(&self) -> Verdict {
        if self.stopping.load(Ordering::SeqCst) {
            // Still alive: finishing in-flight batches. A restart now would cut the drain short.
            return Verdict {
                ok: true,
                text: "ok: stopping\n".into(),
            };
        }
        let s = self.state();
        let now = Instant::now();
        let mut failing = String::new();
        for l in s.loops.values() {
            let since = now.duration_since(l.last);
            if l.ended {
                let _ = writeln!(failing, "{}: ended", l.name);
            } else if since > l.period * STALE_AFTER_PERIODS {
                let _ = writeln!(
                    failing,
                    "{}: stale, last beat {:.1}s ago (bound {:.1}s)",
                    l.name,
                    since.as_secs_f64(),
                    (l.period * STALE_AFTER_PERIODS).as_secs_f64()
                );
            }
        }
        match failing.is_empty() {
            true => Verdict {
                ok: true,
                text: format!("ok: {} loops alive\n", s.loops.len()),
            },
            false => Verdict {
                ok: false,
                text: format!("not alive:\n{failing}"),
            },
        }
    }

    /// `/readyz`: ready while the database answers as a primary and every consumer is in its
    /// group with no drain or failover under way.
    pub fn readiness(&self) -> Verdict {
        let mut failing = String::new();
        if self.stopping.load(Ordering::SeqCst) {
            failing.push_str("stopping\n");
        }
        let s = self.state();
        let now = Instant::now();
        if s.databases.is_empty() {
            failing.push_str("database: not probed yet\n");
        }
        for (name, db) in &s.databases {
            // `database:` for [database], as before there were others; `database NAME:` else.
            let which = match name.as_str() {
                crate::config::DEFAULT_DATABASE => "database".to_string(),
                n => format!("database {n}"),
            };
            match (&db.last_failure, db.last_ok) {
                (Some((at, why)), _) if now.duration_since(*at) < DATABASE_SETTLE => {
                    let _ = writeln!(
                        failing,
                        "{which}: unavailable {:.1}s ago: {why}",
                        now.duration_since(*at).as_secs_f64()
                    );
                }
                (_, None) => {
                    let _ = writeln!(failing, "{which}: not probed yet");
                }
                (_, Some(ok)) if now.duration_since(ok) > DATABASE_FRESH => {
                    let _ = writeln!(
                        failing,
                        "{which}: no probe answered for {:.1}s",
                        now.duration_since(ok).as_secs_f64()
                    );
                }
                _ => {}
            }
        }
        for (name, m) in &s.consumers {
            if !m.joined {
                let _ = writeln!(
                    failing,
                    "consumer {name}: not in its group (no assignment yet)"
                );
            }
            if m.draining > 0 {
                let _ = writeln!(failing, "consumer {name}: draining revoked partitions");
            }
            if m.recovering > 0 {
                let _ = writeln!(
                    failing,
                    "consumer {name}: claiming partitions (failover or fence)"
                );
            }
            if m.partitions > 0 && m.stuck.len() >= m.partitions {
                let _ = write!(
                    failing,
                    "consumer {name}: every partition it holds ({}) is stuck on a Kafka error:",
                    m.partitions
                );
                for ((topic, partition), error) in &m.stuck {
                    let _ = write!(failing, " {topic}/{partition}: {error};");
                }
                failing.push('\n');
            }
        }
        match failing.is_empty() {
            true => Verdict {
                ok: true,
                text: "ready\n".into(),
            },
            false => Verdict {
                ok: false,
                text: format!("not ready:\n{failing}"),
            },
        }
    }
}

/// A registered loop's heartbeat. Dropping it (the loop's task ended, returned or panicked)
/// marks the loop dead, unless the process is [stopping](Health::stopping).
#[derive(Debug)]
pub struct Heartbeat {
    health: Arc<Health>,
    id: u64,
    period: Duration,
}

impl Heartbeat {
    pub fn beat(&self) {
        if let Some(l) = self.health.state().loops.get_mut(&self.id) {
            l.last = Instant::now();
        }
    }

    /// Runs `work`, beating at every period meanwhile. Only for a wait that is bounded
    /// elsewhere (a drain by the revoke deadline, a claim by the transaction deadline and
    /// retried while PostgreSQL does not answer, which readiness reports): the loop is alive
    /// while it waits, and a wait that never ends would hide a hung loop.
    pub async fn during<F: Future>(&self, work: F) -> F::Output {
        tokio::pin!(work);
        let mut tick = tokio::time::interval(self.period);
        loop {
            tokio::select! {
                out = &mut work => {
                    self.beat();
                    return out;
                }
                _ = tick.tick() => self.beat(),
            }
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let stopping = self.health.stopping.load(Ordering::SeqCst);
        let mut s = self.health.state();
        if stopping {
            s.loops.remove(&self.id);
        } else if let Some(l) = s.loops.get_mut(&self.id) {
            l.ended = true;
        }
    }
}

/// One consumer's part of readiness, held by its source and its rebalance callback.
#[derive(Debug, Clone)]
pub struct ConsumerHealth {
    health: Arc<Health>,
    name: Arc<str>,
}

impl ConsumerHealth {
    fn with(&self, f: impl FnOnce(&mut Membership)) {
        let mut s = self.health.state();
        f(s.consumers.entry(self.name.to_string()).or_default());
    }

    /// Registers one of this consumer's loops (`what`: "source", "inbox processor") for
    /// liveness, named after the consumer.
    pub fn heartbeat(&self, what: &str, period: Duration) -> Heartbeat {
        self.health
            .register(format!("{what} {}", self.name), period)
    }

    /// The group handed this consumer an assignment (possibly of no partition).
    pub fn joined(&self) {
        self.with(|m| m.joined = true);
    }

    /// The consumer lost its membership (a rebalance error dropped the assignment).
    pub fn left(&self) {
        self.with(|m| m.joined = false);
    }

    /// A revocation drains until the guard drops.
    pub fn draining(&self) -> Phase {
        self.with(|m| m.draining += 1);
        Phase {
            owner: self.clone(),
            kind: PhaseKind::Draining,
        }
    }

    /// One partition task's part of readiness, counted until the guard drops.
    pub fn partition(&self, topic: &str, partition: i32) -> PartitionHealth {
        self.with(|m| m.partitions += 1);
        PartitionHealth {
            owner: self.clone(),
            key: (topic.to_string(), partition),
        }
    }

    /// Partitions are claimed again (after a failover or a fence) until the guard drops.
    pub fn recovering(&self) -> Phase {
        self.with(|m| m.recovering += 1);
        Phase {
            owner: self.clone(),
            kind: PhaseKind::Recovering,
        }
    }
}

/// One running partition task, and whether it is stuck (its last fetch failed, no record
/// since); the consumer is not ready while every one of its partitions is.
#[derive(Debug)]
pub struct PartitionHealth {
    owner: ConsumerHealth,
    key: (String, i32),
}

impl PartitionHealth {
    /// `Some(error)`: the partition's fetch failed; `None`: a record arrived.
    pub fn stuck(&self, error: Option<&str>) {
        self.owner.with(|m| match error {
            Some(e) => {
                m.stuck.insert(self.key.clone(), e.to_string());
            }
            None => {
                m.stuck.remove(&self.key);
            }
        });
    }
}

impl Drop for PartitionHealth {
    fn drop(&mut self) {
        self.owner.with(|m| {
            m.partitions = m.partitions.saturating_sub(1);
            m.stuck.remove(&self.key);
        });
    }
}

#[derive(Debug)]
enum PhaseKind {
    Draining,
    Recovering,
}

/// A phase of a consumer during which it is not ready; it ends when dropped, so that an early
/// return or a panic cannot leave the consumer not ready for ever.
#[derive(Debug)]
pub struct Phase {
    owner: ConsumerHealth,
    kind: PhaseKind,
}

impl Drop for Phase {
    fn drop(&mut self) {
        self.owner.with(|m| match self.kind {
            PhaseKind::Draining => m.draining = m.draining.saturating_sub(1),
            PhaseKind::Recovering => m.recovering = m.recovering.saturating_sub(1),
        });
    }
}

/// Probes the database called `name` every [`DATABASE_PROBE_EVERY`] until `stop`, on a
/// connection of its own (opened with `db`'s URL and TLS settings, opened again after a
/// failure), so that a
/// pool busy with long batches never reads as a database down. The probe asks
/// `pg_is_in_recovery()`: a connection that lands on a standby (a failover under way, a
/// demoted primary behind a proxy) cannot take the engine's writes, so it fails readiness too.
/// The loop has its own heartbeat.
pub async fn watch_database(
    name: String,
    db: DatabaseConfig,
    health: Arc<Health>,
    stop: CancellationToken,
) {
    health.database(&name);
    let what = match name.as_str() {
        crate::config::DEFAULT_DATABASE => "database probe".to_string(),
        n => format!("database probe {n}"),
    };
    let beat = health.register(what, DATABASE_PROBE_EVERY * 2);
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        let probe = async {
            let c = match client.take() {
                Some(c) if !c.is_closed() => c,
                _ => crate::store::pool::connect_to(&db)
                    .await
                    .map_err(|e| e.to_string())?,
            };
            let standby: bool = c
                .query_one("SELECT pg_is_in_recovery()", &[])
                .await
                .map_err(|e| e.to_string())?
                .get(0);
            Ok::<_, String>((c, standby))
        };
        match tokio::time::timeout(DATABASE_PROBE_EVERY, probe).await {
            Ok(Ok((c, false))) => {
                client = Some(c);
                health.database_ok(&name);
            }
            Ok(Ok((_, true))) => health
                .database_unavailable(&name, "read-only: the server is a standby (in recovery)"),
            Ok(Err(e)) => health.database_unavailable(&name, e),
            Err(_) => health.database_unavailable(
                &name,
                format!("no answer within {}s", DATABASE_PROBE_EVERY.as_secs()),
            ),
        }
        beat.beat();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(DATABASE_PROBE_EVERY) => {}
        }
    }
}

/// [`watch_database`] spawned on the current runtime, until `stop` or until the returned guard
/// drops (the loop that started it ended).
pub fn spawn_database_watch(
    name: &str,
    db: DatabaseConfig,
    health: Arc<Health>,
    stop: &CancellationToken,
) -> tokio_util::sync::DropGuard {
    let own = stop.child_token();
    tokio::spawn(watch_database(name.to_string(), db, health, own.clone()));
    own.drop_guard()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_db(h: &Health) {
        h.database_ok("default");
    }

    #[tokio::test(start_paused = true)]
    async fn a_loop_that_stops_beating_goes_stale_and_one_that_ended_is_dead() {
        let h = Health::new();
        let fast = h.register("source payments", Duration::from_secs(1));
        let slow = h.register("maintenance", Duration::from_secs(60));
        assert!(h.liveness().ok, "{}", h.liveness().text);

        tokio::time::advance(Duration::from_millis(2900)).await;
        assert!(h.liveness().ok, "within 3 periods: {}", h.liveness().text);
        tokio::time::advance(Duration::from_millis(200)).await;
        let v = h.liveness();
        assert!(!v.ok);
        assert!(v.text.contains("source payments: stale"), "{}", v.text);
        assert!(!v.text.contains("maintenance"), "{}", v.text);

        fast.beat();
        assert!(h.liveness().ok, "beaten again: {}", h.liveness().text);

        drop(slow);
        let v = h.liveness();
        assert!(!v.ok);
        assert!(v.text.contains("maintenance: ended"), "{}", v.text);
    }

    #[tokio::test(start_paused = true)]
    async fn during_keeps_a_bounded_wait_alive() {
        let h = Health::new();
        let beat = h.register("source payments", Duration::from_secs(1));
        let h2 = Arc::clone(&h);
        let out = beat
            .during(async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                h2.liveness()
            })
            .await;
        assert!(out.ok, "alive throughout a 10 s wait: {}", out.text);
    }

    #[tokio::test(start_paused = true)]
    async fn loops_that_end_while_stopping_are_not_dead() {
        let h = Health::new();
        let beat = h.register("relay", Duration::from_secs(1));
        h.stopping();
        drop(beat);
        tokio::time::advance(Duration::from_secs(60)).await;
        assert!(h.liveness().ok);
        let r = h.readiness();
        assert!(!r.ok && r.text.contains("stopping"), "{}", r.text);
    }

    #[tokio::test(start_paused = true)]
    async fn readiness_needs_the_group_no_drain_and_no_failover() {
        let h = Health::new();
        ready_db(&h);
        let c = h.consumer("payments");
        let r = h.readiness();
        assert!(
            !r.ok && r.text.contains("payments: not in its group"),
            "{}",
            r.text
        );

        c.joined();
        assert!(h.readiness().ok, "{}", h.readiness().text);

        let drain = c.draining();
        let r = h.readiness();
        assert!(!r.ok && r.text.contains("draining"), "{}", r.text);
        drop(drain);
        assert!(h.readiness().ok);

        let claim = c.recovering();
        let r = h.readiness();
        assert!(!r.ok && r.text.contains("claiming"), "{}", r.text);
        drop(claim);

        c.left();
        assert!(!h.readiness().ok);
    }

    #[tokio::test(start_paused = true)]
    async fn a_consumer_whose_every_partition_is_stuck_is_not_ready() {
        let h = Health::new();
        ready_db(&h);
        let c = h.consumer("payments");
        c.joined();
        let p0 = c.partition("payments", 0);
        let p1 = c.partition("payments", 1);
        p0.stuck(Some("Broker: Topic authorization failed"));
        assert!(h.readiness().ok, "one of two stuck: {}", h.readiness().text);
        p1.stuck(Some("Broker: Topic authorization failed"));
        let r = h.readiness();
        assert!(!r.ok, "{}", r.text);
        assert!(
            r.text.contains("every partition it holds (2) is stuck")
                && r.text
                    .contains("payments/1: Broker: Topic authorization failed"),
            "{}",
            r.text
        );
        p1.stuck(None);
        assert!(h.readiness().ok, "a record arrived: {}", h.readiness().text);
        p1.stuck(Some("again"));
        drop(p1);
        let r = h.readiness();
        assert!(
            !r.ok && r.text.contains("(1) is stuck"),
            "p1 revoked: p0 is all it holds: {}",
            r.text
        );
        drop(p0);
        assert!(h.readiness().ok, "no partition: {}", h.readiness().text);
    }

    #[tokio::test(start_paused = true)]
    async fn readiness_follows_the_database_probe_with_a_settle_time() {
        let h = Health::new();
        let r = h.readiness();
        assert!(!r.ok && r.text.contains("not probed yet"), "{}", r.text);

        h.database_ok("default");
        assert!(h.readiness().ok);

        h.database_unavailable("default", "connection refused");
        h.database_ok("default");
        let r = h.readiness();
        assert!(!r.ok && r.text.contains("connection refused"), "{}", r.text);
        tokio::time::advance(DATABASE_SETTLE).await;
        h.database_ok("default");
        assert!(h.readiness().ok, "settled: {}", h.readiness().text);

        tokio::time::advance(DATABASE_FRESH + Duration::from_secs(1)).await;
        let r = h.readiness();
        assert!(!r.ok && r.text.contains("no probe answered"), "{}", r.text);
    }

    #[tokio::test(start_paused = true)]
    async fn each_database_counts_for_readiness_under_its_own_name() {
        let h = Health::new();
        h.database("default");
        h.database("orders");
        h.database_ok("default");
        let r = h.readiness();
        assert!(
            !r.ok && r.text.contains("database orders: not probed yet"),
            "{}",
            r.text
        );
        assert!(
            !r.text.contains("database: "),
            "the default answered: {}",
            r.text
        );
        h.database_ok("orders");
        assert!(h.readiness().ok, "{}", h.readiness().text);
        h.database_unavailable("orders", "connection refused");
        let r = h.readiness();
        assert!(
            !r.ok && r.text.contains("database orders: unavailable"),
            "{}",
            r.text
        );
        assert!(!r.text.contains("database: "), "{}", r.text);
    }
}
