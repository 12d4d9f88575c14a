//! What the harness watches while faults happen, all through PostgreSQL:
//!
//! - [`CommitWatch`]: every ~50 ms, each partition's `consumer_offsets` row through the
//!   multi-host URL (the first poll after a failover reconnects to the new primary). Each
//!   committed batch moves `next_offset` and sets `updated_at` to its transaction's start;
//!   [`recovery`] and [`longest_stall`] are computed from these commits afterwards.
//! - [`AheadSampler`]: chaos's "Kafka's committed offset is never ahead of PostgreSQL's",
//!   every 250 ms, reconnecting after a failover.
//! - [`stored_offsets`] and [`inbox_ids`]: one server's state (a node's own URL), before a
//!   crash and after a promotion.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::BaseConsumer;
use rdkafka::ClientConfig;

/// Seconds since the Unix epoch, on this machine's clock (PostgreSQL's too: loopback only).
pub(crate) fn now_s() -> f64 {
    chrono::Utc::now().timestamp_micros() as f64 / 1e6
}

/// A connection to `url` within `limit` (connect timeout of each host: 1 s), its driver spawned.
pub(crate) async fn connect(url: &str, limit: Duration) -> anyhow::Result<tokio_postgres::Client> {
    let mut config: tokio_postgres::Config = url.parse()?;
    config.connect_timeout(Duration::from_secs(1));
    let (db, conn) = tokio::time::timeout(limit, config.connect(tokio_postgres::NoTls))
        .await
        .context("connecting to PostgreSQL timed out")??;
    tokio::spawn(conn);
    Ok(db)
}

/// One commit seen: a partition's stored offset moved (or went back, after a lossy failover).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Commit {
    pub partition: i32,
    /// `updated_at`: the committing transaction's start, in epoch seconds.
    pub at: f64,
    pub next_offset: i64,
    /// When the poll first saw it, in epoch seconds.
    pub seen: f64,
    /// The port of the server that answered the poll (which primary committed it).
    pub server: u16,
}

/// Polls a consumer's stored offsets until finished, recording every change.
pub(crate) struct CommitWatch {
    stop: Arc<AtomicBool>,
    commits: Arc<Mutex<Vec<Commit>>>,
    task: tokio::task::JoinHandle<()>,
}

impl CommitWatch {
    pub(crate) fn start(url: &str, consumer: &str) -> CommitWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let commits: Arc<Mutex<Vec<Commit>>> = Arc::default();
        let (url, consumer) = (url.to_string(), consumer.to_string());
        let task = tokio::spawn({
            let (stop, commits) = (Arc::clone(&stop), Arc::clone(&commits));
            async move {
                let mut db: Option<tokio_postgres::Client> = None;
                let mut last: HashMap<i32, i64> = HashMap::new();
                while !stop.load(Relaxed) {
                    if db.as_ref().is_none_or(|d| d.is_closed()) {
                        db = connect(&url, Duration::from_secs(3)).await.ok();
                    }
                    if let Some(d) = &db {
                        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&consumer];
                        let q = d.query(
                            "SELECT partition, extract(epoch FROM updated_at)::float8, next_offset,
                                    inet_server_port()
                             FROM consumer_offsets WHERE consumer = $1 AND topic = $1",
                            &params,
                        );
                        match tokio::time::timeout(Duration::from_secs(1), q).await {
                            Ok(Ok(rows)) => {
                                let seen = now_s();
                                let mut c = commits.lock().unwrap();
                                for r in rows {
                                    let Some(next_offset) = r.get::<_, Option<i64>>(2) else {
                                        continue;
                                    };
                                    let partition: i32 = r.get(0);
                                    // A claim sets updated_at too; only a moved offset is a commit.
                                    if last.insert(partition, next_offset) != Some(next_offset) {
                                        let port: Option<i32> = r.get(3);
                                        c.push(Commit {
                                            partition,
                                            at: r.get(1),
                                            next_offset,
                                            seen,
                                            server: port.unwrap_or(0) as u16,
                                        });
                                    }
                                }
                            }
                            // A server that does not answer (paused) or is gone: reconnect.
                            _ => db = None,
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
        CommitWatch {
            stop,
            commits,
            task,
        }
    }

    /// The commits seen so far.
    pub(crate) fn commits(&self) -> Vec<Commit> {
        self.commits.lock().unwrap().clone()
    }

    /// Stops polling; every commit seen.
    pub(crate) async fn finish(mut self) -> Vec<Commit> {
        self.stop.store(true, Relaxed);
        let _ = (&mut self.task).await;
        self.commits()
    }
}

impl Drop for CommitWatch {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// When a fault happened, and what counts as recovered from it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Since<'a> {
    /// When the fault was issued (epoch seconds): recovery is measured from here.
    pub from: f64,
    /// Only batches begun at or after this count (the fault took effect then).
    pub valid_after: f64,
    /// Each partition's high watermark at the fault (None: Kafka did not answer): a batch
    /// counts only if it stored an offset past it (the engine has read and stored a record
    /// produced after the fault).
    pub past: Option<&'a [i64]>,
    /// After a failover: only batches the new primary (this port) committed count.
    pub server: Option<u16>,
}

/// Seconds from `since.from` until every partition of `partitions` committed a batch that
/// counts ([`Since`]). Err: the partitions that never did.
pub(crate) fn recovery(
    commits: &[Commit],
    partitions: &BTreeSet<i32>,
    since: Since<'_>,
) -> Result<f64, Vec<i32>> {
    let mut slowest: f64 = 0.0;
    let mut never = Vec::new();
    for &p in partitions {
        let end = since.past.and_then(|h| h.get(p as usize)).copied();
        let first = commits.iter().find(|c| {
            c.partition == p
                && c.at >= since.valid_after.max(since.from)
                && end.is_none_or(|e| c.next_offset > e)
                && since.server.is_none_or(|s| c.server == s)
        });
        match first {
            Some(c) => slowest = slowest.max(c.at - since.from),
            None => never.push(p),
        }
    }
    if never.is_empty() {
        Ok(slowest)
    } else {
        Err(never)
    }
}

/// The longest time any partition went without a commit, between its first and its last:
/// the gap between one batch's start and the next's (after a lossy failover the server's
/// older rows come back; the gap runs from the newest commit seen before). The second number
/// leaves out what of each gap falls inside `outages` (epoch-second spans in which commits
/// cannot succeed by design: brokers down, the synchronous standby down), so that what is
/// left is the engine's.
pub(crate) fn longest_stall(commits: &[Commit], outages: &[(f64, f64)]) -> (f64, f64) {
    let mut newest: HashMap<i32, f64> = HashMap::new();
    let (mut longest, mut outside): (f64, f64) = (0.0, 0.0);
    for c in commits {
        match newest.get_mut(&c.partition) {
            None => {
                newest.insert(c.partition, c.at);
            }
            Some(n) => {
                let gap = c.at - *n;
                let inside: f64 = outages
                    .iter()
                    .map(|(a, b)| (c.at.min(*b) - n.max(*a)).max(0.0))
                    .sum();
                longest = longest.max(gap);
                outside = outside.max(gap - inside);
                *n = n.max(c.at);
            }
        }
    }
    (longest, outside)
}

/// Kafka's committed offsets against PostgreSQL's stored ones every 250 ms (see
/// [`crate::chaos::partitions_ahead`]), reconnecting to PostgreSQL after a failover. Samples
/// are counted in the current phase: 0, or 1 after [`AheadSampler::lossy`] (a failover that
/// loses commits the engine had acknowledged to Kafka: there Kafka is ahead until the engine
/// has read the lost records again).
pub(crate) struct AheadSampler {
    stop: Arc<AtomicBool>,
    phase: Arc<AtomicUsize>,
    counts: Arc<[AtomicU64; 2]>,
    task: tokio::task::JoinHandle<()>,
}

impl AheadSampler {
    pub(crate) fn start(
        brokers: &str,
        url: &str,
        name: &str,
        partitions: i32,
    ) -> anyhow::Result<AheadSampler> {
        let observer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", name)
            .create()?;
        let observer = Arc::new(observer);
        let stop = Arc::new(AtomicBool::new(false));
        let phase = Arc::new(AtomicUsize::new(0));
        let counts: Arc<[AtomicU64; 2]> = Arc::default();
        let (url, name) = (url.to_string(), name.to_string());
        let task = tokio::spawn({
            let (stop, phase, counts) =
                (Arc::clone(&stop), Arc::clone(&phase), Arc::clone(&counts));
            async move {
                let mut db: Option<tokio_postgres::Client> = None;
                while !stop.load(Relaxed) {
                    if db.as_ref().is_none_or(|d| d.is_closed()) {
                        db = connect(&url, Duration::from_secs(3)).await.ok();
                    }
                    if let Some(d) = &db {
                        let sample =
                            crate::chaos::partitions_ahead(&observer, d, &name, partitions);
                        match tokio::time::timeout(Duration::from_secs(5), sample).await {
                            Ok(Some(n)) => {
                                counts[phase.load(Relaxed)].fetch_add(n, Relaxed);
                            }
                            Ok(None) => {}
                            Err(_) => db = None,
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        });
        Ok(AheadSampler {
            stop,
            phase,
            counts,
            task,
        })
    }

    /// From now on samples count as after a lossy failover.
    pub(crate) fn lossy(&self) {
        self.phase.store(1, Relaxed);
    }

    /// Stops sampling: (samples ahead, samples ahead after a lossy failover).
    pub(crate) async fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Relaxed);
        let _ = (&mut self.task).await;
        (self.counts[0].load(Relaxed), self.counts[1].load(Relaxed))
    }
}

impl Drop for AheadSampler {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
    }
}

/// How long a standby's replay must stand still, short of what it received, to count as
/// frozen: a standby cut off mid-stream can hold the first part of a WAL record whose rest
/// never comes, and it never replays that part (promotion drops it).
const REPLAY_STILL: Duration = Duration::from_secs(2);

/// Waits (up to `limit`) until the standby at `url` has replayed all the WAL it received, or
/// all it can: its replay stood still for [`REPLAY_STILL`] (see there).
pub(crate) async fn replayed(url: &str, limit: Duration) -> anyhow::Result<()> {
    let db = connect(url, Duration::from_secs(5)).await?;
    let started = std::time::Instant::now();
    let mut still: Option<(String, std::time::Instant)> = None;
    loop {
        let row = db
            .query_one(
                "SELECT pg_is_in_recovery(),
                        coalesce(pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn(), true),
                        coalesce(pg_last_wal_replay_lsn()::text, '')",
                &[],
            )
            .await?;
        let (recovering, caught_up, at): (bool, bool, String) =
            (row.get(0), row.get(1), row.get(2));
        if recovering {
            match &still {
                _ if caught_up => return Ok(()),
                Some((lsn, since)) if *lsn == at && since.elapsed() >= REPLAY_STILL => {
                    return Ok(())
                }
                Some((lsn, _)) if *lsn == at => {}
                _ => still = Some((at, std::time::Instant::now())),
            }
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "the standby at {url} has not replayed what it received after {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Each partition's stored offset of `consumer` on the server at `url`.
pub(crate) async fn stored_offsets(
    url: &str,
    consumer: &str,
) -> anyhow::Result<BTreeMap<i32, i64>> {
    let db = connect(url, Duration::from_secs(5)).await?;
    let rows = db
        .query(
            "SELECT partition, next_offset FROM consumer_offsets
             WHERE consumer = $1 AND topic = $1 AND next_offset IS NOT NULL",
            &[&consumer],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// The message ids of `consumer`'s inbox rows on the server at `url`.
pub(crate) async fn inbox_ids(url: &str, consumer: &str) -> anyhow::Result<HashSet<uuid::Uuid>> {
    let db = connect(url, Duration::from_secs(5)).await?;
    let rows = db
        .query(
            "SELECT message_id FROM inbox WHERE consumer = $1",
            &[&consumer],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(partition: i32, at: f64, next_offset: i64) -> Commit {
        Commit {
            partition,
            at,
            next_offset,
            seen: at + 0.01,
            server: if at < 13.0 { 5432 } else { 5433 },
        }
    }

    #[test]
    fn recovery_waits_for_the_slowest_partition_to_pass_its_end_at_the_fault() {
        let commits = [
            c(0, 9.0, 100),
            c(1, 9.5, 200),
            // The fault at 10.0, when partition 0 ended at 110 and 1 at 205.
            c(0, 10.1, 105), // a batch read before the fault: not past 110
            c(1, 10.2, 210),
            c(0, 13.5, 120),
            c(1, 14.0, 220),
        ];
        let parts = BTreeSet::from([0, 1]);
        let since = |valid_after: f64, past: Option<&'static [i64]>| Since {
            from: 10.0,
            valid_after,
            past,
            server: None,
        };
        assert_eq!(
            recovery(&commits, &parts, since(10.0, Some(&[110, 205]))),
            Ok(3.5)
        );
        // Without the high watermarks, any commit begun after the fault counts.
        let r = recovery(&commits, &parts, since(10.0, None)).unwrap();
        assert!((r - 0.2).abs() < 1e-9, "{r}");
        // A fault that took effect at 13.4: partition 1 first committed at 14.0 after it.
        assert_eq!(recovery(&commits, &parts, since(13.4, None)), Ok(4.0));
        // After a failover only the new primary's commits count (5433's, from 13.0 on).
        let failover = Since {
            server: Some(5433),
            ..since(10.0, None)
        };
        assert_eq!(recovery(&commits, &parts, failover), Ok(4.0));
        // A partition that never committed again is named.
        let parts = BTreeSet::from([0, 1, 2]);
        assert_eq!(
            recovery(&commits, &parts, since(10.0, Some(&[110, 205, 0]))),
            Err(vec![2])
        );
        assert_eq!(
            recovery(&commits, &BTreeSet::from([0]), since(10.0, Some(&[130]))),
            Err(vec![0])
        );
    }

    #[test]
    fn the_longest_stall_spans_a_lossy_failover_from_the_newest_commit() {
        let commits = [
            c(0, 1.0, 10),
            c(1, 1.0, 10),
            c(0, 2.0, 20),
            c(1, 1.5, 15),
            // Promotion: partition 0's row went back to what the standby had (at 1.0).
            c(0, 1.0, 10),
            // The next commit, 7 s after the newest one seen.
            c(0, 9.0, 30),
            c(1, 2.0, 20),
        ];
        assert_eq!(longest_stall(&commits, &[]), (7.0, 7.0));
        // An outage by design from 3 to 8: 5 of partition 0's 7 s fall inside it.
        assert_eq!(longest_stall(&commits, &[(3.0, 8.0)]), (7.0, 2.0));
        assert_eq!(longest_stall(&[], &[]), (0.0, 0.0));
        assert_eq!(longest_stall(&commits[..2], &[]), (0.0, 0.0));
    }
}
