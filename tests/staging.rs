//! The sessions' staging tables against the real PostgreSQL: every connection has
//! `staged_messages`; `staged_inbox` only once a transaction staged into it (PostgreSQL truncates
//! every `ON COMMIT DELETE ROWS` table of a session at each commit, so a table a session never
//! uses would cost every batch transaction: docs/PERFORMANCE.md, "Many partitions"). Staging
//! works the first time, after a rollback that took the new table with it, and again after.

mod common;

use bytes::Bytes;
use common::*;
use effectively::envelope::Envelope;
use effectively::store::inbox::{self, Incoming};

async fn exists(c: &impl deadpool_postgres::GenericClient, table: &str) -> bool {
    c.query_one(
        "SELECT to_regclass('pg_temp.' || $1) IS NOT NULL",
        &[&table],
    )
    .await
    .unwrap()
    .get(0)
}

async fn staged(c: &impl deadpool_postgres::GenericClient) -> i64 {
    c.query_one("SELECT count(*) FROM staged_inbox", &[])
        .await
        .unwrap()
        .get(0)
}

fn envelope(offset: i64) -> Envelope {
    let payload = Bytes::from_static(br#"{"payment_id":"p"}"#);
    Envelope {
        partition: 0,
        offset,
        message_id: uuid::Uuid::new_v4(),
        message_key: None,
        event_date: chrono::Utc::now().date_naive(),
        kafka_ts: None,
        key: Some(Bytes::from_static(b"k")),
        size: payload.len() + 1,
        payload,
        json: None,
        cloudevent: None,
    }
}

#[tokio::test]
async fn staged_inbox_is_created_by_its_first_use_only() {
    let pool = pool(1);
    let mut conn = pool.get().await.unwrap();
    assert!(exists(&conn, "staged_messages").await);
    assert!(
        !exists(&conn, "staged_inbox").await,
        "a new session must not carry the inbox's staging table"
    );

    let headers = vec![("event_id".to_string(), Some(Bytes::from_static(b"x")))];
    let (a, b, c) = (envelope(1), envelope(2), envelope(3));

    // Created by the first stage, and gone with the transaction that created it.
    let tx = conn.transaction().await.unwrap();
    inbox::stage(&tx, &[&Incoming::new(&a, "k".into(), &headers)])
        .await
        .unwrap();
    assert_eq!(staged(&tx).await, 1);
    tx.rollback().await.unwrap();
    assert!(!exists(&conn, "staged_inbox").await);

    // Created again, committed, and emptied by the commit.
    let tx = conn.transaction().await.unwrap();
    inbox::stage(&tx, &[&Incoming::new(&b, "k".into(), &headers)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert!(exists(&conn, "staged_inbox").await);
    assert_eq!(staged(&conn).await, 0);

    // Staged into as it stands.
    let tx = conn.transaction().await.unwrap();
    inbox::stage(&tx, &[&Incoming::new(&c, "k".into(), &headers)])
        .await
        .unwrap();
    assert_eq!(staged(&tx).await, 1);
    tx.commit().await.unwrap();
    assert_eq!(staged(&conn).await, 0);
}
