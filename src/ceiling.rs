//! The SQL ceiling: the batch strategy's exact transaction (fenced offset, binary `COPY` into
//! the staging table, the dedupe insert, the cashback effect, `COMMIT`) driven straight
//! against PostgreSQL with pre-decoded messages and no Kafka. What the engine reaches divided
//! by this is what Kafka, decoding and bookkeeping cost (`make bench` reports the ratio).

use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::batch::{Batch, Raw, Record};
use crate::config::RetryConfig;
use crate::envelope::{Decoder, RawRecord};
use crate::handler::cashback::Cashback;
use crate::store::partitions::Known;
use crate::store::pool::{self, PoolOptions};
use crate::store::{offsets, StoreError};
use crate::strategy::{batched::Batched, PartitionCtx, Strategy};

/// What one ceiling run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Ceiling {
    pub connections: usize,
    pub messages: u64,
    pub batch: usize,
    pub seconds: f64,
    pub msg_s: f64,
    pub effects: u64,
    /// Seconds spent in each phase, summed over all transactions (and connections).
    pub phases_s: [(&'static str, f64); 5],
}

#[derive(Debug, thiserror::Error)]
pub enum CeilingError {
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("batch failed: {0}")]
    Batch(#[from] crate::strategy::BatchError),
}

/// Builds `n` decoded `PaymentSucceeded` records of partition `partition`, every tenth one
/// repeated (the resends the engine benchmark carries too).
pub fn records(run: &str, partition: i32, n: usize) -> Vec<Record> {
    let decoder = Decoder::new(
        &crate::config::MessageIdConfig::header("event_id"),
        &crate::config::EventDateSource::Auto,
        1 << 20,
        true,
    );
    let mut out = Vec::with_capacity(n + n / 10);
    let mut offset = 0i64;
    for i in 0..n {
        let id = uuid::Uuid::now_v7();
        let payload = serde_json::to_vec(&serde_json::json!({
            "event_id": id,
            "payment_id": format!("ceil_{run}_{partition}_{i}"),
            // Users belong to one partition, as with Kafka's key-based partitioning: two
            // partitions' transactions never wait on each other's wallet rows.
            "user_id": format!("uceil_{run}_{partition}_{}", i % 1000),
            "amount_paise": 100 * (1 + i as i64 % 5000),
            "occurred_at": chrono::Utc::now().to_rfc3339(),
        }))
        .expect("json");
        let copies = if i % 10 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            let raw = Raw {
                partition,
                offset,
                timestamp_ms: Some(chrono::Utc::now().timestamp_millis()),
                key: None,
                payload: Some(payload.clone().into()),
                headers: vec![("event_id".into(), Some(id.to_string().into_bytes().into()))],
            };
            offset += 1;
            let decoded = raw.with_view(|v: &RawRecord<'_>| decoder.decode(v));
            out.push(Record { raw, decoded });
        }
    }
    out
}

/// Runs `messages` payments (plus 10% resends) through `connections` partitions in parallel,
/// `batch` records per transaction.
pub async fn run(
    url: &str,
    connections: usize,
    messages: usize,
    batch: usize,
) -> Result<Ceiling, CeilingError> {
    let pool = pool::build(
        url,
        &PoolOptions {
            size: connections,
            connect_timeout: std::time::Duration::from_secs(5),
            idle_in_transaction_timeout: std::time::Duration::from_secs(60),
            no_parallel_query: false,
        },
    )?;
    let run = uuid::Uuid::new_v4().simple().to_string()[..10].to_string();
    let consumer: Arc<str> = Arc::from(format!("ceiling-{run}").as_str());
    let topic: Arc<str> = Arc::from(format!("ceiling-{run}").as_str());
    let known = Arc::new(Known::default());
    let per_partition = messages / connections;
    let mut work = Vec::new();
    for p in 0..connections as i32 {
        let client = pool.get().await.map_err(StoreError::from)?;
        let claim = offsets::claim(&**client, &consumer, &topic, p, "ceiling").await?;
        known
            .create_ahead(&**client, chrono::Utc::now().date_naive(), 1)
            .await?;
        let ctx = PartitionCtx {
            consumer: Arc::clone(&consumer),
            topic: Arc::clone(&topic),
            partition: p,
            epoch: claim.epoch,
            pool: pool.clone(),
            handler: Arc::new(Cashback::new(200)),
            retry: RetryConfig::default(),
            partitions: Arc::clone(&known),
            cancel: CancellationToken::new(),
            version: None,
            deadline: std::time::Duration::from_secs(30),
            dedupe: crate::config::Dedupe::Ledger,
        };
        let recs = records(&run, p, per_partition);
        let mut batches = Vec::new();
        let mut it = recs.into_iter().peekable();
        // Each batch moves the fenced offset from where the one before left it.
        let mut stored = claim.next_offset;
        while it.peek().is_some() {
            let mut b = Batch {
                stored,
                ..Batch::default()
            };
            for r in it.by_ref().take(batch) {
                b.push(r);
            }
            stored = b.next_offset();
            batches.push(b);
        }
        work.push((ctx, batches));
    }
    let records: u64 = work
        .iter()
        .map(|(_, bs)| bs.iter().map(|b| b.len() as u64).sum::<u64>())
        .sum();
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (ctx, batches) in work {
        tasks.spawn(async move {
            let mut out = crate::strategy::Outcome::default();
            for b in batches {
                out.add(Batched::default().process(&ctx, b, &|_| {}).await?);
            }
            Ok::<_, crate::strategy::BatchError>(out)
        });
    }
    let mut total = crate::strategy::Outcome::default();
    while let Some(r) = tasks.join_next().await {
        total.add(r.expect("ceiling task panicked")?);
    }
    let effects = total.effects;
    let p = total.phases;
    let seconds = started.elapsed().as_secs_f64();
    // Messages are records, resent copies included, as in the engine's figure.
    Ok(Ceiling {
        connections,
        messages: records,
        batch,
        seconds,
        msg_s: records as f64 / seconds,
        effects,
        phases_s: [
            ("fence", p.fence.as_secs_f64()),
            ("stage", p.stage.as_secs_f64()),
            ("dedupe", p.dedupe.as_secs_f64()),
            ("effect", p.effect.as_secs_f64()),
            ("commit", p.commit.as_secs_f64()),
        ],
    })
}
