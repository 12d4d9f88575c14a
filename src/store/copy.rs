//! Staging a batch with binary `COPY` into a per-session temporary table.
//!
//! `staged_messages` holds the batch's first copy of each message: what the dedupe insert reads,
//! and, through the `fresh_messages` view, what a set-based effect reads. It is created once per
//! connection (the pool's post-create hook) and emptied by PostgreSQL at every commit
//! (`ON COMMIT DELETE ROWS` truncates in place: no catalog churn, no dead rows, but a cost per
//! commit: see [`ENSURE_STAGED_INBOX`]).

use bytes::{BufMut, Bytes, BytesMut};
use deadpool_postgres::Transaction;
use futures::{pin_mut, SinkExt};
use tokio_postgres::types::{to_sql_checked, IsNull, ToSql, Type};

use super::StoreError;
use crate::envelope::Envelope;
use crate::version::Versions;

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
    fresh      boolean     NOT NULL DEFAULT false,
    aggregate  text,
    version    bigint,
    stored_version bigint,
    ce         jsonb
) ON COMMIT DELETE ROWS;
CREATE OR REPLACE TEMP VIEW fresh_messages AS
    SELECT seq, message_id, event_date, partition, \"offset\", kafka_ts, key, payload,
           aggregate, version, stored_version, ce
    FROM staged_messages WHERE fresh;";

/// The inbox receiver's staging table (see [`crate::store::inbox`]), created by the first
/// transaction of a session that stages into it, not by every connection: PostgreSQL truncates
/// *every* `ON COMMIT DELETE ROWS` table of a session at the commit of any transaction that
/// touched a temporary table, and a truncation costs even when the table is empty (the table's,
/// its TOAST table's and its TOAST index's files, rebuilt). With both tables in every session,
/// that was 15% of the machine's CPU in a load of one-record transactions, and `staged_inbox`
/// half of it, in sessions that never use it (docs/PERFORMANCE.md, "Many partitions").
/// A `DO` block rather than `IF NOT EXISTS`, which would send a notice every time.
pub const ENSURE_STAGED_INBOX: &str = "\
DO $$ BEGIN IF to_regclass('pg_temp.staged_inbox') IS NULL THEN
CREATE TEMP TABLE staged_inbox (
    message_id    uuid        NOT NULL,
    event_date    date        NOT NULL,
    ordering_key  text        NOT NULL,
    partition     int         NOT NULL,
    \"offset\"      bigint      NOT NULL,
    kafka_ts      timestamptz,
    key           bytea,
    header_names  text[]      NOT NULL,
    header_values bytea[]     NOT NULL,
    payload       bytea       NOT NULL
) ON COMMIT DELETE ROWS;
END IF; END $$";

const COPY_IN: &str = "COPY staged_messages (seq, message_id, event_date, partition, \"offset\", \
    kafka_ts, key, payload, fresh, aggregate, version, stored_version, ce) FROM STDIN BINARY";

const TYPES: [Type; 13] = [
    Type::INT4,
    Type::UUID,
    Type::DATE,
    Type::INT4,
    Type::INT8,
    Type::TIMESTAMPTZ,
    Type::BYTEA,
    Type::JSONB,
    Type::BOOL,
    Type::TEXT,
    Type::INT8,
    Type::INT8,
    Type::JSONB,
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
/// `true` when the caller already inserted the key (the per-message strategy). `versions`
/// (under `[consumer.version]`) fills the view's `aggregate`, `version` and `stored_version`.
/// A CloudEvent's attributes fill `ce` when the payload is sent.
pub async fn stage(
    tx: &Transaction<'_>,
    rows: &[&Envelope],
    with_payload: bool,
    fresh: bool,
    versions: Option<&Versions>,
) -> Result<(), StoreError> {
    send(tx, COPY_IN, encode(rows, with_payload, fresh, versions)).await
}

/// Runs `copy_in` (a `COPY ... FROM STDIN BINARY`) with `data`, a whole binary COPY stream.
pub(crate) async fn send(
    tx: &Transaction<'_>,
    copy_in: &str,
    mut data: Bytes,
) -> Result<(), StoreError> {
    let sink = tx.copy_in(copy_in).await?;
    pin_mut!(sink);
    // Two CopyData messages (the protocol allows any split), so that a chaos failpoint can
    // kill the process with the server holding half a COPY.
    let rest = data.split_off(data.len() / 2);
    sink.send(data).await?;
    fail::fail_point!("mid_copy", |_| std::process::abort());
    sink.send(rest).await?;
    sink.finish().await?;
    Ok(())
}

/// The whole batch in PostgreSQL's binary `COPY` format, in one buffer: one write to the
/// connection instead of one await per row.
pub fn encode(
    rows: &[&Envelope],
    with_payload: bool,
    fresh: bool,
    versions: Option<&Versions>,
) -> Bytes {
    let mut buf =
        BytesMut::with_capacity(32 + rows.len() * (80 + if with_payload { 256 } else { 0 }));
    put_header(&mut buf);
    for (seq, env) in rows.iter().enumerate() {
        let payload = with_payload.then_some(RawJson(&env.payload));
        let key = env.key.as_deref();
        let v = versions.and_then(|vs| vs.get(&env.message_id));
        let aggregate = v.map(|v| v.aggregate.as_str());
        let version = v.map(|v| v.version);
        let stored = v.and_then(|v| v.stored);
        let ce = (env.cloudevent.as_deref())
            .filter(|_| with_payload)
            .map(|attrs| serde_json::to_vec(attrs).expect("a JSON value serialises"));
        let ce = ce.as_deref().map(RawJson);
        put_row(
            &mut buf,
            &[
                (&(seq as i32), &TYPES[0]),
                (&env.message_id, &TYPES[1]),
                (&env.event_date, &TYPES[2]),
                (&env.partition, &TYPES[3]),
                (&env.offset, &TYPES[4]),
                (&env.kafka_ts, &TYPES[5]),
                (&key, &TYPES[6]),
                (&payload, &TYPES[7]),
                (&fresh, &TYPES[8]),
                (&aggregate, &TYPES[9]),
                (&version, &TYPES[10]),
                (&stored, &TYPES[11]),
                (&ce, &TYPES[12]),
            ],
        );
    }
    put_trailer(&mut buf);
    buf.freeze()
}

/// The binary `COPY` signature, flags and header extension length.
pub(crate) fn put_header(buf: &mut BytesMut) {
    buf.put_slice(b"PGCOPY\n\xff\r\n\0");
    buf.put_i32(0); // flags
    buf.put_i32(0); // header extension length
}

/// One row: the field count, then each field's length and bytes (-1 for NULL). Values must be
/// of their column's own type, which the callers guarantee, so encoding cannot fail.
pub(crate) fn put_row(buf: &mut BytesMut, fields: &[(&(dyn ToSql + Sync), &Type)]) {
    buf.put_i16(fields.len() as i16);
    for (value, ty) in fields {
        let at = buf.len();
        buf.put_i32(0);
        match value.to_sql_checked(ty, buf) {
            Ok(IsNull::No) => {
                let len = (buf.len() - at - 4) as i32;
                buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
            }
            Ok(IsNull::Yes) | Err(_) => {
                buf.truncate(at + 4);
                buf[at..at + 4].copy_from_slice(&(-1i32).to_be_bytes());
            }
        }
    }
}

/// The end-of-data marker.
pub(crate) fn put_trailer(buf: &mut BytesMut) {
    buf.put_i16(-1);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_copy_framing() {
        let env = Envelope {
            partition: 3,
            offset: 42,
            message_id: uuid::Uuid::nil(),
            message_key: None,
            event_date: chrono::NaiveDate::from_ymd_opt(2026, 12, 2).unwrap(),
            kafka_ts: None,
            key: None,
            payload: bytes::Bytes::from_static(b"{}"),
            json: None,
            cloudevent: None,
            size: 2,
        };
        let b = encode(&[&env, &env], false, false, None);
        assert!(b.starts_with(b"PGCOPY\n\xff\r\n\0"));
        assert_eq!(&b[b.len() - 2..], &(-1i16).to_be_bytes());
        // header 19; per row: field count 2 + 9 length words 36 + int4 4 + uuid 16 + date 4 +
        // int4 4 + int8 8 + bool 1 (kafka_ts, key, payload, the three version columns and ce
        // NULL) plus 4 more length words 16 = 91; trailer 2.
        assert_eq!(b.len(), 19 + 2 * 91 + 2);
        let with_payload = encode(&[&env], true, true, None);
        assert_eq!(
            with_payload.len(),
            19 + 91 + 3 + 2,
            "jsonb: version byte + 2 bytes"
        );
        let ce = Envelope {
            cloudevent: Some(std::sync::Arc::new(serde_json::json!({"id": "1"}))),
            ..env.clone()
        };
        assert_eq!(
            encode(&[&ce], false, true, None).len(),
            19 + 91 + 2,
            "ce only with the payload"
        );
        let attrs = br#"{"id":"1"}"#.len();
        assert_eq!(
            encode(&[&ce], true, true, None).len(),
            19 + 91 + 3 + 1 + attrs + 2
        );
    }
}
