//! The trace context of the transaction, as the rows it writes keep it: `outbox.traceparent`
//! and `notifications.traceparent` (and `tracestate`) default to the transaction's settings
//! `effectively.traceparent` and `effectively.tracestate` (migration V14), which
//! [`set_local`] sets. So any effect's insert, the cashback handler's, an SQL handler's or a
//! library user's, carries the context without naming the columns.

use deadpool_postgres::Transaction;

use super::StoreError;

const SET: &str = "SELECT set_config('effectively.traceparent', $1, true), \
                          set_config('effectively.tracestate', coalesce($2, ''), true)";

/// Sets the context for the rest of the caller's transaction (`set_config(..., true)`: gone
/// at `COMMIT` or `ROLLBACK`, never seen by the connection's next transaction). Called only
/// when tracing is on.
pub async fn set_local(
    tx: &Transaction<'_>,
    traceparent: &str,
    tracestate: Option<&str>,
) -> Result<(), StoreError> {
    let stmt = tx.prepare_cached(SET).await?;
    tx.execute(&stmt, &[&traceparent, &tracestate]).await?;
    Ok(())
}
