//! One `[[consumer]]`: its fields, their defaults, and the checks of a consumer's section.

use super::*;

/// One `[[consumer]]`: topics, a handler, and `name`, the dedupe scope.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsumerConfig {
    /// The dedupe scope: two consumers with different names each apply every message once.
    pub name: String,
    pub topics: Vec<String>,
    /// Kafka `group.id`; `None` uses `name` (see [`ConsumerConfig::group_id`]).
    #[serde(default)]
    pub group: Option<String>,
    /// The database that holds this consumer's ledger, offsets, inbox, dead letters and
    /// effect: a `[database.NAME]`; `None` (or `"default"`) is `[database]`.
    #[serde(default)]
    pub database: Option<String>,
    #[serde(default)] // batch
    pub strategy: Strategy,
    /// Where a message's key is kept: `ledger` (the default: `processed_messages`, one row a
    /// message, dropped by day past `retention`) or `business-row` (the handler's own row keeps
    /// it, under the row's unique key, and no ledger row is written: for handlers that write
    /// exactly one business row a message, such as the cashback handler; batch strategy only).
    #[serde(default)]
    pub dedupe: Dedupe,
    pub handler: HandlerConfig,
    /// Used only for partitions PostgreSQL has no offset for. Default `earliest`, unlike
    /// librdkafka's `latest`: better to apply old events than to skip them.
    #[serde(default)]
    pub auto_offset_reset: OffsetReset,
    /// What a partition does when the offset PostgreSQL stores for it lies outside the
    /// partition's log (above its end: the topic recreated, an unclean leader election; below
    /// its start: retention ran past the consumer). Default `stop`: never skip or re-read
    /// silently (see `crate::source::range`).
    #[serde(default)]
    pub on_offset_out_of_range: OutOfRange,
    #[serde(default)]
    pub batch: BatchConfig,
    /// How records are read: `plain` (the default) or `cloudevents` (CloudEvents 1.0, binary or
    /// structured mode: the key is the event's source and id, the date its time).
    #[serde(default)]
    pub envelope: EnvelopeKind,
    /// Where the dedupe key comes from (see [`MessageIdConfig`]). Default `{ header = "event_id" }`.
    #[serde(default)]
    pub message_id: MessageIdConfig,
    /// Picks the dedupe ledger's daily partition. Default `auto`.
    #[serde(default)]
    pub event_date: EventDateSource,
    /// A record whose value is null (a compacted topic's delete): `park` (the default) or
    /// `skip` (counted in `effectively_records_skipped_total`, the offset moves, nothing
    /// applied).
    #[serde(default)]
    pub on_tombstone: OnTombstone,
    /// A bigger payload is parked as oversized instead of reaching the handler. Default 1 MiB
    /// (librdkafka's message.max.bytes is 1000000, but for a whole message set).
    #[serde(default = "default_max_payload_bytes")]
    pub max_payload_bytes: usize,
    #[serde(default)]
    pub retry: RetryConfig,
    /// A batch still not committed after this long, retrying whatever the cause, is a stall:
    /// its partition's `effectively_partition_stalled` gauge goes to 1 (an alert, the console
    /// marks it) until the batch ends. Also an inbox processor whose round has not succeeded
    /// for this long (one waiting on a lock, or rounds failing again and again). Default 1
    /// minute.
    #[serde(default = "default_stall_after", with = "humantime_serde")]
    pub stall_after: Duration,
    /// How long dedupe keys are kept: the latest a copy can arrive and still be recognised.
    /// Default 15 days, the seed's SQS-with-DLQ figure.
    #[serde(default = "default_retention", with = "humantime_serde")]
    pub retention: Duration,
    /// Events dated further in the future are parked: a bad clock or field would otherwise
    /// create dedupe partitions nobody drops. Default 1 day.
    #[serde(default = "default_future_tolerance", with = "humantime_serde")]
    pub future_tolerance: Duration,
    /// Daily dedupe partitions created ahead of today. Default 3.
    #[serde(default = "default_partitions_ahead")]
    pub partitions_ahead: u32,
    /// `[consumer.inbox]`, read when `strategy = "inbox"`.
    #[serde(default)]
    pub inbox: InboxConfig,
    /// `[consumer.version]`: versioned writes (see `crate::version`). Off by default.
    #[serde(default)]
    pub version: Option<VersionConfig>,
    /// `[consumer.prefilter]`: a Redis lookup before the transaction that skips keys already
    /// committed (see `crate::prefilter`). Off by default; not with the inbox strategy.
    #[serde(default)]
    pub prefilter: Option<PrefilterConfig>,
    /// `[consumer.payload]`: JSON (the default), or Avro, Protobuf or JSON Schema through a
    /// Schema Registry (see `crate::envelope::format`).
    #[serde(default)]
    pub payload: PayloadConfig,
    /// Messages a second this consumer takes across each worker's partitions, for a replay that
    /// must not swamp a shared primary. Each worker holds its own rate: two workers read up to
    /// twice it. `effectively throttle` overrides it at run time. Default: no limit.
    #[serde(default)]
    pub max_rate: Option<u32>,
    /// How many messages may go at once above `max_rate` after a quiet spell (the token
    /// bucket's size). Default: half a second's worth, at least 1.
    #[serde(default)]
    pub max_rate_burst: Option<u32>,
}

fn default_max_payload_bytes() -> usize {
    1_048_576
}
fn default_retention() -> Duration {
    15 * DAY
}
fn default_future_tolerance() -> Duration {
    DAY
}
fn default_stall_after() -> Duration {
    Duration::from_secs(60)
}
fn default_partitions_ahead() -> u32 {
    3
}
/// A rate limit: `max_rate` and its burst, or one set at run time (`effectively throttle`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Throttle {
    /// Messages a second, across each worker's partitions of the consumer.
    pub max_rate: f64,
    /// The token bucket's size: what may go at once after a quiet spell.
    pub burst: u32,
}

/// Half a second's worth of `rate`, at least 1. Tokens that arrive while the bucket is full are
/// lost, and a worker's tasks take theirs between commits: a bucket shorter than a commit
/// (a tenth of a second was, on a loaded machine) loses tokens and the consumer runs below its
/// rate. Half a second covers a slow commit; the sustained rate is the same.
pub fn default_burst(rate: f64) -> u32 {
    ((rate / 2.0).ceil() as u32).max(1)
}
fn default_rate_bp() -> u32 {
    200
}

impl ConsumerConfig {
    /// How this consumer makes its dedupe keys, as recorded in `consumer_keys`: the settings
    /// that, changed, would give the same event another key.
    pub fn keys_made_by(&self) -> String {
        match self.envelope {
            EnvelopeKind::CloudEvents => "envelope = \"cloudevents\" (source and id, time)".into(),
            EnvelopeKind::Plain => format!(
                "message_id = {}, event_date = \"{}\"",
                self.message_id, self.event_date
            ),
        }
    }

    /// `max_rate` and its burst, when set.
    pub fn rate_limit(&self) -> Option<Throttle> {
        self.max_rate.map(|r| Throttle {
            max_rate: f64::from(r),
            burst: self
                .max_rate_burst
                .unwrap_or_else(|| default_burst(f64::from(r))),
        })
    }

    /// The name of this consumer's database: `database`, else [`DEFAULT_DATABASE`].
    pub fn database_name(&self) -> &str {
        self.database.as_deref().unwrap_or(DEFAULT_DATABASE)
    }

    /// The Kafka consumer group: `group` if set, else `name`.
    pub fn group_id(&self) -> &str {
        self.group.as_deref().unwrap_or(&self.name)
    }

    /// Whether this consumer commits in groups (`batch.group_partitions`): as set, or when unset,
    /// wherever groups apply: the batch strategy, without `[consumer.version]` (whose batches
    /// apply versions one partition at a time) or `[consumer.prefilter]` (whose pipeline marks
    /// one partition's keys after its commit).
    pub fn commit_groups(&self) -> bool {
        let applies =
            self.strategy == Strategy::Batch && self.version.is_none() && self.prefilter.is_none();
        self.batch.group_partitions.unwrap_or(applies)
    }
}

/// How records are grouped into PostgreSQL transactions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// One transaction per partition batch: the throughput path.
    #[default]
    Batch,
    /// One transaction per record, for handlers that cannot work on a set.
    PerMessage,
    /// Store first, process later: the receiver stores each batch in the `inbox` table and
    /// lets Kafka move on; processors apply the effects from the table (`[consumer.inbox]`).
    Inbox,
}

/// Where a consumer keeps its messages' keys (`dedupe = "ledger" | "business-row"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Dedupe {
    /// The dedupe ledger, `processed_messages`: a key row a message, in the effect's
    /// transaction; the effect sees only the messages whose key was new.
    #[default]
    Ledger,
    /// The seed's option for a message that creates exactly one business row: the key lives on
    /// that row (its unique key, such as the cashback handler's `payment_id`), the handler
    /// inserts with `ON CONFLICT DO NOTHING` and a copy finds its row there. No ledger row, no
    /// retention: a copy is recognised as long as the row exists. The offset is fenced as ever.
    BusinessRow,
}

/// Where a partition with no offset in PostgreSQL starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OffsetReset {
    #[default]
    Earliest,
    Latest,
}

impl OffsetReset {
    /// The value for librdkafka's `auto.offset.reset`.
    pub fn as_librdkafka(&self) -> &'static str {
        match self {
            OffsetReset::Earliest => "earliest",
            OffsetReset::Latest => "latest",
        }
    }
}

/// `on_offset_out_of_range`: where a partition goes when its stored offset is outside the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutOfRange {
    /// Consume nothing of the partition (it stays assigned), log an error and raise the
    /// `effectively_offset_out_of_range` gauge until an operator acts.
    #[default]
    Stop,
    /// Go to the log start (re-reads what is there; the dedupe keys skip what was applied).
    Earliest,
    /// Go to the log end (skips what is there).
    Latest,
}

impl OutOfRange {
    pub fn as_str(&self) -> &'static str {
        match self {
            OutOfRange::Stop => "stop",
            OutOfRange::Earliest => "earliest",
            OutOfRange::Latest => "latest",
        }
    }
}

/// `[consumer.batch]`: when a partition's batch is cut.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchConfig {
    pub max_messages: usize,
    /// The sum of payload sizes.
    pub max_bytes: usize,
    /// The longest a batch waits for more records while more are arriving; a batch is flushed
    /// at once when nothing more is waiting, so a quiet topic pays no latency.
    #[serde(with = "humantime_serde")]
    pub linger: Duration,
    /// While a partition has a backlog (a batch filled up and more records were waiting), the
    /// count bound doubles per batch up to this, and falls back to `max_messages` as soon as a
    /// batch empties the queue: fewer, larger transactions when catching up, no latency cost
    /// when quiet. Default 1,000: no growth (larger batches hold more memory, and did not pay
    /// off measurably here, see docs/PERFORMANCE.md). Values below `max_messages` mean no growth.
    pub backlog_max_messages: usize,
    /// Commit groups: the small batches of several partitions of a topic share one transaction
    /// (each partition still fenced on its own row), so a topic of many quiet partitions does not
    /// pay one `COMMIT` per record; see `strategy::group`. Unset: on wherever they apply (the
    /// batch strategy without `[consumer.version]` or `[consumer.prefilter]`, see
    /// [`ConsumerConfig::commit_groups`]): `make bench` measured them better in p50 and p99 at 60
    /// and 300 partitions, with one worker and two, and no worse past noise at 6
    /// (docs/PERFORMANCE.md). `false` turns them off; `true` where they do not apply is refused.
    pub group_partitions: Option<bool>,
    /// Group transactions in flight at once, per topic and worker. Default 1: the next group
    /// carries everything that arrived while one commits, the fewest transactions for the
    /// records (measured best for latency as well as PostgreSQL's CPU, docs/PERFORMANCE.md).
    /// Raise it when one transaction at a time cannot keep up with the topic.
    pub group_connections: usize,
    /// A group closes at this many records; a batch larger than it commits on its own.
    pub group_max_records: usize,
}

impl Default for BatchConfig {
    fn default() -> Self {
        BatchConfig {
            max_messages: 1000,
            max_bytes: 4 * 1024 * 1024,
            linger: Duration::from_millis(5),
            backlog_max_messages: 1000,
            group_partitions: None,
            group_connections: 1,
            group_max_records: 1000,
        }
    }
}

/// Where an event's date, which picks its dedupe partition, is read from. Never the processing
/// date: every copy of one event must land in the same partition to meet the same key.
/// TOML: `"auto"`, `"uuid7"`, or a JSON pointer such as `"/occurred_at"`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EventDateSource {
    /// The payload's `/occurred_at` (RFC 3339) if present, else the UUIDv7 message id's time.
    #[default]
    Auto,
    /// The timestamp inside a UUIDv7 message id.
    Uuid7,
    /// An RFC 3339 string at this JSON pointer in the payload.
    JsonPointer(String),
}

impl FromStr for EventDateSource {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(EventDateSource::Auto),
            "uuid7" => Ok(EventDateSource::Uuid7),
            p if p.starts_with('/') => Ok(EventDateSource::JsonPointer(p.into())),
            other => Err(format!(
                "event_date {other:?} must be \"auto\", \"uuid7\" or a JSON pointer starting \
                 with \"/\" (did you mean \"/{other}\"?)"
            )),
        }
    }
}

impl<'de> Deserialize<'de> for EventDateSource {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl fmt::Display for EventDateSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            EventDateSource::Auto => "auto",
            EventDateSource::Uuid7 => "uuid7",
            EventDateSource::JsonPointer(p) => p,
        })
    }
}

/// How a consumer reads its records (`envelope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EnvelopeKind {
    /// The value is the message; its id and date come from `message_id` and `event_date`.
    #[default]
    Plain,
    /// CloudEvents 1.0 over Kafka, binary or structured mode, detected per record.
    #[serde(rename = "cloudevents")]
    CloudEvents,
}

/// What a consumer does with a tombstone (a record whose value is null).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTombstone {
    /// Parked in `dead_letters` with reason `tombstone`: an effect without content is almost
    /// always a producer bug, and a consumer that did not choose is told.
    #[default]
    Park,
    /// Passed over and counted: the partition's offset moves past it, nothing is applied.
    Skip,
}

/// `[consumer.retry]`: transient failures (deadlocks, lost connections) of one batch.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts before the batch's messages are isolated and the failing ones parked, so that
    /// one poison message cannot stall its partition forever.
    pub max_attempts: u32,
    #[serde(with = "humantime_serde")]
    pub initial_backoff: Duration,
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
        }
    }
}

/// The effect applied to a batch's fresh (never applied before) messages, tagged by `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum HandlerConfig {
    /// The built-in cashback example; `rate_bp` in basis points (200 = 2%).
    Cashback {
        #[serde(default = "default_rate_bp")]
        rate_bp: u32,
        /// Record a notification on this channel with every credit (`effectively send`
        /// delivers it).
        #[serde(default)]
        notify: Option<String>,
    },
    /// One SQL statement run in the batch transaction, reading the table `fresh_messages`.
    Sql { statement: String },
    /// A handler registered in Rust by a library user under this name.
    Custom { name: String },
    /// The built-in versioned example: the last status of each order in `order_status_view`
    /// (needs `[consumer.version]`).
    #[serde(rename = "order-status")]
    OrderStatus {
        /// JSON pointer to the status in the payload.
        #[serde(default = "default_status_pointer")]
        status: String,
    },
}

fn default_status_pointer() -> String {
    "/status".into()
}

/// `[A-Za-z0-9._-]` with a length in `1..=max`: Kafka's rule for topic names, reused for
/// consumer names so that they need no quoting in logs, metrics and operators' queries.
fn valid_name(s: &str, max: usize) -> bool {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
    (1..=max).contains(&s.len()) && s.bytes().all(allowed)
}

impl ConsumerConfig {
    /// This consumer's problems, without the `consumer "name": ` prefix.
    pub(super) fn problems(&self) -> Vec<String> {
        let (batch, retry) = (&self.batch, &self.retry);
        let mut p = Vec::new();
        if !valid_name(&self.name, 100) {
            p.push("name must be 1 to 100 characters of A-Z a-z 0-9 . _ -".into());
        }
        if self.topics.is_empty() {
            p.push("topics must list at least one topic".into());
        }
        if self.stall_after < Duration::from_secs(1) {
            p.push("stall_after must be at least 1s: every batch would read as a stall".into());
        }
        if batch.max_messages < 1 {
            p.push("batch.max_messages must be at least 1".into());
        }
        if batch.max_bytes < 1 {
            p.push("batch.max_bytes must be at least 1".into());
        }
        if self.commit_groups() && (batch.group_connections < 1 || batch.group_max_records < 1) {
            p.push("batch.group_connections and batch.group_max_records must be at least 1".into());
        }
        let asked = batch.group_partitions == Some(true);
        if asked && self.strategy != Strategy::Batch {
            p.push("batch.group_partitions works with strategy = \"batch\" only".into());
        }
        if asked && (self.version.is_some() || self.prefilter.is_some()) {
            p.push(
                "batch.group_partitions does not combine with [consumer.version] or [consumer.prefilter] \
                 (their batches commit one partition at a time)"
                    .into(),
            );
        }
        if self.dedupe == Dedupe::BusinessRow {
            if self.strategy != Strategy::Batch {
                p.push("dedupe = \"business-row\" works with strategy = \"batch\" only".into());
            }
            if self.version.is_some() || self.prefilter.is_some() {
                p.push(
                    "dedupe = \"business-row\" does not combine with [consumer.version] or \
                     [consumer.prefilter] (both work on the ledger's keys)"
                        .into(),
                );
            }
            if !matches!(
                self.handler,
                HandlerConfig::Cashback { .. } | HandlerConfig::Custom { .. }
            ) {
                p.push(
                    "dedupe = \"business-row\" needs a handler that writes one row a message under \
                     a unique key (the cashback handler, or a custom one that says so): an SQL \
                     handler reads only the fresh messages from the ledger"
                        .into(),
                );
            }
        }
        if retry.max_attempts < 1 {
            p.push("retry.max_attempts must be at least 1".into());
        }
        match self.max_rate {
            Some(0) => p.push("max_rate must be at least 1 message a second".into()),
            None if self.max_rate_burst.is_some() => p.push("max_rate_burst needs max_rate".into()),
            _ => {}
        }
        if self.max_rate_burst == Some(0) {
            p.push("max_rate_burst must be at least 1".into());
        }
        if self.strategy == Strategy::Inbox {
            p.extend(self.inbox.problems());
        }
        if let Some(v) = &self.version {
            p.extend(v.problems());
        }
        if let Some(f) = &self.prefilter {
            p.extend(f.problems(self.retention));
            if self.strategy == Strategy::Inbox {
                p.push(
                    "prefilter does not apply to strategy = \"inbox\": the receiver's insert into \
                     the inbox is its dedupe, and a stored row's key must follow the inbox's own \
                     life (done = \"delete\", replays); remove [consumer.prefilter]"
                        .into(),
                );
            }
        }
        p.extend(self.payload.problems());
        if matches!(self.handler, HandlerConfig::OrderStatus { .. }) && self.version.is_none() {
            p.push(
                "handler kind \"order-status\" needs [consumer.version] (aggregate, version, mode)"
                    .into(),
            );
        }
        if self.partitions_ahead > 60 {
            p.push("partitions_ahead must be at most 60".into());
        }
        for t in &self.topics {
            if !valid_name(t, 249) || t == "." || t == ".." {
                p.push(format!("topics: {t:?} is not a valid Kafka topic name (1 to 249 characters of A-Z a-z 0-9 . _ -)"));
            }
        }
        match &self.handler {
            HandlerConfig::Cashback { rate_bp, .. } if *rate_bp > 10_000 => p.push(format!(
                "handler.rate_bp ({rate_bp}) must be at most 10000 (100%)"
            )),
            HandlerConfig::Sql { statement } if statement.trim().is_empty() => {
                p.push("handler.statement must not be empty".into())
            }
            HandlerConfig::Custom { name } if name.trim().is_empty() => {
                p.push("handler.name must not be empty".into())
            }
            _ => {}
        }
        match &self.message_id.source {
            MessageIdSource::Header(h) if h.is_empty() => {
                p.push("message_id.header must not be empty".into())
            }
            MessageIdSource::JsonPointer(ptr) if !ptr.starts_with('/') => p.push(format!(
                "message_id.json_pointer {ptr:?} must start with \"/\""
            )),
            _ => {}
        }
        if self.envelope == EnvelopeKind::CloudEvents
            && (self.message_id != MessageIdConfig::default()
                || self.event_date != EventDateSource::Auto)
        {
            p.push(
                "envelope = \"cloudevents\" takes the dedupe key from the event's source and id \
                 and the date from its time: leave message_id and event_date out"
                    .into(),
            );
        }
        // A text id has no time in it, and the ledger's daily partition must come from the
        // event: the processing date would put a copy redelivered after midnight in another
        // partition, where the unique key cannot meet the first copy. Nor the Kafka timestamp:
        // a relay's resend gets a new one. "auto" would fall back to the id's UUIDv7 time.
        if self.message_id.is_text() && !matches!(self.event_date, EventDateSource::JsonPointer(_))
        {
            p.push(format!(
                "event_date = \"{}\" cannot date a consumer whose message_id is text ({}): a \
                 text id carries no time, so event_date must name the event's own time in the \
                 payload (event_date = \"/occurred_at\"); a processing date would let a copy \
                 redelivered after midnight land in another daily partition and escape the \
                 unique key",
                self.event_date, self.message_id
            ));
        }
        if retry.max_backoff < retry.initial_backoff {
            p.push(format!(
                "retry.max_backoff ({}) must be at least retry.initial_backoff ({})",
                format_duration(retry.max_backoff),
                format_duration(retry.initial_backoff)
            ));
        }
        if self.retention <= DAY {
            p.push(format!(
                "retention ({}) must be more than 1 day: whole daily partitions are dropped, so \
                 a shorter retention would forget keys from yesterday",
                format_duration(self.retention)
            ));
        }
        p
    }
}
