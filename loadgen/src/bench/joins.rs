//! Workers joining and leaving under load (issue 35, part 4): what a join costs the partitions.
//!
//! One topic of [`PARTITIONS`] partitions gets [`RATE`] payments a second for the phase's
//! length. One worker holds it from the start; a second worker joins at a fifth of the run, a
//! third at two fifths, the third leaves (SIGTERM, a clean stop) at three fifths and the second
//! at four fifths. With the cooperative-sticky assignor only the partitions that change owner
//! should stop, each for about the time its old owner takes to finish its batch (the revoke
//! drain) and the new owner to claim and fetch it.
//!
//! Reported from the run's own ledger (`loadgen`'s report): each partition's longest commit
//! gap while the run produced to it (`crate::gaps`: consecutive credits of its payments) and
//! when it ended, how many times its ownership moved, and the end-to-end latency per second
//! (effect commit time minus the record's timestamp) in the five seconds after each join or
//! leave, against the seconds away from them.

use std::path::Path;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::db::Db;
use super::partitions::{delete_topic, free_port, settle, steady_spec, timed_topic};
use super::worker::{Launch, Worker};
use super::BenchArgs;
use crate::{finish_stage, produce_stage, Session};

/// Payments a second, as the many-partitions phase offers.
const RATE: f64 = 2000.0;
/// Divisible by 1, 2 and 3 workers.
const PARTITIONS: i32 = 24;
/// The seconds after a join or leave counted as "during" it.
const WINDOW_S: f64 = 5.0;
/// p99 during a join or leave, at most.
pub(super) const P99_TARGET_MS: f64 = 100.0;

/// `joins` in report.json.
#[derive(Debug, Default, Serialize)]
pub(super) struct Joins {
    pub(super) partitions: i32,
    pub(super) offered_msg_s: f64,
    pub(super) seconds: f64,
    /// Where a latency starts (`--latency-from`, see the partitions phase).
    pub(super) latency_from: String,
    /// What `--joins-worker` added to each worker's config ("" for the defaults).
    pub(super) worker_extra: String,
    /// The joins and leaves, in order, with what they cost.
    pub(super) events: Vec<JoinEvent>,
    /// The longest commit gap of any partition over the run, which partition, when it ended
    /// (seconds since the run started), and whether its ownership moved in the run.
    pub(super) longest_stall_ms: f64,
    pub(super) longest_stall_partition: i32,
    pub(super) longest_stall_ended_at_s: f64,
    /// Each partition's longest commit gap (ms), in partition order.
    pub(super) stall_ms_by_partition: Vec<f64>,
    /// Partitions whose owner changed at least once, and the claims in all.
    pub(super) partitions_moved: usize,
    pub(super) claims: u64,
    /// The worst per-second p99 in the [`WINDOW_S`] after any event, and the median per-second
    /// p99 of the seconds away from every event.
    pub(super) p99_during_joins_ms: f64,
    pub(super) p99_steady_ms: f64,
    /// p99 over the whole run, and whether [`P99_TARGET_MS`] held during the joins.
    pub(super) p99_ms: f64,
    pub(super) p99_target_met: bool,
    pub(super) verified: bool,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct JoinEvent {
    /// "worker 2 joins", "worker 3 leaves", ...
    pub(super) what: String,
    pub(super) at_s: f64,
    /// The worst per-second p99 and p50 in the [`WINDOW_S`] seconds after it.
    pub(super) p99_ms: f64,
    pub(super) p50_ms: f64,
    /// The partitions whose longest gap ended in that window, and the longest of those gaps.
    pub(super) partitions_stalled: usize,
    pub(super) longest_stall_ms: f64,
}

/// The phase: `each` of producing, workers joining and leaving as the module docs say.
pub(super) async fn joins(bin: &Path, args: &BenchArgs, each: Duration) -> anyhow::Result<Joins> {
    let name = format!("bench-joins-{:06x}", fastrand::u32(..0xffffff));
    let s = steady_spec(args, &name, PARTITIONS, RATE, each);
    timed_topic(args, &name, PARTITIONS).await?;
    let session = Session::open(&s).await?;
    let _db = Db::connect(args).await?;
    let name = name.as_str();
    let launch = |w: usize, port: u16| async move {
        let (id, file) = (format!("bench-{w}"), format!("{name}-w{w}"));
        let l = Launch {
            id: &id,
            extra: &args.joins_worker,
            file: &file,
            pool_size: None,
            metrics_addr: Some(format!("127.0.0.1:{port}")),
        };
        Worker::launch(bin, args, name, "batch", &l).await
    };
    let port = free_port()?;
    let mut first = vec![(launch(0, port).await?, port)];
    settle(&mut first, PARTITIONS, name).await?;

    let started = Instant::now();
    let at = |fifths: u32| each.mul_f64(f64::from(fifths) / 5.0);
    let schedule = async {
        let mut events: Vec<(String, f64)> = Vec::new();
        let mut joined = Vec::new();
        for (w, fifths) in [(1, 1), (2, 2)] {
            tokio::time::sleep_until((started + at(fifths)).into()).await;
            events.push((
                format!("worker {} joins", w + 1),
                started.elapsed().as_secs_f64(),
            ));
            joined.push(launch(w, free_port()?).await?);
        }
        for (w, fifths) in [(2, 3), (1, 4)] {
            tokio::time::sleep_until((started + at(fifths)).into()).await;
            events.push((
                format!("worker {} leaves", w + 1),
                started.elapsed().as_secs_f64(),
            ));
            joined.pop().expect("joined").stop().await?;
        }
        anyhow::Ok(events)
    };
    let (produced, events) = tokio::join!(produce_stage(&session, &s), schedule);
    let (produced, events) = (produced?, events?);
    let drain = session.drain(&s.consumer, s.drain_timeout).await;
    if let Some(problem) = drain.problem() {
        eprintln!("     {problem}");
    }
    let seconds = started.elapsed().as_secs_f64();
    let r = finish_stage(&session, &s, &produced).await?;
    for (w, _) in first {
        w.stop().await?;
    }
    if let Err(e) = delete_topic(&args.services.brokers, name).await {
        eprintln!("     deleting topic {name}: {e:#}");
    }

    let near = |t: f64, at: f64| t >= at.floor() && t < at + WINDOW_S;
    let series = &r.series.latency;
    let events: Vec<JoinEvent> = (events.into_iter())
        .map(|(what, at_s)| {
            let inside: Vec<_> = series.iter().filter(|p| near(p.t_s, at_s)).collect();
            let stalled: Vec<f64> = (r.partitions.iter())
                .filter(|p| p.gap_ended_at_s >= at_s && p.gap_ended_at_s < at_s + WINDOW_S)
                .map(|p| p.longest_commit_gap_ms)
                .collect();
            JoinEvent {
                what,
                at_s: super::round1(at_s),
                p99_ms: inside.iter().map(|p| p.p99).fold(0.0, f64::max),
                p50_ms: inside.iter().map(|p| p.p50).fold(0.0, f64::max),
                partitions_stalled: stalled.len(),
                longest_stall_ms: stalled.iter().copied().fold(0.0, f64::max),
            }
        })
        .collect();
    let mut steady: Vec<f64> = (series.iter())
        .filter(|p| !events.iter().any(|e| near(p.t_s, e.at_s)))
        .map(|p| p.p99)
        .collect();
    steady.sort_by(f64::total_cmp);
    let longest = (r.partitions.iter())
        .max_by(|a, b| a.longest_commit_gap_ms.total_cmp(&b.longest_commit_gap_ms))
        .cloned()
        .unwrap_or_default();
    let p99_during_joins_ms = events.iter().map(|e| e.p99_ms).fold(0.0, f64::max);
    Ok(Joins {
        partitions: PARTITIONS,
        worker_extra: args.joins_worker.clone(),
        latency_from: args.latency_from.clone(),
        offered_msg_s: super::round1(r.acked as f64 / r.duration_s.max(1e-9)),
        seconds: super::round1(seconds),
        longest_stall_ms: longest.longest_commit_gap_ms,
        longest_stall_partition: longest.partition,
        longest_stall_ended_at_s: longest.gap_ended_at_s,
        stall_ms_by_partition: r
            .partitions
            .iter()
            .map(|p| p.longest_commit_gap_ms)
            .collect(),
        partitions_moved: r.partitions.iter().filter(|p| p.claims > 0).count(),
        claims: r.partitions.iter().map(|p| p.claims).sum(),
        p99_during_joins_ms,
        p99_steady_ms: steady.get(steady.len() / 2).copied().unwrap_or(0.0),
        p99_ms: r.latency_ms.p99,
        p99_target_met: p99_during_joins_ms <= P99_TARGET_MS,
        verified: r.verified && drain.problem().is_none(),
        events,
    })
}
