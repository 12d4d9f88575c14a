//! What `effectively inbox status` and `effectively inbox replay` print and accept.

use chrono::{DateTime, Utc};
use humantime_serde::re::humantime;

use crate::store::inbox::Status;
use crate::store::versions::Gap;

/// `--since`: an RFC 3339 time, or a duration back from `now` (`"2h"`, `"3days"`).
pub fn parse_since(s: &str, now: DateTime<Utc>) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    let ago = humantime::parse_duration(s).map_err(|e| {
        format!("--since {s:?} is neither an RFC 3339 time nor a duration such as \"2h\": {e}")
    })?;
    let ago = chrono::Duration::from_std(ago).map_err(|e| format!("--since {s:?}: {e}"))?;
    // A duration chrono can hold may still reach back past its calendar (about 262,000
    // years): `now - ago` would panic there, in the console's request as in the CLI.
    now.checked_sub_signed(ago).ok_or_else(|| {
        format!("--since {s:?} reaches back before the earliest time this engine can name")
    })
}

/// `--key K`: the ordering key as the receiver stored it (a Kafka key or a payload field `K`
/// is stored as `k:K`).
pub fn stored_key(key: &str) -> String {
    format!("k:{key}")
}

fn age(seconds: f64) -> String {
    humantime::format_duration(std::time::Duration::from_secs(seconds.max(0.0) as u64)).to_string()
}

/// The status table, one line per consumer.
pub fn render_status(rows: &[Status]) -> String {
    let mut out = format!(
        "{:<24} {:>10} {:>10} {:>12} {:>8} {:>8} {:>20}\n",
        "consumer", "pending", "due", "in_progress", "failed", "held", "oldest_pending_age"
    );
    for s in rows {
        out.push_str(&format!(
            "{:<24} {:>10} {:>10} {:>12} {:>8} {:>8} {:>20}\n",
            s.consumer,
            s.pending,
            s.due,
            s.in_progress,
            s.failed,
            s.held,
            age(s.oldest_pending_s)
        ));
    }
    out
}

/// The held gaps of one versioned consumer, one line per aggregate, oldest first: the version
/// applied, the versions waiting, and for how long. `shown_of`: how many aggregates have gaps.
pub fn render_gaps(consumer: &str, gaps: &[Gap], shown_of: i64) -> String {
    if gaps.is_empty() {
        return format!("{consumer}: no held gaps\n");
    }
    let mut out = format!(
        "{consumer}: held gaps ({} of {shown_of} aggregates, oldest first)\n  {:<32} {:>8} {:>8} {:<24} {:>14}\n",
        gaps.len(),
        "aggregate",
        "applied",
        "missing",
        "held versions",
        "waiting"
    );
    for g in gaps {
        let applied = g.stored.unwrap_or(0);
        let held = if g.held.len() > 4 {
            format!(
                "{}, {} .. {} ({})",
                g.held[0],
                g.held[1],
                g.held[g.held.len() - 1],
                g.held.len()
            )
        } else {
            g.held
                .iter()
                .map(i64::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        out.push_str(&format!(
            "  {:<32} {:>8} {:>8} {:<24} {:>14}\n",
            g.aggregate,
            applied,
            applied + 1,
            held,
            age(g.oldest_s)
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
        // Found by tests/fuzz.rs (a console query `since=1000000years`): it panicked.
        assert!(parse_since("1000000years", now)
            .unwrap_err()
            .contains("before the earliest time"));
    }

    #[test]
    fn status_renders_one_line_per_consumer() {
        let s = Status {
            consumer: "notify".into(),
            pending: 3,
            due: 2,
            in_progress: 1,
            failed: 4,
            held: 2,
            oldest_pending_s: 75.0,
        };
        let text = render_status(&[s]);
        assert!(text.lines().nth(1).unwrap().starts_with("notify"));
        assert!(text.contains("1m 15s"), "{text}");
    }

    #[test]
    fn gaps_render_what_is_missing() {
        let g = Gap {
            aggregate: "o-17".into(),
            stored: Some(3),
            held: vec![5, 6],
            oldest_s: 130.0,
        };
        let text = render_gaps("orders", &[g], 1);
        let line = text.lines().nth(2).unwrap();
        assert!(
            line.contains("o-17") && line.contains(" 4 ") && line.contains("5, 6"),
            "{text}"
        );
        assert!(line.contains("2m 10s"), "{text}");
        assert_eq!(render_gaps("orders", &[], 0), "orders: no held gaps\n");
    }
}
