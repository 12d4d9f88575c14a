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
mod consumer;
mod database;
mod example;
mod inbox;
pub mod kafka_security;
mod message_id;
mod payload;
mod prefilter;
mod relay;
mod sender;
mod telemetry;
mod tls;
mod version;
pub use console::{check_addr as check_console_addr, ConsoleConfig, DEFAULT_CONSOLE_ADDR};
pub use consumer::{
    default_burst, BatchConfig, ConsumerConfig, Dedupe, EnvelopeKind, EventDateSource,
    HandlerConfig, OffsetReset, OnTombstone, OutOfRange, RetryConfig, Strategy, Throttle,
};
pub use database::{DatabaseConfig, Databases, DATABASE_KEYS, DEFAULT_DATABASE};
pub use example::EXAMPLE;
pub use inbox::{ClaimMode, DoneRows, InboxConfig, OrderingKey};
pub use kafka_security::{KafkaSasl, KafkaTls, SaslMechanism};
pub use message_id::{MessageIdConfig, MessageIdSource, Part as TemplatePart, Template};
pub use payload::{PayloadConfig, PayloadFormat, RegistryAuth};
pub use prefilter::{PrefilterConfig, Ttl};
pub use relay::{Published, RelayConfig};
pub use sender::{ChannelConfig, OnInterrupted, SenderConfig};
pub use telemetry::{Ratio, TracingConfig};
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
    /// `[database]`, the default database (optional as a whole: the URL usually comes from
    /// `DATABASE_URL`), and `[database.NAME]`, the named ones consumers may choose.
    #[serde(default)]
    pub database: Databases,
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
    /// `[tracing]`: OpenTelemetry traces over OTLP; off by default.
    #[serde(default)]
    pub tracing: TracingConfig,
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
    /// Static group membership (KIP-345): each consumer joins with `group.instance.id =
    /// <worker id>-<consumer>`, so a worker restarted within `session_timeout` gets its
    /// partitions back without a rebalance of the group. Needs a stable `worker.id` (or
    /// `EFFECTIVELY_WORKER_ID`). Default off.
    pub static_membership: bool,
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
            static_membership: false,
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
            .field("static_membership", &self.static_membership)
            .field("options", &options)
            .finish()
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
    /// Whether something of this config works on the database `name`: a consumer on it, or the
    /// relay, sender or console (on `[database]` unless they name another). The default
    /// database of a config whose consumers are all elsewhere, with no relay, sender or console,
    /// need not be there (`migrate` and `check-config --connect` skip it).
    pub fn uses_database(&self, name: &str) -> bool {
        let default = name == DEFAULT_DATABASE;
        self.consumers.iter().any(|c| c.database_name() == name)
            || (default && self.consumers.is_empty())
            || [
                self.relay.as_ref().map(|r| r.database.as_deref()),
                self.sender.as_ref().map(|s| s.database.as_deref()),
                self.console.as_ref().map(|c| c.database.as_deref()),
            ]
            .into_iter()
            .flatten()
            .any(|d| d.unwrap_or(DEFAULT_DATABASE) == name)
    }

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
            config.database.default.url = Secret(v);
        }
        for (name, db) in &mut config.database.named {
            if let Some(v) = var(&Databases::url_variable(name)) {
                db.url = Secret(v);
            }
        }
        if let Some(v) = var("EFFECTIVELY_WORKER_ID") {
            config.worker.id = Some(v);
        }
        if let Some(v) = var("EFFECTIVELY_POOL_SIZE") {
            config.database.default.pool_size = v.trim().parse().map_err(|e| ConfigError::Env {
                name: "EFFECTIVELY_POOL_SIZE".into(),
                reason: format!("{v:?} is not a connection count: {e}"),
            })?;
        }
        config.tracing.apply_env(var)?;
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
        if kafka.static_membership && worker.id.is_none() {
            problems.push(
                "kafka.static_membership needs a stable worker.id (or EFFECTIVELY_WORKER_ID, a \
                 StatefulSet's pod name, say): the default <host>-<pid> changes at every restart, \
                 and each restart would then leave a member behind that holds its partitions \
                 until kafka.session_timeout"
                    .into(),
            );
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
        problems.extend(self.database.problems());
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
        let sections = [
            (
                "relay",
                self.relay.as_ref().and_then(|r| r.database.as_deref()),
            ),
            (
                "sender",
                self.sender.as_ref().and_then(|s| s.database.as_deref()),
            ),
            (
                "console",
                self.console.as_ref().and_then(|c| c.database.as_deref()),
            ),
        ];
        for (section, name) in sections {
            if let Some(name) = name {
                if let Err(e) = self.database.get(Some(name)) {
                    problems.push(format!("{section}.database = {name:?}: {e}"));
                }
            }
        }
        problems.extend(self.tracing.problems());
        // Each processor holds a connection for its whole round; the receivers, maintenance and
        // the gauges need theirs too, or they wait for a processor to finish. Per database:
        // each has its own pool.
        for (name, db) in self.database.iter() {
            let processors: usize = (self.consumers.iter())
                .filter(|c| c.strategy == Strategy::Inbox && c.database_name() == name)
                .map(|c| c.inbox.processors)
                .sum();
            if processors > 0 && db.pool_size < processors + 2 {
                let at = match name {
                    DEFAULT_DATABASE => "database".to_string(),
                    n => format!("database.{n}"),
                };
                problems.push(format!(
                    "{at}.pool_size ({}) must be at least the inbox processors of all consumers \
                     on it ({processors}) plus 2: each processor holds a connection while it \
                     works",
                    db.pool_size
                ));
            }
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
            if let Some(name) = &c.database {
                if let Err(e) = self.database.get(Some(name)) {
                    problems.push(format!("consumer {:?}: database = {name:?}: {e}", c.name));
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems.join("; ")))
        }
    }

    /// The database of consumer `c`: its `database = "NAME"`, else the default. An error
    /// only for a config that skipped [`Config::validate`] (built in code).
    pub fn database_of(&self, c: &ConsumerConfig) -> Result<&DatabaseConfig, String> {
        (self.database.get(c.database.as_deref()))
            .map_err(|e| format!("consumer {:?}: {e}", c.name))
    }

    /// The consumer named `name`, or a sentence naming those there are.
    pub fn consumer(&self, name: &str) -> Result<&ConsumerConfig, String> {
        self.consumers
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.consumers.iter().map(|c| c.name.as_str()).collect();
                format!(
                    "no consumer {name:?} in the config (it has: {})",
                    if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    }
                )
            })
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

/// A secret from its variable (`{what}_env`) or file (`{what}_file`, one trailing newline
/// dropped): the SASL password, the registry's password or token. `None` when neither is set.
pub(super) fn read_secret(
    what: &str,
    env: &Option<String>,
    file: &Option<PathBuf>,
) -> Result<Option<String>, String> {
    match (env, file) {
        (None, None) => Ok(None),
        (Some(var), None) => match std::env::var(var) {
            Ok(v) if !v.is_empty() => Ok(Some(v)),
            _ => Err(format!(
                "{what}_env: the environment variable {var} is not set (or empty)"
            )),
        },
        (None, Some(path)) => match read_small(path) {
            Ok(v) => {
                let v = v.strip_suffix('\n').unwrap_or(&v);
                let v = v.strip_suffix('\r').unwrap_or(v);
                if v.is_empty() {
                    Err(format!("{what}_file {} is empty", path.display()))
                } else {
                    Ok(Some(v.to_string()))
                }
            }
            Err(e) => Err(format!("{what}_file {}: {e}", path.display())),
        },
        (Some(_), Some(_)) => Err(format!("{what}_env and {what}_file exclude each other")),
    }
}

/// The most a secret's file may hold: far more than any password or token.
pub const SECRET_FILE_MAX: u64 = 64 * 1024;

/// Reads a secret's file as UTF-8 text, at most [`SECRET_FILE_MAX`] bytes: a path that names a
/// device (`/dev/zero`), a log or an image by mistake is refused, rather than read until the
/// process runs out of memory.
pub(super) fn read_small(path: &Path) -> Result<String, String> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut bytes = Vec::new();
    file.take(SECRET_FILE_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > SECRET_FILE_MAX {
        return Err(format!(
            "holds more than {SECRET_FILE_MAX} bytes, too much for a secret (the wrong file?)"
        ));
    }
    String::from_utf8(bytes).map_err(|_| "is not UTF-8 text".to_string())
}

#[cfg(test)]
mod tests;
