//! The connection pool, built from a `postgres://` URL.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
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

/// A pool of `size` connections to `url`. Connections are checked with a cheap round trip
/// when recycled (`RecyclingMethod::Fast` would hand out a connection that the server already
/// closed after a restart, and the first statement of a batch would fail on it).
pub fn build(url: &str, size: usize) -> Result<Pool, PoolError> {
    let pg: tokio_postgres::Config = url.parse().map_err(PoolError::Url)?;
    let manager = Manager::from_config(
        pg,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Verified,
        },
    );
    Ok(Pool::builder(manager).max_size(size).build()?)
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
