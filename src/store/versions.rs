//! The last applied version of each aggregate (`aggregate_versions`), read and moved inside
//! the batch's transaction. See `crate::version` for what is applied.
//!
//! Optimistic, like the seed's `UPDATE ... WHERE version = 7`: [`read`] locks the rows that
//! exist (in aggregate order, so two transactions cannot deadlock on them), and [`advance`]
//! moves each aggregate only from the version this transaction read. An aggregate no
//! transaction has stored yet has no row to lock; if another transaction stores it first,
//! [`advance`] finds the version moved and says so, and the caller retries the batch, which then
//! reads and locks the row.

use std::collections::HashMap;

use deadpool_postgres::GenericClient;

use super::StoreError;

const READ: &str = "\
SELECT aggregate, version FROM aggregate_versions
WHERE consumer = $1 AND aggregate = ANY($2::text[])
ORDER BY aggregate
FOR UPDATE";

/// The stored version of each of `aggregates` that has one, locked until the transaction ends.
pub async fn read<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    aggregates: &[&str],
) -> Result<HashMap<String, i64>, StoreError> {
    let stmt = tx.prepare_cached(READ).await?;
    let rows = tx.query(&stmt, &[&consumer, &aggregates]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

// `$3` is the version each aggregate had when read (0: no row). The conflict update applies
// only over that version, so a row another transaction created or moved meanwhile is left
// alone and missing from RETURNING.
const ADVANCE: &str = "\
INSERT INTO aggregate_versions AS v (consumer, aggregate, version)
SELECT $1, a.aggregate, a.version
FROM unnest($2::text[], $4::int8[]) AS a(aggregate, version)
ORDER BY a.aggregate
ON CONFLICT (consumer, aggregate) DO UPDATE
SET version = EXCLUDED.version, updated_at = now()
WHERE v.version = (SELECT f.version FROM unnest($2::text[], $3::int8[]) AS f(aggregate, version)
                   WHERE f.aggregate = EXCLUDED.aggregate)
RETURNING v.aggregate";

/// Another transaction moved an aggregate's version between [`read`] and [`advance`].
#[derive(Debug, thiserror::Error)]
#[error("the version of aggregate {aggregate:?} moved under this transaction; retry the batch")]
pub struct Moved {
    pub aggregate: String,
}

/// Moves each aggregate of `advanced` from the version `read` found (absent: none) to its new
/// one. Fails with [`Moved`] (inside `Ok`) when one had moved meanwhile: the caller must roll
/// back and retry, since the plan was made on a version that is no longer there.
pub async fn advance<C: GenericClient + Sync>(
    tx: &C,
    consumer: &str,
    read: &HashMap<String, i64>,
    advanced: &HashMap<String, i64>,
) -> Result<Result<(), Moved>, StoreError> {
    if advanced.is_empty() {
        return Ok(Ok(()));
    }
    let mut aggregates: Vec<&str> = advanced.keys().map(String::as_str).collect();
    aggregates.sort_unstable();
    let from: Vec<i64> = aggregates
        .iter()
        .map(|a| read.get(*a).copied().unwrap_or(0))
        .collect();
    let to: Vec<i64> = aggregates.iter().map(|a| advanced[*a]).collect();
    let stmt = tx.prepare_cached(ADVANCE).await?;
    let rows = tx
        .query(&stmt, &[&consumer, &aggregates, &from, &to])
        .await?;
    if rows.len() == aggregates.len() {
        return Ok(Ok(()));
    }
    let done: std::collections::HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
    let aggregate = aggregates
        .iter()
        .find(|a| !done.contains(**a))
        .map_or_else(String::new, |a| a.to_string());
    Ok(Err(Moved { aggregate }))
}
