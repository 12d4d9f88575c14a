//! How many of one process's processors (of one consumer) run a round at once.
//!
//! Processors are added to keep up (the seed's point of `SKIP LOCKED`), but every round runs on
//! PostgreSQL's CPU. Past what its cores run at once, another processor adds no rows per second,
//! only waiting: on a two-core machine 8 processors drained 10 to 25% slower than 4, and two
//! workers of 4 slower than 8, while every statement read the same buffers per row and took
//! longer (docs/PERFORMANCE.md, "The inbox curve"). A process cannot count PostgreSQL's cores,
//! nor see the other processes' processors, so it measures instead: rounds take a permit, and the
//! number of permits adapts between 1 and `inbox.processors` (`inbox.adaptive = true`, the
//! default) in the manner of TCP Vegas, which also shares a bottleneck between senders that do not
//! know each other:
//! - a window is `max(limit, 4)` rounds that claimed rows and started under the current limit;
//!   its time per row is the rounds' time over their rows;
//! - the base is the least time per row of a window run one round at a time: what a row costs
//!   when this process does not queue behind itself;
//! - `limit * (1 - base / time per row)` estimates how many of this process's rounds wait on
//!   PostgreSQL rather than run: below [`ALPHA`] the limit grows by one, above [`BETA`] it
//!   shrinks by one, in between it stays (so it never shrinks below two by itself: two rounds
//!   are never more than two queued, and two keep PostgreSQL busy while a commit travels);
//! - [`FIRST_PROBE_AFTER`] the start and every [`PROBE_EVERY`] after, the limit drops to 1 for
//!   one window to measure the base again (BBR's ProbeRTT), then returns: the first windows run
//!   on cold connections, and the cost of a row changes with the handler and the data.
//!
//! The limit starts at 1 (the first window is the first base) and grows a step a window while
//! rows cost what they cost alone. A processor waiting for a permit keeps its slice of the keys;
//! the semaphore is fair, so the processors take turns.
//!
//! Considered: `congestion-limiter` (its Vegas and Gradient), which times a job from its permit
//! to its release and keeps its samples' fields private: a round that claimed 3 rows and one that
//! claimed 100 would be the same job, and its thresholds (3 and 6 queued jobs) never shrink 8
//! processors on two cores.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Fewer rounds than this waiting on PostgreSQL: room for one more.
pub const ALPHA: f64 = 1.0;
/// More rounds than this waiting on PostgreSQL: one fewer.
pub const BETA: f64 = 2.0;
/// How often the base is measured again, one round at a time.
pub const PROBE_EVERY: Duration = Duration::from_secs(10);
/// When it is measured again the first time: the first windows run on cold connections (their
/// first plans, the first reads of the table), a base up to 3 times what a row costs a second
/// later (`make bench`), which would let the limit grow past what PostgreSQL runs.
pub const FIRST_PROBE_AFTER: Duration = Duration::from_secs(1);
/// One more round at once must bring this many times the rows a second, or it is taken back.
pub const GAIN: f64 = 1.05;
/// How long the limit stays after the first growth that did not pay; doubled at each next one,
/// up to [`PROBE_EVERY`].
pub const HOLD_FIRST: Duration = Duration::from_millis(500);
/// The fewest rounds in a window.
const MIN_WINDOW: usize = 4;

/// The permits of one process's processors of one consumer.
#[derive(Debug)]
pub struct Limit {
    consumer: Arc<str>,
    permits: Arc<Semaphore>,
    max: usize,
    adaptive: bool,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    limit: usize,
    /// Permits to forget as rounds give them back, after the limit shrank below the rounds then
    /// running.
    owed: usize,
    /// Bumped at every change of the limit: a round started before it is not a sample of the
    /// new limit.
    epoch: u64,
    window: Window,
    /// Seconds per row, one round at a time.
    base: Option<f64>,
    /// While the base is measured: the limit to go back to.
    probing: Option<usize>,
    next_probe: Instant,
    /// The other members' rounds at once.
    others: usize,
    /// The limit before the last growth and this process's rows a second then: a growth that
    /// does not add [`GAIN`] is taken back.
    grew: Option<(usize, f64)>,
    /// How long the next failed growth holds the limit, and until when this one does.
    hold: Duration,
    hold_until: Instant,
    /// Which of the slots `0..max` a running round holds: a round claims from its slot's
    /// slice of the keys ([`crate::inbox::members`]).
    held: Vec<bool>,
}

#[derive(Debug, Default)]
struct Window {
    rounds: usize,
    rows: u64,
    busy: Duration,
}

/// A round's permit: give it back with [`Permit::done`], or drop it for a round that claimed
/// nothing or failed (no sample).
#[derive(Debug)]
pub struct Permit {
    limit: Arc<Limit>,
    permit: Option<OwnedSemaphorePermit>,
    epoch: u64,
    slot: usize,
    started: Instant,
}

impl Limit {
    /// `processors` permits at most; adaptive ones start at 1.
    pub fn new(consumer: Arc<str>, processors: usize, adaptive: bool) -> Arc<Self> {
        let max = processors.max(1);
        let limit = if adaptive { 1 } else { max };
        crate::metrics::inbox_round_limit(&consumer, limit);
        Arc::new(Limit {
            consumer,
            permits: Arc::new(Semaphore::new(limit)),
            max,
            adaptive,
            state: Mutex::new(State {
                limit,
                owed: 0,
                epoch: 0,
                window: Window::default(),
                base: None,
                probing: None,
                next_probe: Instant::now() + FIRST_PROBE_AFTER,
                held: vec![false; max],
                others: 0,
                grew: None,
                hold: HOLD_FIRST / 2,
                hold_until: Instant::now(),
            }),
        })
    }

    /// Waits for a permit (in turn: the semaphore is fair).
    pub async fn acquire(self: &Arc<Self>) -> Permit {
        let permit = Arc::clone(&self.permits)
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let mut s = self.state.lock().expect("not poisoned");
        // At most `limit` permits are out once those owed are back, so a slot below the limit
        // is free; until then the lowest free one.
        let slot = s.held.iter().position(|h| !h).unwrap_or(0);
        s.held[slot] = true;
        Permit {
            limit: Arc::clone(self),
            permit: Some(permit),
            epoch: s.epoch,
            slot,
            started: Instant::now(),
        }
    }

    /// The rounds that may run at once now.
    pub fn current(&self) -> usize {
        self.state.lock().expect("not poisoned").limit
    }

    /// A round of `rows` rows that took `took`, started under `epoch`.
    fn sample(&self, epoch: u64, rows: u64, took: Duration) {
        if !self.adaptive || rows == 0 {
            return;
        }
        let mut s = self.state.lock().expect("not poisoned");
        if epoch != s.epoch {
            return;
        }
        s.window.rounds += 1;
        s.window.rows += rows;
        s.window.busy += took;
        if s.window.rounds < s.limit.max(MIN_WINDOW) {
            return;
        }
        let per_row = s.window.busy.as_secs_f64() / s.window.rows as f64;
        s.window = Window::default();
        let now = Instant::now();
        let rows_s = s.limit as f64 / per_row;
        let next = if let Some(back) = s.probing.take() {
            s.base = Some(per_row);
            s.grew = None;
            back
        } else if s.limit > 1 && now >= s.next_probe {
            s.next_probe = now + PROBE_EVERY;
            s.probing = Some(s.limit);
            s.grew = None;
            1
        } else {
            match s.grew.take() {
                Some((from, was)) if rows_s < was * GAIN => {
                    // The last round added did not pay: back, and wait longer each time before
                    // trying again.
                    s.hold = (s.hold * 2).clamp(HOLD_FIRST, PROBE_EVERY);
                    s.hold_until = now + s.hold;
                    from
                }
                grew => {
                    if grew.is_some() {
                        // It paid: the next failure holds briefly again.
                        s.hold = HOLD_FIRST / 2;
                    }
                    let base = s.base.map_or(per_row, |b| b.min(per_row));
                    s.base = Some(base);
                    let all = step(s.limit + s.others, base, per_row, self.max + s.others);
                    let next = all.saturating_sub(s.others).clamp(1, self.max);
                    match next > s.limit {
                        true if now < s.hold_until => s.limit,
                        true => {
                            s.grew = Some((s.limit, rows_s));
                            next
                        }
                        false => next,
                    }
                }
            }
        };
        self.set(&mut s, next);
    }

    /// The rounds the other members of the consumer (other processes) may run at once, as
    /// their last beats said ([`crate::inbox::members`]): they run on the same PostgreSQL.
    pub fn others(&self, n: usize) {
        self.state.lock().expect("not poisoned").others = n;
    }

    fn set(&self, s: &mut State, next: usize) {
        if next == s.limit {
            return;
        }
        if next > s.limit {
            // Permits still owed are cancelled first.
            let mut more = next - s.limit;
            let cancel = more.min(s.owed);
            s.owed -= cancel;
            more -= cancel;
            self.permits.add_permits(more);
        } else {
            let fewer = s.limit - next;
            let forgotten = self.permits.forget_permits(fewer);
            s.owed += fewer - forgotten;
        }
        tracing::debug!(consumer = %self.consumer, from = s.limit, to = next, base_us = ?s.base.map(|b| b * 1e6),
            "inbox processors: rounds at once");
        s.limit = next;
        s.epoch += 1;
        crate::metrics::inbox_round_limit(&self.consumer, next);
    }
}

/// The next limit after a window at `limit` whose rows took `per_row` seconds each, against
/// `base` seconds one round at a time.
pub fn step(limit: usize, base: f64, per_row: f64, max: usize) -> usize {
    let queued = limit as f64 * (1.0 - base / per_row);
    if queued < ALPHA && limit < max {
        limit + 1
    } else if queued > BETA && limit > 1 {
        limit - 1
    } else {
        limit
    }
}

impl Permit {
    /// Which of the rounds running at once this is: its slice of the keys.
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The round claimed `rows` rows and committed.
    pub fn done(self, rows: usize) {
        let took = self.started.elapsed();
        self.limit.sample(self.epoch, rows as u64, took);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let Some(permit) = self.permit.take() else {
            return;
        };
        let mut s = self.limit.state.lock().expect("not poisoned");
        s.held[self.slot] = false;
        if s.owed > 0 {
            s.owed -= 1;
            permit.forget();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_grows_while_rows_cost_what_they_cost_alone_and_shrinks_when_they_queue() {
        // Rows at the base's cost: room for one more, up to the processors.
        assert_eq!(step(1, 100e-6, 100e-6, 8), 2);
        assert_eq!(step(8, 100e-6, 100e-6, 8), 8);
        // Two-core figures from the bench (µs per row at 1, 2, 4 and 8 rounds at once: 111,
        // 155, 292, 775): 2 grows, 4 and 8 shrink.
        assert_eq!(step(2, 111e-6, 155e-6, 8), 3);
        assert_eq!(step(4, 111e-6, 292e-6, 8), 3);
        assert_eq!(step(8, 111e-6, 775e-6, 8), 7);
        // Never below two (of two processors or more): two rounds estimate at most two queued,
        // never above BETA, and one round alone queues behind nothing of its own. Two is also
        // what keeps PostgreSQL busy while one round's commit travels.
        assert_eq!(step(3, 100e-6, 10e-3, 8), 2);
        assert_eq!(step(2, 100e-6, 10e-3, 8), 2);
        assert_eq!(step(1, 100e-6, 10e-3, 8), 2);
        assert_eq!(step(1, 100e-6, 10e-3, 1), 1);
    }

    fn window(limit: &Arc<Limit>, rounds: usize, per_row: Duration) {
        let epoch = limit.state.lock().unwrap().epoch;
        for _ in 0..rounds {
            limit.sample(epoch, 100, per_row * 100);
        }
    }

    #[test]
    fn the_limit_climbs_to_where_rows_queue_and_settles_there() {
        let limit = Limit::new(Arc::from("c"), 8, true);
        assert_eq!(limit.current(), 1);
        // A CPU of two cores: rounds run side by side up to two, then share them.
        let cost = |n: usize| Duration::from_micros(100 * (n.max(2) as u64) / 2);
        for _ in 0..5 {
            let n = limit.current();
            window(&limit, n.max(MIN_WINDOW), cost(n));
        }
        // Rows cost what they cost alone up to 2; a third round brings no more rows a second
        // (queued = 3 * (1 - 100/150) = 1, not above BETA), so it is taken back and held.
        for _ in 0..20 {
            assert_eq!(limit.current(), 2);
            window(&limit, MIN_WINDOW, cost(2));
        }
        assert!(limit.state.lock().unwrap().hold >= HOLD_FIRST);
    }

    #[test]
    fn the_limit_climbs_to_the_processors_while_rounds_do_not_queue() {
        let limit = Limit::new(Arc::from("c"), 8, true);
        for _ in 0..20 {
            let n = limit.current();
            window(&limit, n.max(MIN_WINDOW), Duration::from_micros(100));
        }
        assert_eq!(limit.current(), 8);
    }

    #[test]
    fn the_rounds_of_other_members_count_as_queued() {
        let limit = Limit::new(Arc::from("c"), 4, true);
        window(&limit, 4, Duration::from_micros(100));
        assert_eq!(limit.current(), 2);
        // Another process runs 4 rounds and rows cost 4 times as much: 6 rounds, 4.5 queued.
        limit.others(4);
        window(&limit, 4, Duration::from_micros(400));
        assert_eq!(limit.current(), 1);
    }

    #[test]
    fn a_fixed_limit_is_the_processors_and_never_moves() {
        let limit = Limit::new(Arc::from("c"), 6, false);
        assert_eq!(limit.current(), 6);
        window(&limit, 40, Duration::from_millis(5));
        assert_eq!(limit.current(), 6);
    }

    #[tokio::test]
    async fn a_shrunk_limit_takes_back_the_permits_of_rounds_still_running() {
        let limit = Limit::new(Arc::from("c"), 4, true);
        {
            let mut s = limit.state.lock().unwrap();
            limit.set(&mut s, 4);
        }
        let held: Vec<Permit> = futures::future::join_all((0..4).map(|_| limit.acquire())).await;
        {
            let mut s = limit.state.lock().unwrap();
            limit.set(&mut s, 1);
            assert_eq!(s.owed, 3);
        }
        let slots: Vec<usize> = held.iter().map(Permit::slot).collect();
        assert_eq!(slots, [0, 1, 2, 3]);
        drop(held);
        assert_eq!(limit.permits.available_permits(), 1);
        assert_eq!(
            limit.acquire().await.slot(),
            0,
            "the lowest slot, below the limit"
        );
        // Growing again gives permits back.
        let mut s = limit.state.lock().unwrap();
        limit.set(&mut s, 3);
        assert_eq!(limit.permits.available_permits(), 3);
    }

    #[test]
    fn the_base_is_measured_again_one_round_at_a_time() {
        let limit = Limit::new(Arc::from("c"), 8, true);
        window(&limit, 4, Duration::from_micros(100));
        window(&limit, 4, Duration::from_micros(100));
        assert_eq!(limit.current(), 3);
        limit.state.lock().unwrap().next_probe = Instant::now();
        window(&limit, 4, Duration::from_micros(100));
        assert_eq!(limit.current(), 1, "probing");
        // Rows now cost twice as much alone: that is the new base, and the limit goes back.
        window(&limit, 4, Duration::from_micros(200));
        assert_eq!(limit.current(), 3);
        assert_eq!(limit.state.lock().unwrap().base, Some(200e-6));
    }
}
