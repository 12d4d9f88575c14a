//! Retention: keep dedupe keys longer than any redelivery, and drop them a whole day at a
//! time. Dropping a daily partition costs almost nothing, where batched `DELETE`s leave dead
//! rows for vacuum and are what deadlock or time out in the peers' cleanup jobs.
//!
//! A partition (one event date) is dropped when it is older than the longest retention any
//! consumer declared (`retention_policies`) plus one day of margin: the retention guard
//! refuses copies older than the window, so nothing can still be inserted into a partition
//! that is dropped. Only one instance runs maintenance at a time (an advisory lock), however
//! many workers there are; the others skip it.

use chrono::{Days, NaiveDate};
use tokio_postgres::Client;

use super::partitions::{self, Size, PARENT};
use super::StoreError;

/// Held by the instance that runs maintenance.
const MAINTENANCE_LOCK: i64 = 0x6566_6665_6374_0002;

/// Days kept after the retention window before a partition is dropped.
pub const MARGIN_DAYS: u64 = 1;

/// Records `consumer`'s retention so that no instance drops what it still needs.
pub async fn declare(
    client: &Client,
    consumer: &str,
    retention_days: i32,
) -> Result<(), StoreError> {
    client
        .execute(
            "INSERT INTO retention_policies (consumer, retention_days) VALUES ($1, $2)
             ON CONFLICT (consumer) DO UPDATE
             SET retention_days = EXCLUDED.retention_days, updated_at = now()",
            &[&consumer, &retention_days],
        )
        .await?;
    Ok(())
}

/// The longest retention declared, in days, if any.
pub async fn longest(client: &Client) -> Result<Option<i32>, StoreError> {
    Ok(client
        .query_one("SELECT max(retention_days) FROM retention_policies", &[])
        .await?
        .get(0))
}

/// What a maintenance run will do.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub today: NaiveDate,
    pub retention_days: i32,
    /// Partitions of these dates are dropped (older than retention + margin).
    pub drop_before: NaiveDate,
    pub create: Vec<NaiveDate>,
    pub drop: Vec<NaiveDate>,
    pub partitions: Vec<Size>,
}

/// Computes the plan for `today`, creating `ahead` days ahead.
pub async fn plan(
    client: &Client,
    today: NaiveDate,
    ahead: u32,
    retention_days: i32,
) -> Result<Plan, StoreError> {
    let partitions = partitions::sizes(client).await?;
    let drop_before = today - Days::new(retention_days.max(1) as u64 + MARGIN_DAYS);
    let existing: Vec<NaiveDate> = partitions.iter().map(|s| s.date).collect();
    let create = (0..=ahead as u64)
        .map(|d| today + Days::new(d))
        .filter(|d| !existing.contains(d))
        .collect();
    let drop = existing
        .iter()
        .copied()
        .filter(|d| *d < drop_before)
        .collect();
    Ok(Plan {
        today,
        retention_days,
        drop_before,
        create,
        drop,
        partitions,
    })
}

/// What a run did.
#[derive(Debug, Clone, PartialEq)]
pub enum Ran {
    /// Another instance holds the maintenance lock.
    Skipped,
    Done {
        created: Vec<NaiveDate>,
        dropped: Vec<NaiveDate>,
    },
}

/// Creates partitions ahead and drops those past retention, if this instance gets the lock.
/// `client` must not be inside a transaction (`DETACH ... CONCURRENTLY` cannot be).
pub async fn run(
    client: &Client,
    known: &partitions::Known,
    today: NaiveDate,
    ahead: u32,
    fallback_retention_days: i32,
) -> Result<Ran, StoreError> {
    let got: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&MAINTENANCE_LOCK])
        .await?
        .get(0);
    if !got {
        return Ok(Ran::Skipped);
    }
    let result = run_locked(client, known, today, ahead, fallback_retention_days).await;
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MAINTENANCE_LOCK])
        .await;
    result
}

async fn run_locked(
    client: &Client,
    known: &partitions::Known,
    today: NaiveDate,
    ahead: u32,
    fallback_retention_days: i32,
) -> Result<Ran, StoreError> {
    let retention = longest(client).await?.unwrap_or(fallback_retention_days);
    let p = plan(client, today, ahead, retention).await?;
    known.ensure(client, p.create.iter().copied()).await?;
    let mut dropped = Vec::new();
    for date in &p.drop {
        let open = open_inbox_rows(client, *date).await?;
        if open > 0 {
            tracing::error!(%date, open, "not dropping the partitions of a day past retention: \
                its inbox still holds PENDING, IN_PROGRESS, FAILED or HELD rows (process, replay \
                or delete them, or fill the versions HELD rows wait for; see `effectively inbox \
                status`)");
            continue;
        }
        drop_partition(client, *date).await?;
        known.forget(*date);
        dropped.push(*date);
        tracing::info!(%date, retention_days = retention, "dropped dedupe and inbox partitions past retention");
    }
    Ok(Ran::Done {
        created: p.create,
        dropped,
    })
}

/// Rows of the inbox partition of `date` that are neither DONE nor DISCARDED (given up by an
/// operator): work that dropping would lose.
pub async fn open_inbox_rows(client: &Client, date: NaiveDate) -> Result<i64, StoreError> {
    let name = partitions::inbox_name_for(date);
    let exists: Option<String> = client
        .query_one("SELECT to_regclass($1)::text", &[&name])
        .await?
        .get(0);
    if exists.is_none() {
        return Ok(0);
    }
    let sql = format!("SELECT count(*) FROM {name} WHERE status NOT IN ('DONE', 'DISCARDED')");
    Ok(client.query_one(&sql, &[]).await?.get(0))
}

/// Detaches the day's partitions (inbox and dedupe ledger) without blocking writers of the
/// other partitions, then drops them. A detach interrupted earlier (left pending) is finalized
/// first. The caller checks the inbox partition holds no open rows.
pub async fn drop_partition(client: &Client, date: NaiveDate) -> Result<(), StoreError> {
    detach_and_drop(client, partitions::INBOX, &partitions::inbox_name_for(date)).await?;
    detach_and_drop(client, PARENT, &partitions::name_for(date)).await
}

async fn detach_and_drop(client: &Client, parent: &str, name: &str) -> Result<(), StoreError> {
    let pending: Option<bool> = client
        .query_opt(
            "SELECT i.inhdetachpending FROM pg_inherits i
             JOIN pg_class c ON c.oid = i.inhrelid WHERE c.relname = $1",
            &[&name],
        )
        .await?
        .map(|r| r.get(0));
    match pending {
        Some(true) => {
            client
                .batch_execute(&format!(
                    "ALTER TABLE {parent} DETACH PARTITION {name} FINALIZE"
                ))
                .await?
        }
        Some(false) => {
            client
                .batch_execute(&format!(
                    "ALTER TABLE {parent} DETACH PARTITION {name} CONCURRENTLY"
                ))
                .await?
        }
        None => {} // already detached, or never created
    }
    client
        .batch_execute(&format!("DROP TABLE IF EXISTS {name}"))
        .await?;
    Ok(())
}

/// The seed's sizing formula, records = rate x period, with the bytes per row measured on the
/// live dedupe table when it has rows (else the seed's 100 bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct Sizing {
    pub rows: f64,
    pub bytes_per_row: f64,
    pub heap_bytes_per_row: f64,
    pub measured: bool,
    pub bytes: f64,
    pub heap_bytes: f64,
    pub partitions: u64,
}

pub async fn size(client: &Client, rate: f64, days: u64, ahead: u32) -> Result<Sizing, StoreError> {
    let row = client
        .query_one(
            "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float8,
                    coalesce(sum(pg_total_relation_size(c.oid)), 0)::float8,
                    coalesce(sum(pg_relation_size(c.oid)), 0)::float8
             FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = $1",
            &[&PARENT],
        )
        .await?;
    let (tuples, total, heap): (f64, f64, f64) = (row.get(0), row.get(1), row.get(2));
    let measured = tuples >= 1000.0;
    let (per_row, heap_per_row) = if measured {
        (total / tuples, heap / tuples)
    } else {
        (100.0, 60.0)
    };
    let rows = rate * 86_400.0 * days as f64;
    Ok(Sizing {
        rows,
        bytes_per_row: per_row,
        heap_bytes_per_row: heap_per_row,
        measured,
        bytes: rows * per_row,
        heap_bytes: rows * heap_per_row,
        partitions: days + MARGIN_DAYS + 1 + ahead as u64,
    })
}

/// What dropping a day costs against deleting it, measured on two identical partitions.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DropVsDelete {
    pub keys: i64,
    pub delete_batch: i64,
    pub delete_seconds: f64,
    pub delete_wal_bytes: i64,
    pub drop_seconds: f64,
    pub drop_wal_bytes: i64,
    /// How many times longer the batched delete took.
    pub time_ratio: f64,
    pub wal_ratio: f64,
}

async fn wal_lsn(client: &Client) -> Result<String, StoreError> {
    Ok(client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0))
}

async fn wal_since(client: &Client, lsn: &str) -> Result<i64, StoreError> {
    Ok(client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::bigint",
            &[&lsn],
        )
        .await?
        .get(0))
}

/// Fills two old dates' partitions with `keys` keys each, then empties one with batched
/// `DELETE`s of `batch` rows (the peers' cleanup jobs) and drops the other, timing both and
/// counting the WAL each writes.
pub async fn bench_drop_vs_delete(
    client: &Client,
    keys: i64,
    batch: i64,
) -> Result<DropVsDelete, StoreError> {
    let (a, b) = (
        NaiveDate::from_ymd_opt(1999, 1, 1).expect("a date"),
        NaiveDate::from_ymd_opt(1999, 1, 2).expect("a date"),
    );
    for d in [a, b] {
        bench_fill(client, d, keys).await?;
    }
    client.batch_execute("CHECKPOINT").await?;
    let start = std::time::Instant::now();
    let lsn = wal_lsn(client).await?;
    let table_a = partitions::name_for(a);
    loop {
        let n = client
            .execute(
                &format!(
                    "DELETE FROM {table_a} WHERE ctid IN (SELECT ctid FROM {table_a} LIMIT $1)"
                ),
                &[&batch],
            )
            .await?;
        if n == 0 {
            break;
        }
    }
    let delete_seconds = start.elapsed().as_secs_f64();
    let delete_wal_bytes = wal_since(client, &lsn).await?;
    let start = std::time::Instant::now();
    let lsn = wal_lsn(client).await?;
    drop_partition(client, b).await?;
    let drop_seconds = start.elapsed().as_secs_f64();
    let drop_wal_bytes = wal_since(client, &lsn).await?;
    drop_partition(client, a).await?;
    Ok(DropVsDelete {
        keys,
        delete_batch: batch,
        delete_seconds,
        delete_wal_bytes,
        drop_seconds,
        drop_wal_bytes,
        time_ratio: delete_seconds / drop_seconds.max(1e-6),
        wal_ratio: delete_wal_bytes as f64 / (drop_wal_bytes.max(1)) as f64,
    })
}

/// A fresh partition for `date` holding `keys` random dedupe keys (benchmarks only).
pub async fn bench_fill(client: &Client, date: NaiveDate, keys: i64) -> Result<(), StoreError> {
    drop_partition(client, date).await?;
    partitions::Known::default().ensure(client, [date]).await?;
    client
        .execute(
            "INSERT INTO processed_messages (consumer, message_id, event_date)
             SELECT 'bench-retention', gen_random_uuid(), $1 FROM generate_series(1, $2::bigint)",
            &[&date, &keys],
        )
        .await?;
    Ok(())
}
