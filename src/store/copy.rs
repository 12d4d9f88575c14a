//! Staging a batch with binary `COPY` into a per-session temporary table.
//!
//! `staged_messages` holds the batch's first copy of each message: what the dedupe insert reads,
//! and, through the `fresh_messages` view, what a set-based effect reads. It is created once per
//! connection (the pool's post-create hook) and emptied by PostgreSQL at every commit
//! (`ON COMMIT DELETE ROWS` truncates in place: no catalog churn, no dead rows).

use bytes::BufMut;
use deadpool_postgres::Transaction;
use futures::pin_mut;
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

use super::StoreError;
use crate::envelope::Envelope;

/// Run once per connection. `fresh` is set by the dedupe insert for the rows it inserted.
pub const CREATE_SESSION_TABLES: &str = "\
CREATE TEMP TABLE IF NOT EXISTS staged_messages (
    seq        int         NOT NULL,
    message_id uuid        NOT NULL,
    event_date date        NOT NULL,
    partition  int         NOT NULL,
    \"offset\"   bigint      NOT NULL,
    kafka_ts   timestamptz,
    key        bytea,
    payload    jsonb,
    fresh      boolean     NOT NULL DEFAULT false
) ON COMMIT DELETE ROWS;
CREATE OR REPLACE TEMP VIEW fresh_messages AS
    SELECT seq, message_id, event_date, partition, \"offset\", kafka_ts, key, payload
    FROM staged_messages WHERE fresh;";

const COPY_IN: &str = "COPY staged_messages \
    (seq, message_id, event_date, partition, \"offset\", kafka_ts, key, payload, fresh) FROM STDIN BINARY";

const TYPES: [Type; 9] = [
    Type::INT4,
    Type::UUID,
    Type::DATE,
    Type::INT4,
    Type::INT8,
    Type::TIMESTAMPTZ,
    Type::BYTEA,
    Type::JSONB,
    Type::BOOL,
];

/// A payload already validated as JSON, sent as `jsonb` without re-serialising it
/// (binary jsonb is a version byte followed by the JSON text).
#[derive(Debug)]
struct RawJson<'a>(&'a [u8]);

impl ToSql for RawJson<'_> {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.put_u8(1);
        out.put_slice(self.0);
        Ok(IsNull::No)
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::JSONB
    }

    to_sql_checked!();
}

/// Copies `rows` into `staged_messages`; `seq` is the index into `rows`. The payload column is
/// filled only when `with_payload` (a handler that reads it in SQL); otherwise it stays NULL and
/// costs nothing. `fresh` is the rows' initial mark: `false` when the dedupe insert decides,
/// `true` when the caller already inserted the key (the per-message strategy).
pub async fn stage(
    tx: &Transaction<'_>,
    rows: &[&Envelope],
    with_payload: bool,
    fresh: bool,
) -> Result<(), StoreError> {
    let sink = tx.copy_in(COPY_IN).await?;
    let writer = BinaryCopyInWriter::new(sink, &TYPES);
    pin_mut!(writer);
    for (seq, env) in rows.iter().enumerate() {
        let seq = seq as i32;
        let key = env.key.as_deref();
        let payload = if with_payload {
            Some(RawJson(&env.payload))
        } else {
            None
        };
        writer
            .as_mut()
            .write(&[
                &seq,
                &env.message_id,
                &env.event_date,
                &env.partition,
                &env.offset,
                &env.kafka_ts,
                &key,
                &payload,
                &fresh,
            ])
            .await?;
    }
    writer.finish().await?;
    Ok(())
}
