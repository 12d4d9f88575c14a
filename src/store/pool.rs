//! The connection pool, built from a `postgres://` URL.

use std::time::Duration;

use deadpool_postgres::{HookError, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

/// Errors building a pool or opening a connection.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    #[error("invalid database URL: {0}")]
    Url(#[source] tokio_postgres::Error),
    #[error("could not build the connection pool: {0}")]
    Build(#[from] deadpool_postgres::BuildError),
    #[error("could not connect to PostgreSQL: {0}")]
    Connect(#[source] tokio_postgres::Error),
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
}

/// A pool of connections to `url`. Each new connection gets the session's staging table
/// (see [`crate::store::copy`]). Recycling only checks that the connection is not known to be
/// closed (`RecyclingMethod::Fast`): a round trip per checkout would cost the per-message
/// strategy one more round trip per message. A connection the server dropped unnoticed fails
/// its first statement, which the strategies treat as "database unavailable" and retry on a
/// fresh connection.
pub fn build(url: &str, opts: &PoolOptions) -> Result<Pool, PoolError> {
    let mut pg: tokio_postgres::Config = url.parse().map_err(PoolError::Url)?;
    pg.connect_timeout(opts.connect_timeout);
    // A server that vanishes without closing the socket (a network partition, a stalled
    // proxy) must not hold a batch forever: keepalives and the TCP user timeout turn silence
    // into a connection error within about half a minute, which the strategies retry.
    pg.keepalives(true)
        .keepalives_idle(Duration::from_secs(10))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(30));
    pg.application_name("effectively");
    // jit off: every statement of the engine is a short one, and on a large table's estimates
    // PostgreSQL compiled them anyway, at 70 ms a time (the relay's claim: 70 ms with JIT,
    // 1 ms without, whether or not it found a row).
    pg.options(format!(
        "-c idle_in_transaction_session_timeout={} -c jit=off",
        opts.idle_in_transaction_timeout.as_millis()
    ));
    let manager = Manager::from_config(
        pg,
        NoTls,
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

/// One connection outside any pool, its connection task spawned on the current runtime.
pub async fn connect(url: &str) -> Result<tokio_postgres::Client, PoolError> {
    let (client, connection) = tokio_postgres::connect(url, NoTls)
        .await
        .map_err(PoolError::Connect)?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "postgres connection closed");
        }
    });
    Ok(client)
}

/// Redacts the password of a `postgres://` URL for logs and error messages.
pub fn redact(url: &str) -> String {
    match url.parse::<tokio_postgres::Config>() {
        Ok(cfg) => {
            let hosts: Vec<String> = cfg
                .get_hosts()
                .iter()
                .map(|h| match h {
                    tokio_postgres::config::Host::Tcp(s) => s.clone(),
                    tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
                })
                .collect();
            let port = cfg.get_ports().first().copied().unwrap_or(5432);
            format!(
                "postgres://{}@{}:{}/{}",
                cfg.get_user().unwrap_or(""),
                hosts.join(","),
                port,
                cfg.get_dbname().unwrap_or("")
            )
        }
        Err(_) => "<unparseable database URL>".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn redact_drops_the_password() {
        let r = redact("postgres://app:s3cret@db.example:6543/ledger");
        assert_eq!(r, "postgres://app@db.example:6543/ledger");
        assert!(!r.contains("s3cret"));
    }
}
