//! `prefilter = { redis = "redis://127.0.0.1:6379", ttl = "retention" }`: the optional Redis
//! pre-filter of a consumer (see `crate::prefilter`). Redis is never the authority: a hit
//! skips a message PostgreSQL already committed, a miss or any Redis failure goes to
//! PostgreSQL as without a pre-filter.

use std::fmt;
use std::time::Duration;

use humantime_serde::re::humantime::{format_duration, parse_duration};
use serde::{Deserialize, Deserializer};

use super::Secret;

/// `[consumer.prefilter]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefilterConfig {
    /// `redis://[user:password@]host:port[/db]`; the password is never printed. Use a database
    /// (or a server) of its own: every key under `effectively:` is taken as a committed key.
    pub redis: Secret,
    /// How long a key is kept in Redis after its commit: `"retention"` (the consumer's
    /// retention, counted from the event's date like the dedupe keys in PostgreSQL) or a
    /// shorter duration. Default `"retention"`.
    #[serde(default)]
    pub ttl: Ttl,
    /// The longest a lookup or a set may take; past it the batch goes on without Redis. Default
    /// 50 ms: a healthy Redis on the same network answers a 1,000-key MGET in about 1 ms.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

fn default_timeout() -> Duration {
    Duration::from_millis(50)
}

/// How long a key lives in Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ttl {
    /// As long as PostgreSQL keeps the key: until the event's date leaves the consumer's
    /// retention window (after which a copy is parked before any lookup).
    #[default]
    Retention,
    /// At most this long after the commit (and never past the retention window).
    For(Duration),
}

impl<'de> Deserialize<'de> for Ttl {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "retention" {
            return Ok(Ttl::Retention);
        }
        parse_duration(&s).map(Ttl::For).map_err(|e| {
            serde::de::Error::custom(format!(
                "prefilter.ttl {s:?} must be \"retention\" or a duration such as \"2days\": {e}"
            ))
        })
    }
}

impl fmt::Display for Ttl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ttl::Retention => f.write_str("retention"),
            Ttl::For(d) => write!(f, "{}", format_duration(*d)),
        }
    }
}

impl PrefilterConfig {
    /// What is wrong with it for a consumer of `retention`, if anything (one line each).
    pub fn problems(&self, retention: Duration) -> Vec<String> {
        let mut p = Vec::new();
        if let Err(e) = redis::IntoConnectionInfo::into_connection_info(self.redis.expose()) {
            // The error's detail may quote the URL: print ours, redacted, and only its reason.
            let why = match e.detail() {
                Some(d) if !d.contains(self.redis.expose()) => d.to_string(),
                _ => format!("{:?}", e.kind()),
            };
            p.push(format!(
                "prefilter.redis {} is not a Redis URL (redis://host:port[/db]): {why}",
                self.redis
            ));
        }
        match self.ttl {
            Ttl::For(d) if d.is_zero() => p.push("prefilter.ttl must be more than 0".into()),
            // A key kept longer could only answer for a copy that is parked as older than the
            // retention before any lookup: refused, so that the memory it would take is seen.
            Ttl::For(d) if d > retention => p.push(format!(
                "prefilter.ttl ({}) must not exceed retention ({}): a copy older than the \
                 retention is parked before the lookup, so a longer TTL only holds memory; use \
                 ttl = \"retention\"",
                format_duration(d),
                format_duration(retention)
            )),
            _ => {}
        }
        if self.timeout.is_zero() || self.timeout > Duration::from_secs(5) {
            p.push(format!(
                "prefilter.timeout ({}) must be more than 0 and at most 5s: every batch may wait \
                 that long for a Redis that does not answer",
                format_duration(self.timeout)
            ));
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    fn parse(text: &str) -> Result<PrefilterConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn defaults_and_spellings() {
        let c = parse("redis = \"redis://127.0.0.1:6379\"").unwrap();
        assert_eq!(c.ttl, Ttl::Retention);
        assert_eq!(c.timeout, Duration::from_millis(50));
        assert!(c.problems(15 * DAY).is_empty());
        let c = parse("redis = \"redis://h:1/3\"\nttl = \"2days\"\ntimeout = \"10ms\"").unwrap();
        assert_eq!(c.ttl, Ttl::For(2 * DAY));
        assert_eq!(c.ttl.to_string(), "2days");
        assert_eq!(c.timeout, Duration::from_millis(10));
        assert!(c.problems(15 * DAY).is_empty());
        let err = parse("redis = \"redis://h\"\nttl = \"forever\"").unwrap_err();
        assert!(
            err.to_string().contains("\"retention\" or a duration"),
            "{err}"
        );
        assert!(parse("redis = \"redis://h\"\nttls = \"1d\"").is_err());
        assert!(parse("ttl = \"1d\"").is_err(), "redis is required");
    }

    #[test]
    fn a_ttl_past_retention_a_bad_url_and_a_long_timeout_are_refused() {
        let c = parse("redis = \"redis://h\"\nttl = \"16days\"").unwrap();
        let p = c.problems(15 * DAY).join("; ");
        assert!(
            p.contains("prefilter.ttl (16days) must not exceed retention (15days)"),
            "{p}"
        );
        let c = parse("redis = \"redis://h\"\nttl = \"0s\"").unwrap();
        assert_eq!(
            c.problems(15 * DAY),
            vec!["prefilter.ttl must be more than 0"]
        );
        let c = parse("redis = \"http://u:secret@h\"").unwrap();
        let p = c.problems(15 * DAY).join("; ");
        assert!(p.contains("is not a Redis URL"), "{p}");
        assert!(!p.contains("secret"), "{p}");
        let c = parse("redis = \"redis://h\"\ntimeout = \"10s\"").unwrap();
        assert!(c.problems(15 * DAY)[0].contains("at most 5s"));
    }
}
