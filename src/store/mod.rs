//! Everything that talks SQL. Each function takes the caller's transaction (or client), so
//! that dedupe keys, the effect, dead letters and the stored offset compose into one
//! transaction. The SQL sits in named constants next to the code that runs it.

pub mod audit;
pub mod browse;
pub mod copy;
pub mod dead_letters;
pub mod dedupe;
pub mod inbox;
pub mod migrate;
pub mod notifications;
pub mod offsets;
pub mod outbox;
pub mod parked;
pub mod partition_health;
pub mod partitions;
pub mod pool;
pub mod retention;
pub mod tls;
pub mod versions;

/// What the caller should do about a failed database call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Roll back and try the same work again after a backoff: lost connections, serialization
    /// failures and deadlocks (`40001`, `40P01`), lock timeouts, a server shutting down,
    /// resource exhaustion.
    Transient,
    /// The data cannot be applied, whatever we retry (`22xxx` data exceptions, `23xxx`
    /// integrity violations): isolate the message and park it.
    Permanent,
    /// The schema or the configured SQL is wrong (`42xxx`: syntax, undefined table or column,
    /// privileges). Parking every message would be worse than stopping: the worker stops.
    Fatal,
}

/// Classifies a PostgreSQL error by its SQLSTATE class.
pub fn classify(e: &tokio_postgres::Error) -> ErrorClass {
    let Some(state) = e.code() else {
        // No SQLSTATE: an I/O error, a closed connection, a timeout. Try again.
        return ErrorClass::Transient;
    };
    let code = state.code();
    match &code[..2] {
        // 25006 (read-only transaction) lands here too: a connection to a primary that was
        // demoted, or a proxy that sent it to a standby; the strategies retry on a new one.
        "40" | "08" | "25" | "53" | "55" | "57" | "58" => ErrorClass::Transient,
        "22" | "23" => ErrorClass::Permanent,
        "42" | "0A" | "28" | "3D" | "3F" => ErrorClass::Fatal,
        _ => ErrorClass::Transient,
    }
}

/// An error from the database layer, classified for the caller.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("postgres: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("connection pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    /// PostgreSQL did not answer within `database.transaction_deadline` (a frozen server).
    #[error("PostgreSQL did not answer within {0:?} (database.transaction_deadline)")]
    Timeout(std::time::Duration),
}

impl StoreError {
    pub fn class(&self) -> ErrorClass {
        match self {
            StoreError::Postgres(e) => classify(e),
            // Timeouts, a backend that closed: the pool will hand out a fresh connection.
            StoreError::Pool(_) | StoreError::Timeout(_) => ErrorClass::Transient,
        }
    }
}
