//! Everything that talks SQL. Each function takes the caller's transaction (or client), so
//! that dedupe keys, the effect, dead letters and the stored offset compose into one
//! transaction. The SQL sits in named constants next to the code that runs it.

pub mod audit;
pub mod browse;
pub mod control;
pub mod copy;
pub mod dead_letters;
pub mod dedupe;
pub mod inbox;
pub mod keys;
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
pub mod trace_context;
pub mod versions;

/// What the caller should do about a failed database call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The database is unavailable, not the data wrong: roll back and try the same work again
    /// after a backoff, for as long as it takes (nothing could be parked without the database
    /// anyway). Lost or timed-out connections, serialization failures and deadlocks, lock
    /// timeouts, a server shutting down or out of resources, a read-only server.
    Transient,
    /// This data can never be applied, whatever we retry (a data exception, a constraint, a
    /// trigger's `RAISE EXCEPTION`): isolate the message and park it.
    Permanent,
    /// The schema or the configured SQL is wrong (`42xxx`: syntax, undefined table or column,
    /// privileges). Parking every message would be worse than stopping: the worker stops.
    Fatal,
    /// A class this table does not know: it may pass (an operator's intervention, a corrupt
    /// page being repaired) or it may not, so it gets the handler's retry budget
    /// (`[consumer.retry] max_attempts`), then the message is isolated and parked. Never an
    /// endless loop, never a message parked at the first hiccup.
    Unknown,
}

/// Classifies a PostgreSQL error by its SQLSTATE (see the table in docs/DESIGN.md,
/// "Which database errors are retried").
pub fn classify(e: &tokio_postgres::Error) -> ErrorClass {
    match e.code() {
        Some(state) => classify_code(state.code()),
        // No SQLSTATE: an I/O error, a closed connection, a timeout. Try again.
        None => ErrorClass::Transient,
    }
}

/// Classifies one SQLSTATE, `"21000"`.
pub fn classify_code(code: &str) -> ErrorClass {
    match code {
        // read_only_sql_transaction: a connection to a primary that was demoted, or a proxy
        // that sent it to a standby; the strategies retry on a new connection. The rest of class
        // 25 (a transaction in the wrong state) is a bug, not an outage: it gets the budget.
        "25006" => return ErrorClass::Transient,
        // idle_in_transaction_session_timeout: the server closed the session, as a lost
        // connection would be; the next attempt gets a new one.
        "25P03" => return ErrorClass::Transient,
        // lock_not_available (`lock_timeout`, `NOWAIT`): another session holds the row or table
        // and will let go; the data is fine. Parking a message because a neighbour held a lock
        // (a long migration, a vacuum full) would park good data and break its key's order, so
        // it waits like a deadlock does. The rest of class 55 (an object in the wrong state)
        // gets the budget.
        "55P03" => return ErrorClass::Transient,
        _ => {}
    }
    match code.get(..2).unwrap_or("") {
        // connection exception, transaction rollback (40001 serialization, 40P01 deadlock),
        // insufficient resources, operator intervention (shutdown, query canceled), system
        // error: the database cannot do it now.
        "08" | "40" | "53" | "57" | "58" => ErrorClass::Transient,
        // cardinality violation (21000: one upsert meets a key twice), data exception,
        // integrity constraint, triggered data change, WITH CHECK OPTION, PL/pgSQL's RAISE
        // (P0001) and its other errors, and the routine exceptions (SQL routine, external
        // routine, external routine invocation): this data cannot be applied.
        "21" | "22" | "23" | "27" | "44" | "P0" | "2F" | "38" | "39" => ErrorClass::Permanent,
        // syntax or access rule, feature not supported, invalid authorization, invalid catalog
        // or schema name: the configuration is broken, for every message alike.
        "42" | "0A" | "28" | "3D" | "3F" => ErrorClass::Fatal,
        _ => ErrorClass::Unknown,
    }
}

/// The text kept with a parked message (dead letter detail, inbox `last_error`) for a failed
/// statement: the SQLSTATE, the server's message and its detail, and for 21000 what to do.
pub fn describe(e: &tokio_postgres::Error) -> String {
    let Some(db) = e.as_db_error() else {
        return e.to_string();
    };
    let code = db.code().code();
    let mut text = format!("SQLSTATE {code}: {}", db.message());
    if let Some(detail) = db.detail() {
        text.push_str(&format!(" (detail: {detail})"));
    }
    if code == "21000" {
        text.push_str(HINT_21000);
    }
    text
}

/// Appended to a 21000's text: the one statement met two rows of one key.
pub const HINT_21000: &str = ". Hint: two messages of one key met in one statement; \
    aggregate per key in its SELECT (GROUP BY the key, sum the amounts) or keep one row per \
    key with DISTINCT ON (docs/CONFIGURATION.md, \"Two messages of one key in a batch\")";

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

    /// The text for a log line or a parked message (see [`describe`]).
    pub fn describe(&self) -> String {
        match self {
            StoreError::Postgres(e) => describe(e),
            other => other.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{classify_code, ErrorClass::*};

    #[test]
    fn only_an_unavailable_database_is_retried_without_limit() {
        for code in [
            "08000", "08006", "08P01", // connection exceptions
            "40001", "40P01", // serialization failure, deadlock
            "53100", "53200", "53300", // disk full, out of memory, too many connections
            "57P01", "57P03", "57014", // admin shutdown, cannot connect now, query canceled
            "58030", // I/O error
            "25006", // read-only transaction: a demoted primary
            "25P03", // idle-in-transaction timeout closed the session
            "55P03", // lock_not_available: another session holds the lock
        ] {
            assert_eq!(classify_code(code), Transient, "{code}");
        }
    }

    #[test]
    fn data_that_cannot_be_applied_is_parked() {
        for code in [
            "21000", // ON CONFLICT DO UPDATE meets a row a second time
            "22001", "22003", "22P02", "22012", // too long, out of range, bad text, ÷0
            "23502", "23503", "23505", "23514", // not null, foreign key, unique, check
            "27000", // triggered data change violation
            "44000", // WITH CHECK OPTION
            "P0001", "P0002", "P0003", "P0004", // RAISE, no data, too many rows, ASSERT
            "2F005", "38001", "39P01", // routine exceptions
        ] {
            assert_eq!(classify_code(code), Permanent, "{code}");
        }
    }

    #[test]
    fn a_broken_configuration_stops_the_worker() {
        for code in [
            "42601", "42P01", "42703", "42501", "0A000", "28P01", "3D000", "3F000",
        ] {
            assert_eq!(classify_code(code), Fatal, "{code}");
        }
    }

    #[test]
    fn an_unknown_class_gets_the_budget_never_an_endless_loop() {
        for code in [
            "U0001", // a user's own ERRCODE
            "XX000", "XX001", // internal error, data corrupted
            "25001", "25P02", // the rest of class 25: a transaction in the wrong state
            "55000", "55006", // the rest of class 55: an object in the wrong state
            "20000", "HV000", "72000", "F0000", "",
        ] {
            assert_eq!(classify_code(code), Unknown, "{code:?}");
        }
    }
}
