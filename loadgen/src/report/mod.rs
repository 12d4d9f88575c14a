//! The run report: what was produced, what the ledger holds, and how fast it got there.
//!
//! [`Report`] is filled in by the producer and the verifier; this module writes it out as
//! pretty JSON ([`write_json`]), as one self-contained HTML page with four inline SVG charts
//! ([`write_html`]: no JavaScript, no external URL, readable offline) and as a plain-text
//! table for the terminal ([`summary_table`]).
//! The charts are drawn in [`charts`].

mod charts;

use std::fmt::Write as _;
use std::io;
use std::path::Path;

use serde::{Deserialize, Serialize};

use charts::charts;

/// Everything one run measured and verified. The totals are here; [`Anomalies`] holds examples.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Report {
    pub offered_rate: f64,  // mean target rate in msg/s over the run
    pub rate_plan: String,  // e.g. "2000/s for 60s" or "500/s 20s -> 2000/s 20s -> max 20s"
    pub duration_s: f64,    // producing time
    pub sent: u64,          // records attempted (all kinds)
    pub acked: u64,         // records the broker acknowledged
    pub unique_events: u64, // distinct acknowledged payments (by payment id)
    pub duplicates_sent: DuplicatesSent,
    pub poison_sent: u64, // acknowledged poison records
    pub effects: u64,     // credits found in the database for this run
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    pub parked: u64,
    pub wallet_mismatches: u64, // users whose wallet differs from 2% of their unique payments
    pub throughput_msg_s: f64,  // effects per second, first to last effect commit
    pub commit_span_s: f64,     // seconds from the first to the last effect commit
    pub latency_ms: Latency,
    /// The wall clock's time over the run minus the monotonic clock's: not zero when the
    /// system clock was stepped (NTP, a paused and resumed VM). Latencies are differences of
    /// two wall-clock readings, so those of records in flight at the step are off by this much.
    pub clock_step_s: f64,
    pub verified: bool,
    pub anomalies: Anomalies,
    /// Per partition: the longest commit gap and the claims during the run (see `gaps`).
    pub partitions: Vec<PartitionRun>,
    pub series: Series,
}

/// How one partition fared over the run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct PartitionRun {
    pub partition: i32,
    /// The longest time between two consecutive effects of the partition's payments.
    pub longest_commit_gap_ms: f64,
    /// When that gap ended, in seconds since the run started.
    pub gap_ended_at_s: f64,
    /// Times a worker claimed the partition during the run (0: one owner throughout).
    pub claims: u64,
    /// Its owner when the run was verified.
    pub owner: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DuplicatesSent {
    pub resend: u64,
    pub redrive: u64,
    pub double_tap: u64,
}

/// End-to-end latency percentiles in milliseconds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

/// Example ids of each anomaly, at most 20 each.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Anomalies {
    pub lost: Vec<String>,
    pub duplicated: Vec<String>,
    pub unexpected: Vec<String>,
    pub wallets: Vec<String>,
    pub parked_not_poison: Vec<String>,
}

/// Time series for the charts; every `t_s` is seconds since the run started.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Series {
    pub latency: Vec<LatencyPoint>, // per second of effect commit time
    pub histogram: Vec<Bucket>,     // e2e latency distribution
    pub throughput: Vec<RatePoint>, // effects committed per second
    pub produced: Vec<RatePoint>,   // records acknowledged per second
    pub lag: Vec<LagPoint>,         // consumer lag sampled during the run
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LatencyPoint {
    pub t_s: f64,
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
}

/// The values `v` with `previous le_ms < v <= le_ms` (not cumulative), log-spaced.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct Bucket {
    pub le_ms: f64,
    pub count: u64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct RatePoint {
    pub t_s: f64,
    pub per_s: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct LagPoint {
    pub t_s: f64,
    pub lag: i64,
}

/// Writes the report as pretty JSON, creating the parent directories.
pub fn write_json(report: &Report, path: &Path) -> io::Result<()> {
    let json = serde_json::to_string_pretty(report).map_err(io::Error::other)?;
    write_file(path, json + "\n")
}

/// Writes one self-contained HTML page (inline CSS and SVG), creating the parent directories.
pub fn write_html(report: &Report, path: &Path) -> io::Result<()> {
    write_file(path, render_html(report)?)
}

/// A plain-text table for the terminal, the verdict line last.
pub fn summary_table(report: &Report) -> String {
    let rows = summary_rows(report);
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in &rows {
        let _ = writeln!(out, "{}", format!("{k:<width$}  {v}").trim_end());
    }
    out + &verdict_line(report)
}

/// Counts values into log-spaced buckets (1, 2, 5, 10, 20, 50, ... ms) up to the first bound
/// at or above the largest value, empty buckets in between included. Values at or below 1 ms
/// (negative ones too) fall in the first bucket; non-finite values are not counted.
pub fn histogram_buckets(values_ms: &[f64]) -> Vec<Bucket> {
    let finite = || values_ms.iter().copied().filter(|v| v.is_finite());
    let Some(max) = finite().reduce(f64::max) else {
        return Vec::new();
    };
    let mut bounds = Vec::new();
    for le in (0..=308).flat_map(|e| [1.0, 2.0, 5.0].map(|m| m * 10f64.powi(e))) {
        bounds.push(le);
        if le >= max || !le.is_finite() {
            break;
        }
    }
    let mut buckets: Vec<Bucket> = bounds
        .iter()
        .map(|&le_ms| Bucket { le_ms, count: 0 })
        .collect();
    for v in finite() {
        let i = bounds.partition_point(|&le| le < v).min(bounds.len() - 1);
        buckets[i].count += 1;
    }
    buckets
}

fn write_file(path: &Path, text: String) -> io::Result<()> {
    let parent = path.parent().filter(|dir| !dir.as_os_str().is_empty());
    parent.map_or(Ok(()), std::fs::create_dir_all)?;
    std::fs::write(path, text)
}

/// 1234567 -> "1,234,567".
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn summary_rows(r: &Report) -> Vec<(&'static str, String)> {
    let (d, l, g) = (&r.duplicates_sent, &r.latency_ms, group);
    let total = d.resend + d.redrive + d.double_tap;
    let (resend, redrive, double_tap) = (g(d.resend), g(d.redrive), g(d.double_tap));
    let dups = format!(
        "{} (resend {resend}, redrive {redrive}, double tap {double_tap})",
        g(total)
    );
    let ms = |v: f64| format!("{v:.1} ms");
    let mut rows = vec![
        ("rate plan", r.rate_plan.clone()),
        ("offered rate", format!("{:.1} msg/s", r.offered_rate)),
        ("duration", format!("{:.1} s", r.duration_s)),
        ("sent", g(r.sent)),
        ("acked", g(r.acked)),
        ("unique events", g(r.unique_events)),
        ("duplicates sent", dups),
        ("poison sent", g(r.poison_sent)),
        ("effects", g(r.effects)),
        ("lost", g(r.lost)),
        ("duplicated", g(r.duplicated)),
        ("unexpected", g(r.unexpected)),
        ("parked", g(r.parked)),
        ("wallet mismatches", g(r.wallet_mismatches)),
        ("throughput", format!("{:.1} msg/s", r.throughput_msg_s)),
        ("latency p50", ms(l.p50)),
        ("latency p90", ms(l.p90)),
        ("latency p99", ms(l.p99)),
        ("latency p99.9", ms(l.p999)),
        ("latency max", ms(l.max)),
    ];
    if !r.partitions.is_empty() {
        rows.push(("longest commit gap", commit_gaps(&r.partitions)));
    }
    if clock_stepped(r.clock_step_s) {
        rows.push(("clock step", format!("{:+.1} s", r.clock_step_s)));
    }
    rows
}

/// `p0 12 ms, p1 850 ms (claimed 2x), ...`: per partition, and how often it moved.
fn commit_gaps(partitions: &[PartitionRun]) -> String {
    partitions
        .iter()
        .map(|p| {
            let moved = match p.claims {
                0 => String::new(),
                n => format!(" (claimed {n}x)"),
            };
            format!("p{} {:.0} ms{moved}", p.partition, p.longest_commit_gap_ms)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Whether the wall clock moved against the monotonic clock by more than its usual drift.
pub fn clock_stepped(step_s: f64) -> bool {
    step_s.abs() >= 1.0
}

fn verdict_line(r: &Report) -> String {
    let verdict = if r.verified { "yes" } else { "no" };
    let rel = if r.parked == r.poison_sent { "=" } else { "!=" };
    let (lost, dup, unexp, wallets) = (r.lost, r.duplicated, r.unexpected, r.wallet_mismatches);
    format!(
        "verified: {verdict} (lost {lost}, duplicated {dup}, unexpected {unexp}, \
         wallet mismatches {wallets}, parked {} {rel} poison {})",
        r.parked, r.poison_sent
    )
}

/// Text for HTML content and attribute values.
fn escape(s: &str) -> String {
    let s = s
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    s.replace('"', "&quot;").replace('\'', "&#39;")
}

const CSS: &str = "body{font-family:sans-serif;margin:2em;color:#222;max-width:980px}\
    h1 .ok{color:#1a7f37}h1 .bad{color:#cf222e}table{border-collapse:collapse;margin:1em 0}\
    td,th{padding:.25em .8em;border-bottom:1px solid #ddd;text-align:left}\
    td{text-align:right;font-variant-numeric:tabular-nums}code{background:#f4f4f4;padding:0 .3em}\
    figure{margin:1.5em 0}svg{max-width:100%;height:auto}";

fn render_html(r: &Report) -> io::Result<String> {
    let (class, verdict) = [("bad", "NOT VERIFIED"), ("ok", "VERIFIED")][usize::from(r.verified)];
    let mut h = format!(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>loadgen report: {verdict}</title>\n<style>{CSS}</style>\n</head>\n<body>\n\
         <h1>loadgen report: <span class=\"{class}\">{verdict}</span></h1>\n<p>{}</p>\n\
         <h2>Summary</h2>\n<table>\n",
        escape(&verdict_line(r))
    );
    for (k, v) in summary_rows(r) {
        let _ = writeln!(h, "<tr><th>{k}</th><td>{}</td></tr>", escape(&v));
    }
    let yes_no = if r.verified { "yes" } else { "no" };
    let _ = writeln!(h, "<tr><th>verified</th><td>{yes_no}</td></tr>\n</table>");

    let a = &r.anomalies;
    let lists: [(&str, u64, &[String]); 5] = [
        ("Lost", r.lost, &a.lost),
        ("Duplicated", r.duplicated, &a.duplicated),
        ("Unexpected", r.unexpected, &a.unexpected),
        ("Wallet mismatches", r.wallet_mismatches, &a.wallets),
        ("Parked but not poison", 0, &a.parked_not_poison),
    ];
    if lists.iter().any(|(_, _, ids)| !ids.is_empty()) {
        h.push_str("<h2>Anomalies (examples)</h2>\n");
    }
    for (name, total, ids) in lists.into_iter().filter(|(_, _, ids)| !ids.is_empty()) {
        let total = group(total.max(ids.len() as u64));
        let _ = writeln!(h, "<h3>{name}: {total} (showing {})</h3>\n<ul>", ids.len());
        for id in ids {
            let _ = writeln!(h, "<li><code>{}</code></li>", escape(id));
        }
        h.push_str("</ul>\n");
    }

    h.push_str("<h2>Charts</h2>\n");
    let drawn = charts(&r.series).map_err(|e| io::Error::other(format!("chart: {e}")))?;
    for svg in drawn {
        let _ = writeln!(h, "<figure>\n{svg}\n</figure>");
    }
    Ok(h + "</body>\n</html>\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A minute at 2000/s; fields left out of the JSON take their defaults.
    fn typical() -> Report {
        let lat: Vec<f64> = (0..5000).map(|i| 3.0 + (i % 97) as f64 * 1.7).collect();
        let secs = |n: u32| (0..n).map(f64::from);
        serde_json::from_value(json!({
            "offered_rate": 2000.0, "rate_plan": "500/s 20s -> 2000/s 20s -> max 20s",
            "duration_s": 60.0, "sent": 120_500, "acked": 120_500, "unique_events": 118_000,
            "duplicates_sent": {"resend": 1200, "redrive": 800, "double_tap": 488},
            "poison_sent": 12, "effects": 118_000, "parked": 12, "throughput_msg_s": 1966.7,
            "latency_ms": {"p50": 12.0, "p90": 30.0, "p99": 80.5, "p999": 150.0, "max": 400.0},
            "verified": true,
            "series": {
                "latency": secs(60)
                    .map(|t| json!({"t_s": t, "p50": 10.0 + t, "p99": 60.0, "p999": 120.0, "max": 300.0}))
                    .collect::<Vec<_>>(),
                "histogram": histogram_buckets(&lat),
                "throughput": secs(60).map(|t| json!({"t_s": t, "per_s": 1950.0})).collect::<Vec<_>>(),
                "produced": secs(60).map(|t| json!({"t_s": t, "per_s": 2000.0})).collect::<Vec<_>>(),
                "lag": secs(30).map(|t| json!({"t_s": 2.0 * t, "lag": 50 * t as i64})).collect::<Vec<_>>(),
            }
        }))
        .unwrap()
    }

    /// A directory of this test's own, so that parallel tests never remove each other's files.
    fn tmp_dir(test: &str) -> std::path::PathBuf {
        let name = format!("loadgen-report-{}-{test}", std::process::id());
        std::env::temp_dir().join(name)
    }

    #[test]
    fn typical_report_renders_four_charts_and_the_verdict() {
        let html = render_html(&typical()).unwrap();
        assert_eq!(html.matches("<svg").count(), 4);
        assert!(html.contains("VERIFIED") && !html.contains("NOT VERIFIED"));
        assert!(!html.contains("<script") && !html.contains("http") && !html.contains("no data"));
        let dir = tmp_dir("html");
        write_html(&typical(), &dir.join("a/report.html")).unwrap();
        let written = std::fs::read_to_string(dir.join("a/report.html")).unwrap();
        assert!(
            written == html,
            "not the same page from one rendering to the next"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn html_shows_escaped_anomalies() {
        let mut r = typical();
        (r.verified, r.lost, r.unexpected, r.rate_plan) = (false, 30, 1, "a & b".into());
        r.anomalies.lost = vec!["pay-1".into(), "pay-2".into()];
        r.anomalies.unexpected = vec!["<script>alert('x')</script>".into()];
        let html = render_html(&r).unwrap();
        assert!(html.contains("NOT VERIFIED") && html.contains("Lost: 30 (showing 2)"));
        assert!(html.contains("<code>pay-2</code>") && html.contains("a &amp; b"));
        assert!(!html.contains("<script"));
        assert!(html.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;"));
    }

    #[test]
    fn empty_and_single_point_reports_render() {
        let html = render_html(&Report::default()).unwrap();
        assert_eq!(html.matches("<svg").count(), 4);
        assert_eq!(html.matches("no data").count(), 4);
        assert!(html.contains("NOT VERIFIED"));
        assert!(summary_table(&Report::default()).ends_with("parked 0 = poison 0)"));

        let one: Report = serde_json::from_value(json!({"series": {
            "latency": [{"t_s": 1.0, "p50": 0.0, "p99": 2.0, "p999": 3.0, "max": 4.0}],
            "histogram": histogram_buckets(&[0.5]),
            "throughput": [{"t_s": 1.0, "per_s": 0.0}],
            "lag": [{"t_s": 0.0, "lag": 0}],
        }}))
        .unwrap();
        let html = render_html(&one).unwrap();
        assert_eq!(html.matches("<svg").count(), 4);
        assert_eq!(html.matches("no data").count(), 0);
    }

    #[test]
    fn json_round_trips_with_the_expected_keys() {
        let r = typical();
        let dir = tmp_dir("json");
        let path = dir.join("run/1/report.json");
        write_json(&r, &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let keys = "offered_rate latency_ms p999 duplicates_sent double_tap verified";
        for key in keys.split(' ') {
            assert!(text.contains(&format!("\"{key}\":")), "{key} missing");
        }
        let back: Report = serde_json::from_str(&text).unwrap();
        let again = serde_json::to_string_pretty(&back).unwrap();
        assert_eq!(again.trim_end(), text.trim_end());
        assert_eq!(back.duplicates_sent.double_tap, 488);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn histogram_counts_every_value_once() {
        let values = [0.2, 1.0, 1.5, 2.0, 2.01, 7.0, 49.9, 50.0, 51.0, 999.0, -3.0];
        let b = histogram_buckets(&values);
        let bounds: Vec<f64> = b.iter().map(|b| b.le_ms).collect();
        let want = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];
        assert_eq!(bounds, want);
        let counts: Vec<u64> = b.iter().map(|b| b.count).collect();
        assert_eq!(counts, [3, 2, 1, 1, 0, 2, 1, 0, 0, 1]);

        let total = |v: &[f64]| histogram_buckets(v).iter().map(|b| b.count).sum::<u64>();
        let many: Vec<f64> = (0..10_000).map(|i| i as f64 * 0.37).collect();
        assert_eq!(total(&many), 10_000);
        assert_eq!(total(&[1e300, 0.0]), 2);
        assert_eq!(total(&[f64::NAN, 3.0]), 1);
        assert!(histogram_buckets(&[]).is_empty());
    }

    #[test]
    fn a_clock_step_is_shown_only_when_there_was_one() {
        let mut r = typical();
        r.clock_step_s = 0.3;
        assert!(
            !summary_table(&r).contains("clock step"),
            "NTP slewing is not a step"
        );
        r.clock_step_s = 57.9;
        let t = summary_table(&r);
        assert!(
            t.lines()
                .any(|l| l.starts_with("clock step") && l.ends_with(" +57.9 s")),
            "{t}"
        );
    }

    #[test]
    fn summary_table_is_aligned_with_the_verdict_last() {
        let t = summary_table(&typical());
        let lines: Vec<&str> = t.lines().collect();
        let verdict = "verified: yes (lost 0, duplicated 0, unexpected 0, wallet mismatches 0, parked 12 = poison 12)";
        assert_eq!(*lines.last().unwrap(), verdict);
        let col = lines[0].find("500/s").unwrap();
        let (rows, _) = lines.split_at(lines.len() - 1);
        assert!(rows
            .iter()
            .all(|l| l.len() > col && l[..col].ends_with("  ")));
        assert!(t.contains("120,500") && t.contains("double tap 488"));
    }
}
