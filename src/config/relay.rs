//! `[relay]`: the outbox relay (`effectively relay`), which publishes the rows of the `outbox`
//! table to Kafka. It may share a file with the workers' `[[consumer]]`s or stand alone; the
//! `[kafka]` and `[database]` sections are the same.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

/// `[relay]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// The topic of each event type this relay publishes. Only rows of these types are
    /// claimed, unless `topic` is set.
    pub topics: BTreeMap<String, String>,
    /// The topic of every event type not in `topics`: with it, the relay publishes every row.
    pub topic: Option<String>,
    /// Rows claimed, published and marked per transaction.
    pub batch: usize,
    /// The database whose `outbox` table this relay works: a `[database.NAME]`; `None` is
    /// `[database]`. `effectively relay --database NAME` overrides it; one relay
    /// process works one database.
    pub database: Option<String>,
    /// How long an idle relay waits before it looks again; one that claimed a full batch looks
    /// again at once.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// What happens to a row once the broker acknowledged it.
    pub published: Published,
    /// The longest the relay waits for the broker to acknowledge a batch; past it the batch is
    /// rolled back (its rows stay unpublished) and tried again.
    #[serde(with = "humantime_serde")]
    pub publish_timeout: Duration,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            topics: BTreeMap::new(),
            topic: None,
            batch: 500,
            database: None,
            poll_interval: Duration::from_millis(100),
            published: Published::Keep,
            publish_timeout: Duration::from_secs(30),
        }
    }
}

/// What happens to a published outbox row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Published {
    /// `published_at` is set and the row stays (an audit trail; delete old rows yourself).
    #[default]
    Keep,
    /// The row is deleted in the transaction that would have marked it.
    Delete,
}

impl RelayConfig {
    /// The topic for `event_type`, if this relay publishes it.
    pub fn topic_for(&self, event_type: &str) -> Option<&str> {
        self.topics
            .get(event_type)
            .or(self.topic.as_ref())
            .map(String::as_str)
    }

    /// The event types this relay claims; `None`: every type (a default `topic` is set).
    pub fn event_types(&self) -> Option<Vec<String>> {
        match self.topic {
            Some(_) => None,
            None => Some(self.topics.keys().cloned().collect()),
        }
    }

    /// What is wrong with it, if anything (one line each).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.topics.is_empty() && self.topic.is_none() {
            p.push("[relay] needs `topics` (event type -> topic) or a default `topic`".into());
        }
        let routes = self.topics.iter().map(|(t, topic)| (t.as_str(), topic));
        for (t, topic) in routes.chain(self.topic.as_ref().map(|t| ("*", t))) {
            if topic.is_empty() {
                p.push(format!("relay topic for {t:?} is empty"));
            }
        }
        if self.batch == 0 {
            p.push("relay.batch must be at least 1".into());
        }
        if self.publish_timeout.is_zero() {
            p.push("relay.publish_timeout must be more than 0".into());
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_by_type_then_the_default() {
        let c: RelayConfig =
            toml::from_str("topics = { PaymentSucceeded = \"payments\" }").unwrap();
        assert_eq!(c.topic_for("PaymentSucceeded"), Some("payments"));
        assert_eq!(c.topic_for("CashbackCredited"), None);
        assert_eq!(c.event_types(), Some(vec!["PaymentSucceeded".to_string()]));
        assert!(c.problems().is_empty());
        let c: RelayConfig = toml::from_str("topic = \"all\"\npublished = \"delete\"").unwrap();
        assert_eq!(c.topic_for("CashbackCredited"), Some("all"));
        assert_eq!((c.event_types(), c.published), (None, Published::Delete));
        assert_eq!(RelayConfig::default().problems().len(), 1);
    }
}
