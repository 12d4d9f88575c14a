//! The operator's way back for parked rows: redrive or discard dead letters, replay or discard
//! FAILED inbox rows, retry or discard FAILED notifications. The CLI (`effectively dead-letters
//! | inbox | notifications`) and the console call these same functions.
//!
//! Every action writes its audit row (`operator_actions`, [`crate::store::audit`]) in the
//! transaction that makes the change, so the audit cannot miss a change or record one that
//! rolled back. Large selections are worked in chunks of [`CHUNK`] rows, one transaction and one
//! audit row each, all under one action id; a crash between chunks leaves the committed chunks
//! done and the rest as they were. Nothing is deleted: a dead letter keeps its bytes with its
//! `resolution`, an inbox row or notification its row with status DISCARDED.
//!
//! How a redrive stays exactly-once is [`redrive`]'s business (docs/OPERATIONS.md, "Parked
//! messages").

pub mod control;
mod dead_letters;
mod rows;
pub mod show;

pub use dead_letters::{discard_dead_letters, redrive, Redriver};
pub use rows::{
    count_inbox, count_notifications, discard_inbox, discard_notifications, replay_inbox,
    replay_inbox_done, retry_notifications,
};

use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::store::audit;
use crate::store::parked::Filter;
use crate::store::StoreError;

/// Rows per transaction of a large action.
pub const CHUNK: i64 = 500;

/// Who acts: `cli:<user>` or `console:<peer>`, recorded in the audit row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor(pub String);

impl Actor {
    /// The CLI's user: `$USER` (or `$LOGNAME`), as the operating system says who runs it.
    pub fn cli() -> Actor {
        let user = std::env::var("USER")
            .or_else(|_| std::env::var("LOGNAME"))
            .unwrap_or_else(|_| "unknown".into());
        Actor(format!("cli:{user}"))
    }
}

/// Which dead letters: one by id, or every parked one matching a filter.
#[derive(Debug, Clone, PartialEq)]
pub enum DeadLetters {
    Id(i64),
    Matching(Filter),
}

/// Which FAILED inbox rows: one, or every one matching a filter.
#[derive(Debug, Clone, PartialEq)]
pub enum InboxRows {
    Id { consumer: String, message_id: Uuid },
    Matching(Filter),
}

/// Which FAILED notifications: one, or every one of a channel (all channels when `None`)
/// created since a time.
#[derive(Debug, Clone, PartialEq)]
pub enum Notifications {
    Id {
        event_id: Uuid,
        channel: String,
    },
    Matching {
        channel: Option<String>,
        since: Option<chrono::DateTime<chrono::Utc>>,
    },
}

/// What an action did: its audit id and how many rows it changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    pub action: Uuid,
    pub count: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum OperatorError {
    #[error("database: {0}")]
    Store(#[from] StoreError),
    #[error("connection pool: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("Kafka settings: {0}")]
    KafkaSettings(String),
    #[error("Kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    /// A redrive's copy was not acknowledged: its chunk rolled back, its rows stay parked.
    #[error(
        "redrive of dead letter {id} to {topic:?} not acknowledged: {reason} \
         ({done} row(s) redriven before it; the rest stay parked, a second redrive is safe)"
    )]
    Produce {
        id: i64,
        topic: String,
        reason: String,
        done: u64,
    },
}

impl From<tokio_postgres::Error> for OperatorError {
    fn from(e: tokio_postgres::Error) -> Self {
        OperatorError::Store(StoreError::from(e))
    }
}

/// An action that matched nothing is audited too (count 0): an operator looking for what was
/// done finds that it was tried.
async fn audit_nothing(
    pool: &deadpool_postgres::Pool,
    entry: &audit::Entry<'_>,
) -> Result<(), OperatorError> {
    let client = pool.get().await?;
    let nothing = audit::Entry {
        count: 0,
        ..entry.clone()
    };
    audit::record(&**client, &nothing).await?;
    Ok(())
}

/// Runs `sql` chunk after chunk until it changes nothing: an `UPDATE ... RETURNING <key>`
/// whose parameters are the filter (`$1..$6`), one row's id or NULL (`$7`), the last key done
/// (`$8`), the chunk's size (`$9`) and `extra` (`$10..`). Each chunk commits with its audit
/// row (`entry`, counting the chunk's rows); an action that changed nothing is audited with 0.
async fn in_chunks(
    pool: &deadpool_postgres::Pool,
    sql: &str,
    f: &Filter,
    one: &(dyn ToSql + Sync),
    extra: &[&(dyn ToSql + Sync)],
    entry: &audit::Entry<'_>,
) -> Result<u64, OperatorError> {
    let chunk = CHUNK * 10;
    let mut done = 0u64;
    let mut after = 0i64;
    loop {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        let keys: Vec<i64> = {
            let mut params = f.params(&[one, &after, &chunk]);
            params.extend_from_slice(extra);
            tx.query(sql, &params)
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect()
        };
        if keys.is_empty() {
            break;
        }
        after = keys.iter().copied().max().unwrap_or(after);
        let n = keys.len() as i64;
        audit::record(
            &*tx,
            &audit::Entry {
                count: n,
                ..entry.clone()
            },
        )
        .await?;
        tx.commit().await?;
        done += n as u64;
    }
    if done == 0 {
        audit_nothing(pool, entry).await?;
    }
    Ok(done)
}

/// The selection as the audit row's `filter`.
fn describe<T: serde::Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or(serde_json::Value::Null)
}

/// The `filter` column of a dead-letter action.
fn dead_letters_filter(sel: &DeadLetters) -> serde_json::Value {
    match sel {
        DeadLetters::Id(id) => serde_json::json!({ "id": id }),
        DeadLetters::Matching(f) => describe(f),
    }
}

/// The filter and the one id a dead-letter selection stands for.
fn dead_letters_parts(sel: &DeadLetters) -> (Filter, Option<i64>) {
    match sel {
        DeadLetters::Id(id) => (Filter::default(), Some(*id)),
        DeadLetters::Matching(f) => (f.clone(), None),
    }
}

/// Exactly how many parked dead letters `sel` takes (the confirmation step's number).
pub async fn count_dead_letters(
    pool: &deadpool_postgres::Pool,
    sel: &DeadLetters,
) -> Result<u64, OperatorError> {
    let client = pool.get().await?;
    let (f, id) = dead_letters_parts(sel);
    let sql = format!(
        "SELECT count(*) FROM dead_letters WHERE {}
           AND ($7::int8 IS NULL OR id = $7)",
        crate::store::parked::DEAD_LETTER_WHERE
    );
    let n: i64 = client.query_one(&sql, &f.params(&[&id])).await?.get(0);
    Ok(n as u64)
}
