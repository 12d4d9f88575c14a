//! When each of the peer's transactions became visible, which is when its effects happened.
//!
//! Flink's XA sink writes a checkpoint's rows long before it commits them (`COMMIT PREPARED`
//! once the checkpoint is complete), so a row's `clock_timestamp()` says when it was written,
//! not when anyone could see it. PostgreSQL keeps no commit time unless
//! `track_commit_timestamp` is on (a server-wide setting, for every phase). Instead a session
//! of ours reads `pg_current_snapshot()` every [`POLL`]: the first snapshot in which a
//! transaction id is neither running nor prepared is when it committed, within one poll. A row's
//! `xmin` is its transaction; so every row gets its commit time, and the peer's latency is that
//! time minus the record's Kafka timestamp, like the engine's (`credited_at - kafka_ts`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;

use super::super::procfs;

/// How often the snapshot is read: the commit times' resolution. A checkpoint interval of a
/// second or more is what the latency is made of, and each read costs PostgreSQL a few
/// microseconds (the session's CPU is left out of the peer's cost: [`CommitClock::cpu_s`]).
const POLL: Duration = Duration::from_millis(20);

/// One snapshot: when (the server's clock, seconds since the epoch), and which transactions it
/// saw as not yet committed.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Snapshot {
    pub(super) at: f64,
    xmin: u64,
    xmax: u64,
    running: Vec<u64>,
}

impl Snapshot {
    /// `xmin:xmax:xip,...` of `pg_current_snapshot()::text`.
    fn parse(at: f64, text: &str) -> Option<Snapshot> {
        let mut parts = text.split(':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let running = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<_>>()?,
        };
        Some(Snapshot {
            at,
            xmin,
            xmax,
            running,
        })
    }

    /// Whether transaction `xid` (64-bit) had ended by this snapshot. For a row's `xmin` that is
    /// its commit: an aborted transaction leaves no row.
    fn ended(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && !self.running.contains(&xid))
    }

    /// A row's 32-bit `xmin` as the 64-bit id of this snapshot's epoch (or the one before, if
    /// the counter wrapped since).
    fn widen(&self, xid: u32) -> u64 {
        let full = (self.xmax >> 32 << 32) | u64::from(xid);
        if full > self.xmax {
            full.saturating_sub(1 << 32)
        } else {
            full
        }
    }
}

/// Snapshots taken until [`CommitClock::stop`].
pub(super) struct CommitClock {
    snapshots: Arc<Mutex<Vec<Snapshot>>>,
    task: tokio::task::JoinHandle<()>,
    backend: u32,
}

impl CommitClock {
    pub(super) async fn start(url: &str) -> anyhow::Result<CommitClock> {
        let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .context("connecting the commit clock to PostgreSQL")?;
        tokio::spawn(conn);
        let backend: i32 = db.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
        let read = db
            .prepare(
                "SELECT pg_current_snapshot()::text, extract(epoch FROM clock_timestamp())::float8",
            )
            .await?;
        let snapshots: Arc<Mutex<Vec<Snapshot>>> = Arc::default();
        let into = Arc::clone(&snapshots);
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if let Ok(r) = db.query_one(&read, &[]).await {
                    if let Some(s) = Snapshot::parse(r.get(1), r.get(0)) {
                        into.lock().unwrap().push(s);
                    }
                }
            }
        });
        Ok(CommitClock {
            snapshots,
            task,
            backend: backend as u32,
        })
    }

    /// CPU seconds of the clock's own PostgreSQL session so far: not the peer's cost.
    pub(super) fn cpu_s(&self) -> f64 {
        procfs::stat(self.backend).map_or(0.0, |s| s.cpu_s)
    }

    /// Stops reading; the snapshots taken, oldest first.
    pub(super) fn stop(self) -> Commits {
        self.task.abort();
        let snapshots = std::mem::take(&mut *self.snapshots.lock().unwrap());
        Commits { snapshots }
    }
}

/// A clock dropped on an error path stops too (a task of its own polls until aborted).
impl Drop for CommitClock {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The snapshots of a run, to look commit times up in.
pub(super) struct Commits {
    snapshots: Vec<Snapshot>,
}

impl Commits {
    /// When the transaction `xid` (a row's `xmin`) was first seen committed; None if it was not
    /// by the last snapshot.
    pub(super) fn committed_at(&self, xid: u32) -> Option<f64> {
        let last = self.snapshots.last()?;
        let xid = last.widen(xid);
        // Once ended, ended in every later snapshot: the first is found by bisection.
        let i = self.snapshots.partition_point(|s| !s.ended(xid));
        self.snapshots.get(i).map(|s| s.at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(at: f64, text: &str) -> Snapshot {
        Snapshot::parse(at, text).unwrap()
    }

    #[test]
    fn a_snapshot_is_read_from_its_text() {
        assert_eq!(
            snap(1.0, "748:760:748,752"),
            Snapshot {
                at: 1.0,
                xmin: 748,
                xmax: 760,
                running: vec![748, 752]
            }
        );
        assert!(snap(1.0, "760:760:").running.is_empty());
        assert!(Snapshot::parse(1.0, "garbage").is_none());
    }

    #[test]
    fn a_prepared_transaction_commits_when_it_leaves_the_snapshot() {
        // 752 prepared at 1.0 and 2.0 (running, as PostgreSQL counts prepared transactions),
        // committed by 3.0; 755 had not started at 1.0 and committed by 2.0.
        let commits = Commits {
            snapshots: vec![
                snap(1.0, "748:754:748,752"),
                snap(2.0, "752:757:752"),
                snap(3.0, "758:758:"),
            ],
        };
        assert_eq!(commits.committed_at(752), Some(3.0));
        assert_eq!(commits.committed_at(755), Some(2.0));
        assert_eq!(commits.committed_at(700), Some(1.0));
        assert_eq!(
            commits.committed_at(758),
            None,
            "not ended by the last snapshot"
        );
    }

    #[test]
    fn a_row_xid_takes_the_snapshots_epoch() {
        let s = snap(1.0, &format!("{}:{}:", (3u64 << 32) + 5, (3u64 << 32) + 9));
        assert_eq!(s.widen(7), (3 << 32) + 7);
        // Assigned before the counter wrapped into this epoch.
        assert_eq!(s.widen(u32::MAX), (2 << 32) + u64::from(u32::MAX));
    }
}
