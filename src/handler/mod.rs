//! Handlers: the effect a consumer applies to its fresh messages, inside the engine's open
//! transaction. Two come built in, [`cashback`] (the seed's walk-through) and [`sql`] (an
//! effect written in the config file); library users implement [`Handler`] for their own and
//! register it by name in [`Registry`].

pub mod cashback;
pub mod order_status;
pub mod sql;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use deadpool_postgres::Transaction;

use crate::config::HandlerConfig;
use crate::envelope::{Envelope, Rejection};
use crate::store::{classify, describe, ErrorClass};

/// Where a batch comes from, for handlers that record it.
#[derive(Debug, Clone, Copy)]
pub struct BatchContext<'a> {
    pub consumer: &'a str,
    pub topic: &'a str,
    /// The batch's partition; `None` when it spans several (an inbox processor's round takes
    /// due rows of every partition at once). Each message carries its own in any case.
    pub partition: Option<i32>,
    /// Under `[consumer.version]`: each message's aggregate, version, and the version stored
    /// before it (see [`BatchContext::version_of`]).
    pub versions: Option<&'a crate::version::Versions>,
    /// Under `dedupe = "business-row"`: no ledger stands before the handler, so `fresh` holds
    /// every message of the batch (first copies), copies of messages applied before included,
    /// and the handler's insert under its unique key is the dedupe. It says how many of them
    /// it found applied already ([`Applied::redelivered`]).
    pub business_row: bool,
}

impl BatchContext<'_> {
    /// The version facts of `msg` (under `[consumer.version]`), for a conditional write:
    /// `UPDATE ... SET ..., version = v.version WHERE id = v.aggregate AND version = v.stored`
    /// (an insert when `stored` is `None`). The engine has already decided that `msg` applies;
    /// the condition is the handler's own guard, and a row it does not move means the handler's
    /// table and the engine's versions disagree.
    pub fn version_of(&self, msg: &Envelope) -> Option<&crate::version::Versioned> {
        self.versions.and_then(|v| v.get(&msg.message_id))
    }
}

/// What the effect did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Effects applied (for the cashback handler: credits).
    pub effects: u64,
    /// Fresh messages whose effect was already there under a business key (a double tap: same
    /// payment, new event id). They commit their dedupe key and change nothing else.
    pub business_duplicates: u64,
    /// Under `dedupe = "business-row"`: messages whose row this very message wrote before (a
    /// redelivery, a resend, a redrive), which the ledger would have stopped. The engine counts
    /// them as duplicates of their key. Always 0 under the ledger.
    pub redelivered: u64,
}

/// How a handler failed, which decides what the engine does with the batch.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Roll back and retry the batch after a backoff, up to `retry.max_attempts`; then the
    /// engine isolates the message that still fails and parks it. Also what a SQLSTATE of
    /// unknown meaning becomes (a lost connection or a lock timeout is [`Self::Unavailable`]).
    #[error("transient: {0}")]
    Transient(String),
    /// These messages (indexes into the `fresh` slice) can never be applied: the engine rolls
    /// back, parks them, and applies the rest of the batch.
    #[error("rejected {} message(s)", .0.len())]
    Reject(Vec<(usize, String)>),
    /// Something in this batch cannot be applied and the handler cannot say which message
    /// (a set-based statement hit a constraint): the engine isolates it by splitting the batch.
    #[error("permanent: {0}")]
    Permanent(String),
    /// The handler cannot work at all (its SQL or the schema is wrong): the worker stops rather
    /// than park every message.
    #[error("fatal: {0}")]
    Fatal(String),
    /// The database could not do it now (connection lost, deadlock, serialization failure):
    /// retried with backoff for as long as it takes, never counted against the message.
    #[error("database unavailable: {0}")]
    Unavailable(String),
}

impl From<tokio_postgres::Error> for HandlerError {
    /// By the SQLSTATE (see [`classify`]); the text names it, with the server's message.
    fn from(e: tokio_postgres::Error) -> Self {
        let text = describe(&e);
        match classify(&e) {
            ErrorClass::Transient => HandlerError::Unavailable(text),
            ErrorClass::Permanent => HandlerError::Permanent(text),
            ErrorClass::Fatal => HandlerError::Fatal(text),
            ErrorClass::Unknown => HandlerError::Transient(text),
        }
    }
}

/// The effect of a consumer.
///
/// A handler must decide from the message alone: never read the clock, a random number or a
/// changing rate to decide an amount, or a retry may decide differently from the attempt that
/// failed.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    /// The handler reads the payload as a JSON object (so the decoder parses it once, and parks
    /// a payload that is not JSON).
    fn needs_json(&self) -> bool {
        true
    }

    /// The handler reads `payload` from the `fresh_messages` view in SQL, so the batch's payloads
    /// are copied to the database too.
    fn stages_payload(&self) -> bool {
        false
    }

    /// The handler writes exactly one row a message under a unique key of the business (the
    /// cashback handler: one credit per payment), inserts it with `ON CONFLICT DO NOTHING`, and
    /// tells a copy of a message it applied before from a new message ([`Applied::redelivered`]):
    /// then a consumer may keep its keys on that row (`dedupe = "business-row"`) instead of in
    /// the ledger.
    fn dedupes_by_row(&self) -> bool {
        false
    }

    /// Checks one message before any transaction. A rejection is parked with its reason and
    /// the message never reaches [`Handler::apply`].
    fn check(&self, _msg: &Envelope) -> Result<(), Rejection> {
        Ok(())
    }

    /// Checks the handler against the database once at start-up (for example, that its SQL
    /// prepares), so a broken configuration stops the worker before it takes any partition.
    async fn prepare(&self, _client: &tokio_postgres::Client) -> Result<(), HandlerError> {
        Ok(())
    }

    /// Applies the effect of `fresh` (the messages whose dedupe key was new, in offset order)
    /// in the caller's transaction. The same messages are visible to SQL as the temporary view
    /// `fresh_messages`. The engine commits the transaction; the handler never does.
    async fn apply(
        &self,
        tx: &Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError>;
}

/// Handlers written in Rust by a library user, by the name a config refers to with
/// `handler = { kind = "custom", name = "..." }`.
#[derive(Default, Clone)]
pub struct Registry {
    custom: HashMap<String, Arc<dyn Handler>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("custom", &self.custom.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl Registry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `handler` under `name`.
    pub fn with(mut self, name: impl Into<String>, handler: Arc<dyn Handler>) -> Self {
        self.custom.insert(name.into(), handler);
        self
    }

    /// The handler a consumer's config names.
    pub fn build(&self, config: &HandlerConfig) -> Result<Arc<dyn Handler>, String> {
        match config {
            HandlerConfig::Cashback { rate_bp, notify } => Ok(Arc::new(
                cashback::Cashback::new(*rate_bp).notifying(notify.clone()),
            )),
            HandlerConfig::Sql { statement } => {
                Ok(Arc::new(sql::SqlHandler::new(statement.clone())))
            }
            HandlerConfig::OrderStatus { status } => {
                Ok(Arc::new(order_status::OrderStatus::new(status.clone())))
            }
            HandlerConfig::Custom { name } => self.custom.get(name).cloned().ok_or_else(|| {
                format!("no custom handler named {name:?} is registered with this binary")
            }),
        }
    }
}
