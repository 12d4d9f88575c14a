//! `operator_actions`: who redrove, replayed, retried or discarded which parked rows, written
//! by the action's own transaction (`crate::operator`), so an action that rolled back left no
//! audit row and a committed one cannot lack it.

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::StoreError;

/// One committed chunk of an operator action.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct AuditRow {
    pub id: i64,
    /// Shared by every chunk of one action.
    pub action: Uuid,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub verb: String,
    pub target: String,
    pub filter: serde_json::Value,
    pub count: i64,
    pub note: Option<String>,
}

/// What to record; `count` is what this transaction changed.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    pub action: Uuid,
    pub actor: &'a str,
    pub verb: &'a str,
    pub target: &'a str,
    pub filter: &'a serde_json::Value,
    pub count: i64,
    pub note: Option<&'a str>,
}

const RECORD: &str = "\
INSERT INTO operator_actions (action, actor, verb, target, filter, count, note)
VALUES ($1, $2, $3, $4, $5, $6, $7)";

/// Writes `e` in the caller's transaction.
pub async fn record<C: GenericClient + Sync>(client: &C, e: &Entry<'_>) -> Result<(), StoreError> {
    client
        .execute(
            RECORD,
            &[
                &e.action, &e.actor, &e.verb, &e.target, e.filter, &e.count, &e.note,
            ],
        )
        .await?;
    Ok(())
}

const COLUMNS: &str = "id, action, at, actor, verb, target, filter, count, note";

fn row(r: &tokio_postgres::Row) -> AuditRow {
    AuditRow {
        id: r.get(0),
        action: r.get(1),
        at: r.get(2),
        actor: r.get(3),
        verb: r.get(4),
        target: r.get(5),
        filter: r.get(6),
        count: r.get(7),
        note: r.get(8),
    }
}

/// The newest `limit` audit rows, older than `before` (an id) if given.
pub async fn recent<C: GenericClient + Sync>(
    client: &C,
    before: Option<i64>,
    limit: i64,
) -> Result<Vec<AuditRow>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM operator_actions WHERE ($1::int8 IS NULL OR id < $1)
         ORDER BY id DESC LIMIT $2"
    );
    let rows = client.query(&sql, &[&before, &limit]).await?;
    Ok(rows.iter().map(row).collect())
}

/// The newest `limit` audit rows whose selection names `consumer` (pauses, resumes, resets,
/// throttles, and parked-row actions filtered by it), among the newest 10,000 actions: `filter`
/// has no index, and no page reads the table whole.
pub async fn of_consumer<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    limit: i64,
) -> Result<Vec<AuditRow>, StoreError> {
    let sql = format!(
        "SELECT {COLUMNS} FROM operator_actions
         WHERE id > coalesce((SELECT max(id) FROM operator_actions), 0) - 10000
           AND filter->>'consumer' = $1
         ORDER BY id DESC LIMIT $2"
    );
    let rows = client.query(&sql, &[&consumer, &limit]).await?;
    Ok(rows.iter().map(row).collect())
}

/// Every chunk of one action, oldest first.
pub async fn of_action<C: GenericClient + Sync>(
    client: &C,
    action: Uuid,
) -> Result<Vec<AuditRow>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM operator_actions WHERE action = $1 ORDER BY id");
    let rows = client.query(&sql, &[&action]).await?;
    Ok(rows.iter().map(row).collect())
}
