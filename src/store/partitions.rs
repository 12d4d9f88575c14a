//! Daily partitions of `processed_messages`, named `processed_messages_pYYYYMMDD` and covering
//! one event date each. The engine creates them ahead of need and on demand for a date it has
//! not seen; dropping them past retention is the retention module's job.
//!
//! DDL runs outside the batch transaction, on its own connection: `CREATE TABLE ... PARTITION
//! OF` locks the parent, and holding that lock for a whole batch would stall every other
//! partition's transaction.

use std::collections::HashSet;
use std::sync::Mutex;

use chrono::{Days, NaiveDate};
use tokio_postgres::GenericClient;

use super::StoreError;

pub const PARENT: &str = "processed_messages";

/// The inbox strategy's table, partitioned by the same event dates: each date's partition of it
/// is created and dropped together with the dedupe ledger's.
pub const INBOX: &str = "inbox";

/// The partition's table name for `date`.
pub fn name_for(date: NaiveDate) -> String {
    format!("{PARENT}_p{}", date.format("%Y%m%d"))
}

/// The inbox partition's table name for `date`.
pub fn inbox_name_for(date: NaiveDate) -> String {
    format!("{INBOX}_p{}", date.format("%Y%m%d"))
}

/// Creates the partitions for `date` (dedupe ledger and inbox) if they do not exist. Two
/// workers racing to create the same partition both succeed.
pub async fn create<C: GenericClient + Sync>(
    client: &C,
    date: NaiveDate,
) -> Result<(), StoreError> {
    let next = date + Days::new(1);
    for (parent, name) in [(PARENT, name_for(date)), (INBOX, inbox_name_for(date))] {
        let sql = format!(
            "CREATE TABLE IF NOT EXISTS {name} PARTITION OF {parent} FOR VALUES FROM ('{}') TO ('{}')",
            date.format("%Y-%m-%d"),
            next.format("%Y-%m-%d"),
        );
        match client.batch_execute(&sql).await {
            Ok(()) => {}
            // A concurrent CREATE ... IF NOT EXISTS can still lose the race on the catalog's
            // unique index (23505) or find the relation created in between (42P07): it exists.
            Err(e)
                if e.code().is_some_and(|c| {
                    c == &tokio_postgres::error::SqlState::UNIQUE_VIOLATION
                        || c == &tokio_postgres::error::SqlState::DUPLICATE_TABLE
                }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// One daily partition's size, from the catalog's estimates (cheap: no scan).
#[derive(Debug, Clone, PartialEq)]
pub struct Size {
    pub date: NaiveDate,
    pub rows: f64,
    pub bytes: f64,
}

/// Every daily partition with its estimated rows and its bytes, indexes included.
pub async fn sizes<C: GenericClient + Sync>(client: &C) -> Result<Vec<Size>, StoreError> {
    let rows = client
        .query(
            "SELECT c.relname, greatest(c.reltuples, 0)::float8,
                    pg_total_relation_size(c.oid)::float8
             FROM pg_inherits i
             JOIN pg_class c ON c.oid = i.inhrelid
             JOIN pg_class p ON p.oid = i.inhparent
             WHERE p.relname = $1 ORDER BY 1",
            &[&PARENT],
        )
        .await?;
    let prefix = format!("{PARENT}_p");
    Ok(rows
        .iter()
        .filter_map(|r| {
            let name: &str = r.get(0);
            let date = NaiveDate::parse_from_str(name.strip_prefix(&prefix)?, "%Y%m%d").ok()?;
            Some(Size {
                date,
                rows: r.get(1),
                bytes: r.get(2),
            })
        })
        .collect())
}

/// Remembers which dates have a partition, so the hot path asks the database only for a date
/// it has not seen yet.
#[derive(Debug, Default)]
pub struct Known {
    dates: Mutex<HashSet<NaiveDate>>,
}

impl Known {
    /// Makes sure every date in `dates` has a partition.
    pub async fn ensure<C: GenericClient + Sync>(
        &self,
        client: &C,
        dates: impl IntoIterator<Item = NaiveDate>,
    ) -> Result<(), StoreError> {
        let missing: Vec<NaiveDate> = {
            let known = self.dates.lock().unwrap_or_else(|p| p.into_inner());
            let mut m: Vec<NaiveDate> = dates.into_iter().filter(|d| !known.contains(d)).collect();
            m.sort_unstable();
            m.dedup();
            m
        };
        for date in missing {
            create(client, date).await?;
            self.dates
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(date);
        }
        Ok(())
    }

    /// Forgets a date (its partition was dropped).
    pub fn forget(&self, date: NaiveDate) {
        self.dates
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&date);
    }

    /// Creates today's partition and the `ahead` days after it.
    pub async fn create_ahead<C: GenericClient + Sync>(
        &self,
        client: &C,
        today: NaiveDate,
        ahead: u32,
    ) -> Result<(), StoreError> {
        let dates = (0..=ahead as u64).map(|d| today + Days::new(d));
        self.ensure(client, dates).await
    }
}
