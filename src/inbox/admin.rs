//! What `effectively inbox status` and `effectively inbox replay` print and accept.

use chrono::{DateTime, Utc};
use humantime_serde::re::humantime;

use crate::store::inbox::Status;

/// `--since`: an RFC 3339 time, or a duration back from `now` (`"2h"`, `"3days"`).
pub fn parse_since(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = humantime::parse_duration(s).map_err(|e| {
        format!("--since {s:?} is neither an RFC 3339 time nor a duration such as \"2h\": {e}")
    })?;
    let ago = chrono::Duration::from_std(ago).map_err(|e| format!("--since {s:?}: {e}"))?;
    Ok(now - ago)
}

/// `--key K`: the ordering key as the receiver stored it (a Kafka key or a payload field `K`
/// is stored as `k:K`).
pub fn stored_key(key: &str) -> String {
    format!("k:{key}")
}

/// The status table, one line per consumer.
pub fn render_status(rows: &[Status]) -> String {
    let mut out = format!(
        "{:<24} {:>10} {:>10} {:>12} {:>8} {:>20}\n",
        "consumer", "pending", "due", "in_progress", "failed", "oldest_pending_age"
    );
    for s in rows {
        let age = std::time::Duration::from_secs(s.oldest_pending_s.max(0.0) as u64);
        out.push_str(&format!(
            "{:<24} {:>10} {:>10} {:>12} {:>8} {:>20}\n",
            s.consumer,
            s.pending,
            s.due,
            s.in_progress,
            s.failed,
            humantime::format_duration(age).to_string()
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn since_takes_a_time_or_a_duration() {
        let now = DateTime::parse_from_rfc3339("2026-12-03T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let t = parse_since("2026-12-01T00:00:00Z", now).unwrap();
        assert_eq!(t.to_rfc3339(), "2026-12-01T00:00:00+00:00");
        assert_eq!(
            parse_since("2h", now).unwrap(),
            now - chrono::Duration::hours(2)
        );
        assert!(parse_since("yesterday", now)
            .unwrap_err()
            .contains("--since"));
    }

    #[test]
    fn status_renders_one_line_per_consumer() {
        let s = Status {
            consumer: "notify".into(),
            pending: 3,
            due: 2,
            in_progress: 1,
            failed: 4,
            oldest_pending_s: 75.0,
        };
        let text = render_status(&[s]);
        assert!(text.lines().nth(1).unwrap().starts_with("notify"));
        assert!(text.contains("1m 15s"), "{text}");
    }
}
