//! Replay or discard FAILED inbox rows; retry or discard FAILED notifications. Both change rows
//! in place, in chunks, each chunk with its audit row in its transaction.
//!
//! A FAILED inbox row was never applied (a row becomes DONE only in the transaction of its
//! effect), so replaying it applies it once. A FAILED notification keeps its idempotency key
//! when retried: if a provider did act on an earlier call, it answers the retry from its own
//! record of that key instead of sending again.

use chrono::{DateTime, Utc};
use deadpool_postgres::Pool;
use uuid::Uuid;

use super::{describe, Actor, Done, InboxRows, Notifications, OperatorError};
use crate::store::audit;
use crate::store::inbox::ReplayFilter;
use crate::store::parked::{Filter, INBOX_WHERE};

/// The filter and the one message id an inbox selection stands for.
fn inbox_parts(sel: &InboxRows) -> (Filter, Option<Uuid>) {
    match sel {
        InboxRows::Id {
            consumer,
            message_id,
        } => (
            Filter {
                consumer: Some(consumer.clone()),
                ..Filter::default()
            },
            Some(*message_id),
        ),
        InboxRows::Matching(f) => (f.clone(), None),
    }
}

fn inbox_filter(sel: &InboxRows) -> serde_json::Value {
    match sel {
        InboxRows::Id {
            consumer,
            message_id,
        } => serde_json::json!({ "consumer": consumer, "message_id": message_id }),
        InboxRows::Matching(f) => describe(f),
    }
}

/// Exactly how many FAILED inbox rows `sel` takes.
pub async fn count_inbox(pool: &Pool, sel: &InboxRows) -> Result<u64, OperatorError> {
    let (f, id) = inbox_parts(sel);
    if !f.takes_inbox() {
        return Ok(0);
    }
    let sql = format!(
        "SELECT count(*) FROM inbox WHERE {INBOX_WHERE} AND ($7::uuid IS NULL OR message_id = $7)"
    );
    let client = pool.get().await?;
    let n: i64 = client.query_one(&sql, &f.params(&[&id])).await?.get(0);
    Ok(n as u64)
}

/// `SET` clauses of the two inbox actions.
const REPLAY_SET: &str = "status = 'PENDING', attempts = 0, next_attempt_at = now(), \
                          lease_until = NULL, claim_token = NULL, done_at = NULL";
const DISCARD_SET: &str = "status = 'DISCARDED', lease_until = NULL, claim_token = NULL";

/// Puts the FAILED inbox rows of `sel` back to PENDING (attempts reset); the processors apply
/// them in their key's order.
pub async fn replay_inbox(
    pool: &Pool,
    sel: &InboxRows,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    change_inbox(pool, sel, who, note, "replay", REPLAY_SET).await
}

/// Gives up the FAILED inbox rows of `sel`: status DISCARDED, bytes kept, never applied.
pub async fn discard_inbox(
    pool: &Pool,
    sel: &InboxRows,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    change_inbox(pool, sel, who, note, "discard", DISCARD_SET).await
}

async fn change_inbox(
    pool: &Pool,
    sel: &InboxRows,
    who: &Actor,
    note: Option<&str>,
    verb: &str,
    set: &str,
) -> Result<Done, OperatorError> {
    let action = Uuid::now_v7();
    let filter = inbox_filter(sel);
    let (f, id) = inbox_parts(sel);
    // Chunks in seq order; the partition key (event_date) is in the join so each row is found
    // by its primary key.
    let sql = format!(
        "WITH picked AS (
             SELECT consumer, message_id, event_date, seq FROM inbox
             WHERE {INBOX_WHERE} AND ($7::uuid IS NULL OR message_id = $7) AND seq > $8
             ORDER BY seq LIMIT $9 FOR UPDATE SKIP LOCKED
         )
         UPDATE inbox i SET {set}
         FROM picked p
         WHERE i.consumer = p.consumer AND i.message_id = p.message_id
           AND i.event_date = p.event_date
         RETURNING i.seq"
    );
    let entry = audit::Entry {
        action,
        actor: &who.0,
        verb,
        target: "inbox",
        filter: &filter,
        count: 0,
        note,
    };
    let done = if f.takes_inbox() {
        super::in_chunks(pool, &sql, &f, &id, &[], &entry).await?
    } else {
        super::audit_nothing(pool, &entry).await?;
        0
    };
    Ok(Done {
        action,
        count: done,
    })
}

/// `effectively inbox replay` without `--failed`: FAILED and DONE rows of `consumer` back to
/// PENDING in one statement, with its audit row. Replaying DONE rows applies their effect
/// again: safe only for an effect that keeps its own business key.
pub async fn replay_inbox_done(
    pool: &Pool,
    consumer: &str,
    filter: &ReplayFilter,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    let action = Uuid::now_v7();
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let n = crate::store::inbox::replay(&*tx, consumer, filter).await?;
    let described = serde_json::json!({
        "consumer": consumer,
        "failed_only": filter.failed_only,
        "since": filter.since,
        "key": filter.key,
    });
    audit::record(
        &*tx,
        &audit::Entry {
            action,
            actor: &who.0,
            verb: "replay",
            target: "inbox",
            filter: &described,
            count: n as i64,
            note,
        },
    )
    .await?;
    tx.commit().await?;
    Ok(Done { action, count: n })
}

/// The notification selection as `($1 channel, $2 since, $3 event id)`.
fn notification_parts(
    sel: &Notifications,
) -> (Option<String>, Option<DateTime<Utc>>, Option<Uuid>) {
    match sel {
        Notifications::Id { event_id, channel } => (Some(channel.clone()), None, Some(*event_id)),
        Notifications::Matching { channel, since } => (channel.clone(), *since, None),
    }
}

fn notification_filter(sel: &Notifications) -> serde_json::Value {
    match sel {
        Notifications::Id { event_id, channel } => {
            serde_json::json!({ "event_id": event_id, "channel": channel })
        }
        Notifications::Matching { channel, since } => {
            serde_json::json!({ "channel": channel, "since": since })
        }
    }
}

const NOTIFICATION_WHERE: &str = "status = 'FAILED'
  AND ($1::text IS NULL OR channel = $1)
  AND ($2::timestamptz IS NULL OR created_at >= $2)
  AND ($3::uuid IS NULL OR event_id = $3)";

/// Exactly how many FAILED notifications `sel` takes.
pub async fn count_notifications(pool: &Pool, sel: &Notifications) -> Result<u64, OperatorError> {
    let (channel, since, id) = notification_parts(sel);
    let client = pool.get().await?;
    let n: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM notifications WHERE {NOTIFICATION_WHERE}"),
            &[&channel, &since, &id],
        )
        .await?
        .get(0);
    Ok(n as u64)
}

/// Puts the FAILED notifications of `sel` back to PENDING (attempts reset, same idempotency
/// key): the senders call the provider again.
pub async fn retry_notifications(
    pool: &Pool,
    sel: &Notifications,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    change_notifications(
        pool,
        sel,
        who,
        note,
        "retry",
        "status = 'PENDING', attempts = 0, next_attempt_at = now(), sending_since = NULL",
    )
    .await
}

/// Gives up the FAILED notifications of `sel`: status DISCARDED, never sent.
pub async fn discard_notifications(
    pool: &Pool,
    sel: &Notifications,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    change_notifications(pool, sel, who, note, "discard", "status = 'DISCARDED'").await
}

async fn change_notifications(
    pool: &Pool,
    sel: &Notifications,
    who: &Actor,
    note: Option<&str>,
    verb: &str,
    set: &str,
) -> Result<Done, OperatorError> {
    let action = Uuid::now_v7();
    let (channel, since, id) = notification_parts(sel);
    let filter = notification_filter(sel);
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let n = tx
        .execute(
            &format!("UPDATE notifications SET {set} WHERE {NOTIFICATION_WHERE}"),
            &[&channel, &since, &id],
        )
        .await?;
    audit::record(
        &*tx,
        &audit::Entry {
            action,
            actor: &who.0,
            verb,
            target: "notifications",
            filter: &filter,
            count: n as i64,
            note,
        },
    )
    .await?;
    tx.commit().await?;
    Ok(Done { action, count: n })
}
