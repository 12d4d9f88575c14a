//! `[database]` and the named databases beside it, `[database.NAME]`.
//!
//! `[database]`'s own keys (`url`, `pool_size`, ..., `tls`) are the **default database**, as
//! they always were; every other table nested under it is a **named database** with the same
//! keys. A consumer picks one with `database = "NAME"` (default: the default database), and
//! everything the engine keeps for it (ledger, offsets, claims, inbox, dead letters, the
//! effect) lives there. A consumer never spans two: the dedupe key, the effect and the offset
//! commit in one transaction is the whole guarantee.
//!
//! serde cannot say "these keys, and any other key is a table of the same shape" with
//! `deny_unknown_fields`, so the section is read by hand ([`Databases`]'s `Deserialize`): each
//! key is either one of [`DATABASE_KEYS`] or a named table, and anything else is refused with a
//! sentence saying which.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{Secret, TlsConfig};

/// The name the default database goes by, in metrics labels, logs and `--database`.
pub const DEFAULT_DATABASE: &str = "default";

/// The keys of `[database]` (and of each `[database.NAME]`): a named database cannot take one
/// of these names, since `[database.tls]` is the default database's TLS.
pub const DATABASE_KEYS: &[&str] = &[
    "url",
    "pool_size",
    "connect_timeout",
    "idle_in_transaction_timeout",
    "transaction_deadline",
    "tls",
];

/// One database: `[database]` or a `[database.NAME]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// Overridden by `DATABASE_URL` (the default database) or `DATABASE_URL_<NAME>` (a named
    /// one); printed without its password.
    pub url: Secret,
    /// Shared by every partition's transactions of the consumers on this database, per worker
    /// process; the default database's is overridden by `EFFECTIVELY_POOL_SIZE`.
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

impl DatabaseConfig {
    /// What serde cannot check, each problem prefixed with where it is (`database` or
    /// `database.NAME`).
    pub(super) fn problems(&self, at: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if self.pool_size < 1 {
            problems.push(format!("{at}.pool_size must be at least 1"));
        }
        if self.transaction_deadline < Duration::from_secs(1) {
            problems.push(format!("{at}.transaction_deadline must be at least 1s"));
        }
        if let Err(e) = self.tls.resolve(self.url.expose()) {
            // The TLS checks name `database.tls`; say which database when it is a named one.
            problems.push(match at {
                "database" => e,
                _ => format!("{at}: {e}"),
            });
        }
        problems
    }
}

/// `[database]`: the default database, and the named ones.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Databases {
    /// `[database]`'s own keys: the database of every consumer without `database = "..."`,
    /// and of the relay, the sender and the console unless told otherwise.
    pub default: DatabaseConfig,
    /// `[database.NAME]`, by name.
    pub named: BTreeMap<String, DatabaseConfig>,
}

impl Databases {
    /// The database called `name` ([`DEFAULT_DATABASE`] or `None` for the default), or a
    /// sentence naming the ones there are.
    pub fn get(&self, name: Option<&str>) -> Result<&DatabaseConfig, String> {
        match name {
            None | Some(DEFAULT_DATABASE) => Ok(&self.default),
            Some(n) => self.named.get(n).ok_or_else(|| {
                format!(
                    "no database {n:?}: there is no [database.{n}] (configured: {})",
                    self.names().collect::<Vec<_>>().join(", ")
                )
            }),
        }
    }

    /// Every database's name, the default first.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(DEFAULT_DATABASE).chain(self.named.keys().map(String::as_str))
    }

    /// Every database with its name, the default first.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &DatabaseConfig)> {
        std::iter::once((DEFAULT_DATABASE, &self.default))
            .chain(self.named.iter().map(|(n, d)| (n.as_str(), d)))
    }

    /// The environment variable that overrides a database's URL: `DATABASE_URL` for the
    /// default, `DATABASE_URL_<NAME>` (upper case) for a named one.
    pub fn url_variable(name: &str) -> String {
        match name {
            DEFAULT_DATABASE => "DATABASE_URL".into(),
            n => format!("DATABASE_URL_{}", n.to_ascii_uppercase()),
        }
    }

    /// Where each database's problems are reported from: `database` or `database.NAME`.
    pub(super) fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        for (name, db) in self.iter() {
            problems.extend(db.problems(&key(name)));
        }
        // One database under two names: a worker would take a consumer's own offsets for rows
        // it left behind elsewhere. A named database without a `url` (in the file or its
        // variable) has the built-in default's, the usual way to get here.
        let all: Vec<(&str, &DatabaseConfig)> = self.iter().collect();
        for (i, (a, da)) in all.iter().enumerate() {
            for (b, db) in &all[i + 1..] {
                if da.url.expose() == db.url.expose() {
                    problems.push(format!(
                        "[{}] and [database.{b}] have the same url: give [database.{b}] a url of \
                         its own (in the file or {}); a database without one has the built-in \
                         default, {}",
                        key(a),
                        Databases::url_variable(b),
                        DatabaseConfig::default().url.expose()
                    ));
                }
            }
        }
        problems
    }
}

/// The config file's key of the database `name`: `database` or `database.NAME`.
fn key(name: &str) -> String {
    match name {
        DEFAULT_DATABASE => "database".into(),
        n => format!("database.{n}"),
    }
}

/// Whether `name` may name a database: lower-case ASCII letters, digits and `_`, starting
/// with a letter, so that it is a metrics label and an environment variable's suffix as it is
/// (`DATABASE_URL_ORDERS`), and two names never map to one variable.
fn check_name(name: &str) -> Result<(), String> {
    let mut chars = name.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !ok {
        return Err(format!(
            "[database.{name}]: a database's name is lower-case letters, digits and `_`, \
             starting with a letter (it becomes a metrics label and the suffix of \
             DATABASE_URL_<NAME>)"
        ));
    }
    if name == DEFAULT_DATABASE {
        return Err(format!(
            "[database.{name}]: \"{DEFAULT_DATABASE}\" is the name of [database] itself: put \
             the default database's keys in [database]"
        ));
    }
    Ok(())
}

impl<'de> Deserialize<'de> for Databases {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(SectionVisitor)
    }
}

struct SectionVisitor;

impl<'de> Visitor<'de> for SectionVisitor {
    type Value = Databases;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("the [database] section: its keys, and [database.NAME] tables")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Databases, A::Error> {
        let mut own = toml::Table::new();
        let mut named = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            let value: toml::Value = map.next_value()?;
            if DATABASE_KEYS.contains(&key.as_str()) {
                if key != "tls" && value.is_table() {
                    return Err(de::Error::custom(format!(
                        "[database.{key}]: a database cannot be named {key:?}, a key of \
                         [database] (reserved: {})",
                        DATABASE_KEYS.join(", ")
                    )));
                }
                own.insert(key, value);
                continue;
            }
            if !value.is_table() {
                return Err(de::Error::custom(format!(
                    "unknown field `{key}` in [database]: expected one of {}, or a table \
                     [database.NAME] that names another database",
                    DATABASE_KEYS.join(", ")
                )));
            }
            check_name(&key).map_err(de::Error::custom)?;
            let db: DatabaseConfig = value
                .try_into()
                .map_err(|e| de::Error::custom(format!("[database.{key}]: {e}")))?;
            named.insert(key, db);
        }
        let default: DatabaseConfig = toml::Value::Table(own)
            .try_into()
            .map_err(|e| de::Error::custom(format!("[database]: {e}")))?;
        Ok(Databases { default, named })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::config::{Config, ConfigError, Databases, TlsMode, DEFAULT_DATABASE};

    /// Two consumers: `payments` on the default database, `orders` on `ledger`.
    const TWO: &str = "[[consumer]]\nname = \"payments\"\ntopics = [\"p\"]\n\
                       handler = { kind = \"cashback\" }\n\
                       [[consumer]]\nname = \"orders\"\ntopics = [\"o\"]\n\
                       handler = { kind = \"cashback\" }\ndatabase = \"ledger\"\n";

    fn parse_err(text: &str) -> String {
        match Config::from_toml_str(text) {
            Err(ConfigError::Parse(e)) => e.to_string(),
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    fn invalid(text: &str) -> String {
        match Config::from_toml_str(text) {
            Err(ConfigError::Invalid(msg)) => msg,
            other => panic!("expected ConfigError::Invalid, got {other:?}"),
        }
    }

    #[test]
    fn named_databases_sit_beside_the_default_and_consumers_pick_theirs() {
        let text = format!(
            "[database]\nurl = \"postgres://a@h1/x\"\npool_size = 8\n\
             [database.tls]\nmode = \"require\"\n\
             [database.ledger]\nurl = \"postgres://b@h2:5433/y\"\npool_size = 4\n\
             transaction_deadline = \"10s\"\n\
             [database.ledger.tls]\nmode = \"disable\"\n{TWO}"
        );
        let c = Config::from_toml_str(&text).expect("valid");
        assert_eq!(c.database.default.url.expose(), "postgres://a@h1/x");
        assert_eq!(c.database.default.pool_size, 8);
        assert_eq!(c.database.default.tls.mode, Some(TlsMode::Require));
        let ledger = &c.database.named["ledger"];
        assert_eq!(ledger.url.expose(), "postgres://b@h2:5433/y");
        assert_eq!(
            (ledger.pool_size, ledger.tls.mode),
            (4, Some(TlsMode::Disable))
        );
        assert_eq!(ledger.transaction_deadline, Duration::from_secs(10));
        // Keys a named database leaves out take the defaults, not [database]'s values.
        assert_eq!(ledger.connect_timeout, Duration::from_secs(5));
        let (payments, orders) = (&c.consumers[0], &c.consumers[1]);
        assert_eq!(payments.database_name(), DEFAULT_DATABASE);
        assert_eq!(orders.database_name(), "ledger");
        assert_eq!(c.database_of(payments).unwrap(), &c.database.default);
        assert_eq!(c.database_of(orders).unwrap(), ledger);
        let names: Vec<&str> = c.database.names().collect();
        assert_eq!(names, ["default", "ledger"]);
        // `database = "default"` is the default database, spelled out.
        let spelled = TWO.replace("\"ledger\"", "\"default\"");
        let c = Config::from_toml_str(&spelled).expect("valid");
        assert_eq!(c.database_of(&c.consumers[1]).unwrap(), &c.database.default);
    }

    #[test]
    fn a_named_database_alone_leaves_the_default_as_it_was() {
        let text = format!("[database.ledger]\nurl = \"postgres://b@h2/y\"\n{TWO}");
        let c = Config::from_toml_str(&text).expect("valid");
        assert_eq!(c.database.default, Databases::default().default);
        assert_eq!(c.database.named.len(), 1);
    }

    #[test]
    fn a_consumer_naming_a_database_that_is_not_configured_is_refused() {
        let msg = invalid(TWO);
        assert!(
            msg.contains("consumer \"orders\": database = \"ledger\": no database \"ledger\"")
                && msg.contains("configured: default"),
            "{msg}"
        );
        let text = format!("[database.ledgers]\nurl = \"postgres://b@h2/y\"\n{TWO}");
        let msg = invalid(&text);
        assert!(msg.contains("configured: default, ledgers"), "{msg}");
    }

    #[test]
    fn a_key_that_is_neither_a_setting_nor_a_table_is_refused() {
        let msg = parse_err(&format!("[database]\nurll = \"postgres://h/x\"\n{TWO}"));
        assert!(
            msg.contains("unknown field `urll` in [database]") && msg.contains("pool_size"),
            "{msg}"
        );
    }

    #[test]
    fn an_unknown_key_inside_a_named_database_is_refused_with_its_name() {
        let msg = parse_err(&format!(
            "[database.ledger]\nurl = \"postgres://h/x\"\npool = 4\n{TWO}"
        ));
        assert!(
            msg.contains("[database.ledger]") && msg.contains("unknown field `pool`"),
            "{msg}"
        );
        let msg = parse_err(&format!(
            "[database.ledger]\nurl = \"postgres://h/x\"\n[database.ledger.replica]\nurl = \"x\"\n{TWO}"
        ));
        assert!(msg.contains("unknown field `replica`"), "no nesting: {msg}");
    }

    #[test]
    fn database_names_are_checked() {
        for bad in ["Ledger", "2nd", "led-ger", "default"] {
            let msg = parse_err(&format!(
                "[database.\"{bad}\"]\nurl = \"postgres://h/x\"\n{TWO}"
            ));
            assert!(msg.contains(&format!("[database.{bad}]")), "{bad}: {msg}");
        }
        // A key of [database] cannot name a database (`tls` is the default's TLS).
        let msg = parse_err(&format!("[database.url]\nurl = \"postgres://h/x\"\n{TWO}"));
        assert!(msg.contains("cannot be named \"url\""), "{msg}");
    }

    #[test]
    fn each_database_is_checked_on_its_own() {
        let text = format!(
            "[database.ledger]\npool_size = 0\ntransaction_deadline = \"10ms\"\n\
             tls = {{ mode = \"verify-ca\" }}\n{TWO}"
        );
        let msg = invalid(&text);
        assert!(
            msg.contains("database.ledger.pool_size must be at least 1"),
            "{msg}"
        );
        assert!(
            msg.contains("database.ledger.transaction_deadline"),
            "{msg}"
        );
        assert!(msg.contains("database.ledger: database.tls.mode"), "{msg}");
    }

    #[test]
    fn inbox_processors_count_against_their_own_database_pool() {
        let inbox = "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 6\n";
        // 6 processors on `ledger` (pool 4): refused there, whatever the default's pool.
        let text = format!("[database.ledger]\npool_size = 4\n{TWO}{inbox}");
        let msg = invalid(&text);
        assert!(
            msg.contains("database.ledger.pool_size (4)") && msg.contains("(6)"),
            "{msg}"
        );
        // Pool 8 on `ledger` is enough, though the default's pool is 1.
        let text =
            format!("[database]\npool_size = 1\n[database.ledger]\nurl = \"postgres://h2/y\"\npool_size = 8\n{TWO}{inbox}");
        Config::from_toml_str(&text).expect("6 + 2 fit ledger's pool");
    }

    #[test]
    fn one_database_under_two_names_is_refused() {
        // No url: the built-in default's, which [database] has too.
        let msg = invalid(&format!("[database.ledger]\npool_size = 4\n{TWO}"));
        assert!(
            msg.contains("[database] and [database.ledger] have the same url")
                && msg.contains("DATABASE_URL_LEDGER"),
            "{msg}"
        );
        let text = format!(
            "[database]\nurl = \"postgres://h/x\"\n[database.ledger]\nurl = \"postgres://h/x\"\n{TWO}"
        );
        assert!(invalid(&text).contains("the same url"));
        let text = format!(
            "[database.ledger]\nurl = \"postgres://h/y\"\n[database.orders]\nurl = \"postgres://h/y\"\n{TWO}"
        );
        assert!(
            invalid(&text).contains("[database.ledger] and [database.orders] have the same url")
        );
    }

    #[test]
    fn a_named_database_url_comes_from_its_own_variable() {
        let path = std::env::temp_dir().join(format!("effectively-db-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            format!("[database.ledger]\nurl = \"postgres://file/x\"\n{TWO}"),
        )
        .expect("write a temporary config");
        let vars = [
            ("DATABASE_URL", "postgres://u:pw@one/x"),
            ("DATABASE_URL_LEDGER", "postgres://u:pw@two/y"),
            ("EFFECTIVELY_POOL_SIZE", "3"),
        ];
        let config = Config::load_with_env(&path, |name| {
            vars.iter().find(|v| v.0 == name).map(|v| v.1.to_string())
        });
        let _ = std::fs::remove_file(&path);
        let c = config.expect("valid");
        assert_eq!(c.database.default.url.expose(), "postgres://u:pw@one/x");
        assert_eq!(
            c.database.named["ledger"].url.expose(),
            "postgres://u:pw@two/y"
        );
        // EFFECTIVELY_POOL_SIZE is the default database's only.
        assert_eq!(c.database.default.pool_size, 3);
        assert_eq!(c.database.named["ledger"].pool_size, 16);
        assert_eq!(Databases::url_variable("ledger"), "DATABASE_URL_LEDGER");
        assert_eq!(Databases::url_variable("default"), "DATABASE_URL");
        // Never printed with its password.
        assert!(!format!("{c:?}").contains("pw"));
    }
}
