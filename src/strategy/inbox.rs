//! The `inbox` strategy's receiver: store first, process later. One transaction per batch of a
//! partition, through the same driver as the batch strategy:
//!
//! 1. advance the partition's offset, fenced by the ownership epoch (a zombie stops here);
//! 2. park what cannot even be stored (no id, oversized, undated) in `dead_letters`;
//! 3. binary `COPY` the first copy of each message, with its ordering key and raw bytes, into
//!    `staged_inbox`;
//! 4. `INSERT INTO inbox ... ON CONFLICT DO NOTHING`: the primary key dedupes;
//! 5. `COMMIT`, then tell Kafka, and wake this process's processors.
//!
//! No handler runs here, so a slow or failing handler never holds the partition: the processors
//! ([`crate::inbox`]) apply the effects from the table.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use deadpool_postgres::Transaction;
use serde_json::Value;
use tokio::sync::Notify;

use super::segments::{drive, Body, BodyOutcome, Shape};
use super::{AttemptError, BatchError, Committed, Outcome, PartitionCtx, Strategy};
use crate::batch::{Batch, Raw};
use crate::config::{DoneRows, OrderingKey};
use crate::envelope::Envelope;
use crate::store::inbox::{self, Incoming};

/// The receiver of one inbox consumer.
pub struct Inbox {
    pub ordering_key: OrderingKey,
    pub done: DoneRows,
    /// Notified after every commit that stored rows, so local processors need not wait for
    /// their next poll.
    pub stored: Arc<Notify>,
    /// When this process last had the inbox's statistics refreshed, and what it stored since.
    pub freshness: Arc<Freshness>,
}

/// Refreshes PostgreSQL's statistics of the inbox partitions a burst lands in, once this
/// process has stored `Freshness::ROWS` rows since the last refresh (at most every
/// `Freshness::EVERY`).
///
/// The processors' statements are shaped not to depend on statistics (see `store::inbox`), but
/// a burst into a consumer, or onto a table whose last `ANALYZE` saw only DONE rows, is still
/// estimated at "1 row" until autovacuum gets to it, and on such estimates PostgreSQL picks
/// plans that read the whole backlog per claim: with autovacuum's own timing a 100,000-row
/// backlog drained in 32 s under lease claims instead of 10 s. An `ANALYZE` of the touched
/// day's partition costs a fraction of a second and runs beside the receiver, never in its
/// transaction.
#[derive(Debug, Default)]
pub struct Freshness {
    state: std::sync::Mutex<FreshnessState>,
}

#[derive(Debug, Default)]
struct FreshnessState {
    stored: u64,
    dates: std::collections::BTreeSet<chrono::NaiveDate>,
    last: Option<Instant>,
    running: bool,
}

impl Freshness {
    const ROWS: u64 = 20_000;
    const EVERY: std::time::Duration = std::time::Duration::from_secs(10);

    /// Counts `stored` rows of `dates`; returns the partitions to analyze now, if it is time.
    fn stored(&self, stored: u64, dates: impl Iterator<Item = chrono::NaiveDate>) -> Vec<String> {
        let mut st = self.state.lock().expect("not poisoned");
        st.stored += stored;
        st.dates.extend(dates);
        let due = st.stored >= Self::ROWS
            && !st.running
            && st.last.is_none_or(|t| t.elapsed() >= Self::EVERY);
        if !due {
            return Vec::new();
        }
        st.stored = 0;
        st.running = true;
        st.last = Some(Instant::now());
        let dates = std::mem::take(&mut st.dates);
        dates
            .into_iter()
            .map(crate::store::partitions::inbox_name_for)
            .collect()
    }

    fn done(&self) {
        self.state.lock().expect("not poisoned").running = false;
    }
}

#[async_trait]
impl Strategy for Inbox {
    fn checks_messages(&self) -> bool {
        false
    }

    async fn process(
        &self,
        ctx: &PartitionCtx,
        batch: Batch,
        committed: Committed<'_>,
    ) -> Result<Outcome, BatchError> {
        let shape = Shape {
            segment_len: usize::MAX,
            fence_first: true,
            strategy: "inbox",
        };
        // No pre-filter: the inbox's primary key is the receiver's dedupe (see the config check).
        let out = drive(ctx, &batch, &shape, self, None, committed).await?;
        if out.fresh > 0 {
            self.stored.notify_waiters();
            let tables = self.freshness.stored(
                out.fresh,
                batch
                    .records
                    .iter()
                    .filter_map(|r| r.decoded.as_ref().ok().map(|e| e.event_date)),
            );
            if !tables.is_empty() {
                analyze(Arc::clone(&self.freshness), ctx.pool.clone(), tables);
            }
        }
        Ok(out)
    }
}

#[async_trait]
impl Body for Inbox {
    async fn run(
        &self,
        ctx: &PartitionCtx,
        tx: &Transaction<'_>,
        candidates: &[&Envelope],
        raws: &[&Raw],
    ) -> Result<BodyOutcome, AttemptError> {
        let traced = crate::telemetry::enabled();
        let rows: Vec<Incoming<'_>> = candidates
            .iter()
            .zip(raws)
            .map(|(env, raw)| {
                let mut row =
                    Incoming::new(env, ordering_key(&self.ordering_key, env), &raw.headers);
                if traced {
                    row.trace = crate::telemetry::context::from_headers(&raw.headers)
                        .map(|cx| crate::telemetry::context::format(&cx));
                }
                row
            })
            .collect();
        let t0 = Instant::now();
        let record_keys = self.done == DoneRows::Delete;
        let stored = inbox::receive(tx, &ctx.consumer, &ctx.topic, &rows, record_keys).await?;
        Ok(BodyOutcome {
            stage: t0.elapsed(),
            fresh: stored,
            duplicates: candidates.len() as u64 - stored,
            ..BodyOutcome::default()
        })
    }
}

/// `ANALYZE`s `tables` on a connection of its own, beside the receiver. A failure (the table was
/// dropped by retention meanwhile, the database is away) is logged and otherwise ignored:
/// autovacuum does the same work later.
fn analyze(freshness: Arc<Freshness>, pool: deadpool_postgres::Pool, tables: Vec<String>) {
    tokio::spawn(async move {
        let t0 = Instant::now();
        let sql = format!("ANALYZE {}", tables.join(", "));
        let result = match pool.get().await {
            Ok(client) => client.batch_execute(&sql).await.map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        freshness.done();
        match result {
            Ok(()) => tracing::debug!(
                ?tables,
                ms = t0.elapsed().as_millis() as u64,
                "inbox: statistics refreshed after a burst"
            ),
            Err(e) => tracing::warn!(?tables, error = %e,
                "inbox: could not refresh statistics (autovacuum will)"),
        }
    });
}

/// The key whose rows are applied in arrival order. A message without one (no Kafka key, or
/// nothing at the pointer) is its own key: it is ordered with nothing, as Kafka orders keyless
/// records with nothing either.
pub fn ordering_key(source: &OrderingKey, env: &Envelope) -> String {
    let own = || format!("id:{}", env.message_id);
    match source {
        OrderingKey::None => own(),
        OrderingKey::KafkaKey => match env.key.as_deref() {
            Some(k) if !k.is_empty() => match std::str::from_utf8(k) {
                Ok(text) => format!("k:{text}"),
                Err(_) => format!("x:{}", hex(k)),
            },
            _ => own(),
        },
        OrderingKey::JsonPointer(ptr) => {
            let parsed;
            let doc = match &env.json {
                Some(doc) => Some(doc),
                None => {
                    parsed = serde_json::from_slice::<Value>(&env.payload).ok();
                    parsed.as_ref()
                }
            };
            match doc.and_then(|d| d.pointer(ptr)) {
                Some(Value::String(s)) if !s.is_empty() => format!("k:{s}"),
                Some(v @ Value::Number(_)) => format!("k:{v}"),
                _ => own(),
            }
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_are_refreshed_after_a_burst_once_at_a_time() {
        let day = |d| chrono::NaiveDate::from_ymd_opt(2026, 12, d).unwrap();
        let f = Freshness::default();
        assert!(f.stored(19_999, [day(4)].into_iter()).is_empty());
        // The 20,000th row: both days it saw, once each.
        assert_eq!(
            f.stored(1, [day(3), day(4)].into_iter()),
            vec!["inbox_p20261203", "inbox_p20261204"]
        );
        // Not again while that ANALYZE runs, nor within 10 s of it.
        assert!(f.stored(50_000, [day(4)].into_iter()).is_empty());
        f.done();
        assert!(f.stored(50_000, [day(4)].into_iter()).is_empty());
        f.state.lock().unwrap().last = Some(Instant::now() - Freshness::EVERY);
        assert_eq!(f.stored(0, std::iter::empty()), vec!["inbox_p20261204"]);
    }

    fn env(key: Option<&[u8]>, payload: &str) -> Envelope {
        Envelope {
            partition: 0,
            offset: 0,
            message_id: uuid::Uuid::nil(),
            message_key: None,
            event_date: chrono::NaiveDate::from_ymd_opt(2026, 12, 3).unwrap(),
            kafka_ts: None,
            key: key.map(bytes::Bytes::copy_from_slice),
            payload: bytes::Bytes::copy_from_slice(payload.as_bytes()),
            json: None,
            cloudevent: None,
            size: 0,
        }
    }

    #[test]
    fn ordering_keys() {
        let own = format!("id:{}", uuid::Uuid::nil());
        let e = env(Some(b"u_17"), r#"{"order_id": "o-1", "n": 7}"#);
        assert_eq!(ordering_key(&OrderingKey::KafkaKey, &e), "k:u_17");
        assert_eq!(ordering_key(&OrderingKey::None, &e), own);
        let order = OrderingKey::JsonPointer("/order_id".into());
        assert_eq!(ordering_key(&order, &e), "k:o-1");
        let n = OrderingKey::JsonPointer("/n".into());
        assert_eq!(ordering_key(&n, &e), "k:7");
        let missing = OrderingKey::JsonPointer("/nope".into());
        assert_eq!(ordering_key(&missing, &e), own);
        assert_eq!(ordering_key(&OrderingKey::KafkaKey, &env(None, "{}")), own);
        let binary = env(Some(&[0xff, 0x00]), "{}");
        assert_eq!(ordering_key(&OrderingKey::KafkaKey, &binary), "x:ff00");
    }
}
