//! Steps 3 and 4 of the batch strategy, shared by one partition's transaction
//! ([`super::batched`]) and a commit group's ([`super::group`]): stage the first copies with a
//! binary `COPY`, then insert their keys into the dedupe ledger; the keys it returns are fresh.
//! And, before any transaction that writes keys (the per-message strategy's too), the ledger's
//! daily partitions they go to.

use std::time::Instant;

use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;

use super::PartitionCtx;
use crate::config::Dedupe;
use crate::envelope::Envelope;
use crate::store::{copy, dedupe, StoreError};

/// Steps 3 and 4 for `candidates` (first copies), in `tx`: when the staging ended, and the
/// indexes of the fresh ones, ascending. Under `dedupe = "business-row"` neither runs: the
/// handler's row is the key, and every candidate goes to it. Shared by [`super::batched`] and
/// [`super::group`].
pub(super) async fn stage_and_dedupe(
    ctx: &PartitionCtx,
    tx: &Transaction<'_>,
    candidates: &[&Envelope],
) -> Result<(Instant, Vec<usize>), StoreError> {
    if ctx.dedupe == Dedupe::BusinessRow {
        return Ok((Instant::now(), (0..candidates.len()).collect()));
    }
    let set_based = ctx.handler.stages_payload();
    copy::stage(tx, candidates, set_based, false, None).await?;
    let staged = Instant::now();
    let fresh = dedupe::insert_staged(tx, &ctx.consumer, candidates, set_based).await?;
    Ok((staged, fresh))
}

/// Before the transaction: the ledger's daily partitions for the dates of `candidates`, made
/// where missing (none under `dedupe = "business-row"`: no key is written there).
pub(super) async fn ensure_partitions<C: GenericClient + Sync>(
    ctx: &PartitionCtx,
    client: &C,
    candidates: &[&Envelope],
) -> Result<(), StoreError> {
    if ctx.dedupe == Dedupe::BusinessRow {
        return Ok(());
    }
    let dates = candidates.iter().map(|e| e.event_date);
    ctx.partitions.ensure(client, dates).await
}
