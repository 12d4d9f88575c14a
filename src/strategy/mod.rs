//! What one batch of a partition does to the database. The source hands every strategy the
//! same thing (a [`Batch`] of decoded records, in offset order) and the strategy commits it
//! in one transaction ([`batched`]) or one per message ([`per_message`]), calling back after
//! each PostgreSQL commit so the source can tell Kafka.

pub mod batched;
pub mod group;
pub mod inbox;
pub mod per_message;
mod segments;
mod stage;
pub(crate) mod versioned;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use crate::batch::Batch;
use crate::config::RetryConfig;
use crate::handler::{Handler, HandlerError};
use crate::store::{ErrorClass, StoreError};

/// What a batch amounted to: [`crate::batch`] owns the types, so [`crate::metrics`] and
/// [`crate::stats`] read them without depending on the strategies.
pub use crate::batch::{Outcome, Phases};

/// Everything a strategy needs to know about the partition it works for.
#[derive(Clone)]
pub struct PartitionCtx {
    pub consumer: Arc<str>,
    pub topic: Arc<str>,
    pub partition: i32,
    /// The ownership epoch this worker claimed; every transaction is fenced on it.
    pub epoch: i64,
    pub pool: Pool,
    pub handler: Arc<dyn Handler>,
    pub retry: RetryConfig,
    /// Which daily dedupe partitions exist (shared by the worker's partitions).
    pub partitions: Arc<crate::store::partitions::Known>,
    /// Cancelled when the partition is revoked or the worker stops: a strategy waiting out a
    /// backoff gives up at once (nothing is in flight then, and the next owner resumes from the
    /// stored offset).
    pub cancel: CancellationToken,
    /// `[consumer.version]`, when the consumer has versioned writes.
    pub version: Option<Arc<crate::config::VersionConfig>>,
    /// The longest one transaction attempt may wait for PostgreSQL (`database.transaction_deadline`).
    pub deadline: Duration,
    /// Where the consumer keeps its keys (`dedupe`): the ledger, or the handler's row.
    pub dedupe: crate::config::Dedupe,
}

/// Why a batch stopped without committing all of it. Whatever committed before the error was
/// reported through the callback.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    /// Another worker claimed the partition: this one is a zombie and rolled back.
    #[error("fenced: another worker owns the partition now")]
    Fenced,
    /// The partition was revoked or the worker is stopping.
    #[error("cancelled")]
    Cancelled,
    /// PostgreSQL no longer holds the offset this worker committed last (`from`): it went back
    /// (a failover that lost commits, a restore) and now says `stored`. Nothing of the batch
    /// committed; the partition must be claimed again and read from `stored`.
    #[error("the stored offset went back from {from:?} to {stored:?}")]
    WentBack {
        from: Option<i64>,
        stored: Option<i64>,
    },
    /// The handler or the schema cannot work; the worker stops.
    #[error("fatal: {0}")]
    Fatal(String),
}

/// Called with the partition's next offset after every PostgreSQL commit.
pub type Committed<'a> = &'a (dyn Fn(i64) + Send + Sync);

#[async_trait]
pub trait Strategy: Send + Sync + 'static {
    /// Whether the source runs the handler's check on each record before the batch (parking
    /// what it refuses). The inbox receiver stores such records instead.
    fn checks_messages(&self) -> bool {
        true
    }

    async fn process(
        &self,
        ctx: &PartitionCtx,
        batch: Batch,
        committed: Committed<'_>,
    ) -> Result<Outcome, BatchError>;
}

/// How one transaction attempt failed.
#[derive(Debug)]
pub(crate) enum AttemptError {
    /// The fenced offset move matched no row, for this reason.
    Refused(crate::store::offsets::Refusal),
    /// The database could not do it now: retry without limit.
    Unavailable(String),
    /// The handler asked for a retry, or the database failed with a SQLSTATE of unknown
    /// meaning: counted against the batch (`retry.max_attempts`), then the batch is split and
    /// the message that still fails alone is parked.
    Transient(String),
    /// These candidates (by index) can never be applied.
    Reject(Vec<(usize, String)>),
    /// Something in the batch cannot be applied; culprit unknown.
    Permanent(String),
    Fatal(String),
}

impl From<StoreError> for AttemptError {
    fn from(e: StoreError) -> Self {
        let text = e.describe();
        match e.class() {
            ErrorClass::Transient => AttemptError::Unavailable(text),
            ErrorClass::Permanent => AttemptError::Permanent(text),
            ErrorClass::Fatal => AttemptError::Fatal(text),
            // The handler's budget, then isolation: the same path as a handler's own retry.
            ErrorClass::Unknown => AttemptError::Transient(text),
        }
    }
}

impl From<tokio_postgres::Error> for AttemptError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError::from(e).into()
    }
}

impl From<deadpool_postgres::PoolError> for AttemptError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        StoreError::from(e).into()
    }
}

impl From<HandlerError> for AttemptError {
    fn from(e: HandlerError) -> Self {
        match e {
            HandlerError::Transient(t) => AttemptError::Transient(t),
            HandlerError::Reject(v) => AttemptError::Reject(v),
            HandlerError::Permanent(t) => AttemptError::Permanent(t),
            HandlerError::Fatal(t) => AttemptError::Fatal(t),
            HandlerError::Unavailable(t) => AttemptError::Unavailable(t),
        }
    }
}

/// Exponential backoff with jitter: `initial × 2^(attempt-1)`, capped at `max`, then a random
/// half of it added or not, so that workers retrying together spread out.
pub fn backoff(retry: &RetryConfig, attempt: u32) -> Duration {
    let exp = retry
        .initial_backoff
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(20));
    let base = exp.min(retry.max_backoff);
    base / 2 + base.mul_f64(fastrand::f64() / 2.0)
}

/// Sleeps for the backoff unless the partition is cancelled first.
pub(crate) async fn wait(ctx: &PartitionCtx, attempt: u32) -> Result<(), BatchError> {
    tokio::select! {
        _ = ctx.cancel.cancelled() => Err(BatchError::Cancelled),
        _ = tokio::time::sleep(backoff(&ctx.retry, attempt)) => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_and_stays_under_the_cap() {
        let retry = RetryConfig {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        };
        let b1 = backoff(&retry, 1);
        assert!(b1 >= Duration::from_millis(50) && b1 <= Duration::from_millis(100));
        let b3 = backoff(&retry, 3);
        assert!(b3 >= Duration::from_millis(200) && b3 <= Duration::from_millis(400));
        for n in 1..40 {
            assert!(backoff(&retry, n) <= Duration::from_secs(1));
        }
    }
}
