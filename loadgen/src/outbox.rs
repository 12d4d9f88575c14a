//! `loadgen --via-outbox`: the payments service's half of the seed's outbox walk. Each payment
//! becomes a row of the `outbox` table (id = the payment's event id, `aggregate_id` = the
//! payment id, `event_type` = `PaymentSucceeded`, payload = the JSON loadgen would have
//! produced), and `effectively relay` publishes it to Kafka. A payment counts as sent once its
//! row committed, whatever the relay does next.
//!
//! Rows are written [`BATCH`] at a time, or every [`BATCH_WINDOW`] if fewer are due: one
//! `INSERT` (one transaction) a batch, on [`CONNECTIONS`] connections. Why batches: a real
//! payments service commits every payment on its own, but over many connections; one loadgen
//! process committing one row at a time pays a round trip and a WAL flush per payment, and
//! tops out near the demo's 2,000/s. Why small ones: a row reaches the relay only when its batch
//! commits, so the window adds at most 10 ms to the latency; and a batch that fails loses at
//! most 100 payments, none of them counted as sent.
//!
//! [`census`] reads back what reached the topic, to count the records the relay published more
//! than once (after a crash between publishing and marking a row).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use uuid::Uuid;

/// The event type of every row loadgen writes (the relay's `[relay] topics` routes it).
pub const EVENT_TYPE: &str = "PaymentSucceeded";
/// Rows per transaction, at most.
pub const BATCH: usize = 100;
/// The longest a row waits for its batch to fill.
pub const BATCH_WINDOW: Duration = Duration::from_millis(10);
/// Connections that write batches side by side.
const CONNECTIONS: usize = 4;
/// Batches written or waiting for a connection, at most: the producing loop stops taking new
/// payments beyond it, as it does at its cap of records in flight.
pub const MAX_BATCHES_IN_FLIGHT: usize = 2 * CONNECTIONS;

/// One statement, so one transaction, however many rows. RETURNING hands back each payload as
/// the relay will publish it (`jsonb` text: keys reordered, spaces after `:` and `,`), so a
/// redrive repeats the relay's bytes.
const INSERT: &str = "\
INSERT INTO outbox (id, aggregate_id, event_type, payload)
SELECT id, aggregate_id, $1, payload::jsonb
FROM unnest($2::uuid[], $3::text[], $4::text[]) AS t(id, aggregate_id, payload)
RETURNING id, payload::text";

/// After a failed INSERT, whether its rows are there: a connection lost during the commit
/// leaves the outcome unknown. (With the relay's `published = "delete"` a row published since
/// is gone, and reads as not written: its credit then shows as unexpected, not hidden.)
const WRITTEN: &str = "SELECT id, payload::text FROM outbox WHERE id = ANY($1)";

/// Unpublished rows of a run (by its payment id prefix), found through the relay's partial
/// index on unpublished rows of a type.
const UNPUBLISHED: &str = "SELECT count(*) FROM outbox
    WHERE event_type = $1 AND published_at IS NULL AND aggregate_id LIKE $2";

/// One payment to write.
#[derive(Debug, Clone)]
pub struct Row {
    pub id: Uuid,
    pub aggregate_id: String,
    /// JSON text.
    pub payload: String,
}

/// The connections rows are written on.
pub struct Writer {
    clients: Vec<(tokio_postgres::Client, tokio_postgres::Statement)>,
    next: std::sync::atomic::AtomicUsize,
}

impl Writer {
    pub async fn connect(database_url: &str) -> anyhow::Result<Writer> {
        let mut clients = Vec::with_capacity(CONNECTIONS);
        for _ in 0..CONNECTIONS {
            let (client, conn) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
                .await
                .context("connecting to PostgreSQL to write outbox rows")?;
            tokio::spawn(conn);
            let insert = client.prepare(INSERT).await.context(
                "preparing the outbox insert (is the database migrated? `effectively migrate`)",
            )?;
            clients.push((client, insert));
        }
        Ok(Writer {
            clients,
            next: Default::default(),
        })
    }

    /// Writes `rows` in one transaction. `Ok` holds each committed row's payload as stored;
    /// `Err` means none of them is in the table.
    pub async fn write(&self, rows: &[Row]) -> Result<HashMap<Uuid, String>, String> {
        let at = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (client, insert) = &self.clients[at % self.clients.len()];
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        let aggregates: Vec<&str> = rows.iter().map(|r| r.aggregate_id.as_str()).collect();
        let payloads: Vec<&str> = rows.iter().map(|r| r.payload.as_str()).collect();
        let error = match client
            .query(insert, &[&EVENT_TYPE, &ids, &aggregates, &payloads])
            .await
        {
            Ok(written) => return Ok(written.iter().map(|r| (r.get(0), r.get(1))).collect()),
            Err(e) => e,
        };
        // In doubt: ask on another connection.
        let (other, _) = &self.clients[(at + 1) % self.clients.len()];
        match other.query(WRITTEN, &[&ids]).await {
            Ok(found) if found.len() == rows.len() => {
                Ok(found.iter().map(|r| (r.get(0), r.get(1))).collect())
            }
            Ok(_) => Err(format!("writing {} outbox rows: {error}", rows.len())),
            Err(check) => Err(format!(
                "writing {} outbox rows: {error} (counted as not written; the check failed \
                 too: {check})",
                rows.len()
            )),
        }
    }
}

/// This run's rows still unpublished (`payment_prefix`: the run's payment id prefix).
pub async fn unpublished(
    db: &tokio_postgres::Client,
    payment_prefix: &str,
) -> Result<i64, tokio_postgres::Error> {
    let like = format!("{payment_prefix}%");
    Ok(db
        .query_one(UNPUBLISHED, &[&EVENT_TYPE, &like])
        .await?
        .get(0))
}

/// What reached the topic from this run's rows, as counted by [`census`].
#[derive(Debug, Clone, Default, Serialize)]
pub struct Census {
    /// Records the topic gained during the run, from any producer.
    pub topic_records: u64,
    /// Of those, records carrying the event id of one of this run's committed rows: the
    /// relay's and loadgen's redrives.
    pub row_records: u64,
    /// Records beyond each row's one publication and its redrives: what the relay published
    /// again (after a crash between its broker's acknowledgement and its commit).
    pub republished: u64,
    /// Rows that the relay published more than once.
    pub rows_republished: u64,
    /// Committed rows with fewer records on the topic than expected: never published (the
    /// ledger shows their payments lost, unless a redrive carried them).
    pub rows_missing: u64,
}

/// Reads `topic` from the offsets `from` to `to` (per partition, end exclusive) and counts the
/// records of each row in `expected` (event id -> the records loadgen expects of it: 1 from the
/// relay, plus its redrives).
pub fn census(
    brokers: &str,
    topic: &str,
    from: &[i64],
    to: &[i64],
    expected: &HashMap<Uuid, u64>,
) -> anyhow::Result<Census> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("loadgen-census-{}", Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .create()
        .context("creating the census consumer")?;
    let mut assignment = TopicPartitionList::new();
    let mut left: HashMap<i32, i64> = HashMap::new();
    for (p, (&start, &end)) in from.iter().zip(to).enumerate() {
        if end > start {
            assignment.add_partition_offset(topic, p as i32, Offset::Offset(start))?;
            left.insert(p as i32, end);
        }
    }
    consumer.assign(&assignment)?;
    let mut census = Census {
        topic_records: from
            .iter()
            .zip(to)
            .map(|(a, b)| (b - a).max(0) as u64)
            .sum(),
        ..Census::default()
    };
    let mut seen: HashMap<Uuid, u64> = HashMap::with_capacity(expected.len());
    let deadline = Instant::now() + Duration::from_secs(120);
    while !left.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "reading {topic} back: partitions {:?} not read to their end in 120 s",
            left.keys().collect::<Vec<_>>()
        );
        let Some(msg) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let msg = msg.context("reading the topic back")?;
        let p = msg.partition();
        if left.get(&p).is_some_and(|end| msg.offset() + 1 >= *end) {
            left.remove(&p);
        }
        let id = msg
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "event_id"))
            .and_then(|h| std::str::from_utf8(h.value?).ok())
            .and_then(|s| Uuid::parse_str(s).ok());
        if let Some(id) = id.filter(|id| expected.contains_key(id)) {
            *seen.entry(id).or_default() += 1;
        }
    }
    for (id, want) in expected {
        let n = seen.get(id).copied().unwrap_or(0);
        census.row_records += n;
        if n > *want {
            census.republished += n - want;
            census.rows_republished += 1;
        } else if n < *want {
            census.rows_missing += 1;
        }
    }
    Ok(census)
}
