//! `[sender]`: the notification sender (`effectively send`), which delivers the intents handlers
//! record in `notifications` to providers outside the database, with idempotency keys.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use super::RetryConfig;

/// `[sender]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SenderConfig {
    /// `[sender.channels.<name>]`: where each channel's notifications go. Only these channels
    /// are sent by this sender.
    pub channels: BTreeMap<String, ChannelConfig>,
    /// Notifications claimed per round (each one sent on its own, concurrently).
    pub batch: usize,
    /// The database whose `notifications` table this sender works: a `[database.NAME]`; `None` is
    /// `[database]`. `effectively send --database NAME` overrides it; one sender
    /// process works one database.
    pub database: Option<String>,
    /// How long an idle sender waits before it looks again.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// One provider call's limit; past it the outcome is unknown and the same key is tried
    /// again later (the provider answers from its record, or 409 while it is still working).
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    /// A notification SENDING for longer than this was interrupted (its sender died, or its
    /// call outlived every timeout): another sender takes it over under the channel's policy.
    /// Keep it well above `request_timeout`.
    #[serde(with = "humantime_serde")]
    pub sending_timeout: Duration,
    /// Attempts and backoff per notification; past `max_attempts` it is FAILED.
    pub retry: RetryConfig,
}

impl Default for SenderConfig {
    fn default() -> Self {
        SenderConfig {
            channels: BTreeMap::new(),
            batch: 20,
            database: None,
            poll_interval: Duration::from_millis(200),
            request_timeout: Duration::from_secs(10),
            sending_timeout: Duration::from_secs(60),
            retry: RetryConfig {
                max_attempts: 8,
                initial_backoff: Duration::from_secs(1),
                max_backoff: Duration::from_secs(300),
            },
        }
    }
}

/// `[sender.channels.<name>]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChannelConfig {
    /// The provider's endpoint: `POST` with the `Idempotency-Key` header and the notification's
    /// payload as JSON.
    pub url: String,
    /// The provider can look a key up (`GET <url>?idempotency_key=K`: 200 if it delivered
    /// something under it, 404 if not). The sender then reconciles an interrupted send, or an
    /// ambiguous 500, by asking instead of guessing.
    #[serde(default)]
    pub lookup: bool,
    /// What to do with an interrupted send when the provider cannot be asked.
    #[serde(default)]
    pub on_interrupted: OnInterrupted,
}

/// What a sender does with a notification whose previous send was interrupted, when it
/// cannot ask the provider whether it went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum OnInterrupted {
    /// Send it again under the same key: once if the provider honours keys, perhaps twice if
    /// not. Right for a one-time password, where a second SMS is better than none.
    #[default]
    Resend,
    /// Give it up (SKIPPED): at most once. Right for an alert that is stale a minute later.
    Skip,
}

impl SenderConfig {
    /// What is wrong with it, if anything (one line each).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.channels.is_empty() {
            p.push("[sender] needs at least one [sender.channels.<name>]".into());
        }
        for (name, c) in &self.channels {
            if !(c.url.starts_with("http://") || c.url.starts_with("https://")) {
                p.push(format!(
                    "sender.channels.{name}.url must be an http(s) URL, not {:?}",
                    c.url
                ));
            }
        }
        if self.batch == 0 {
            p.push("sender.batch must be at least 1".into());
        }
        if self.sending_timeout <= self.request_timeout {
            p.push(format!(
                "sender.sending_timeout ({:?}) must exceed sender.request_timeout ({:?}): a send \
                 still in flight would be taken over",
                self.sending_timeout, self.request_timeout
            ));
        }
        if self.retry.max_attempts == 0 {
            p.push("sender.retry.max_attempts must be at least 1".into());
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_channels_and_policies() {
        let c: SenderConfig = toml::from_str(
            "request_timeout = \"2s\"\nsending_timeout = \"10s\"\n\
             [channels.sms]\nurl = \"http://127.0.0.1:8099/v1/messages\"\nlookup = true\n\
             [channels.alerts]\nurl = \"https://alerts.example/v1\"\non_interrupted = \"skip\"\n",
        )
        .unwrap();
        assert!(c.problems().is_empty(), "{:?}", c.problems());
        assert!(c.channels["sms"].lookup);
        assert_eq!(c.channels["sms"].on_interrupted, OnInterrupted::Resend);
        assert_eq!(c.channels["alerts"].on_interrupted, OnInterrupted::Skip);
        let bad: SenderConfig =
            toml::from_str("sending_timeout = \"1s\"\n[channels.x]\nurl = \"ftp://x\"\n").unwrap();
        assert_eq!(bad.problems().len(), 2);
    }
}
