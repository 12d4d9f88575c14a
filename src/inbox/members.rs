//! The processors of one consumer across processes, and the slice of the ordering keys each one
//! claims from.
//!
//! A processor claims from a slice of the keys (see [`Slice`]), so that processors stop walking
//! over each other's locked heads. Within one process that is easy (processor `k` of `n` takes
//! slice `k` of `n`), but a process does not know the others: two workers of four processors
//! each took slices `0..4` of 4 both, every slice was claimed by two processors, and the two
//! workers together drained 7 times slower than one processor (`make bench`, 10,000 rows of
//! 1,000 keys). So every process with processors keeps a row in `inbox_members` (migration
//! V11) and beats it every [`BEAT_EVERY`]; at each beat it reads the live members, oldest
//! first, and its processors take the slices after those of the members before it: with two
//! workers of four, slices `0..4` and `4..8` of 8.
//!
//! A slice is a round's, not a processor's: a member takes as many slices as its processors
//! may run rounds at once ([`crate::inbox::limit`]), and a round claims from the slice of the
//! permit it holds. A claim reads about as many rows as there are slices for each row of its
//! own (it filters the oldest rows by slice), so slices kept for processors waiting for a
//! permit made every claim dearer: 8 processors at a limit of 3 drained 20 to 45% slower than
//! 4 at the same limit (`make bench`, quick).
//!
//! A member that stops deletes its row; one that dies is deleted by the next beat of any other
//! once its row is older than [`TIME_TO_LIVE`]. Until the others have seen a change, slices
//! overlap or a slice is nobody's for a moment: harmless, because a slice narrows where a claim
//! looks and never what it may take (the head-of-key check and the row locks keep order and
//! exclusion), and a processor whose slice has no due row looks at every key
//! ([`crate::inbox::processor`]), so a dead member's keys are not left waiting for its row to
//! expire. When PostgreSQL does not answer a beat, the processors keep the slices they have.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::inbox::limit::Limit;
use crate::store::inbox::{members as table, Slice};

/// How often a member beats and looks at the others: a joining member's slices overlap the
/// others' until they have seen it, so this is short (a beat is three small statements).
pub const BEAT_EVERY: Duration = Duration::from_millis(250);

/// A member whose last beat is older than this is gone (twelve missed beats).
pub const TIME_TO_LIVE: Duration = Duration::from_secs(3);

/// This process's place among the members of one consumer: its processors' slices are
/// `first .. first + n` of `total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Place {
    first: i32,
    total: i32,
}

/// One process's membership for one consumer, shared by its processors.
#[derive(Clone)]
pub struct Members {
    consumer: Arc<str>,
    member: Uuid,
    worker: Arc<str>,
    /// How many slices this member takes, read at every beat: a fixed number, or the rounds
    /// its processors may run at once ([`Limit`], which hears of the others' in return).
    slices: Slices,
    place: Arc<Mutex<Place>>,
}

#[derive(Debug, Clone)]
enum Slices {
    Fixed(usize),
    Limit(Arc<Limit>),
}

impl Slices {
    fn now(&self) -> i32 {
        let n = match self {
            Slices::Fixed(n) => *n,
            Slices::Limit(l) => l.current(),
        };
        n.max(1) as i32
    }
}

impl Members {
    /// A member of `slices` slices, alone until its first beat.
    pub fn new(consumer: Arc<str>, worker: &str, slices: usize) -> Self {
        Self::with(consumer, worker, Slices::Fixed(slices))
    }

    /// A member of a slice for each round `limit` lets its processors run at once, read at
    /// each beat, so that the keys are cut in as many slices as rounds run (a claim reads
    /// about as many rows as there are slices for each of its own, see [`Slice`]); `limit`
    /// hears at each beat how many rounds the other members run.
    pub fn following(consumer: Arc<str>, worker: &str, limit: Arc<Limit>) -> Self {
        Self::with(consumer, worker, Slices::Limit(limit))
    }

    fn with(consumer: Arc<str>, worker: &str, slices: Slices) -> Self {
        let n = slices.now();
        Members {
            consumer,
            member: Uuid::new_v4(),
            worker: Arc::from(worker),
            slices,
            place: Arc::new(Mutex::new(Place { first: 0, total: n })),
        }
    }

    /// The slice round `k` (of this process's running at once) claims from now. A `k` past
    /// this member's slices at its last beat (its limit grew since) wraps into the others': an
    /// overlap until the next beat, harmless (module docs).
    pub fn slice(&self, k: usize) -> Slice {
        let place = *self.place.lock().expect("not poisoned");
        Slice {
            index: (place.first + k as i32) % place.total.max(1),
            of: place.total,
        }
    }

    /// Beats until `stop`, then leaves.
    pub async fn run(self, pool: Pool, stop: CancellationToken) {
        let ttl_ms = TIME_TO_LIVE.as_millis() as f64;
        let mut failing = false;
        loop {
            let n = self.slices.now();
            let beat = async {
                let client = pool.get().await.map_err(|e| e.to_string())?;
                table::beat(
                    &**client,
                    &self.consumer,
                    self.member,
                    &self.worker,
                    n,
                    ttl_ms,
                )
                .await
                .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(BEAT_EVERY * 2, beat).await {
                Ok(Ok(live)) => {
                    failing = false;
                    self.place_among(&live, n);
                }
                Ok(Err(e)) if !failing => {
                    failing = true;
                    tracing::warn!(consumer = %self.consumer, error = %e,
                        "inbox processors: could not beat in inbox_members; keeping the slices they have");
                }
                Err(_) if !failing => {
                    failing = true;
                    tracing::warn!(consumer = %self.consumer,
                        "inbox processors: the beat in inbox_members timed out; keeping the slices they have");
                }
                _ => {}
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(BEAT_EVERY) => {}
            }
        }
        let leave = async {
            let client = pool.get().await.map_err(|e| e.to_string())?;
            table::leave(&**client, &self.consumer, self.member)
                .await
                .map_err(|e| e.to_string())
        };
        if let Ok(Err(e)) = tokio::time::timeout(BEAT_EVERY, leave).await {
            tracing::debug!(consumer = %self.consumer, error = %e,
                "inbox processors: could not leave inbox_members; the row expires");
        }
    }

    /// Takes the slices after those of the members before this one in `live`.
    fn place_among(&self, live: &[(Uuid, i32)], n: i32) {
        let Some(at) = live.iter().position(|(m, _)| *m == self.member) else {
            return;
        };
        let first: i32 = live[..at].iter().map(|(_, n)| n).sum();
        let total: i32 = live.iter().map(|(_, n)| n).sum();
        let place = Place { first, total };
        if let Slices::Limit(limit) = &self.slices {
            limit.others((total - n).max(0) as usize);
        }
        let mut was = self.place.lock().expect("not poisoned");
        if *was != place {
            tracing::debug!(consumer = %self.consumer, members = live.len(),
                slices = format!("{}..{} of {}", first, first + n, total),
                "inbox processors: the members or their rounds at once changed; new slices of the keys");
            *was = place;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_takes_the_slices_after_those_before_it() {
        let m = Members::new(Arc::from("c"), "w", 4);
        assert_eq!(m.slice(3), Slice { index: 3, of: 4 });
        let older = Uuid::new_v4();
        let newer = Uuid::new_v4();
        m.place_among(&[(older, 2), (m.member, 4), (newer, 3)], 4);
        assert_eq!(m.slice(0), Slice { index: 2, of: 9 });
        assert_eq!(m.slice(3), Slice { index: 5, of: 9 });
        // Not among the live (its own beat failed to show): keeps what it has.
        m.place_among(&[(older, 2)], 4);
        assert_eq!(m.slice(0), Slice { index: 2, of: 9 });
        m.place_among(&[(m.member, 4)], 4);
        assert_eq!(m.slice(1), Slice { index: 1, of: 4 });
        // A round past the slices of the last beat wraps.
        assert_eq!(m.slice(5), Slice { index: 1, of: 4 });
    }
}
