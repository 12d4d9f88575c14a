//! The receiver's side of the `inbox` table: staging a batch's messages by binary `COPY` and
//! the deduplicating insert that stores the fresh ones (`done = "keep"` or `"delete"`).

use bytes::BytesMut;
use deadpool_postgres::Transaction;
use tokio_postgres::types::Type;

use crate::envelope::Envelope;
use crate::store::copy;
use crate::store::StoreError;

/// One message for the receiver to store.
#[derive(Debug)]
pub struct Incoming<'a> {
    pub env: &'a Envelope,
    pub ordering_key: String,
    pub header_names: Vec<&'a str>,
    pub header_values: Vec<Option<&'a [u8]>>,
    /// The message's W3C trace context (`traceparent`, `tracestate`), kept in the row's own
    /// columns for the processor's span; set only when tracing is on.
    pub trace: Option<(String, Option<String>)>,
}

impl<'a> Incoming<'a> {
    /// `env`, to be stored under `ordering_key` with its record's `headers` (names and values
    /// as the inbox's two array columns).
    pub fn new(
        env: &'a Envelope,
        ordering_key: String,
        headers: &'a [(String, Option<bytes::Bytes>)],
    ) -> Self {
        Incoming {
            env,
            ordering_key,
            header_names: headers.iter().map(|(k, _)| k.as_str()).collect(),
            header_values: headers.iter().map(|(_, v)| v.as_deref()).collect(),
            trace: None,
        }
    }
}

const COPY_IN: &str = "COPY staged_inbox (message_id, event_date, ordering_key, partition, \
    \"offset\", kafka_ts, key, header_names, header_values, payload) FROM STDIN BINARY";

const TYPES: [Type; 10] = [
    Type::UUID,
    Type::DATE,
    Type::TEXT,
    Type::INT4,
    Type::INT8,
    Type::TIMESTAMPTZ,
    Type::BYTEA,
    Type::TEXT_ARRAY,
    Type::BYTEA_ARRAY,
    Type::BYTEA,
];

// The tail both receive statements share, given a CTE `fresh` of the staged rows to store.
// `seq` is drawn in offset order (the OFFSET 0 fence keeps the ordered subquery from being
// flattened, so nextval runs after the sort); rows are inserted in message_id order, so two
// receivers inserting overlapping ids lock them in the same order.
// Traced (a row of the batch has a trace context): the contexts come as arrays beside the
// staged rows (`$3` message ids, `$4` traceparents, `$5` tracestates) and fill the row's
// `traceparent` and `tracestate`. Untraced, the statement is the one without them.
macro_rules! store_fresh {
    () => {
        store_fresh!("", "", "")
    };
    (traced) => {
        store_fresh!(
            ", traceparent, tracestate",
            ", t.tp, t.ts",
            " LEFT JOIN unnest($3::uuid[], $4::text[], $5::text[]) AS t(id, tp, ts)
          ON t.id = numbered.message_id"
        )
    };
    ($columns:literal, $values:literal, $join:literal) => {
        concat!(
            "numbered AS MATERIALIZED (
    SELECT f.*, nextval('inbox_seq') AS seq
    FROM (SELECT * FROM fresh ORDER BY \"offset\" OFFSET 0) f
)
INSERT INTO inbox (consumer, message_id, event_date, seq, ordering_key, topic, partition,
                   \"offset\", kafka_ts, key, header_names, header_values, payload",
            $columns,
            ")
SELECT $1, message_id, event_date, seq, ordering_key, $2, partition, \"offset\", kafka_ts, key,
       header_names, header_values, payload",
            $values,
            "
FROM numbered",
            $join,
            " ORDER BY message_id
ON CONFLICT DO NOTHING"
        )
    };
}

// `done = "keep"`. The NOT EXISTS honours keys this consumer recorded in processed_messages
// (under the batch strategy, or `done = "delete"`), so switching a consumer to the inbox does
// not apply old messages again.
macro_rules! keep_head {
    () => {
        "WITH fresh AS MATERIALIZED (
    SELECT s.* FROM staged_inbox s
    WHERE NOT EXISTS (SELECT 1 FROM processed_messages p
                      WHERE p.consumer = $1 AND p.message_id = s.message_id
                        AND p.event_date = s.event_date)
), "
    };
}
const RECEIVE_KEEP: &str = concat!(keep_head!(), store_fresh!());
const RECEIVE_KEEP_TRACED: &str = concat!(keep_head!(), store_fresh!(traced));

// `done = "delete"`: the inbox row goes once applied, so the key is recorded in the dedupe
// ledger as it arrives, and only the keys new there are stored.
macro_rules! delete_head {
    () => {
        "WITH keys AS (
    INSERT INTO processed_messages (consumer, message_id, event_date)
    SELECT $1, message_id, event_date FROM staged_inbox ORDER BY message_id
    ON CONFLICT DO NOTHING
    RETURNING message_id, event_date
), fresh AS MATERIALIZED (
    SELECT s.* FROM staged_inbox s JOIN keys k USING (message_id, event_date)
), "
    };
}
const RECEIVE_DELETE: &str = concat!(delete_head!(), store_fresh!());
const RECEIVE_DELETE_TRACED: &str = concat!(delete_head!(), store_fresh!(traced));

/// Stores `rows` (first copies, in offset order) in the caller's transaction; returns how many
/// were new (the rest are duplicates). With `record_keys`, keys also go to processed_messages.
pub async fn receive(
    tx: &Transaction<'_>,
    consumer: &str,
    topic: &str,
    rows: &[Incoming<'_>],
    record_keys: bool,
) -> Result<u64, StoreError> {
    let refs: Vec<&Incoming<'_>> = rows.iter().collect();
    stage(tx, &refs).await?;
    if rows.iter().all(|r| r.trace.is_none()) {
        let sql = if record_keys {
            RECEIVE_DELETE
        } else {
            RECEIVE_KEEP
        };
        let stmt = tx.prepare_cached(sql).await?;
        return Ok(tx.execute(&stmt, &[&consumer, &topic]).await?);
    }
    let sql = if record_keys {
        RECEIVE_DELETE_TRACED
    } else {
        RECEIVE_KEEP_TRACED
    };
    let (mut ids, mut parents, mut states) = (Vec::new(), Vec::new(), Vec::new());
    for r in rows {
        if let Some((parent, state)) = &r.trace {
            ids.push(r.env.message_id);
            parents.push(parent.as_str());
            states.push(state.as_deref());
        }
    }
    let stmt = tx.prepare_cached(sql).await?;
    Ok(tx
        .execute(&stmt, &[&consumer, &topic, &ids, &parents, &states])
        .await?)
}

/// Copies `rows` into the session's `staged_inbox`, creating it first in a session that has
/// none (see [`copy::ENSURE_STAGED_INBOX`]).
pub async fn stage(tx: &Transaction<'_>, rows: &[&Incoming<'_>]) -> Result<(), StoreError> {
    tx.batch_execute(copy::ENSURE_STAGED_INBOX).await?;
    copy::send(tx, COPY_IN, encode(rows)).await
}

fn encode(rows: &[&Incoming<'_>]) -> bytes::Bytes {
    let payload_bytes: usize = rows.iter().map(|r| r.env.size).sum();
    let mut buf = BytesMut::with_capacity(32 + rows.len() * 128 + payload_bytes);
    copy::put_header(&mut buf);
    for r in rows {
        let e = r.env;
        let key = e.key.as_deref();
        let payload: &[u8] = &e.payload;
        copy::put_row(
            &mut buf,
            &[
                (&e.message_id, &TYPES[0]),
                (&e.event_date, &TYPES[1]),
                (&r.ordering_key, &TYPES[2]),
                (&e.partition, &TYPES[3]),
                (&e.offset, &TYPES[4]),
                (&e.kafka_ts, &TYPES[5]),
                (&key, &TYPES[6]),
                (&r.header_names, &TYPES[7]),
                (&r.header_values, &TYPES[8]),
                (&payload, &TYPES[9]),
            ],
        );
    }
    copy::put_trailer(&mut buf);
    buf.freeze()
}
