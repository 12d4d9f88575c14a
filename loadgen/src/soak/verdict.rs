//! Which samples the trends are fitted on, and the thresholds they are judged by.
//!
//! A sample counts for a process if it was taken at least the warm-up after that process
//! started (its first sample: the soak's start, or its restart), and for every series only if
//! it was not taken within `settle` after a fault: a restart, a broker's or PostgreSQL's
//! return reconnects everything, and the pools and librdkafka's connections take a moment to
//! settle; nor while the consumer is behind (lag above [`BEHIND_S`] seconds of traffic, or
//! unknown: Kafka down): a worker catching up a backlog grows its batches and its heap, which is
//! load, not a leak. The growth judged is the fitted slope times the run's length: for the hour's soak,
//! growth per hour. Two fits per series:
//!
//! - **within**: each process run and each interval between two faults is a group with its
//!   own level. This judges growth that goes on while nothing happens (a leak per message or
//!   per batch), and a one-time move at a fault (a backlog caught up after a broker restart
//!   leaves the allocator bigger; a reconnect opens a descriptor more) is not read as one.
//! - **between faults**: one point per process run and fault interval (its median), grouped
//!   by process run: a staircase, something left behind at every fault (a descriptor or a
//!   thread per reconnect). Judged only with at least [`MIN_INTERVALS`] intervals (the hour's
//!   12, a 10-minute run's 6): with fewer, one move at one fault would be read as a trend.

use std::collections::HashMap;

use super::processes::ROLES;
use super::sample::{ProcSample, Sample};
use super::trend::{judge, Point, Threshold, Trend};

/// RSS: more than 10% of the median and more than 20 MB over the run. A debug worker at 2,000
/// msg/s holds some tens of MB; a leak of 10 bytes per message is 72 MB an hour at 2,000
/// msg/s, so this catches any per-message leak within the hour and stays above the
/// allocator's breathing (a few MB) in a short run.
pub(super) const RSS: Threshold = Threshold {
    unit: "MB",
    relative: Some(0.10),
    absolute: 20.0,
};
/// Descriptors: more than 8 over the run. Every connection is one (a pool of 8, a broker's
/// few); a leak of one per reconnect or per batch passes 8 within a few faults or seconds,
/// while a reconnect in flight at a sample moves the count by one or two.
pub(super) const FDS: Threshold = Threshold {
    unit: "descriptors",
    relative: None,
    absolute: 8.0,
};
/// Threads: more than 8 over the run. librdkafka's are fixed in number, but tokio's blocking
/// pool starts threads on demand and lets them go after 10 s idle (a worker under a backlog
/// moved between 13 and 22 in a 3-minute run); a thread per reconnect would still pass 8
/// within the hour's faults.
pub(super) const THREADS: Threshold = Threshold {
    unit: "threads",
    relative: None,
    absolute: 8.0,
};
/// PostgreSQL's connections of the engine: more than 4 over the run (the pools are bounded;
/// a lazily filled pool may open one or two more under load).
pub(super) const CONNECTIONS: Threshold = Threshold {
    unit: "connections",
    relative: None,
    absolute: 4.0,
};

/// Lag (in seconds of traffic) above which a sample is not steady state.
pub(super) const BEHIND_S: f64 = 5.0;

/// The fewest fault intervals the between-faults fit needs.
pub(super) const MIN_INTERVALS: usize = 6;

/// Which interval between faults `t_s` falls in (0: before the first).
fn interval(t_s: f64, faults: &[(f64, f64)]) -> u32 {
    faults.iter().filter(|f| f.0 <= t_s).count() as u32
}

/// The between-faults points of `points` (grouped by process run in `group / 1000`, by
/// interval in `group % 1000`): each group's median at its mean time, grouped by process run.
fn staircase(points: &[Point]) -> Vec<Point> {
    let mut groups: std::collections::BTreeMap<u32, Vec<&Point>> = Default::default();
    for p in points {
        groups.entry(p.group).or_default().push(p);
    }
    groups
        .iter()
        .map(|(g, pts)| Point {
            t_s: pts.iter().map(|p| p.t_s).sum::<f64>() / pts.len() as f64,
            group: g / 1000,
            y: super::trend::median(&pts.iter().map(|p| p.y).collect::<Vec<_>>()),
        })
        .collect()
}

/// Whether a sample at `t_s` falls in one of `faults` (from its start until a service was back,
/// seconds since the start) or within `settle` after it. (While a broker is down the lag reads
/// small: loadgen's producer holds the records, not Kafka.)
fn near_fault(t_s: f64, faults: &[(f64, f64)], settle: f64) -> bool {
    faults
        .iter()
        .any(|(from, to)| t_s >= *from && t_s < to + settle)
}

/// The trends of every process's RSS, descriptors and threads, and of the connections, from
/// the samples up to `end_s` (the traffic's end).
pub(super) fn trends(
    samples: &[Sample],
    faults: &[(f64, f64)],
    warm_up: f64,
    settle: f64,
    end_s: f64,
    rate: f64,
) -> Vec<Trend> {
    let samples: Vec<&Sample> = samples.iter().filter(|s| s.t_s <= end_s).collect();
    let mut first_seen: HashMap<u32, f64> = HashMap::new();
    for s in &samples {
        for p in &s.processes {
            first_seen.entry(p.incarnation).or_insert(s.t_s);
        }
    }
    // The soak's own processes started at 0, whenever their first sample was.
    let first = samples.first().map_or(0.0, |s| s.t_s);
    let start_of = |p: &ProcSample| match first_seen[&p.incarnation] {
        seen if seen <= first => 0.0,
        seen => seen,
    };
    let settled: Vec<&Sample> = samples
        .iter()
        .copied()
        .filter(|s| !near_fault(s.t_s, faults, settle))
        .filter(|s| s.lag.is_some_and(|l| l as f64 <= BEHIND_S * rate))
        .collect();
    let mut out = Vec::new();
    type Metric = (&'static str, fn(&ProcSample) -> f64, Threshold);
    let metrics: [Metric; 3] = [
        ("rss_mb", |p| p.rss_mb, RSS),
        ("fds", |p| p.fds as f64, FDS),
        ("threads", |p| p.threads as f64, THREADS),
    ];
    for role in ROLES {
        for (name, f, threshold) in metrics {
            let mut points = Vec::new();
            for s in &settled {
                for p in s.processes.iter().filter(|p| p.role == role) {
                    if s.t_s >= start_of(p) + warm_up {
                        points.push(Point {
                            t_s: s.t_s,
                            group: p.incarnation * 1000 + interval(s.t_s, faults),
                            y: f(p),
                        });
                    }
                }
            }
            out.extend(both(
                format!("{role} {name}"),
                &points,
                threshold,
                end_s,
                faults,
            ));
        }
    }
    let points: Vec<Point> = (settled.iter())
        .filter(|s| s.t_s >= warm_up)
        .filter_map(|s| {
            Some(Point {
                t_s: s.t_s,
                group: interval(s.t_s, faults),
                y: s.pg_connections? as f64,
            })
        })
        .collect();
    let connections = "postgres connections".to_string();
    let [within, between] = both(connections, &points, CONNECTIONS, end_s, faults);
    out.push(bounded(within, &points));
    out.push(between);
    out
}

/// The most connections the engine's processes may hold: each of the four has a pool of 8
/// (the soak's `pool_size`) and may hold up to 2 of its own beside it.
pub(super) const CONNECTIONS_BOUND: f64 = (ROLES.len() * (8 + 2)) as f64;

/// The connections' within-fit, judged against the pools' bound: the pools fill lazily, so
/// after every restart the count climbs back (in a 3-minute run a climb from 14 to 20 fitted
/// as 8.5 connections over the run, 2026-12-07), which is no leak while it stays within what
/// the pools may hold. A connection that leaks (dropped by a pool without being closed, or
/// opened beside it) takes the count past the bound sooner or later.
fn bounded(mut within: Trend, points: &[Point]) -> Trend {
    let most = points.iter().map(|p| p.y).fold(0.0, f64::max);
    if !within.passed && within.growth_over_run.is_some() && most <= CONNECTIONS_BOUND {
        within.passed = true;
        within.note = format!(
            "{} (a pool filling up, not judged: at most {most} connections, within the pools' \
             {CONNECTIONS_BOUND})",
            within.note
        );
    } else if most > CONNECTIONS_BOUND {
        within.passed = false;
        within.note = format!(
            "{} {most} connections, over the pools' {CONNECTIONS_BOUND}",
            within.note
        );
    }
    within
}

/// The within and the between-faults trend of one series (module docs).
fn both(
    series: String,
    points: &[Point],
    threshold: Threshold,
    end_s: f64,
    faults: &[(f64, f64)],
) -> [Trend; 2] {
    let within = judge(format!("{series} (within)"), points, threshold, end_s);
    let steps = staircase(points);
    let mut between = judge(
        format!("{series} (between faults)"),
        &steps,
        threshold,
        end_s,
    );
    if faults.len() + 1 < MIN_INTERVALS {
        between.passed = true;
        between.note = format!(
            "not judged: {} fault intervals, fewer than {MIN_INTERVALS}",
            faults.len() + 1
        );
    }
    [within, between]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(t_s: f64, inc_a: u32, rss_a: f64) -> Sample {
        let p = |role, incarnation, rss_mb| ProcSample {
            role,
            pid: incarnation,
            incarnation,
            rss_mb,
            fds: 20,
            threads: 10,
        };
        Sample {
            t_s,
            processes: vec![
                p("worker-a", inc_a, rss_a),
                p("worker-b", 2, 50.0),
                p("relay", 3, 30.0),
                p("sender", 4, 20.0),
            ],
            pg_connections: Some(12),
            lag: Some(0),
            p99_ms: None,
        }
    }

    #[test]
    fn connections_climbing_within_the_pools_bound_are_no_leak_and_past_it_are() {
        // A pool refilling after a restart: 14 to 20 connections over a 3-minute run.
        let climb: Vec<Point> = (0..=12)
            .map(|i| Point {
                t_s: 60.0 + 5.0 * i as f64,
                group: 1,
                y: 14.0 + (i as f64 / 2.0).floor(),
            })
            .collect();
        let fitted = judge("c".into(), &climb, CONNECTIONS, 180.0);
        assert!(!fitted.passed, "the bare fit reads a refill as growth");
        assert!(bounded(fitted, &climb).passed);
        // The same climb, 30 connections higher: past the pools' bound.
        let over: Vec<Point> = climb
            .iter()
            .map(|p| Point {
                y: p.y + 30.0,
                ..*p
            })
            .collect();
        let fitted = judge("c".into(), &over, CONNECTIONS, 180.0);
        let judged = bounded(fitted, &over);
        assert!(!judged.passed, "{judged:?}");
        assert!(
            judged.note.contains("over the pools' 40"),
            "{}",
            judged.note
        );
    }

    #[test]
    fn a_restarted_worker_warms_up_again_and_faults_settle() {
        // Worker a grows 10 MB in its first 20 s (warm-up), then stays flat; it is killed at
        // 60 s and its new run warms up again from 40 MB.
        let mut samples = Vec::new();
        for i in 0..=24 {
            let t = 5.0 * i as f64;
            let (inc, rss) = if t < 60.0 {
                (1, 50.0 + (t / 2.0).min(10.0))
            } else {
                (5, 40.0 + ((t - 60.0) / 2.0).min(10.0))
            };
            samples.push(sample(t, inc, rss));
        }
        let trends = trends(&samples, &[(60.0, 60.0)], 20.0, 10.0, 120.0, 500.0);
        assert!(trends.iter().all(|t| t.passed), "{trends:#?}");
        let a = &trends[0];
        assert_eq!(a.series, "worker-a rss_mb (within)");
        assert_eq!(a.groups, 2);
        assert_eq!(a.slope_per_hour, Some(0.0));
        // Without the warm-up both runs' growth would count.
        let trends = super::trends(&samples, &[(60.0, 60.0)], 0.0, 0.0, 120.0, 500.0);
        assert!(trends[0].slope_per_hour.unwrap() > 0.0);
    }

    #[test]
    fn a_step_at_one_fault_is_no_trend_and_a_step_at_every_fault_is() {
        // Worker a's descriptors: 60, then 6 more after the first fault, and flat.
        let faults: Vec<(f64, f64)> = (1..=6)
            .map(|k| (100.0 * k as f64, 100.0 * k as f64))
            .collect();
        let run = |fds_at: &dyn Fn(f64) -> u64| {
            let samples: Vec<Sample> = (0..140)
                .map(|i| {
                    let t = 5.0 * i as f64;
                    let mut s = sample(t, 1, 50.0);
                    s.processes[0].fds = fds_at(t);
                    s
                })
                .collect();
            super::trends(&samples, &faults, 20.0, 10.0, 700.0, 500.0)
        };
        let once = run(&|t| if t < 100.0 { 60 } else { 66 });
        let (within, between) = (&once[2], &once[3]);
        assert_eq!(within.series, "worker-a fds (within)");
        assert!(within.passed && between.passed, "{within:?} {between:?}");
        // 3 more at every fault: 18 over the run, each interval flat.
        let stairs = run(&|t| 60 + 3 * interval(t, &faults) as u64);
        let (within, between) = (&stairs[2], &stairs[3]);
        assert!(within.passed, "{within:?}");
        assert_eq!(between.series, "worker-a fds (between faults)");
        assert!(!between.passed, "{between:?}");
    }

    #[test]
    fn near_a_fault_is_the_settle_after_it() {
        assert!(near_fault(61.0, &[(60.0, 60.0)], 10.0));
        assert!(!near_fault(59.0, &[(60.0, 60.0)], 10.0));
        assert!(!near_fault(70.0, &[(60.0, 60.0)], 10.0));
        // A broker down from 60 to 100 s: settled from 110 s.
        assert!(near_fault(105.0, &[(60.0, 100.0)], 10.0));
        assert!(!near_fault(110.0, &[(60.0, 100.0)], 10.0));
    }
}
