//! The typed configuration: `effectively.toml`, then environment overrides, then the
//! cross-field checks, all before any connection is opened, so that a bad value fails
//! `check-config` rather than a rebalance in production.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use humantime_serde::re::humantime::format_duration;
use serde::{Deserialize, Deserializer};

mod console;
mod inbox;
pub mod kafka_security;
mod prefilter;
mod relay;
mod sender;
mod tls;
mod version;
pub use console::{check_addr as check_console_addr, ConsoleConfig, DEFAULT_CONSOLE_ADDR};
pub use inbox::{ClaimMode, DoneRows, InboxConfig, OrderingKey};
pub use kafka_security::{KafkaSasl, KafkaTls, SaslMechanism};
pub use prefilter::{PrefilterConfig, Ttl};
pub use relay::{Published, RelayConfig};
pub use sender::{ChannelConfig, OnInterrupted, SenderConfig};
pub use tls::{without_tls_params, Tls, TlsConfig, TlsMode};
pub use version::{VersionConfig, VersionMode};

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// Why a configuration was refused; each message names the key or variable to fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The TOML error's text carries the line and column.
    #[error("invalid configuration file: {0}")]
    Parse(#[from] toml::de::Error),
    #[error("invalid configuration: {0}")]
    Invalid(String),
    #[error("environment variable {name}: {reason}")]
    Env { name: String, reason: String },
}

/// The top level of `effectively.toml`. Every section but `[[consumer]]` may be left out.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub kafka: KafkaConfig,
    /// Optional as a whole: the URL usually comes from `DATABASE_URL`.
    #[serde(default)]
    pub database: DatabaseConfig,
    #[serde(default)]
    pub worker: WorkerConfig,
    /// `[[consumer]]`. Defaults to empty so that `validate` can say what is missing.
    #[serde(rename = "consumer", default)]
    pub consumers: Vec<ConsumerConfig>,
    /// `[relay]`: the outbox relay's settings (`effectively relay`).
    #[serde(default)]
    pub relay: Option<RelayConfig>,
    /// `[sender]`: the notification sender's settings (`effectively send`).
    #[serde(default)]
    pub sender: Option<SenderConfig>,
    /// `[console]`: the web console's settings (`effectively console`); absent, its defaults.
    #[serde(default)]
    pub console: Option<ConsoleConfig>,
}

/// `[kafka]`. `Debug` is by hand so that credentials in `options` are never printed.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KafkaConfig {
    /// `bootstrap.servers`; overridden by `KAFKA_BROKERS`.
    pub brokers: String,
    /// How long the group coordinator waits to hear from this member before evicting it.
    #[serde(with = "humantime_serde")]
    pub session_timeout: Duration,
    /// The longest gap between two polls before librdkafka leaves the group on our behalf.
    #[serde(with = "humantime_serde")]
    pub max_poll_interval: Duration,
    /// `[kafka.tls]`: TLS to the brokers (see `kafka_security`).
    pub tls: Option<KafkaTls>,
    /// `[kafka.sasl]`: SASL authentication (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512).
    pub sasl: Option<KafkaSasl>,
    /// `[kafka.options]`: raw librdkafka properties (tuning), passed through; they override
    /// the engine's own.
    pub options: BTreeMap<String, String>,
}

impl KafkaConfig {
    /// A librdkafka client config with the brokers, the security settings and the raw
    /// options (applied last): what every Kafka client of the engine starts from. `defaults`
    /// are the caller's own properties, which the raw options may override.
    pub fn client_config(
        &self,
        defaults: &[(&str, String)],
    ) -> Result<rdkafka::ClientConfig, String> {
        let mut c = rdkafka::ClientConfig::new();
        c.set("bootstrap.servers", &self.brokers);
        for (k, v) in kafka_security::properties(self.tls.as_ref(), self.sasl.as_ref())? {
            c.set(k, v);
        }
        for (k, v) in defaults {
            c.set(*k, v);
        }
        for (k, v) in &self.options {
            c.set(k, v);
        }
        Ok(c)
    }
}

impl Default for KafkaConfig {
    fn default() -> Self {
        KafkaConfig {
            brokers: "127.0.0.1:9092".into(),         // the local stack's broker
            session_timeout: Duration::from_secs(45), // librdkafka session.timeout.ms 45000
            max_poll_interval: Duration::from_secs(300), // librdkafka max.poll.interval.ms 300000
            tls: None,
            sasl: None,
            options: BTreeMap::new(),
        }
    }
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let secret = |k: &str| {
            let k = k.to_ascii_lowercase();
            ["password", "secret", "sasl.oauthbearer", "ssl.key.pem"]
                .iter()
                .any(|s| k.contains(s))
        };
        let options: BTreeMap<&str, &str> = (self.options.iter())
            .map(|(k, v)| (k.as_str(), if secret(k) { "***" } else { v.as_str() }))
            .collect();
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("session_timeout", &self.session_timeout)
            .field("max_poll_interval", &self.max_poll_interval)
            .field("tls", &self.tls)
            .field("sasl", &self.sasl)
            .field("options", &options)
            .finish()
    }
}

/// `[database]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Overridden by `DATABASE_URL`; printed without its password.
    pub url: Secret,
    /// Shared by every partition's transactions; overridden by `EFFECTIVELY_POOL_SIZE`.
    pub pool_size: usize,
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// PostgreSQL's `idle_in_transaction_session_timeout`: the server ends the session (and
    /// releases the locks) of a zombie worker left inside a transaction.
    #[serde(with = "humantime_serde")]
    pub idle_in_transaction_timeout: Duration,
    /// The longest one transaction attempt (a batch's, a claim's, an inbox round's) waits for
    /// PostgreSQL before its connection is dropped and the attempt retried on a new one. A
    /// frozen server (SIGSTOP, a hung VM) still has its kernel acknowledge every packet, so
    /// neither TCP keepalives nor the TCP user timeout notice it: only a deadline does. Above
    /// the slowest batch the handler may legitimately take.
    #[serde(with = "humantime_serde")]
    pub transaction_deadline: Duration,
    /// `[database.tls]` (or `tls = { mode = "verify-full", ca_file = "..." }`): libpq's
    /// `sslmode` semantics; the URL's `sslmode`/`sslrootcert` work too.
    pub tls: TlsConfig,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        DatabaseConfig {
            url: Secret::new("postgres://postgres@127.0.0.1:5432/effectively"), // the local stack
            pool_size: 16,
            connect_timeout: Duration::from_secs(5),
            idle_in_transaction_timeout: Duration::from_secs(60),
            transaction_deadline: Duration::from_secs(30),
            tls: TlsConfig::default(), // libpq's sslmode=prefer
        }
    }
}

/// `[worker]`: this process.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Recorded as the owner of the partitions it holds; see [`Config::worker_id`].
    pub id: Option<String>,
    /// The longest the engine spends finishing in-flight batches when partitions are revoked.
    #[serde(with = "humantime_serde")]
    pub revoke_deadline: Duration,
    /// The longest a graceful shutdown waits for in-flight batches.
    #[serde(with = "humantime_serde")]
    pub shutdown_deadline: Duration,
    /// Where to serve metrics; `None` serves none.
    pub metrics_addr: Option<SocketAddr>,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            id: None,
            revoke_deadline: Duration::from_secs(20), // well under the 45s session timeout
            shutdown_deadline: Duration::from_secs(30),
            metrics_addr: None,
        }
    }
}

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
    #[serde(default)] // batch
    pub strategy: Strategy,
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
    #[serde(default = "default_message_id")] // { header = "event_id" }
    pub message_id: MessageIdSource,
    /// Picks the dedupe ledger's daily partition. Default `auto`.
    #[serde(default)]
    pub event_date: EventDateSource,
    /// A bigger payload is parked as oversized instead of reaching the handler. Default 1 MiB
    /// (librdkafka's message.max.bytes is 1000000, but for a whole message set).
    #[serde(default = "default_max_payload_bytes")]
    pub max_payload_bytes: usize,
    #[serde(default)]
    pub retry: RetryConfig,
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
}

fn default_message_id() -> MessageIdSource {
    MessageIdSource::Header("event_id".into())
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
fn default_partitions_ahead() -> u32 {
    3
}
fn default_rate_bp() -> u32 {
    200
}

impl ConsumerConfig {
    /// The Kafka consumer group: `group` if set, else `name`.
    pub fn group_id(&self) -> &str {
        self.group.as_deref().unwrap_or(&self.name)
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
    /// pay one `COMMIT` per record. Off by default; see `strategy::group`.
    pub group_partitions: bool,
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
            group_partitions: false,
            group_connections: 1,
            group_max_records: 1000,
        }
    }
}

/// Where a record's message id (the dedupe key, a UUID) is read from.
/// TOML: `message_id = { header = "event_id" }` or `message_id = { json_pointer = "/event_id" }`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MessageIdSource {
    Header(String),
    JsonPointer(String),
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

/// A connection string whose `Debug` and `Display` hide the password, so that `{:?}` of a whole
/// [`Config`] is safe to log; [`Secret::expose`] gives the real value.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The real value, for the one place that connects.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&redact(&self.0), f)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&redact(&self.0))
    }
}

/// Hides the password of `scheme://user:password@host...`, and any `password=value` (a URL
/// query parameter, or a libpq key/value string). The *last* `@` ends the user info, so that a
/// password holding `/` or `@` is hidden too: when unsure, this hides too much, never too little.
fn redact(s: &str) -> String {
    let mut url = s.to_string();
    if let Some((scheme, rest)) = s.split_once("://") {
        if let Some(at) = rest.rfind('@') {
            if let Some((user, _)) = rest[..at].split_once(':') {
                url = format!("{scheme}://{user}:***{}", &rest[at..]);
            }
        }
    }
    let (mut out, mut rest) = (String::new(), url.as_str());
    while let Some(i) = rest.find("password=") {
        let (head, value) = rest.split_at(i + "password=".len());
        let end = match value.strip_prefix('\'') {
            Some(quoted) => quoted.find('\'').map_or(value.len(), |j| j + 2),
            None => (value.find(|c: char| c == '&' || c.is_whitespace())).unwrap_or(value.len()),
        };
        out.push_str(head);
        out.push_str("***");
        rest = &value[end..];
    }
    out + rest
}

impl Config {
    /// Parses and validates `text`, without environment overrides.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let config: Config = toml::from_str(text)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads `path`, applies the environment overrides, and validates.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with_env(path, |name| std::env::var(name).ok())
    }

    /// [`Config::load`] with the environment as a lookup, so that tests need not change the
    /// process's environment (which other test threads read).
    ///
    /// Overrides: `KAFKA_BROKERS`, `DATABASE_URL`, `EFFECTIVELY_WORKER_ID` and
    /// `EFFECTIVELY_POOL_SIZE`. An empty variable counts as unset, because a compose file's
    /// `${VAR:-}` would otherwise wipe a configured value.
    pub fn load_with_env<F>(path: &Path, env: F) -> Result<Config, ConfigError>
    where
        F: Fn(&str) -> Option<String>,
    {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config: Config = toml::from_str(&text)?;
        let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        if let Some(v) = var("KAFKA_BROKERS") {
            config.kafka.brokers = v;
        }
        if let Some(v) = var("DATABASE_URL") {
            config.database.url = Secret(v);
        }
        if let Some(v) = var("EFFECTIVELY_WORKER_ID") {
            config.worker.id = Some(v);
        }
        if let Some(v) = var("EFFECTIVELY_POOL_SIZE") {
            config.database.pool_size = v.trim().parse().map_err(|e| ConfigError::Env {
                name: "EFFECTIVELY_POOL_SIZE".into(),
                reason: format!("{v:?} is not a connection count: {e}"),
            })?;
        }
        config.validate()?;
        Ok(config)
    }

    /// The checks serde cannot express. Reports every problem at once, separated by `; `.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let (kafka, worker) = (&self.kafka, &self.worker);
        let mut problems = Vec::new();
        if worker.revoke_deadline >= kafka.session_timeout {
            problems.push(format!(
                "worker.revoke_deadline ({}) must be less than kafka.session_timeout ({}): the \
                 rebalance callback must return before the group coordinator gives up on this \
                 member",
                format_duration(worker.revoke_deadline),
                format_duration(kafka.session_timeout)
            ));
        }
        if kafka.session_timeout > kafka.max_poll_interval {
            problems.push(format!(
                "kafka.session_timeout ({}) must not exceed kafka.max_poll_interval ({}), as \
                 librdkafka requires",
                format_duration(kafka.session_timeout),
                format_duration(kafka.max_poll_interval)
            ));
        }
        // Reads the SASL password and checks the certificate files now: a missing one fails at
        // start, not at the first connection.
        if let Err(e) = kafka_security::properties(kafka.tls.as_ref(), kafka.sasl.as_ref()) {
            problems.push(e);
        }
        if self.database.pool_size < 1 {
            problems.push("database.pool_size must be at least 1".into());
        }
        if self.database.transaction_deadline < Duration::from_secs(1) {
            problems.push("database.transaction_deadline must be at least 1s".into());
        }
        if let Err(e) = self.database.tls.resolve(self.database.url.expose()) {
            problems.push(e);
        }
        if self.consumers.is_empty()
            && self.relay.is_none()
            && self.sender.is_none()
            && self.console.is_none()
        {
            problems.push(
                "at least one [[consumer]] (or a [relay], [sender] or [console]) is required"
                    .into(),
            );
        }
        if let Some(r) = &self.relay {
            problems.extend(r.problems());
        }
        if let Some(s) = &self.sender {
            problems.extend(s.problems());
        }
        if let Some(c) = &self.console {
            problems.extend(c.problems());
        }
        // Each processor holds a connection for its whole round; the receivers, maintenance and
        // the gauges need theirs too, or they wait for a processor to finish.
        let processors: usize = (self.consumers.iter())
            .filter(|c| c.strategy == Strategy::Inbox)
            .map(|c| c.inbox.processors)
            .sum();
        if processors > 0 && self.database.pool_size < processors + 2 {
            problems.push(format!(
                "database.pool_size ({}) must be at least the inbox processors of all consumers \
                 ({processors}) plus 2: each processor holds a connection while it works",
                self.database.pool_size
            ));
        }
        let mut names = HashSet::new();
        for c in &self.consumers {
            if !names.insert(&c.name) {
                problems.push(format!(
                    "consumer {:?} is defined twice: names are dedupe scopes, so must be unique",
                    c.name
                ));
            }
            for p in c.problems() {
                problems.push(format!("consumer {:?}: {p}", c.name));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }

    /// `worker.id` if set, else `<hostname>-<pid>`: unique per running process, and readable
    /// by an operator looking at who owns a partition.
    pub fn worker_id(&self) -> String {
        if let Some(id) = &self.worker.id {
            return id.clone();
        }
        let host = hostname::get().map_or_else(
            |_| "unknown-host".into(),
            |h| h.to_string_lossy().into_owned(),
        );
        format!("{host}-{}", std::process::id())
    }
}

/// `[A-Za-z0-9._-]` with a length in `1..=max`: Kafka's rule for topic names, reused for
/// consumer names so that they need no quoting in logs, metrics and operators' queries.
fn valid_name(s: &str, max: usize) -> bool {
    let allowed = |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-');
    (1..=max).contains(&s.len()) && s.bytes().all(allowed)
}

impl ConsumerConfig {
    /// This consumer's problems, without the `consumer "name": ` prefix.
    fn problems(&self) -> Vec<String> {
        let (batch, retry) = (&self.batch, &self.retry);
        let mut p = Vec::new();
        if !valid_name(&self.name, 100) {
            p.push("name must be 1 to 100 characters of A-Z a-z 0-9 . _ -".into());
        }
        if self.topics.is_empty() {
            p.push("topics must list at least one topic".into());
        }
        if batch.max_messages < 1 {
            p.push("batch.max_messages must be at least 1".into());
        }
        if batch.max_bytes < 1 {
            p.push("batch.max_bytes must be at least 1".into());
        }
        if batch.group_partitions && (batch.group_connections < 1 || batch.group_max_records < 1) {
            p.push("batch.group_connections and batch.group_max_records must be at least 1".into());
        }
        if batch.group_partitions && self.strategy != Strategy::Batch {
            p.push("batch.group_partitions works with strategy = \"batch\" only".into());
        }
        if batch.group_partitions && (self.version.is_some() || self.prefilter.is_some()) {
            p.push(
                "batch.group_partitions does not combine with [consumer.version] or [consumer.prefilter] \
                 (their batches commit one partition at a time)"
                    .into(),
            );
        }
        if retry.max_attempts < 1 {
            p.push("retry.max_attempts must be at least 1".into());
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
        match &self.message_id {
            MessageIdSource::Header(h) if h.is_empty() => {
                p.push("message_id.header must not be empty".into())
            }
            MessageIdSource::JsonPointer(ptr) if !ptr.starts_with('/') => p.push(format!(
                "message_id.json_pointer {ptr:?} must start with \"/\""
            )),
            _ => {}
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

/// A complete, commented `effectively.toml`. Every value shown is the default unless its
/// comment says otherwise.
pub const EXAMPLE: &str = r#"# effectively.toml
# Environment overrides: KAFKA_BROKERS, DATABASE_URL, EFFECTIVELY_WORKER_ID, EFFECTIVELY_POOL_SIZE.
# Durations are humantime strings: "5ms", "45s", "5m", "15days".

[kafka]
brokers = "127.0.0.1:9092"
# The group coordinator evicts a member silent this long (librdkafka session.timeout.ms).
session_timeout = "45s"
# The longest gap between polls before librdkafka leaves the group (max.poll.interval.ms).
max_poll_interval = "5m"

# TLS to the brokers (security.protocol ssl, or sasl_ssl with [kafka.sasl]); no CA file: the
# system's CAs. Client certificate optional.
# [kafka.tls]
# ca_file = "/etc/effectively/kafka-ca.pem"
# cert_file = "/etc/effectively/client.pem"
# key_file = "/etc/effectively/client.key"
# verify_hostname = true
# SASL: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512; the password from a variable or a file, never
# from this file, and never printed.
# [kafka.sasl]
# mechanism = "SCRAM-SHA-512"
# username = "effectively"
# password_env = "KAFKA_PASSWORD"   # or password_file = "/run/secrets/kafka-password"

# Raw librdkafka properties, passed through (they win over the fields above); values of keys
# naming a password or secret are never printed. (Not a default: the default is no options.)
[kafka.options]
"client.id" = "effectively"

[database]
# A password here (or in DATABASE_URL) is never printed.
url = "postgres://postgres@127.0.0.1:5432/effectively"
pool_size = 16
connect_timeout = "5s"
# PostgreSQL ends the session of a zombie worker left inside a transaction after this long.
idle_in_transaction_timeout = "1m"
# A transaction attempt that PostgreSQL has not answered within this (a frozen primary) is
# abandoned on a new connection; keep it above the slowest batch the handler may take.
transaction_deadline = "30s"
# libpq's sslmode: "disable", "prefer" (TLS if offered, nothing verified), "require" (TLS,
# nothing verified), "verify-ca" (the chain must lead to ca_file), "verify-full" (and the
# certificate must name the URL's host: the mode for production). The URL's ?sslmode= and
# &sslrootcert= are read too. Default: the URL's sslmode, else "prefer".
# tls = { mode = "verify-full", ca_file = "/etc/effectively/db-ca.pem" }

[worker]
# id = "worker-1"   # default "<hostname>-<pid>"
# Must be less than kafka.session_timeout: revocation must finish before the coordinator
# gives up on this member.
revoke_deadline = "20s"
shutdown_deadline = "30s"
# metrics_addr = "127.0.0.1:9464"   # `effectively run` serves /metrics here by default
#                                   # (--metrics-addr overrides it, or `off`)

# Credits 2% cashback for every payment, a batch of fresh messages per transaction.
[[consumer]]
name = "rewards"            # the dedupe scope, and the Kafka group unless `group` is set
topics = ["payments"]
strategy = "batch"          # or "per-message", or "inbox" (see the last consumer)
handler = { kind = "cashback", rate_bp = 200 }
auto_offset_reset = "earliest"   # only for partitions PostgreSQL has no offset for
on_offset_out_of_range = "stop"  # a stored offset outside the log: "stop", "earliest" or "latest"
message_id = { header = "event_id" }   # or { json_pointer = "/event_id" }; a UUID
event_date = "auto"         # "/occurred_at" if present, else the UUIDv7 id's time
max_payload_bytes = 1048576 # bigger payloads are parked as oversized
retention = "15days"        # how long a duplicate is still recognised
future_tolerance = "1day"   # events dated further ahead are parked
partitions_ahead = 3        # daily dedupe partitions created ahead of today

[consumer.batch]
max_messages = 1000
max_bytes = 4194304
linger = "5ms"              # only while more records are arriving
backlog_max_messages = 1000 # raise to let batches grow while catching up

[consumer.retry]
max_attempts = 5            # then the batch is split and failing messages are parked
initial_backoff = "100ms"
max_backoff = "10s"

# Copies every payment into a table of your own, one message per transaction. Create it first:
#   CREATE TABLE payment_audit (event_id uuid PRIMARY KEY, amount_paise bigint);
[[consumer]]
name = "audit"
topics = ["payments"]
strategy = "per-message"
message_id = { json_pointer = "/event_id" }
event_date = "/occurred_at"

# `fresh_messages` is a view of the batch's messages this consumer has never applied (columns
# seq, message_id, event_date, partition, offset, kafka_ts, key, payload jsonb); $1 is the
# consumer's name.
[consumer.handler]
kind = "sql"
statement = """
INSERT INTO payment_audit (event_id, amount_paise)
SELECT message_id, (payload->>'amount_paise')::bigint
FROM fresh_messages ORDER BY message_id
"""

# Optional: keys this consumer committed are also set in Redis after each commit, and every
# batch looks its keys up there first (one MGET); hits skip the dedupe insert and the effect.
# A replay of old traffic then costs no transaction per duplicate. Redis is never the
# authority: a miss, an error or a timeout goes to PostgreSQL. (Not a default: off unless set.)
[consumer.prefilter]
redis = "redis://127.0.0.1:6379/0"   # a password here is never printed; a database of its own
ttl = "retention"           # or a shorter duration, e.g. "2days"
timeout = "50ms"            # per lookup (a set: 10x, at most 1s); past it the batch goes on without Redis

# Store first, process later: the receiver stores each batch in the `inbox` table and lets
# Kafka move on at once; processors apply the effect from the table, in order per user, with
# their own retries (the schedule is [consumer.retry]: past max_attempts a row is FAILED).
# `effectively inbox status` and `effectively inbox replay` work on its rows. Create first:
#   CREATE TABLE sms_log (event_id uuid PRIMARY KEY, user_id text);
[[consumer]]
name = "notify"
topics = ["payments"]
strategy = "inbox"
handler = { kind = "sql", statement = """
INSERT INTO sms_log (event_id, user_id)
SELECT message_id, payload->>'user_id' FROM fresh_messages ORDER BY message_id""" }

[consumer.inbox]
processors = 4              # processor tasks in this process (0: receive only)
claim_batch = 100           # rows per processor transaction
poll_interval = "100ms"     # an idle processor looks for due rows this often
ordering_key = "kafka_key"  # or { json_pointer = "/user_id" }, or "none"
claim = "lock"              # or "lease": IN_PROGRESS + lease_until, reclaimed after expiry
lease = "5m"                # claim = "lease" only: a dead processor's rows wait this long
done = "keep"               # or "delete"; kept rows go when retention drops their partition

# Versioned writes: each order's last status, moved only forward (out-of-order and stale copies
# change nothing; see docs/CONFIGURATION.md, "Versioned writes").
[[consumer]]
name = "orders"
topics = ["order-status"]
handler = { kind = "order-status" }   # order_status_view (order_id, status, version)

[consumer.version]
aggregate = "/order_id"     # JSON pointers into the payload
version = "/version"
mode = "full-state"         # or "delta": only stored + 1 applies; later versions wait HELD
gap_alert_after = "5m"      # delta: a gap held longer raises EffectivelyVersionGapOverdue

# `effectively relay`: publishes the outbox table's rows to Kafka, in order per aggregate.
[relay]
topics = { CashbackCredited = "cashback-credited" }   # event type -> topic
batch = 500
poll_interval = "100ms"
published = "keep"          # or "delete"

# `effectively send`: delivers notifications recorded by handlers (cashback with
# notify = "sms") with idempotency keys.
# [sender]
# request_timeout = "10s"
# sending_timeout = "60s"
# [sender.channels.sms]
# url = "https://sms.example/v1/messages"
# lookup = true              # the provider answers GET url?idempotency_key=K
# on_interrupted = "resend"  # or "skip", when it cannot be asked

# `effectively console`: the web console (lag, parked messages, inbox, outbox, notifications,
# and with writes = true redrive, replay and discard). Without this section: these defaults.
# [console]
# addr = "127.0.0.1:9470"    # any non-loopback address needs a token
# token_env = "EFFECTIVELY_CONSOLE_TOKEN"   # or token_file = "/run/secrets/console-token"
# writes = false             # read-only: every POST is refused
# mask = ["/card/number"]    # JSON pointers shown as *** on every page
# refresh = "5s"             # pages reload themselves (each has a Pause link); "0s": never
# page_size = 50
"#;

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[[consumer]]\nname = \"rewards\"\ntopics = [\"payments\"]\n\
                           handler = { kind = \"cashback\" }\n";
    const SEC: Duration = Duration::from_secs(1);
    const MS: Duration = Duration::from_millis(1);

    /// MINIMAL with `extra` appended inside its consumer.
    fn with(extra: &str) -> String {
        format!("{MINIMAL}{extra}\n")
    }

    fn consumer(text: &str) -> ConsumerConfig {
        let config = Config::from_toml_str(text);
        config.expect(text).consumers.remove(0)
    }

    fn invalid(text: &str) -> String {
        match Config::from_toml_str(text) {
            Err(ConfigError::Invalid(msg)) => msg,
            other => panic!("expected ConfigError::Invalid, got {other:?}"),
        }
    }

    fn is_parse_error(text: &str) -> bool {
        matches!(Config::from_toml_str(text), Err(ConfigError::Parse(_)))
    }

    #[test]
    fn example_parses_validates_and_shows_the_defaults() {
        let config = Config::from_toml_str(EXAMPLE).expect("EXAMPLE is valid");
        let minimal = Config::from_toml_str(MINIMAL).expect("MINIMAL is valid");
        assert_eq!(config.database, minimal.database);
        assert_eq!(config.worker, minimal.worker);
        assert_eq!(config.consumers[0], minimal.consumers[0]);
        let audit = &config.consumers[1];
        assert_eq!(audit.strategy, Strategy::PerMessage);
        let HandlerConfig::Sql { statement } = &audit.handler else {
            panic!("audit has an sql handler");
        };
        assert!(statement.contains("payload->>'amount_paise'"));
        let prefilter = audit
            .prefilter
            .as_ref()
            .expect("audit shows [consumer.prefilter]");
        assert_eq!(prefilter.ttl, Ttl::Retention);
        assert_eq!(prefilter.timeout, 50 * MS);
        assert_eq!(prefilter.redis.expose(), "redis://127.0.0.1:6379/0");
        assert!(config.consumers[0].prefilter.is_none(), "off by default");
        let notify = &config.consumers[2];
        assert_eq!(notify.strategy, Strategy::Inbox);
        assert_eq!(notify.inbox, InboxConfig::default());
    }

    #[test]
    fn minimal_config_gets_the_defaults() {
        let config = Config::from_toml_str(MINIMAL).expect("valid");
        let (k, d, w) = (&config.kafka, &config.database, &config.worker);
        assert_eq!(k.brokers, "127.0.0.1:9092");
        assert_eq!(k.session_timeout, 45 * SEC);
        assert_eq!(k.max_poll_interval, 300 * SEC);
        assert!(k.options.is_empty());
        let url = "postgres://postgres@127.0.0.1:5432/effectively";
        assert_eq!(d.url.expose(), url);
        assert_eq!(d.pool_size, 16);
        assert_eq!(d.connect_timeout, 5 * SEC);
        assert_eq!(d.idle_in_transaction_timeout, 60 * SEC);
        assert_eq!(d.transaction_deadline, 30 * SEC);
        assert_eq!(w.id, None);
        assert_eq!(w.revoke_deadline, 20 * SEC);
        assert_eq!(w.shutdown_deadline, 30 * SEC);
        assert_eq!(w.metrics_addr, None);
        let c = &config.consumers[0];
        assert_eq!(c.group_id(), "rewards");
        assert_eq!(c.strategy, Strategy::Batch);
        assert_eq!(
            c.handler,
            HandlerConfig::Cashback {
                rate_bp: 200,
                notify: None
            }
        );
        assert_eq!(c.auto_offset_reset, OffsetReset::Earliest);
        assert_eq!(c.on_offset_out_of_range, OutOfRange::Stop);
        assert_eq!(c.batch.max_messages, 1000);
        assert_eq!(c.batch.max_bytes, 4_194_304);
        assert_eq!(c.batch.linger, 5 * MS);
        assert_eq!(c.message_id, MessageIdSource::Header("event_id".into()));
        assert_eq!(c.event_date, EventDateSource::Auto);
        assert_eq!(c.max_payload_bytes, 1_048_576);
        assert_eq!(c.retry.max_attempts, 5);
        assert_eq!(c.retry.initial_backoff, 100 * MS);
        assert_eq!(c.retry.max_backoff, 10 * SEC);
        assert_eq!(c.retention, 15 * DAY);
        assert_eq!(c.future_tolerance, DAY);
        assert_eq!(c.partitions_ahead, 3);
        let i = &c.inbox;
        assert_eq!((i.processors, i.claim_batch), (4, 100));
        assert_eq!(i.poll_interval, 100 * MS);
        assert_eq!(i.ordering_key, OrderingKey::KafkaKey);
        assert_eq!(
            (i.claim, i.lease, i.done),
            (ClaimMode::Lock, 300 * SEC, DoneRows::Keep)
        );
        let pid = format!("-{}", std::process::id());
        assert!(config.worker_id().ends_with(&pid));
    }

    #[test]
    fn every_enum_spelling() {
        let c = |extra: &str| consumer(&with(extra));
        assert_eq!(c("strategy = \"batch\"").strategy, Strategy::Batch);
        let per_message = c("strategy = \"per-message\"").strategy;
        assert_eq!(per_message, Strategy::PerMessage);
        let latest = c("auto_offset_reset = \"latest\"").auto_offset_reset;
        assert_eq!(latest.as_librdkafka(), "latest");
        let earliest = c("auto_offset_reset = \"earliest\"").auto_offset_reset;
        assert_eq!(earliest.as_librdkafka(), "earliest");
        for policy in [OutOfRange::Stop, OutOfRange::Earliest, OutOfRange::Latest] {
            let line = format!("on_offset_out_of_range = \"{}\"", policy.as_str());
            assert_eq!(c(&line).on_offset_out_of_range, policy);
        }
        assert!(is_parse_error(&with("on_offset_out_of_range = \"none\"")));
        assert!(is_parse_error(&with("on_offset_out_of_range = \"Stop\"")));
        let header = c("message_id = { header = \"id\" }").message_id;
        assert_eq!(header, MessageIdSource::Header("id".into()));
        let pointer = c("message_id = { json_pointer = \"/id\" }").message_id;
        assert_eq!(pointer, MessageIdSource::JsonPointer("/id".into()));
        let uuid7 = c("event_date = \"uuid7\"").event_date;
        assert_eq!(uuid7, EventDateSource::Uuid7);
        let h = |h: &str| consumer(&MINIMAL.replace("{ kind = \"cashback\" }", h)).handler;
        let cashback = h("{ kind = \"cashback\", rate_bp = 150 }");
        assert_eq!(
            cashback,
            HandlerConfig::Cashback {
                rate_bp: 150,
                notify: None
            }
        );
        let statement = "SELECT 1".to_string();
        let sql = h("{ kind = \"sql\", statement = \"SELECT 1\" }");
        assert_eq!(sql, HandlerConfig::Sql { statement });
        let name = "my-handler".to_string();
        assert_eq!(
            h("{ kind = \"custom\", name = \"my-handler\" }"),
            HandlerConfig::Custom { name }
        );
        assert!(is_parse_error(&with("strategy = \"Batch\"")));
        let inbox = |extra: &str| consumer(&with(&format!("strategy = \"inbox\"\n{extra}")));
        assert_eq!(inbox("").strategy, Strategy::Inbox);
        let pointer = inbox("[consumer.inbox]\nordering_key = { json_pointer = \"/user_id\" }");
        let user = OrderingKey::JsonPointer("/user_id".into());
        assert_eq!(pointer.inbox.ordering_key, user);
        let none = inbox("[consumer.inbox]\nordering_key = \"none\"")
            .inbox
            .ordering_key;
        assert_eq!(none, OrderingKey::None);
        let lease = inbox("[consumer.inbox]\nclaim = \"lease\"\ndone = \"delete\"").inbox;
        assert_eq!(
            (lease.claim, lease.done),
            (ClaimMode::Lease, DoneRows::Delete)
        );
        assert!(is_parse_error(&with(
            "[consumer.inbox]\nordering_key = \"key\""
        )));
        let msg = invalid(&with(
            "strategy = \"inbox\"\n[consumer.inbox]\nclaim_batch = 0",
        ));
        assert!(
            msg.contains("inbox.claim_batch must be at least 1"),
            "{msg}"
        );
        let msg = invalid(&with(
            "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 15",
        ));
        assert!(msg.contains("database.pool_size (16)"), "{msg}");
        consumer(&with(
            "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 14",
        ));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        assert!(is_parse_error(&format!("colour = \"blue\"\n{MINIMAL}")));
        assert!(is_parse_error(
            &MINIMAL.replace("\"cashback\"", "\"cashback\", rate = 1")
        ));
        let err = Config::from_toml_str(&with("topic = \"payments\"")).expect_err("a typo");
        assert!(matches!(err, ConfigError::Parse(_)));
        assert!(err.to_string().contains("line 5"), "{err}");
    }

    #[test]
    fn revoke_deadline_must_be_under_the_session_timeout() {
        let msg = invalid(&format!("[kafka]\nsession_timeout = \"20s\"\n{MINIMAL}"));
        assert!(msg.contains("worker.revoke_deadline (20s)"), "{msg}");
        assert!(msg.contains("kafka.session_timeout (20s)"), "{msg}");
        assert!(msg.contains("group coordinator gives up"), "{msg}");
    }

    #[test]
    fn duplicate_names_and_bad_fields_are_rejected() {
        let msg = invalid(&format!("{MINIMAL}{MINIMAL}"));
        assert!(msg.contains("\"rewards\" is defined twice"), "{msg}");
        let msg = invalid(&with("[consumer.batch]\nmax_messages = 0"));
        assert!(msg.contains("consumer \"rewards\": batch.max_messages must be at least 1"));
        let msg = invalid(&with(
            "strategy = \"per-message\"\n[consumer.batch]\ngroup_partitions = true",
        ));
        assert!(
            msg.contains("group_partitions works with strategy = \"batch\" only"),
            "{msg}"
        );
        let msg = invalid(&with("retention = \"1day\""));
        assert!(
            msg.contains("consumer \"rewards\": retention (1day)"),
            "{msg}"
        );
        let msg = invalid(&MINIMAL.replace("payments", "pay ments"));
        assert!(msg.contains("not a valid Kafka topic name"), "{msg}");
        assert!(invalid("").contains("at least one [[consumer]]"));
    }

    #[test]
    fn env_overrides_apply() {
        let name = format!("effectively-config-{}.toml", std::process::id());
        let path = std::env::temp_dir().join(name);
        std::fs::write(&path, MINIMAL).expect("write a temporary config");
        let load = |vars: &[(&str, &str)]| {
            let lookup = |name: &str| vars.iter().find(|v| v.0 == name).map(|v| v.1.to_string());
            Config::load_with_env(&path, lookup)
        };
        let config = load(&[
            ("KAFKA_BROKERS", "k1:9092,k2:9092"),
            ("DATABASE_URL", "postgres://u:pw@db/x"),
            ("EFFECTIVELY_WORKER_ID", "w7"),
            ("EFFECTIVELY_POOL_SIZE", "4"),
        ]);
        let bad = load(&[("EFFECTIVELY_POOL_SIZE", "many")]);
        let zero = load(&[("EFFECTIVELY_POOL_SIZE", "0")]);
        let _ = std::fs::remove_file(&path);
        let config = config.expect("valid");
        assert_eq!(config.kafka.brokers, "k1:9092,k2:9092");
        assert_eq!(config.database.url.expose(), "postgres://u:pw@db/x");
        assert_eq!(config.worker_id(), "w7");
        assert_eq!(config.database.pool_size, 4);
        assert!(matches!(bad, Err(ConfigError::Env { name, .. }) if name.ends_with("POOL_SIZE")));
        assert!(matches!(zero, Err(ConfigError::Invalid(_))));
        let missing = Config::load_with_env(&path, |_| None);
        assert!(matches!(missing, Err(ConfigError::Io { .. })));
    }

    #[test]
    fn debug_never_shows_passwords() {
        let text = format!(
            "[database]\nurl = \"postgres://u:pw@h/db\"\n[kafka.options]\n\"sasl.password\" = \
             \"hunter2\"\n\"sasl.oauthbearer.config\" = \"tok\"\n\"linger.ms\" = \"7\"\n{MINIMAL}"
        );
        let config = Config::from_toml_str(&text).expect("valid");
        let debug = format!("{config:?}");
        assert!(!debug.contains("pw") && !debug.contains("hunter2") && !debug.contains("tok"));
        assert!(
            debug.contains("postgres://u:***@h/db") && debug.contains("\"7\""),
            "{debug}"
        );
        assert_eq!(config.database.url.to_string(), "postgres://u:***@h/db");
        assert_eq!(config.database.url.expose(), "postgres://u:pw@h/db");
        let plain = "postgres://postgres@127.0.0.1:5432/effectively";
        assert_eq!(redact(plain), plain);
        assert_eq!(redact("postgres://u:p/w@h/db"), "postgres://u:***@h/db");
        let query = redact("postgres://u@h/db?password=pw&x=1");
        assert_eq!(query, "postgres://u@h/db?password=***&x=1");
        let key_value = redact("host=h password='a b' user=u");
        assert_eq!(key_value, "host=h password=*** user=u");
    }

    #[test]
    fn event_date_source_spellings() {
        for s in ["auto", "uuid7", "/occurred_at"] {
            let parsed: EventDateSource = s.parse().expect(s);
            assert_eq!(parsed.to_string(), s);
        }
        assert_eq!("auto".parse(), Ok(EventDateSource::Auto));
        assert_eq!("uuid7".parse(), Ok(EventDateSource::Uuid7));
        let pointer = EventDateSource::JsonPointer("/occurred_at".into());
        assert_eq!("/occurred_at".parse(), Ok(pointer));
        let err = Config::from_toml_str(&with("event_date = \"occurred_at\"")).expect_err("no /");
        assert!(
            err.to_string().contains("did you mean \"/occurred_at\"?"),
            "{err}"
        );
    }

    #[test]
    fn version_section_is_read_and_checked() {
        let orders = "[[consumer]]\nname = \"orders\"\ntopics = [\"o\"]\n\
                      handler = { kind = \"order-status\" }\n";
        let msg = invalid(orders);
        assert!(msg.contains("needs [consumer.version]"), "{msg}");
        let text = format!(
            "{orders}[consumer.version]\naggregate = \"/order_id\"\nversion = \"/version\"\n\
             mode = \"delta\"\n"
        );
        let c = consumer(&text);
        let v = c.version.expect("read");
        assert_eq!((v.mode, v.gap_alert_after), (VersionMode::Delta, 300 * SEC));
        assert!(
            matches!(c.handler, HandlerConfig::OrderStatus { ref status } if status == "/status")
        );
        let msg = invalid(&text.replace("\"/order_id\"", "\"order_id\""));
        assert!(
            msg.contains("version.aggregate must be a JSON pointer"),
            "{msg}"
        );
        assert!(consumer(MINIMAL).version.is_none());
    }

    #[test]
    fn prefilter_section_is_read_and_checked() {
        let c = consumer(&with(
            "prefilter = { redis = \"redis://:pw@127.0.0.1:6380/2\", ttl = \"2days\" }",
        ));
        let f = c.prefilter.expect("read");
        assert_eq!(f.ttl, Ttl::For(2 * DAY));
        assert_eq!(f.redis.to_string(), "redis://:***@127.0.0.1:6380/2");
        let msg = invalid(&with(
            "retention = \"3days\"\n[consumer.prefilter]\nredis = \"redis://h\"\nttl = \"4days\"",
        ));
        assert!(
            msg.contains(
                "consumer \"rewards\": prefilter.ttl (4days) must not exceed retention (3days)"
            ),
            "{msg}"
        );
        let msg = invalid(&with(
            "strategy = \"inbox\"\nprefilter = { redis = \"redis://h\" }",
        ));
        assert!(
            msg.contains("prefilter does not apply to strategy = \"inbox\""),
            "{msg}"
        );
        let per_message = consumer(&with(
            "strategy = \"per-message\"\nprefilter = { redis = \"redis://h\" }",
        ));
        assert!(per_message.prefilter.is_some());
        let debug = format!(
            "{:?}",
            Config::from_toml_str(&with("prefilter = { redis = \"redis://u:hunter2@h\" }"))
                .unwrap()
        );
        assert!(!debug.contains("hunter2"), "{debug}");
    }
}
