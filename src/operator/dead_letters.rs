//! Redrive and discard dead letters.
//!
//! A redrive produces each parked record back to its own topic, with the same key, headers and
//! bytes (plus `effectively-redrive` and `effectively-redriven-from` headers, and any the
//! operator set), through an idempotent producer, so the copy takes the normal exactly-once
//! path: a message whose key was applied meanwhile is skipped as a duplicate, one that still
//! cannot be applied is parked again at its new offset. Per chunk, in one transaction:
//!
//! 1. lock the chunk's parked rows (`FOR UPDATE SKIP LOCKED`: a concurrent redrive takes
//!    others);
//! 2. produce every row's copy and wait for the broker's acknowledgements;
//! 3. mark the rows `redriven` (with where each copy landed) and write the audit row;
//! 4. `COMMIT`.
//!
//! A crash or error before 4 leaves the chunk parked; the copies already produced are harmless,
//! because a second redrive's copies are the same messages again and the dedupe key applies the
//! message once. A crash after 4 leaves it redriven. So a row is always either redriven or still
//! parked, and redriving twice doubles nothing.

use std::time::Duration;

use deadpool_postgres::Pool;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

use super::{dead_letters_filter, dead_letters_parts, Actor, DeadLetters, Done, OperatorError};
use crate::config::KafkaConfig;
use crate::store::audit;
use crate::store::parked::DEAD_LETTER_WHERE;

/// Header naming the redrive action (its audit id) on every copy.
pub const REDRIVE_HEADER: &str = "effectively-redrive";
/// Header naming where the copy was parked: `topic/partition@offset`.
pub const REDRIVEN_FROM_HEADER: &str = "effectively-redriven-from";

/// The producer a redrive sends its copies with.
pub struct Redriver {
    producer: FutureProducer,
    /// Headers added to every copy, replacing a header of the same name.
    headers: Vec<(String, String)>,
}

impl Redriver {
    /// An idempotent producer (acks = all) on `kafka`'s brokers and security settings.
    pub fn new(kafka: &KafkaConfig) -> Result<Redriver, OperatorError> {
        let config = kafka
            .client_config(&[
                ("enable.idempotence", "true".into()),
                ("acks", "all".into()),
                ("linger.ms", "5".into()),
                // A broker that does not acknowledge within this rolls the chunk back.
                ("message.timeout.ms", "30000".into()),
            ])
            .map_err(OperatorError::KafkaSettings)?;
        Ok(Redriver {
            producer: config.create()?,
            headers: Vec::new(),
        })
    }

    /// Adds (or replaces) header `name` on every copy.
    pub fn header(mut self, name: &str, value: &str) -> Redriver {
        self.headers.retain(|(n, _)| n != name);
        self.headers.push((name.to_string(), value.to_string()));
        self
    }
}

/// One parked row, as a chunk reads it.
struct Row {
    id: i64,
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
    header_names: Vec<String>,
    header_values: Vec<Option<Vec<u8>>>,
    payload: Option<Vec<u8>>,
}

fn chunk_sql(lock: &str) -> String {
    format!(
        "SELECT id, topic, partition, \"offset\", key, header_names, header_values, payload
         FROM dead_letters WHERE {DEAD_LETTER_WHERE}
           AND ($7::int8 IS NULL OR id = $7) AND id > $8
         ORDER BY id LIMIT $9 {lock}"
    )
}

const MARK: &str = "\
UPDATE dead_letters d
SET resolution = $1, resolved_at = now(), resolved_by = $2, resolved_action = $3,
    redriven_to = m.redriven_to
FROM unnest($4::int8[], $5::text[]) AS m(id, redriven_to)
WHERE d.id = m.id AND d.resolution IS NULL";

/// Redrives the parked dead letters of `sel` (module docs). Returns how many were redriven;
/// on an error, the chunks committed before it stay redriven (the error says how many).
pub async fn redrive(
    pool: &Pool,
    redriver: &Redriver,
    sel: &DeadLetters,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    let action = Uuid::now_v7();
    let filter = dead_letters_filter(sel);
    let (f, id) = dead_letters_parts(sel);
    let select = chunk_sql("FOR UPDATE SKIP LOCKED");
    let mut done = 0u64;
    let mut after = 0i64;
    loop {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        let rows = tx
            .query(&select, &f.params(&[&id, &after, &super::CHUNK]))
            .await?;
        if rows.is_empty() {
            break;
        }
        let rows: Vec<Row> = rows
            .iter()
            .map(|r| Row {
                id: r.get(0),
                topic: r.get(1),
                partition: r.get(2),
                offset: r.get(3),
                key: r.get(4),
                header_names: r.get(5),
                header_values: r.get(6),
                payload: r.get(7),
            })
            .collect();
        after = rows.last().map_or(after, |r| r.id);
        let landed = produce(redriver, &rows, action, done).await?;
        // A crash here: the copies are in Kafka and the rows still parked (tests/operator.rs).
        fail::fail_point!("redrive_before_mark", |_| std::process::abort());
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let n = tx
            .execute(MARK, &[&"redriven", &who.0, &action, &ids, &landed])
            .await?;
        audit::record(
            &*tx,
            &audit::Entry {
                action,
                actor: &who.0,
                verb: "redrive",
                target: "dead_letters",
                filter: &filter,
                count: n as i64,
                note,
            },
        )
        .await?;
        tx.commit().await?;
        done += n;
        tracing::info!(%action, rows = n, total = done, "dead letters redriven");
        if id.is_some() {
            break;
        }
    }
    if done == 0 {
        let entry = audit::Entry {
            action,
            actor: &who.0,
            verb: "redrive",
            target: "dead_letters",
            filter: &filter,
            count: 0,
            note,
        };
        super::audit_nothing(pool, &entry).await?;
    }
    Ok(Done {
        action,
        count: done,
    })
}

/// Produces every row's copy and waits for all acknowledgements; returns where each landed.
async fn produce(
    redriver: &Redriver,
    rows: &[Row],
    action: Uuid,
    done: u64,
) -> Result<Vec<String>, OperatorError> {
    let action = action.to_string();
    let mut deliveries = Vec::with_capacity(rows.len());
    for r in rows {
        let from = format!("{}/{}@{}", r.topic, r.partition, r.offset);
        let ours: [(&str, &[u8]); 2] = [
            (REDRIVE_HEADER, action.as_bytes()),
            (REDRIVEN_FROM_HEADER, from.as_bytes()),
        ];
        let replaced = |name: &str| {
            ours.iter().any(|(n, _)| *n == name) || redriver.headers.iter().any(|(n, _)| n == name)
        };
        let mut headers = OwnedHeaders::new();
        for (name, value) in r.header_names.iter().zip(&r.header_values) {
            if !replaced(name) {
                headers = headers.insert(Header {
                    key: name,
                    value: value.as_deref(),
                });
            }
        }
        for (name, value) in ours {
            headers = headers.insert(Header {
                key: name,
                value: Some(value),
            });
        }
        for (name, value) in &redriver.headers {
            headers = headers.insert(Header {
                key: name,
                value: Some(value.as_bytes()),
            });
        }
        let mut record: FutureRecord<'_, [u8], [u8]> = FutureRecord::to(&r.topic).headers(headers);
        if let Some(k) = &r.key {
            record = record.key(k.as_slice());
        }
        if let Some(p) = &r.payload {
            record = record.payload(p.as_slice());
        }
        let fail = |reason: String| OperatorError::Produce {
            id: r.id,
            topic: r.topic.clone(),
            reason,
            done,
        };
        match redriver.producer.send_result(record) {
            Ok(d) => deliveries.push((r, d)),
            Err((e, _)) => return Err(fail(e.to_string())),
        }
    }
    let mut landed = Vec::with_capacity(rows.len());
    for (r, d) in deliveries {
        let fail = |reason: String| OperatorError::Produce {
            id: r.id,
            topic: r.topic.clone(),
            reason,
            done,
        };
        match tokio::time::timeout(Duration::from_secs(60), d).await {
            Ok(Ok(Ok(delivery))) => landed.push(format!(
                "{}/{}@{}",
                r.topic, delivery.partition, delivery.offset
            )),
            Ok(Ok(Err((e, _)))) => return Err(fail(e.to_string())),
            Ok(Err(_)) => return Err(fail("the producer was dropped".into())),
            Err(_) => return Err(fail("no acknowledgement within 60 s".into())),
        }
    }
    Ok(landed)
}

const DISCARD: &str = "\
WITH picked AS (
    SELECT id FROM dead_letters WHERE {DEAD_LETTER_WHERE}
      AND ($7::int8 IS NULL OR id = $7) AND id > $8
    ORDER BY id LIMIT $9 FOR UPDATE SKIP LOCKED
)
UPDATE dead_letters d
SET resolution = 'discarded', resolved_at = now(), resolved_by = $10, resolved_action = $11
FROM picked WHERE d.id = picked.id
RETURNING d.id";

/// Gives up the parked dead letters of `sel`: they stay, bytes and all, marked `discarded`.
pub async fn discard_dead_letters(
    pool: &Pool,
    sel: &DeadLetters,
    who: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    let action = Uuid::now_v7();
    let filter = dead_letters_filter(sel);
    let (f, id) = dead_letters_parts(sel);
    let sql = DISCARD.replace("{DEAD_LETTER_WHERE}", DEAD_LETTER_WHERE);
    let entry = audit::Entry {
        action,
        actor: &who.0,
        verb: "discard",
        target: "dead_letters",
        filter: &filter,
        count: 0,
        note,
    };
    let done = super::in_chunks(pool, &sql, &f, &id, &[&who.0, &action], &entry).await?;
    Ok(Done {
        action,
        count: done,
    })
}
