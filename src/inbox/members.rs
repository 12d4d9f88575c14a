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
#[derive(Debug, Clone)]
pub struct Members {
    consumer: Arc<str>,
    member: Uuid,
    worker: Arc<str>,
    processors: i32,
    place: Arc<Mutex<Place>>,
}

impl Members {
    /// A member with `processors` processors, alone until its first beat.
    pub fn new(consumer: Arc<str>, worker: &str, processors: usize) -> Self {
        let processors = processors.max(1) as i32;
        Members {
            consumer,
            member: Uuid::new_v4(),
            worker: Arc::from(worker),
            processors,
            place: Arc::new(Mutex::new(Place {
                first: 0,
                total: processors,
            })),
        }
    }

    /// The slice processor `k` (of this process's) claims from now.
    pub fn slice(&self, k: usize) -> Slice {
        let place = *self.place.lock().expect("not poisoned");
        Slice {
            index: place.first + k as i32,
            of: place.total,
        }
    }

    /// Beats until `stop`, then leaves.
    pub async fn run(self, pool: Pool, stop: CancellationToken) {
        let ttl_ms = TIME_TO_LIVE.as_millis() as f64;
        let mut failing = false;
        loop {
            let beat = async {
                let client = pool.get().await.map_err(|e| e.to_string())?;
                table::beat(
                    &**client,
                    &self.consumer,
                    self.member,
                    &self.worker,
                    self.processors,
                    ttl_ms,
                )
                .await
                .map_err(|e| e.to_string())
            };
            match tokio::time::timeout(BEAT_EVERY * 2, beat).await {
                Ok(Ok(live)) => {
                    failing = false;
                    self.place_among(&live);
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
    fn place_among(&self, live: &[(Uuid, i32)]) {
        let Some(at) = live.iter().position(|(m, _)| *m == self.member) else {
            return;
        };
        let first: i32 = live[..at].iter().map(|(_, n)| n).sum();
        let total: i32 = live.iter().map(|(_, n)| n).sum();
        let place = Place { first, total };
        let mut was = self.place.lock().expect("not poisoned");
        if *was != place {
            tracing::info!(consumer = %self.consumer, members = live.len(),
                slices = format!("{}..{} of {}", first, first + self.processors, total),
                "inbox processors: the members changed; new slices of the keys");
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
        m.place_among(&[(older, 2), (m.member, 4), (newer, 3)]);
        assert_eq!(m.slice(0), Slice { index: 2, of: 9 });
        assert_eq!(m.slice(3), Slice { index: 5, of: 9 });
        // Not among the live (its own beat failed to show): keeps what it has.
        m.place_among(&[(older, 2)]);
        assert_eq!(m.slice(0), Slice { index: 2, of: 9 });
        m.place_among(&[(m.member, 4)]);
        assert_eq!(m.slice(1), Slice { index: 1, of: 4 });
    }
}
