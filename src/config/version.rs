//! `[consumer.version]`: versioned writes. Each event names the aggregate it changes and the
//! version it produces; the engine keeps the last applied version per aggregate and applies an
//! event only when its version is the one the aggregate can take next (see `crate::version`).

use std::time::Duration;

use serde::Deserialize;

/// `[consumer.version]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VersionConfig {
    /// JSON pointer to the aggregate's id in the payload (a string or an integer).
    pub aggregate: String,
    /// JSON pointer to the version the event produces (an integer, at least 1).
    pub version: String,
    /// How versions follow each other.
    pub mode: VersionMode,
    /// A gap (delta mode) held longer than this raises `effectively_version_gaps_overdue`.
    #[serde(with = "humantime_serde", default = "default_gap_alert_after")]
    pub gap_alert_after: Duration,
}

fn default_gap_alert_after() -> Duration {
    Duration::from_secs(300)
}

/// How versions follow each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum VersionMode {
    /// Every event carries the aggregate's whole new state: any version above the stored one
    /// is applied (the newest of a batch only); older and equal ones are stale.
    FullState,
    /// Every event is a change to the previous state ("add 100"): only the stored version + 1
    /// is applied; a later one is a gap and waits for the missing versions.
    Delta,
}

impl VersionConfig {
    /// What is wrong with it, if anything (one line each).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        for (name, ptr) in [("aggregate", &self.aggregate), ("version", &self.version)] {
            if !ptr.starts_with('/') {
                p.push(format!(
                    "version.{name} must be a JSON pointer such as \"/order_id\", not {ptr:?}"
                ));
            }
        }
        if self.gap_alert_after.is_zero() {
            p.push("version.gap_alert_after must be more than 0".into());
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_both_modes_and_checks_pointers() {
        let c: VersionConfig =
            toml::from_str("aggregate = \"/order_id\"\nversion = \"/version\"\nmode = \"delta\"")
                .unwrap();
        assert_eq!(c.mode, VersionMode::Delta);
        assert_eq!(c.gap_alert_after, Duration::from_secs(300));
        assert!(c.problems().is_empty());
        let c: VersionConfig = toml::from_str(
            "aggregate = \"order_id\"\nversion = \"/v\"\nmode = \"full-state\"\ngap_alert_after = \"1m\"",
        )
        .unwrap();
        assert_eq!(c.mode, VersionMode::FullState);
        assert_eq!(c.problems().len(), 1);
        assert!(toml::from_str::<VersionConfig>(
            "aggregate = \"/a\"\nversion = \"/v\"\nmode = \"latest\""
        )
        .is_err());
    }
}
