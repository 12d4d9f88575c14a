//! The soak's report: `report.json` (settings, the ledger's verdict, the sender's and the
//! relay's checks, each fault with its recovery, the trends with their thresholds, every
//! sample) and `report.svg` ([`super::chart`]), and the lines printed at the end.

use std::path::Path;

use serde::Serialize;

use super::checks::{Delivery, Relayed};
use super::faults::Fault;
use super::sample::Sample;
use super::trend::{Threshold, Trend};
use super::verdict;

/// The numbers a soak ran with.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Settings {
    pub topic: String,
    pub seed: u64,
    pub strategy: &'static str,
    pub duration_s: f64,
    pub rate: f64,
    /// The notifying stream's rate.
    pub notify_rate: f64,
    pub sample_s: f64,
    pub fault_every_s: f64,
    pub warm_up_s: f64,
    /// Samples this long after a fault are left out of the trends.
    pub settle_s: f64,
    pub recovery_limit_s: f64,
    /// The Redis pre-filter: off in the soak (its memory is not sampled).
    pub redis: &'static str,
}

/// What the ledger's verification found (loadgen's checker, as every harness's).
#[derive(Debug, Clone, Serialize)]
pub(super) struct Ledger {
    pub sent: u64,
    pub acked: u64,
    pub unique_events: u64,
    pub effects: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    pub parked: u64,
    pub poison_sent: u64,
    pub wallet_mismatches: u64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub verified: bool,
}

impl Ledger {
    pub(super) fn of(r: &crate::report::Report) -> Ledger {
        Ledger {
            sent: r.sent,
            acked: r.acked,
            unique_events: r.unique_events,
            effects: r.effects,
            lost: r.lost,
            duplicated: r.duplicated,
            unexpected: r.unexpected,
            parked: r.parked,
            poison_sent: r.poison_sent,
            wallet_mismatches: r.wallet_mismatches,
            p50_ms: r.latency_ms.p50,
            p99_ms: r.latency_ms.p99,
            verified: r.verified,
        }
    }
}

/// One fault and its recovery.
#[derive(Debug, Clone, Serialize)]
pub(super) struct FaultResult {
    pub kind: Fault,
    pub label: String,
    /// Seconds since the soak started.
    pub at_s: f64,
    /// A service's: from its crash until `scripts/stack.sh up` returned.
    pub down_s: Option<f64>,
    /// Until every partition with traffic committed past its end at the fault (None: never),
    /// from the kill, or from a service's return.
    pub recover_s: Option<f64>,
    pub passed: bool,
}

/// A threshold as the report states it.
#[derive(Debug, Clone, Serialize)]
pub(super) struct Stated {
    pub metric: &'static str,
    #[serde(flatten)]
    pub threshold: Threshold,
}

#[derive(Debug, Clone, Serialize)]
pub(super) struct SoakReport {
    pub passed: bool,
    pub failures: Vec<String>,
    /// Faults left out because the ones before ran long (a broker slow to start).
    pub notes: Vec<String>,
    pub settings: Settings,
    /// The main stream's (at `rate`).
    pub ledger: Ledger,
    /// The notifying stream's (at `notify_rate`).
    pub notify_ledger: Ledger,
    /// Samples where Kafka's committed offset was ahead of PostgreSQL's (must be 0).
    pub kafka_ahead: u64,
    pub delivery: Delivery,
    pub relay: Relayed,
    pub faults: Vec<FaultResult>,
    /// The longest time any partition went without a commit, and that less the faults'
    /// outages by design (broker or PostgreSQL down).
    pub stall_s: f64,
    pub engine_stall_s: f64,
    /// Growth over the run that fails a series: past both the relative and the absolute limit.
    pub thresholds: Vec<Stated>,
    pub trends: Vec<Trend>,
    pub samples: Vec<Sample>,
}

/// The thresholds, for the report.
pub(super) fn thresholds() -> Vec<Stated> {
    vec![
        Stated {
            metric: "rss_mb",
            threshold: verdict::RSS,
        },
        Stated {
            metric: "fds",
            threshold: verdict::FDS,
        },
        Stated {
            metric: "threads",
            threshold: verdict::THREADS,
        },
        Stated {
            metric: "postgres connections",
            threshold: verdict::CONNECTIONS,
        },
    ]
}

impl SoakReport {
    /// Writes `report.json` and `report.svg` into `dir`.
    pub(super) fn write(&self, dir: &Path) -> anyhow::Result<()> {
        std::fs::write(
            dir.join("report.json"),
            serde_json::to_string_pretty(self)? + "\n",
        )?;
        let faults: Vec<super::chart::FaultLine> = (self.faults.iter())
            .map(|f| super::chart::FaultLine {
                t_s: f.at_s,
                label: f.label.clone(),
            })
            .collect();
        let svg = super::chart::chart(&self.samples, &faults, self.settings.warm_up_s)
            .map_err(|e| anyhow::anyhow!("drawing the chart: {e}"))?;
        std::fs::write(dir.join("report.svg"), svg)?;
        Ok(())
    }

    /// The summary printed at the end.
    pub(super) fn print(&self) {
        for (name, l) in [("ledger", &self.ledger), ("notifying", &self.notify_ledger)] {
            eprintln!(
                "{name}: sent {} acked {} effects {} lost {} duplicated {} unexpected {} parked {} \
                 (poison {}) p99 {} ms",
                l.sent, l.acked, l.effects, l.lost, l.duplicated, l.unexpected, l.parked,
                l.poison_sent, l.p99_ms
            );
        }
        let d = &self.delivery;
        eprintln!(
            "sender: {} notifications, {} SENT, {} open, {} FAILED; provider delivered {} \
             ({} replays, {} lookups)",
            d.notifications,
            d.sent,
            d.open,
            d.failed,
            d.provider_effects,
            d.provider_replays,
            d.provider_lookups
        );
        let r = &self.relay;
        eprintln!(
            "relay: {} outbox rows, {} unpublished; {} records in the topic",
            r.rows, r.unpublished, r.topic_records
        );
        for f in &self.faults {
            eprintln!(
                "fault at {:.0} s, {}{}: recovered {}",
                f.at_s,
                f.label,
                f.down_s
                    .map_or(String::new(), |d| format!(" (down {d:.1} s)")),
                f.recover_s
                    .map_or("never".into(), |s| format!("in {s:.2} s"))
            );
        }
        eprintln!(
            "longest commit stall {:.1} s ({:.1} s outside the outages)",
            self.stall_s, self.engine_stall_s
        );
        for t in &self.trends {
            eprintln!(
                "trend {}: median {} {}, slope {}/h over {} points ({} groups), growth over the \
                 run {} (at least {}, limit {}){}{}",
                t.series,
                t.median,
                t.unit,
                t.slope_per_hour.map_or("-".into(), |s| format!("{s:+.2}")),
                t.points,
                t.groups,
                t.growth_over_run.map_or("-".into(), |g| format!("{g:+.2}")),
                t.growth_at_least.map_or("-".into(), |g| format!("{g:+.2}")),
                t.limit,
                if t.passed { "" } else { "  FAIL" },
                if t.note.is_empty() || !t.passed {
                    String::new()
                } else {
                    format!(" ({})", t.note)
                }
            );
        }
        for n in &self.notes {
            eprintln!("note: {n}");
        }
        for f in &self.failures {
            eprintln!("FAILED: {f}");
        }
        println!(
            "soak: {} ({} faults, {} samples)",
            if self.passed { "PASS" } else { "FAIL" },
            self.faults.len(),
            self.samples.len()
        );
    }
}
