//! What the soak samples every `--sample`: each process's RSS, open descriptors and threads
//! (from `/proc`, of the role's current pid), PostgreSQL's connections of the engine (its
//! pools set `application_name = 'effectively'`), and the consumer's lag (the partitions'
//! high watermarks less the stored offsets). The p99 of each interval is filled in after the
//! run from the ledger ([`fill_p99`]): one pass over the run's credits then, rather than a scan
//! of a growing table every interval while the soak runs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use super::processes::{Running, ROLES};
use crate::bench::procfs;
use crate::harness::watch::{connect, now_s};
use crate::session::LagWatcher;

/// One process at one sample.
#[derive(Debug, Clone, Serialize)]
pub(super) struct ProcSample {
    pub role: &'static str,
    pub pid: u32,
    /// Which start of the role (a restarted worker is a new one).
    pub incarnation: u32,
    pub rss_mb: f64,
    pub fds: u64,
    pub threads: u64,
}

/// Everything sampled at one moment.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Sample {
    /// Seconds since the soak started.
    pub t_s: f64,
    /// The roles running then (a role being restarted is absent).
    pub processes: Vec<ProcSample>,
    /// `pg_stat_activity` rows of the engine's processes (None: PostgreSQL did not answer).
    pub pg_connections: Option<i64>,
    /// Records not yet applied (None: Kafka or PostgreSQL did not answer).
    pub lag: Option<i64>,
    /// p99 end-to-end latency of the credits committed since the previous sample: from the
    /// record's Kafka timestamp (loadgen's send) to `credited_at` (the effect, in its
    /// transaction). None: no credit in the interval.
    pub p99_ms: Option<f64>,
}

/// Samples until finished.
pub(super) struct Sampler {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Vec<Sample>>,
}

impl Sampler {
    /// Samples now and every `every`, `started` (epoch seconds) being the soak's time zero.
    pub(super) fn start(
        every: Duration,
        started: f64,
        running: Arc<Mutex<Vec<Option<Running>>>>,
        url: String,
        watcher: LagWatcher,
        consumer: String,
    ) -> Sampler {
        let (stop, mut stopped) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut db: Option<tokio_postgres::Client> = None;
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = &mut stopped => break,
                    _ = tick.tick() => {}
                }
                if db.as_ref().is_none_or(|d| d.is_closed()) {
                    db = connect(&url, Duration::from_secs(3)).await.ok();
                }
                let t_s = now_s() - started;
                let now: Vec<Option<Running>> = running.lock().unwrap().clone();
                let processes = (now.iter().zip(ROLES))
                    .filter_map(|(r, role)| {
                        let r = (*r)?;
                        let (rss_mb, fds, threads) = procfs::resources(r.pid)?;
                        Some(ProcSample {
                            role,
                            pid: r.pid,
                            incarnation: r.incarnation,
                            rss_mb: (rss_mb * 100.0).round() / 100.0,
                            fds,
                            threads,
                        })
                    })
                    .collect();
                let (mut pg_connections, mut lag) = (None, None);
                if let Some(d) = &db {
                    let limit = Duration::from_secs(5);
                    let q = d.query_one(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'effectively'",
                        &[],
                    );
                    match tokio::time::timeout(limit, q).await {
                        Ok(Ok(row)) => pg_connections = Some(row.get(0)),
                        _ => db = None,
                    }
                    if let Some(d) = &db {
                        lag = tokio::time::timeout(limit, watcher.lag(d, &consumer))
                            .await
                            .ok()
                            .and_then(Result::ok);
                    }
                }
                samples.push(Sample {
                    t_s: (t_s * 100.0).round() / 100.0,
                    processes,
                    pg_connections,
                    lag,
                    p99_ms: None,
                });
            }
            samples
        });
        Sampler { stop, task }
    }

    /// Stops sampling: every sample taken.
    pub(super) async fn finish(self) -> Vec<Sample> {
        let _ = self.stop.send(());
        self.task.await.unwrap_or_default()
    }
}

/// Sets each sample's `p99_ms` from the consumer's credits committed between the previous
/// sample and it, in one query.
pub(super) async fn fill_p99(
    url: &str,
    consumer: &str,
    started: f64,
    samples: &mut [Sample],
) -> anyhow::Result<()> {
    if samples.len() < 2 {
        return Ok(());
    }
    let db = connect(url, Duration::from_secs(5)).await?;
    let bounds: Vec<f64> = samples.iter().map(|s| started + s.t_s).collect();
    // width_bucket: i for bounds[i-1] <= t < bounds[i] (1-based), so bucket i ends at sample i.
    let rows = db
        .query(
            "SELECT width_bucket(extract(epoch FROM credited_at)::float8, $2::float8[]),
                    percentile_cont(0.99) WITHIN GROUP
                        (ORDER BY extract(epoch FROM credited_at - kafka_ts)::float8 * 1000)
             FROM cashback_credits
             WHERE consumer = $1 AND kafka_ts IS NOT NULL
             GROUP BY 1",
            &[&consumer, &bounds],
        )
        .await?;
    for r in rows {
        let bucket: i32 = r.get(0);
        let p99: Option<f64> = r.get(1);
        if let Some(s) = samples.get_mut(bucket as usize) {
            if bucket >= 1 {
                s.p99_ms = p99.map(|v| (v * 10.0).round() / 10.0);
            }
        }
    }
    Ok(())
}
