//! The optional Redis pre-filter of a consumer (`[consumer.prefilter]`): before a batch's
//! transaction, one `MGET` of the batch's dedupe keys; a hit is a key PostgreSQL has committed
//! already, so that message skips staging, the dedupe insert and the effect (the transaction
//! still runs, to advance the fenced offset). After `COMMIT`, one pipeline of `SET ... PX` for
//! the keys that transaction confirmed.
//!
//! Redis is never the authority. What makes a hit safe:
//! - a key is written only after PostgreSQL's `COMMIT` returned, and only for a candidate of
//!   that transaction (fresh, or a duplicate whose committed key the insert ran into): never a
//!   parked message, never a candidate of an attempt that rolled back;
//! - a key expires no later than the event's date leaves the consumer's retention window; a copy
//!   older than that is parked before any lookup, and PostgreSQL keeps its keys longer;
//! - whatever goes wrong with Redis (down, flushed, evicting, slow) only turns hits into misses,
//!   and a miss is the engine without a pre-filter.
//!
//! What it must not cost: a lookup waits at most `timeout`; an error, or a lookup's timeout,
//! drops the connection and opens a short circuit (250 ms, doubling to 5 s) during which no
//! batch talks to Redis at all; reconnecting happens in a background task, never in a batch. So
//! a dead Redis costs nothing per batch, and a hung one at most one `timeout` per circuit
//! period. A set may wait longer ([`set_timeout`]): its pipeline holds a whole batch's keys and
//! shares the socket with the other partitions' requests, so under a full-speed drain it can
//! answer late while Redis is fine. A late set is not abandoned: it runs in a task of its own,
//! and the partition goes on after [`set_timeout`] without it, so its keys still land (at most
//! [`SETS_IN_FLIGHT`] such sets per consumer; past that a set's keys are not set: future hits
//! only). Neither costs the connection: dropping the shared connection for a late set failed
//! every partition's requests in flight and closed the circuit for seconds, which left tens of
//! thousands of keys of a 1.1 M-record drain unset (issue 26); and abandoning late sets still
//! left 2% of them unset with a busy core beside the drain. A Redis that stopped answering is
//! found by the lookups, which every batch makes first.
//!
//! The one thing Redis must never hold is a key PostgreSQL does not: after restoring PostgreSQL
//! from a backup, or a failover that lost commits, flush the pre-filter's keys (see
//! docs/OPERATIONS.md).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chrono::{DateTime, NaiveDate, Utc};
use redis::aio::MultiplexedConnection;
use uuid::Uuid;

use crate::config::{PrefilterConfig, Ttl};
use crate::metrics::{PrefilterMetrics, PrefilterOp as Op};

/// A dedupe key: the consumer is the pre-filter's own.
pub type Key = (Uuid, NaiveDate);

/// A background connection attempt gives up after this long (it never holds a batch).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The circuit after the first failure; it doubles with every failure in a row, up to
/// [`CIRCUIT_MAX`].
const CIRCUIT_MIN: Duration = Duration::from_millis(250);
const CIRCUIT_MAX: Duration = Duration::from_secs(5);
/// How much longer than a lookup a set may take, at most [`SET_TIMEOUT_MAX`] (module docs).
const SET_TIMEOUT_FACTOR: u32 = 10;
const SET_TIMEOUT_MAX: Duration = Duration::from_secs(1);

/// How long a set waits: ten lookups' `timeout`, at most a second, never less than `timeout`.
pub fn set_timeout(timeout: Duration) -> Duration {
    (timeout * SET_TIMEOUT_FACTOR)
        .min(SET_TIMEOUT_MAX)
        .max(timeout)
}

/// A warning at most this often per consumer; every failure is logged at debug level.
const WARN_EVERY: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum PrefilterError {
    #[error("consumer {consumer:?}: prefilter.redis: {reason}")]
    Url { consumer: String, reason: String },
}

/// One consumer's pre-filter, shared by its partition tasks (they share one multiplexed
/// connection: requests of several partitions are pipelined on one socket).
pub struct Prefilter {
    consumer: Arc<str>,
    ttl: Ttl,
    retention_days: u64,
    timeout: Duration,
    shared: Arc<Shared>,
}

struct Shared {
    client: redis::Client,
    consumer: Arc<str>,
    metrics: PrefilterMetrics,
    state: Mutex<State>,
    /// One permit per set pipeline in flight (see [`SETS_IN_FLIGHT`]).
    sets: Arc<tokio::sync::Semaphore>,
}

/// Set pipelines one consumer may have in flight, the late ones included: a partition has one
/// at a time while it waits, so this is room for about as many late sets as partitions, each
/// finishing in the background; past it, a set is given up (its keys cost future hits only)
/// rather than queue without bound behind a Redis that answers slower than the drain.
pub const SETS_IN_FLIGHT: usize = 64;

/// How long a late set may still take in the background before its keys count as not set.
const SET_LATE_LIMIT: Duration = Duration::from_secs(30);

#[derive(Default)]
struct State {
    /// The connection and its generation: a failure seen on an older connection does not drop
    /// a newer one.
    conn: Option<(u64, MultiplexedConnection)>,
    /// The sets' own connection: a lookup that fails or answers late drops the lookups'
    /// connection and opens the circuit, and before it had one of its own, every set in flight
    /// or made during that circuit was lost with it (1.3% of a 300,000-event drain's keys with a
    /// busy core beside it). Dropped only when a set fails.
    set_conn: Option<MultiplexedConnection>,
    generation: u64,
    connecting: bool,
    /// Failures in a row (round trips or connection attempts).
    failures: u32,
    /// No round trip and no connection attempt before this.
    closed_until: Option<Instant>,
    last_warned: Option<Instant>,
    unwarned: u64,
}

impl State {
    /// Whether a failure at `now` gets a warning (at most one per [`WARN_EVERY`]): then how
    /// many failures it speaks for; else it is counted for the next one.
    fn warn_now(&mut self, now: Instant) -> Option<u64> {
        if self
            .last_warned
            .is_some_and(|t| now.duration_since(t) < WARN_EVERY)
        {
            self.unwarned += 1;
            return None;
        }
        self.last_warned = Some(now);
        Some(std::mem::take(&mut self.unwarned) + 1)
    }
}

impl Prefilter {
    /// Builds the client and starts connecting in the background (inside a tokio runtime), so
    /// that the first batch finds the connection ready.
    pub fn new(
        consumer: &str,
        config: &PrefilterConfig,
        retention: Duration,
    ) -> Result<Prefilter, PrefilterError> {
        let client =
            redis::Client::open(config.redis.expose()).map_err(|e| PrefilterError::Url {
                consumer: consumer.to_string(),
                reason: format!("{} is not a Redis URL ({:?})", config.redis, e.kind()),
            })?;
        let consumer: Arc<str> = Arc::from(consumer);
        let shared = Arc::new(Shared {
            client,
            metrics: PrefilterMetrics::new(&consumer),
            consumer: Arc::clone(&consumer),
            state: Mutex::new(State::default()),
            sets: Arc::new(tokio::sync::Semaphore::new(SETS_IN_FLIGHT)),
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            let _ = shared.connection();
        }
        Ok(Prefilter {
            consumer,
            ttl: config.ttl,
            retention_days: (retention.as_secs() / 86_400).max(1),
            timeout: config.timeout,
            shared,
        })
    }

    /// Which of `keys` Redis says PostgreSQL committed already. All `false` when Redis cannot
    /// answer within the timeout (or is known to be away): the batch then goes to PostgreSQL
    /// as without a pre-filter.
    pub async fn lookup(&self, keys: &[Key]) -> Vec<bool> {
        let mut hits = vec![false; keys.len()];
        if keys.is_empty() {
            return hits;
        }
        let m = &self.shared.metrics;
        let Some((generation, mut conn)) = self.shared.connection() else {
            m.fell_through(keys.len() as u64);
            return hits;
        };
        let names: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let t0 = Instant::now();
        let answer = tokio::time::timeout(
            self.timeout,
            redis::cmd("MGET")
                .arg(&names)
                .query_async::<Vec<Option<Vec<u8>>>>(&mut conn),
        )
        .await;
        m.round_trip(Op::Lookup, t0.elapsed());
        match answer {
            Ok(Ok(values)) if values.len() == keys.len() => {
                self.shared.succeeded();
                for (hit, v) in hits.iter_mut().zip(values) {
                    // Only the engine's own mark counts: anything else under the prefix is
                    // not a key this engine committed.
                    *hit = v.as_deref() == Some(b"1");
                }
                let n = hits.iter().filter(|h| **h).count() as u64;
                m.looked_up(n, keys.len() as u64 - n);
            }
            Ok(Ok(values)) => {
                let why = format!(
                    "MGET of {} keys answered {} values",
                    keys.len(),
                    values.len()
                );
                self.shared.failed(generation, Op::Lookup, false, &why);
                m.fell_through(keys.len() as u64);
            }
            Ok(Err(e)) => {
                self.shared
                    .failed(generation, Op::Lookup, false, &e.to_string());
                m.fell_through(keys.len() as u64);
            }
            Err(_) => {
                let why = format!("no answer within {:?}", self.timeout);
                self.shared.failed(generation, Op::Lookup, true, &why);
                m.fell_through(keys.len() as u64);
            }
        }
        hits
    }

    /// Sets `keys`, which a transaction has just committed (fresh, or already there), each with
    /// its TTL. Called only after PostgreSQL's `COMMIT` returned. A failure only costs future
    /// hits.
    pub async fn remember(&self, keys: &[Key]) {
        let now = Utc::now();
        let mut pipe = redis::pipe();
        let mut n = 0u64;
        for k in keys {
            if let Some(ttl) = ttl_for(self.ttl, self.retention_days, k.1, now) {
                let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
                pipe.cmd("SET")
                    .arg(self.key(k))
                    .arg("1")
                    .arg("PX")
                    .arg(ms)
                    .ignore();
                n += 1;
            }
        }
        if n == 0 {
            return;
        }
        let m = &self.shared.metrics;
        let Some((mut conn, wait)) = self.shared.set_connection() else {
            m.not_set(n);
            return;
        };
        let Ok(permit) = Arc::clone(&self.shared.sets).try_acquire_owned() else {
            // Every permit is held by sets still in flight: Redis is behind the drain.
            self.shared
                .slow(Op::Set, n, set_timeout(self.timeout), false);
            m.not_set(n);
            return;
        };
        let t0 = Instant::now();
        let limit = set_timeout(self.timeout);
        let shared = Arc::clone(&self.shared);
        let mut set = tokio::spawn(async move {
            let answer =
                tokio::time::timeout(SET_LATE_LIMIT, pipe.query_async::<()>(&mut conn)).await;
            shared.metrics.round_trip(Op::Set, t0.elapsed());
            match answer {
                Ok(Ok(())) => {
                    shared.succeeded();
                    shared.metrics.set(n);
                }
                Ok(Err(e)) => {
                    shared.set_failed(false, &e.to_string());
                    shared.metrics.not_set(n);
                }
                Err(_) => {
                    shared.set_failed(true, "no answer within 30 s");
                    shared.metrics.not_set(n);
                }
            }
            drop(permit);
        });
        // With the circuit open (a lookup failed or was late), nothing waits for Redis: the set
        // goes on in its task.
        if wait && tokio::time::timeout(limit, &mut set).await.is_err() {
            // Late, not dead: it finishes in its task; the connection and the circuit stay.
            self.shared.slow(Op::Set, n, limit, true);
        }
    }

    fn key(&self, k: &Key) -> String {
        key(&self.consumer, &k.0, k.1)
    }
}

/// The Redis key of a dedupe key: every part of `(consumer, message_id, event_date)`, readable
/// (`redis-cli --scan --pattern 'effectively:rewards:*'`). Consumer names cannot hold `:`.
pub fn key(consumer: &str, message_id: &Uuid, event_date: NaiveDate) -> String {
    format!(
        "effectively:{consumer}:{}:{message_id}",
        event_date.format("%Y-%m-%d")
    )
}

/// How long a key committed `now` for an event of `event_date` stays in Redis: until the event
/// leaves the retention window (the end of the day `event_date + retention_days`, UTC, as the
/// window check counts it), or `ttl` if sooner. `None`: already outside, do not set it.
pub fn ttl_for(
    ttl: Ttl,
    retention_days: u64,
    event_date: NaiveDate,
    now: DateTime<Utc>,
) -> Option<Duration> {
    let last_day = event_date.checked_add_days(chrono::Days::new(retention_days + 1))?;
    let window_end = last_day.and_hms_opt(0, 0, 0)?.and_utc();
    let left = (window_end - now).to_std().ok()?;
    let ttl = match ttl {
        Ttl::Retention => left,
        Ttl::For(d) => d.min(left),
    };
    (ttl >= Duration::from_millis(1)).then_some(ttl)
}

impl Shared {
    /// The connection, when there is one and the circuit is closed; otherwise `None` at once,
    /// after starting a connection attempt in the background if none is running and the circuit
    /// allows it.
    fn connection(self: &Arc<Self>) -> Option<(u64, MultiplexedConnection)> {
        let mut st = self.state.lock().expect("not poisoned");
        let now = Instant::now();
        if st.closed_until.is_some_and(|t| now < t) {
            return None;
        }
        let found = st.conn.as_ref().map(|(g, c)| (*g, c.clone()));
        if st.set_conn.is_none() || found.is_none() {
            self.start_connecting(&mut st);
        }
        found
    }

    /// The sets' connection, whatever the circuit (a late lookup says nothing about a set in
    /// flight), and whether a set should wait for Redis now: not while the circuit is open.
    /// `None` (after starting a connection attempt if the circuit allows) when there is none.
    fn set_connection(self: &Arc<Self>) -> Option<(MultiplexedConnection, bool)> {
        let mut st = self.state.lock().expect("not poisoned");
        let open = st.closed_until.is_some_and(|t| Instant::now() < t);
        match &st.set_conn {
            Some(c) => Some((c.clone(), !open)),
            None => {
                if !open {
                    self.start_connecting(&mut st);
                }
                None
            }
        }
    }

    /// A connection attempt in the background, unless one is running.
    fn start_connecting(self: &Arc<Self>, st: &mut State) {
        if !st.connecting {
            st.connecting = true;
            let shared = Arc::clone(self);
            tokio::spawn(async move { shared.connect().await });
        }
    }

    /// A set failed (an error, or no answer within [`SET_LATE_LIMIT`]): its connection goes
    /// (the next set starts a new one) and the circuit opens as for any failure; the lookups'
    /// connection stays.
    fn set_failed(&self, timeout: bool, why: &str) {
        self.state.lock().expect("not poisoned").set_conn = None;
        // No lookup connection has this generation: only the circuit and the log.
        self.failed(u64::MAX, Op::Set, timeout, why);
    }

    /// Connects whichever of the two connections is missing (lookups', sets').
    async fn connect(self: Arc<Self>) {
        let (lookups, sets) = {
            let st = self.state.lock().expect("not poisoned");
            (st.conn.is_none(), st.set_conn.is_none())
        };
        let mut made = Vec::new();
        for _ in 0..(lookups as usize + sets as usize) {
            match self.open().await {
                Ok(c) => made.push(c),
                Err((timeout, why)) => {
                    self.state.lock().expect("not poisoned").connecting = false;
                    return self.failed(0, Op::Connect, timeout, &why);
                }
            }
        }
        let mut st = self.state.lock().expect("not poisoned");
        st.connecting = false;
        if sets {
            st.set_conn = made.pop();
        }
        if let Some(conn) = made.pop() {
            st.generation += 1;
            st.conn = Some((st.generation, conn));
            if st.failures > 0 || st.unwarned > 0 {
                tracing::info!(consumer = %self.consumer, "prefilter: connected to Redis again");
            } else {
                tracing::debug!(consumer = %self.consumer, "prefilter: connected to Redis");
            }
        }
    }

    /// One multiplexed connection, within [`CONNECT_TIMEOUT`]; `(timed out, why)` if not.
    async fn open(&self) -> Result<MultiplexedConnection, (bool, String)> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(None);
        let result = tokio::time::timeout(
            CONNECT_TIMEOUT,
            self.client
                .get_multiplexed_async_connection_with_config(&config),
        )
        .await;
        match result {
            Ok(Ok(c)) => Ok(c),
            Ok(Err(e)) => Err((false, e.to_string())),
            Err(_) => Err((true, format!("no connection within {CONNECT_TIMEOUT:?}"))),
        }
    }

    fn succeeded(&self) {
        let mut st = self.state.lock().expect("not poisoned");
        st.failures = 0;
        st.closed_until = None;
    }

    /// A round trip answered too late, on a connection that may well be fine: count it and log
    /// it (a warning at most every minute), and leave the connection and the circuit alone.
    /// `finishing`: the set goes on in its task (its keys may still land); otherwise it was
    /// given up and its keys are not set.
    fn slow(&self, op: Op, keys: u64, limit: Duration, finishing: bool) {
        self.metrics.failed(op, true);
        let mut st = self.state.lock().expect("not poisoned");
        let now = Instant::now();
        let what = if finishing {
            "Redis answered a set later than set_timeout; it finishes in the background"
        } else {
            "Redis is behind: too many sets in flight, so these keys are not set (later copies \
             of those messages go to PostgreSQL, which dedupes them)"
        };
        tracing::debug!(consumer = %self.consumer, op = op.as_str(), keys, ?limit, "prefilter: {what}");
        if let Some(unwarned) = st.warn_now(now) {
            tracing::warn!(consumer = %self.consumer, op = op.as_str(), keys, ?limit,
                failures_since_last_warning = unwarned, "prefilter: {what}");
        }
    }

    /// A round trip on connection `generation` (0: a connection attempt) failed: count it,
    /// drop that connection, open the circuit, and log (a warning at most every minute).
    fn failed(&self, generation: u64, op: Op, timeout: bool, why: &str) {
        self.metrics.failed(op, timeout);
        let mut st = self.state.lock().expect("not poisoned");
        if generation == 0 || st.conn.as_ref().is_some_and(|(g, _)| *g == generation) {
            st.conn = None;
        }
        st.failures = st.failures.saturating_add(1);
        let circuit = CIRCUIT_MIN
            .saturating_mul(1 << (st.failures - 1).min(8))
            .min(CIRCUIT_MAX);
        let now = Instant::now();
        st.closed_until = Some(now + circuit);
        tracing::debug!(consumer = %self.consumer, op = op.as_str(), error = %why, ?circuit,
            "prefilter: Redis failed; batches go to PostgreSQL alone meanwhile");
        if let Some(unwarned) = st.warn_now(now) {
            tracing::warn!(consumer = %self.consumer, op = op.as_str(), error = %why,
                failures_since_last_warning = unwarned,
                "prefilter: Redis failed; every batch goes to PostgreSQL until it is back \
                 (nothing is lost or applied twice: Redis is never the authority)");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn day(s: &str) -> NaiveDate {
        s.parse().unwrap()
    }

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().unwrap()
    }

    #[test]
    fn a_set_waits_longer_than_a_lookup_but_at_most_a_second() {
        let ms = Duration::from_millis;
        assert_eq!(set_timeout(ms(50)), ms(500));
        assert_eq!(set_timeout(ms(10)), ms(100));
        assert_eq!(set_timeout(ms(300)), ms(1000));
        assert_eq!(set_timeout(Duration::from_secs(5)), Duration::from_secs(5));
    }

    #[test]
    fn the_key_names_consumer_date_and_id() {
        let id: Uuid = "0190f1c2-0000-7000-8000-000000000001".parse().unwrap();
        assert_eq!(
            key("rewards", &id, day("2026-12-03")),
            "effectively:rewards:2026-12-03:0190f1c2-0000-7000-8000-000000000001"
        );
    }

    #[test]
    fn a_key_lives_until_its_event_leaves_the_retention_window() {
        let h = Duration::from_secs(3600);
        // Retention 15 days: an event of Dec 3 is applicable through Dec 18 (today - 15 days
        // = Dec 3 is still inside), parked from Dec 19 on.
        let now = at("2026-12-03T10:00:00Z");
        let left = ttl_for(Ttl::Retention, 15, day("2026-12-03"), now).unwrap();
        assert_eq!(left, 15 * 24 * h + 14 * h);
        // A shorter configured TTL wins; a longer one never outlives the window.
        let two_days = Ttl::For(48 * h);
        assert_eq!(ttl_for(two_days, 15, day("2026-12-03"), now), Some(48 * h));
        let late = at("2026-12-18T23:00:00Z");
        assert_eq!(ttl_for(two_days, 15, day("2026-12-03"), late), Some(h));
        // Outside the window: not set at all.
        let gone = at("2026-12-19T00:00:00Z");
        assert_eq!(ttl_for(Ttl::Retention, 15, day("2026-12-03"), gone), None);
        // A future-dated event (within the tolerance) lives its whole window too.
        let ahead = ttl_for(Ttl::Retention, 15, day("2026-12-04"), now).unwrap();
        assert_eq!(ahead, left + 24 * h);
    }

    fn closed_port() -> u16 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }

    #[tokio::test]
    async fn a_redis_that_is_not_there_costs_no_batch_anything() {
        let config: PrefilterConfig = toml::from_str(&format!(
            "redis = \"redis://127.0.0.1:{}\"\ntimeout = \"2s\"",
            closed_port()
        ))
        .unwrap();
        let p = Prefilter::new("absent", &config, Duration::from_secs(15 * 86_400)).unwrap();
        let keys: Vec<Key> = (0..100)
            .map(|_| (Uuid::now_v7(), Utc::now().date_naive()))
            .collect();
        let t0 = Instant::now();
        for _ in 0..50 {
            assert!(p.lookup(&keys).await.iter().all(|h| !h));
            p.remember(&keys).await;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // Neither waited for the 2 s timeout nor for a connection attempt.
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        let st = p.shared.state.lock().unwrap();
        assert!(st.conn.is_none());
        assert!(st.failures >= 1, "the refused connection was counted");
        assert!(st.closed_until.is_some(), "and opened the circuit");
    }
}
