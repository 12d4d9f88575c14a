//! Which samples the trends are fitted on, and the thresholds they are judged by.
//!
//! A sample counts for a process if it was taken at least the warm-up after that process
//! started (its first sample: the soak's start, or its restart), and for every series only if
//! it was not taken within `settle` after a fault: a restart, a broker's or PostgreSQL's
//! return reconnects everything, and the pools and librdkafka's connections take a moment to
//! settle. The growth judged is the fitted slope times the run's length: for the hour's soak,
//! growth per hour.

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

/// Whether a sample at `t_s` is within `settle` after one of `faults` (seconds since start).
fn near_fault(t_s: f64, faults: &[f64], settle: f64) -> bool {
    faults.iter().any(|f| t_s >= *f && t_s < f + settle)
}

/// The trends of every process's RSS, descriptors and threads, and of the connections, from
/// the samples up to `end_s` (the traffic's end).
pub(super) fn trends(
    samples: &[Sample],
    faults: &[f64],
    warm_up: f64,
    settle: f64,
    end_s: f64,
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
                            incarnation: p.incarnation,
                            y: f(p),
                        });
                    }
                }
            }
            out.push(judge(format!("{role} {name}"), &points, threshold, end_s));
        }
    }
    let points: Vec<Point> = (settled.iter())
        .filter(|s| s.t_s >= warm_up)
        .filter_map(|s| {
            Some(Point {
                t_s: s.t_s,
                incarnation: 0,
                y: s.pg_connections? as f64,
            })
        })
        .collect();
    out.push(judge(
        "postgres connections".into(),
        &points,
        CONNECTIONS,
        end_s,
    ));
    out
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
        let trends = trends(&samples, &[60.0], 20.0, 10.0, 120.0);
        assert!(trends.iter().all(|t| t.passed), "{trends:#?}");
        let a = &trends[0];
        assert_eq!(a.series, "worker-a rss_mb");
        assert_eq!(a.incarnations, 2);
        assert_eq!(a.slope_per_hour, Some(0.0));
        // Without the warm-up both runs' growth would count.
        let trends = super::trends(&samples, &[60.0], 0.0, 0.0, 120.0);
        assert!(trends[0].slope_per_hour.unwrap() > 0.0);
    }

    #[test]
    fn near_a_fault_is_the_settle_after_it() {
        assert!(near_fault(61.0, &[60.0], 10.0));
        assert!(!near_fault(59.0, &[60.0], 10.0));
        assert!(!near_fault(70.0, &[60.0], 10.0));
    }
}
