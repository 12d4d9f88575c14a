//! Whether a resource grows over a soak: a least-squares slope through the samples that count,
//! compared with a threshold stated up front.
//!
//! A restarted process starts small and grows into its steady state, and a fault can move a
//! level once (a backlog caught up after a broker restart leaves the allocator bigger), so one
//! line through a role's whole series would read a restart or a catch-up as a leak (or hide
//! one). Each group of points (see `verdict`) keeps its own level; the slope is the one they
//! share, fitted within each (the "within" estimator: every point measured from its group's
//! means). A single group gets the plain least-squares slope. The growth judged is the slope
//! less two standard errors (see [`judge`]).

use serde::Serialize;

/// One sample of a series: when (seconds since the start), which group, the value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Point {
    pub t_s: f64,
    pub group: u32,
    pub y: f64,
}

/// A within fit: the slope (per second) the groups share, and its standard error.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Fit {
    pub slope: f64,
    /// None when the points leave no degree of freedom for the residuals (every group's mean
    /// and the slope use one each).
    pub std_err: Option<f64>,
}

/// How many standard errors below the fitted slope a series must still grow past its limit
/// to fail: a one-sided bound of about 97.5% with many points, about 95% with a dozen.
pub(super) const STD_ERRS: f64 = 2.0;

/// The slope shared by the groups, each around its own means, and its standard error; None
/// with fewer than 3 points or no spread in time within any group.
pub(super) fn within_fit(points: &[Point]) -> Option<Fit> {
    if points.len() < 3 {
        return None;
    }
    let mut groups: std::collections::BTreeMap<u32, Vec<(f64, f64)>> = Default::default();
    for p in points {
        groups.entry(p.group).or_default().push((p.t_s, p.y));
    }
    // Each point measured from its group's means.
    let centred: Vec<(f64, f64)> = groups
        .values()
        .flat_map(|pts| {
            let n = pts.len() as f64;
            let tm = pts.iter().map(|p| p.0).sum::<f64>() / n;
            let ym = pts.iter().map(|p| p.1).sum::<f64>() / n;
            pts.iter().map(move |(t, y)| (t - tm, y - ym))
        })
        .collect();
    let sxx: f64 = centred.iter().map(|(t, _)| t * t).sum();
    let sxy: f64 = centred.iter().map(|(t, y)| t * y).sum();
    if sxx <= 1e-9 {
        return None;
    }
    let slope = sxy / sxx;
    let residuals: f64 = centred.iter().map(|(t, y)| (y - slope * t).powi(2)).sum();
    let freedom = points.len() as f64 - groups.len() as f64 - 1.0;
    let std_err = (freedom >= 1.0).then(|| (residuals / freedom / sxx).sqrt());
    Some(Fit { slope, std_err })
}

/// The median of `ys` (0 for none).
pub(super) fn median(ys: &[f64]) -> f64 {
    let mut v: Vec<f64> = ys.iter().copied().filter(|y| y.is_finite()).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// How much growth over the run a metric may show: it fails only past both limits (the
/// relative one keeps a big process's noise from failing it, the absolute one a small one's).
#[derive(Debug, Clone, Copy, Serialize)]
pub(super) struct Threshold {
    /// The metric's unit ("MB", "descriptors", ...).
    pub unit: &'static str,
    /// A fraction of the series' median (None: the absolute limit alone).
    pub relative: Option<f64>,
    pub absolute: f64,
}

impl Threshold {
    /// The growth allowed for a series of this median.
    pub(super) fn limit(&self, median: f64) -> f64 {
        match self.relative {
            Some(r) => self.absolute.max(r * median),
            None => self.absolute,
        }
    }
}

/// One series' verdict.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Trend {
    /// `worker-a rss_mb`, `postgres connections`, ...
    pub series: String,
    /// Points fitted (samples after the warm-up and away from faults; or, between faults,
    /// one per process run and fault interval).
    pub points: usize,
    /// Groups with a level of their own.
    pub groups: usize,
    pub median: f64,
    pub slope_per_hour: Option<f64>,
    /// The slope over the whole run's length (`run_s`): what the series would have grown.
    pub growth_over_run: Option<f64>,
    /// The growth at [`STD_ERRS`] standard errors below the slope: what is judged.
    pub growth_at_least: Option<f64>,
    /// The growth allowed ([`Threshold::limit`]).
    pub limit: f64,
    pub unit: &'static str,
    pub passed: bool,
    pub note: String,
}

/// Fits `points` and judges the growth over `run_s` seconds against `threshold`; too few
/// points to fit fails (a soak too short to judge is no pass). What is judged is the growth
/// at [`STD_ERRS`] standard errors below the fitted slope: a real leak grows steadily and its
/// slope is tight, while one step of the allocator inside a short group (3 to 10 MB in 15 s
/// of a 3-minute run) fits a steep slope that its scatter does not support; extrapolated to
/// the run's length it failed a clean run (2026-12-07).
pub(super) fn judge(series: String, points: &[Point], threshold: Threshold, run_s: f64) -> Trend {
    let ys: Vec<f64> = points.iter().map(|p| p.y).collect();
    let med = median(&ys);
    let limit = threshold.limit(med);
    let groups = points
        .iter()
        .map(|p| p.group)
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let fit = within_fit(points);
    let slope = fit.map(|f| f.slope);
    let growth = slope.map(|s| s * run_s);
    let at_least = fit.map(|f| (f.slope - STD_ERRS * f.std_err.unwrap_or(0.0)) * run_s);
    let (passed, note) = match (growth, at_least) {
        (Some(g), Some(low)) if low > limit => (
            false,
            format!(
                "grows {g:.1} {} over the run (at least {low:.1}), over the limit {limit:.1}",
                threshold.unit
            ),
        ),
        (Some(_), Some(_)) => (true, String::new()),
        _ => (false, "too few samples to fit a slope".to_string()),
    };
    let round = |v: f64| (v * 1000.0).round() / 1000.0;
    Trend {
        series,
        points: points.len(),
        groups,
        median: round(med),
        slope_per_hour: slope.map(|s| round(s * 3600.0)),
        growth_over_run: growth.map(round),
        growth_at_least: at_least.map(round),
        limit: round(limit),
        unit: threshold.unit,
        passed,
        note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within_slope(points: &[Point]) -> Option<f64> {
        within_fit(points).map(|f| f.slope)
    }

    fn pts(inc: u32, from: f64, ys: &[f64]) -> Vec<Point> {
        ys.iter()
            .enumerate()
            .map(|(i, &y)| Point {
                t_s: from + 10.0 * i as f64,
                group: inc,
                y,
            })
            .collect()
    }

    #[test]
    fn one_incarnation_is_plain_least_squares() {
        // y = 5 + 0.1 t with noise that cancels.
        let p = pts(1, 0.0, &[5.0, 6.5, 7.0, 8.5, 9.0]);
        let s = within_slope(&p).unwrap();
        assert!((s - 0.1).abs() < 1e-9, "{s}");
        assert_eq!(within_slope(&p[..2]), None);
        let flat = pts(1, 0.0, &[3.0, 3.0, 3.0]);
        assert_eq!(within_slope(&flat), Some(0.0));
    }

    #[test]
    fn a_restart_that_starts_small_is_no_slope() {
        // Flat at 100 MB, restarted at 60 s, flat at 40 MB: one line through all of it would
        // fall (or, the other way round, rise); within each run it is flat.
        let mut p = pts(1, 0.0, &[100.0, 100.0, 100.0, 100.0]);
        p.extend(pts(2, 60.0, &[40.0, 40.0, 40.0]));
        assert_eq!(within_slope(&p), Some(0.0));
        // A leak in both runs is still seen: 1 MB per 10 s in each.
        let mut p = pts(1, 0.0, &[100.0, 101.0, 102.0, 103.0]);
        p.extend(pts(2, 60.0, &[40.0, 41.0, 42.0]));
        let s = within_slope(&p).unwrap();
        assert!((s - 0.1).abs() < 1e-9, "{s}");
    }

    #[test]
    fn fails_only_past_both_limits() {
        let rss = Threshold {
            unit: "MB",
            relative: Some(0.10),
            absolute: 20.0,
        };
        // A 100 MB process: the absolute 20 MB is the larger limit.
        assert_eq!(rss.limit(100.0), 20.0);
        // A 1 GB one: 10% of it.
        assert_eq!(rss.limit(1000.0), 100.0);
        // 0.01 MB/s over an hour: 36 MB > 20 MB.
        let p: Vec<Point> = (0..10)
            .map(|i| Point {
                t_s: 360.0 * i as f64,
                group: 1,
                y: 100.0 + 3.6 * i as f64,
            })
            .collect();
        let t = judge("w rss".into(), &p, rss, 3600.0);
        assert!(!t.passed, "{t:?}");
        assert!((t.slope_per_hour.unwrap() - 36.0).abs() < 1e-6);
        // The same slope over 3 minutes grows 1.8 MB: under the limit.
        let t = judge("w rss".into(), &p, rss, 180.0);
        assert!(t.passed, "{t:?}");
        // Too few points fail.
        assert!(!judge("w rss".into(), &p[..2], rss, 180.0).passed);
    }

    #[test]
    fn one_step_in_a_short_group_is_no_trend_and_a_noisy_leak_is() {
        let rss = Threshold {
            unit: "MB",
            relative: Some(0.10),
            absolute: 20.0,
        };
        // A 3-minute run: four groups of four samples 5 s apart, flat at 40 MB, but in one
        // the allocator steps up 8 MB and stays. The bare slope extrapolates the step to the
        // run; its scatter says it is no line.
        let mut p = Vec::new();
        for g in 0..4u32 {
            for i in 0..4 {
                let step = if g == 2 && i >= 2 { 8.0 } else { 0.0 };
                p.push(Point {
                    t_s: 40.0 * g as f64 + 5.0 * i as f64,
                    group: g,
                    y: 40.0 + step,
                });
            }
        }
        let t = judge("w rss".into(), &p, rss, 180.0);
        assert!(t.growth_over_run.unwrap() > 20.0, "{t:?}");
        assert!(t.growth_at_least.unwrap() < 20.0, "{t:?}");
        assert!(t.passed, "{t:?}");
        // The leak the threshold is for, 10 bytes a message at 2,000 msg/s (72 MB an hour),
        // with up to 2.5 MB of noise on every sample (steady processes here move by 0.1),
        // still fails.
        let noise = [1.5, -2.0, 0.5, 2.5, -1.0, -2.5, 1.0, 0.0, 2.0, -1.5];
        let p: Vec<Point> = (0..120)
            .map(|i| Point {
                t_s: 30.0 * i as f64,
                group: i / 10,
                y: 60.0 + 0.02 * 30.0 * i as f64 + noise[i as usize % 10],
            })
            .collect();
        let t = judge("w rss".into(), &p, rss, 3600.0);
        assert!(!t.passed, "{t:?}");
        assert!(t.note.contains("at least"), "{}", t.note);
    }

    #[test]
    fn the_median_of_even_and_odd_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
