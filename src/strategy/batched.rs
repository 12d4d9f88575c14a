//! The `batch` strategy (the default): one transaction per batch of a partition.
//!
//! 1. advance the partition's offset, fenced by the ownership epoch (a zombie stops here);
//! 2. park the batch's undecodable or refused records;
//! 3. binary `COPY` the first copy of each message into `staged_messages`;
//! 4. insert the staged keys into `processed_messages ... ON CONFLICT DO NOTHING`: the keys it
//!    returns are the fresh messages
//!    (under `dedupe = "business-row"`, steps 3 and 4 are skipped: every first copy goes to the
//!    handler, whose insert under its business row's unique key is the dedupe);
//! 5. the handler applies the effect to the fresh messages only;
//! 6. `COMMIT`, and only then tell Kafka.
//!
//! Failures roll the whole transaction back; see `segments` for what is retried and how a
//! failing message is found and parked.

use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use deadpool_postgres::Transaction;

use super::group::{Groups, Reply};
use super::segments::{drive, Body, BodyOutcome, Shape};
use super::stage;
use super::{versioned, AttemptError, BatchError, Committed, Outcome, PartitionCtx, Strategy};
use crate::batch::{Batch, Raw};
use crate::config::Dedupe;
use crate::envelope::Envelope;
use crate::handler::BatchContext;
use crate::prefilter::Prefilter;

#[derive(Default, Clone)]
pub struct Batched {
    /// The consumer's Redis pre-filter, if it has one.
    pub prefilter: Option<Arc<Prefilter>>,
    /// Commit groups (`batch.group_partitions`): small batches of several partitions share a
    /// transaction.
    pub groups: Option<Arc<Groups>>,
}

#[async_trait]
impl Strategy for Batched {
    async fn process(
        &self,
        ctx: &PartitionCtx,
        batch: Batch,
        committed: Committed<'_>,
    ) -> Result<Outcome, BatchError> {
        let (batch, rolled_back) = match &self.groups {
            Some(groups) if groups.takes(&batch) => {
                let next = batch.next_offset();
                match groups.submit(ctx, batch).await? {
                    Reply::Committed(outcome) => {
                        next.into_iter().for_each(committed);
                        return Ok(outcome);
                    }
                    Reply::Alone { batch, rolled_back } => (batch, rolled_back),
                }
            }
            _ => (batch, false),
        };
        let shape = Shape {
            segment_len: usize::MAX,
            fence_first: true,
            strategy: "batch",
        };
        let mut outcome = drive(
            ctx,
            &batch,
            &shape,
            &StageAndDedupe,
            self.prefilter.as_deref(),
            committed,
        )
        .await?;
        outcome.retries += u64::from(rolled_back);
        Ok(outcome)
    }
}

struct StageAndDedupe;

#[async_trait]
impl Body for StageAndDedupe {
    async fn run(
        &self,
        ctx: &PartitionCtx,
        tx: &Transaction<'_>,
        candidates: &[&Envelope],
        raws: &[&Raw],
    ) -> Result<BodyOutcome, AttemptError> {
        let business_row = ctx.dedupe == Dedupe::BusinessRow;
        let t0 = Instant::now();
        let (t1, fresh_seq) = stage::stage_and_dedupe(ctx, tx, candidates).await?;
        let t2 = Instant::now();
        let fresh: Vec<&Envelope> = fresh_seq.iter().map(|&s| candidates[s]).collect();
        let mut out = BodyOutcome {
            fresh_ts_ms: fresh
                .iter()
                .filter_map(|e| e.kafka_ts.map(|t| t.timestamp_millis()))
                .collect(),
            stage: t1 - t0,
            dedupe: t2 - t1,
            fresh: fresh.len() as u64,
            duplicates: (candidates.len() - fresh.len()) as u64,
            ..BodyOutcome::default()
        };
        if fresh.is_empty() {
            return Ok(out);
        }
        let applied = match &ctx.version {
            Some(cfg) => {
                let fresh_raws: Vec<&Raw> = fresh_seq.iter().map(|&s| raws[s]).collect();
                versioned::apply(ctx, cfg, tx, &fresh, &fresh_raws)
                    .await
                    .map(|e| {
                        out.versions = e.skipped;
                        e.applied
                    })
            }
            None => {
                let bctx = BatchContext {
                    consumer: &ctx.consumer,
                    topic: &ctx.topic,
                    partition: Some(ctx.partition),
                    versions: None,
                    business_row,
                };
                ctx.handler
                    .apply(tx, &bctx, &fresh)
                    .await
                    .map_err(Into::into)
            }
        };
        out.effect = t2.elapsed();
        match applied {
            Ok(applied) => {
                out.effects = applied.effects;
                out.business_duplicates = applied.business_duplicates;
                // Copies the handler's row recognised (business-row only): duplicates of their
                // key, as the ledger would have counted them. Their timestamps stay in
                // `fresh_ts_ms` (the handler does not say which they were).
                out.fresh -= applied.redelivered;
                out.duplicates += applied.redelivered;
                Ok(out)
            }
            // The handler names fresh messages; the driver wants candidates.
            Err(AttemptError::Reject(list)) => Err(AttemptError::Reject(
                list.into_iter()
                    .map(|(f, why)| (fresh_seq[f], why))
                    .collect(),
            )),
            Err(e) => Err(e),
        }
    }
}
