//! `[consumer.inbox]`: how the inbox strategy's processors claim, order and finish rows. Read
//! only when the consumer's `strategy = "inbox"`; the receiver side uses the consumer's usual
//! `batch`, `message_id` and `event_date` settings, and the processors' retry schedule is the
//! consumer's `[consumer.retry]`.

use std::time::Duration;

use humantime_serde::re::humantime::format_duration;
use serde::Deserialize;

/// `[consumer.inbox]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InboxConfig {
    /// Processor tasks in this worker process. 0 makes the process a receiver only (other
    /// processes process). Any number of processes may process the same consumer.
    pub processors: usize,
    /// Whether the rounds this process runs at once adapt between 1 and `processors` to what
    /// PostgreSQL's CPU runs without queueing (see [`crate::inbox::limit`]); `false` runs every
    /// processor's round whenever it is ready.
    pub adaptive: bool,
    /// Rows one processor claims per transaction.
    pub claim_batch: usize,
    /// How long an idle processor (its last round found no due row) waits before it looks
    /// again, unless the receiver signals new rows first. A round that claimed rows is
    /// followed by another at once.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Which rows must be applied in arrival order: those of one key.
    pub ordering_key: OrderingKey,
    /// How a processor holds the rows it works on.
    pub claim: ClaimMode,
    /// With `claim = "lease"`: how long a claim is good for; a dead processor's rows wait this
    /// long before another processor takes them. The applying transaction locks the rows still
    /// leased to it before the handler runs, so a row is never applied twice however short the
    /// lease; rows whose lease ran out before that lock (a stalled process) are left to the
    /// processor that reclaimed them and counted as lost. Keep it well above the slowest round.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// What happens to a row once its effect is committed.
    pub done: DoneRows,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            processors: 4,
            adaptive: true,
            claim_batch: 100,
            poll_interval: Duration::from_millis(100),
            ordering_key: OrderingKey::KafkaKey,
            claim: ClaimMode::Lock,
            lease: Duration::from_secs(300),
            done: DoneRows::Keep,
        }
    }
}

/// Where a message's ordering key comes from. TOML: `"kafka_key"`, `"none"`, or
/// `{ json_pointer = "/order_id" }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrderingKey {
    /// The record's Kafka key (hex when it is not UTF-8).
    KafkaKey,
    /// A string or number at this JSON pointer in the payload.
    JsonPointer(String),
    /// No order: every row is its own key, and processors take rows in any order.
    None,
}

impl<'de> Deserialize<'de> for OrderingKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Word(String),
            Pointer { json_pointer: String },
        }
        match Repr::deserialize(d)? {
            Repr::Word(w) if w == "kafka_key" => Ok(OrderingKey::KafkaKey),
            Repr::Word(w) if w == "none" => Ok(OrderingKey::None),
            Repr::Word(w) => Err(serde::de::Error::custom(format!(
                "ordering_key {w:?} must be \"kafka_key\", \"none\" or {{ json_pointer = \"/field\" }}"
            ))),
            Repr::Pointer { json_pointer } => Ok(OrderingKey::JsonPointer(json_pointer)),
        }
    }
}

/// How a processor holds its claimed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClaimMode {
    /// Row locks (`FOR UPDATE SKIP LOCKED`) held by the transaction that applies the effect:
    /// a processor that dies releases its rows with its connection, at once.
    #[default]
    Lock,
    /// `IN_PROGRESS` with `lease_until`, committed by the claim itself: operators see the
    /// claimed rows (`effectively inbox status`), attempts count even for a processor that
    /// dies, and a dead processor's rows are reclaimed after the lease expires. The applying
    /// transaction still locks the rows it applies.
    Lease,
}

/// What a processor does with a row whose effect it committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DoneRows {
    /// Mark it DONE and keep it (audit, replay) until retention drops its daily partition.
    /// The row is the dedupe record.
    #[default]
    Keep,
    /// Delete it. The receiver then also records the message's key in `processed_messages`
    /// (the dedupe ledger of the batch strategy), so a redelivery within retention is still
    /// recognised after its inbox row is gone.
    Delete,
}

impl InboxConfig {
    /// This section's problems, prefixed `inbox.`.
    pub(super) fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.claim_batch < 1 {
            p.push("inbox.claim_batch must be at least 1".into());
        }
        if self.claim_batch > 10_000 {
            p.push("inbox.claim_batch must be at most 10000".into());
        }
        if self.processors > 256 {
            p.push("inbox.processors must be at most 256".into());
        }
        if self.poll_interval.is_zero() {
            p.push("inbox.poll_interval must be more than 0".into());
        }
        if self.claim == ClaimMode::Lease && self.lease < Duration::from_secs(1) {
            p.push(format!(
                "inbox.lease ({}) must be at least 1s, and well above the slowest processor round",
                format_duration(self.lease)
            ));
        }
        if let OrderingKey::JsonPointer(ptr) = &self.ordering_key {
            if !ptr.starts_with('/') {
                p.push(format!(
                    "inbox.ordering_key.json_pointer {ptr:?} must start with \"/\""
                ));
            }
        }
        p
    }
}
