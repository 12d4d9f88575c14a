//! The connection pool, built from a `postgres://` URL and `[database.tls]`. Every connection
//! of the engine is made here, so that none bypasses the TLS settings.

use std::collections::BTreeMap;
use std::time::Duration;

use deadpool_postgres::{HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};

use crate::config::{Config, ConsumerConfig, DatabaseConfig, Tls, TlsConfig};
use crate::store::tls::{self, TlsError};

/// The longest a statement waits for a server that went silent without closing the socket
/// (a network partition, a stalled proxy) before it fails as a connection error: keepalives
/// and the TCP user timeout. Loops count it in their heartbeat periods ([`crate::health`]).
pub const SILENT_SERVER_TIMEOUT: Duration = Duration::from_secs(30);

/// The server's side of the keepalives, as session settings (each is PostgreSQL's
/// `PGC_USERSET`, so any role may set them): probes after 10 s of silence, 5 s apart, 3 of
/// them; and a 30 s TCP user timeout for what the server sent and the client never acked.
const SERVER_KEEPALIVES: &str = "-c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 \
    -c tcp_keepalives_count=3 -c tcp_user_timeout=30000";

/// Errors building a pool or opening a connection.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("invalid database URL: {0}")]
    Url(#[source] tokio_postgres::Error),
    /// Contradictory TLS settings (the config and the URL), or a mode without its CA file.
    #[error("invalid database TLS settings: {0}")]
    TlsConfig(String),
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("could not build the connection pool: {0}")]
    Build(#[from] deadpool_postgres::BuildError),
    /// A consumer names a database the config does not have (a config built in code that
    /// skipped `Config::validate`).
    #[error("{0}")]
    Unknown(String),
    /// `explained`: what to fix, when the cause is TLS (a wrong CA, a host name the
    /// certificate does not list, a server that refuses plaintext).
    #[error(
        "could not connect to PostgreSQL at {target} (sslmode {mode}): {}",
        explained.clone().unwrap_or_else(|| source.to_string())
    )]
    Connect {
        target: String,
        mode: crate::config::TlsMode,
        explained: Option<String>,
        #[source]
        source: tokio_postgres::Error,
    },
}

/// How the engine's connections are set up.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub size: usize,
    pub connect_timeout: Duration,
    /// PostgreSQL ends a session left idle inside a transaction for this long. A worker that
    /// was stopped (SIGSTOP, a long GC-like pause) mid-batch would otherwise hold the partition's
    /// offsets row lock forever, and the new owner's claim would wait behind it.
    pub idle_in_transaction_timeout: Duration,
    /// No parallel query on these sessions (the console's: a page's capped count finishes
    /// sooner alone than with workers to start, and those workers take the engine's cores).
    pub no_parallel_query: bool,
}

impl PoolOptions {
    /// `db`'s settings: its `pool_size`, timeouts, parallel query on. A caller that needs a
    /// few connections only (a command, the console) sets `size` itself.
    pub fn of(db: &DatabaseConfig) -> PoolOptions {
        PoolOptions {
            size: db.pool_size,
            connect_timeout: db.connect_timeout,
            idle_in_transaction_timeout: db.idle_in_transaction_timeout,
            no_parallel_query: false,
        }
    }
}

/// A process's pools, one per database it uses, by the database's name (`default` for
/// `[database]`, else its `[database.NAME]`). Everything per consumer (its partitions'
/// transactions, claims, control, inbox processors, gauges) takes the pool of the consumer's
/// database from here: above `store/`, nothing needs to know how many databases there are.
#[derive(Clone, Default)]
pub struct Pools {
    pools: BTreeMap<String, Named>,
}

/// One database's pool, with the settings it was built from.
#[derive(Clone)]
pub struct Named {
    pub name: String,
    pub config: DatabaseConfig,
    pub pool: Pool,
}

impl Pools {
    /// A pool for each database that `consumers` use, with `options` for each (lazy: no
    /// connection is opened here).
    pub fn for_consumers<'a>(
        config: &Config,
        consumers: impl IntoIterator<Item = &'a ConsumerConfig>,
        options: impl Fn(&DatabaseConfig) -> PoolOptions,
    ) -> Result<Pools, PoolError> {
        let mut pools = BTreeMap::new();
        for c in consumers {
            let name = c.database_name();
            if pools.contains_key(name) {
                continue;
            }
            let db = config.database_of(c).map_err(PoolError::Unknown)?;
            let named = Named {
                name: name.to_string(),
                config: db.clone(),
                pool: build_for(db, &options(db))?,
            };
            pools.insert(name.to_string(), named);
        }
        Ok(Pools { pools })
    }

    /// The pool of consumer `c`'s database; `None` when this process holds no pool for it.
    pub fn of(&self, c: &ConsumerConfig) -> Option<&Named> {
        self.pools.get(c.database_name())
    }

    /// The pool of the database called `name`.
    pub fn get(&self, name: &str) -> Option<&Named> {
        self.pools.get(name)
    }

    /// Every pool, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Named> {
        self.pools.values()
    }

    pub fn len(&self) -> usize {
        self.pools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }
}

/// A pool of connections to `url`. Each new connection gets the session's staging table
/// (see [`crate::store::copy`]). Recycling only checks that the connection is not known to be
/// closed (`RecyclingMethod::Fast`): a round trip per checkout would cost the per-message
/// strategy one more round trip per message. A connection the server dropped unnoticed fails
/// its first statement, which the strategies treat as "database unavailable" and retry on a
/// fresh connection.
///
/// TLS: the URL's own `sslmode`/`sslrootcert`, else `prefer`. The engine's processes use
/// [`build_for`], which adds `[database.tls]`.
pub fn build(url: &str, opts: &PoolOptions) -> Result<Pool, PoolError> {
    build_with(url, &TlsConfig::default(), opts)
}

/// [`build`] for `[database]`: its URL and its TLS settings.
pub fn build_for(db: &DatabaseConfig, opts: &PoolOptions) -> Result<Pool, PoolError> {
    build_with(db.url.expose(), &db.tls, opts)
}

fn build_with(url: &str, tls: &TlsConfig, opts: &PoolOptions) -> Result<Pool, PoolError> {
    let (mut pg, _, connector) = prepare(url, tls)?;
    pg.connect_timeout(opts.connect_timeout);
    // A server that vanishes without closing the socket (a network partition, a stalled
    // proxy) must not hold a batch forever: keepalives and the TCP user timeout turn silence
    // into a connection error within about half a minute, which the strategies retry.
    pg.keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3)
        .tcp_user_timeout(SILENT_SERVER_TIMEOUT);
    pg.application_name("effectively");
    // jit off: every statement of the engine is a short one, and on a large table's estimates
    // PostgreSQL compiled them anyway, at 70 ms a time (the relay's claim: 70 ms with JIT,
    // 1 ms without, whether or not it found a row).
    let parallel = if opts.no_parallel_query {
        " -c max_parallel_workers_per_gather=0"
    } else {
        ""
    };
    // The same for the server's end: a worker that vanishes (cut off, or its connection
    // dropped at a deadline while the network was down) can leave a session in the middle of
    // a statement (a COPY waiting for its rows), where `idle_in_transaction_session_timeout`
    // does not apply, holding its locks (a partition's offset row) against the next attempt
    // until the server's TCP notices: two hours with the kernel's keepalive defaults. With
    // these the server drops it within about 25 s of the last packet.
    pg.options(format!(
        "-c idle_in_transaction_session_timeout={} -c jit=off{parallel} {SERVER_KEEPALIVES}",
        opts.idle_in_transaction_timeout.as_millis()
    ));
    let manager = Manager::from_config(
        pg,
        connector,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Ok(Pool::builder(manager)
        .max_size(opts.size)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(opts.connect_timeout))
        .post_create(deadpool_postgres::Hook::async_fn(|client, _| {
            Box::pin(async move {
                client
                    .batch_execute(super::copy::CREATE_SESSION_TABLES)
                    .await
                    .map_err(HookError::Backend)
            })
        }))
        .build()?)
}

/// Takes a connection out of its pool for good: it closes when dropped here, and the pool opens
/// a new one (to whichever host `target_session_attrs` finds) when it next needs one. For a
/// connection that failed with the database unavailable or did not answer in time: it may be
/// closed, stuck behind a statement that never returns (a frozen server), or on a server that
/// is read-only now (a demoted primary behind a proxy: SQLSTATE 25006). Dropping one healthy
/// connection after a deadlock costs one reconnect; keeping a broken one could cost a batch
/// per use for ever.
pub fn discard(conn: deadpool_postgres::Object) {
    drop(deadpool_postgres::Object::take(conn));
}

/// The parsed URL (without the `sslmode`/`sslrootcert` the engine handles), the TLS settings
/// in force, and their connector. Reads the CA file: a missing or unreadable one fails here.
fn prepare(
    url: &str,
    tls: &TlsConfig,
) -> Result<
    (
        tokio_postgres::Config,
        Tls,
        tokio_postgres_rustls::MakeRustlsConnect,
    ),
    PoolError,
> {
    let (url, tls) = tls.resolve(url).map_err(PoolError::TlsConfig)?;
    let mut pg: tokio_postgres::Config = url.parse().map_err(PoolError::Url)?;
    let (connector, mode) = tls::connector(&tls)?;
    pg.ssl_mode(mode);
    Ok((pg, tls, connector))
}

/// One connection outside any pool, its connection task spawned on the current runtime. TLS
/// as for [`build`]: the URL's own parameters.
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, PoolError> {
    connect_with(url, &TlsConfig::default()).await
}

/// [`connect`] to `[database]`, with its TLS settings. A wrong CA, a certificate for another
/// host, or a server that refuses plaintext fails here with a sentence saying which.
pub async fn connect_to(db: &DatabaseConfig) -> Result<tokio_postgres::Client, PoolError> {
    connect_with(db.url.expose(), &db.tls).await
}

async fn connect_with(url: &str, tls: &TlsConfig) -> Result<tokio_postgres::Client, PoolError> {
    let (pg, tls, connector) = prepare(url, tls)?;
    let (client, connection) = pg.connect(connector).await.map_err(|source| {
        let host = match pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => String::new(),
        };
        PoolError::Connect {
            target: describe(&pg),
            mode: tls.mode,
            explained: tls::explain(&source, &tls, &host),
            source,
        }
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

/// Redacts the password of a `postgres://` URL for logs and error messages.
pub fn redact(url: &str) -> String {
    // The TLS parameters only the engine understands would fail tokio-postgres's parser.
    match crate::config::without_tls_params(url).parse::<tokio_postgres::Config>() {
        Ok(cfg) => describe(&cfg),
        Err(_) => "<unparseable database URL>".to_string(),
    }
}

/// `postgres://user@host:port,host:port/db`: never the password. Each host with its port (a
/// single port applies to every host, as in libpq), so a multi-host URL reads as it was meant.
fn describe(cfg: &tokio_postgres::Config) -> String {
    let ports = cfg.get_ports();
    let hosts: Vec<String> = (cfg.get_hosts().iter().enumerate())
        .map(|(i, h)| {
            let host = match h {
                tokio_postgres::config::Host::Tcp(s) => s.clone(),
                tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
            };
            let port = match ports {
                [one] => *one,
                many => many.get(i).copied().unwrap_or(5432),
            };
            format!("{host}:{port}")
        })
        .collect();
    let attrs = match cfg.get_target_session_attrs() {
        tokio_postgres::config::TargetSessionAttrs::ReadWrite => "?target_session_attrs=read-write",
        _ => "",
    };
    format!(
        "postgres://{}@{}/{}{attrs}",
        cfg.get_user().unwrap_or(""),
        hosts.join(","),
        cfg.get_dbname().unwrap_or("")
    )
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redact_drops_the_password() {
        let r = redact("postgres://app:s3cret@db.example:6543/ledger");
        assert_eq!(r, "postgres://app@db.example:6543/ledger");
        assert!(!r.contains("s3cret"));
        let tls = redact("postgres://app:s3cret@db.example/ledger?sslmode=verify-ca");
        assert_eq!(tls, "postgres://app@db.example:5432/ledger");
    }

    #[test]
    fn redact_names_every_host_of_a_multi_host_url() {
        let url = "postgres://app:s3cret@10.0.0.1:5433,10.0.0.2:5434/ledger?target_session_attrs=read-write";
        let r = redact(url);
        assert_eq!(
            r,
            "postgres://app@10.0.0.1:5433,10.0.0.2:5434/ledger?target_session_attrs=read-write"
        );
        assert!(!r.contains("s3cret"));
        // In a URL, a host without a port gets 5432.
        let r = redact("postgres://app@a,b:6000/ledger");
        assert_eq!(r, "postgres://app@a:5432,b:6000/ledger");
    }
}
