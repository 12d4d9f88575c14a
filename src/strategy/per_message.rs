//! The `per-message` strategy: the seed's idempotent consumer, exactly. One transaction per
//! message: insert the key first (`ON CONFLICT DO NOTHING`; a duplicate inserts 0 rows and
//! changes nothing else), apply the effect, store the offset, commit, then tell Kafka.
//!
//! One deviation from the seed's text, on purpose: for a duplicate the seed rolls back and
//! acks. Here the duplicate's transaction still commits the offset advance, so that Kafka's
//! committed offset is never ahead of the one stored in PostgreSQL.
//!
//! It is bounded by one commit (one `fsync`) per message, a real option for low rates and the
//! baseline the benchmark compares the batch strategy against.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use deadpool_postgres::Transaction;

use super::segments::{drive, Body, BodyOutcome, Shape};
use super::{versioned, AttemptError, BatchError, Committed, Outcome, PartitionCtx, Strategy};
use crate::batch::{Batch, Raw};
use crate::envelope::Envelope;
use crate::handler::BatchContext;
use crate::prefilter::Prefilter;
use crate::store::{copy, dedupe};

#[derive(Default, Clone)]
pub struct PerMessage {
    /// The consumer's Redis pre-filter, if it has one.
    pub prefilter: Option<Arc<Prefilter>>,
}

#[async_trait]
impl Strategy for PerMessage {
    async fn process(
        &self,
        ctx: &PartitionCtx,
        batch: Batch,
        committed: Committed<'_>,
    ) -> Result<Outcome, BatchError> {
        let shape = Shape {
            segment_len: 1,
            fence_first: false,
            strategy: "per-message",
        };
        drive(
            ctx,
            &batch,
            &shape,
            &KeyFirst,
            self.prefilter.as_deref(),
            committed,
        )
        .await
    }
}

struct KeyFirst;

#[async_trait]
impl Body for KeyFirst {
    async fn run(
        &self,
        ctx: &PartitionCtx,
        tx: &Transaction<'_>,
        candidates: &[&Envelope],
        raws: &[&Raw],
    ) -> Result<BodyOutcome, AttemptError> {
        let mut out = BodyOutcome::default();
        // Segments of one record: exactly one candidate.
        for (msg, raw) in candidates.iter().zip(raws) {
            let t0 = Instant::now();
            let fresh =
                dedupe::insert_one(tx, &ctx.consumer, &msg.message_id, &msg.event_date).await?;
            out.dedupe += t0.elapsed();
            if !fresh {
                out.duplicates += 1;
                continue;
            }
            out.fresh += 1;
            out.fresh_ts_ms
                .extend(msg.kafka_ts.map(|t| t.timestamp_millis()));
            if let Some(cfg) = &ctx.version {
                let t2 = Instant::now();
                let e = versioned::apply(ctx, cfg, tx, &[*msg], &[*raw]).await?;
                out.effect += t2.elapsed();
                out.effects += e.applied.effects;
                out.business_duplicates += e.applied.business_duplicates;
                out.versions.add(&e.skipped);
                continue;
            }
            let t1 = Instant::now();
            if ctx.handler.stages_payload() {
                copy::stage(tx, &[*msg], true, true, None).await?;
            }
            out.stage += t1.elapsed();
            let bctx = BatchContext {
                consumer: &ctx.consumer,
                topic: &ctx.topic,
                partition: Some(ctx.partition),
                versions: None,
                business_row: false,
            };
            let t2 = Instant::now();
            let applied = ctx.handler.apply(tx, &bctx, &[*msg]).await?;
            out.effect += t2.elapsed();
            out.effects += applied.effects;
            out.business_duplicates += applied.business_duplicates;
        }
        Ok(out)
    }
}
