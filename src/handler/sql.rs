//! A declarative handler: one SQL statement from the config file, run once per batch over the
//! `fresh_messages` view (columns `seq, message_id, event_date, partition, offset, kafka_ts,
//! key, payload`), so a user who writes no Rust can run the engine on their own tables:
//!
//! ```toml
//! handler = { kind = "sql", statement = """
//!   INSERT INTO payment_audit (event_id, amount_paise)
//!   SELECT message_id, (payload->>'amount_paise')::bigint FROM fresh_messages
//!   ORDER BY message_id""" }
//! ```
//!
//! The statement may use `$1`, the consumer's name. It is prepared at start-up, so a typo stops
//! the worker before it takes a partition instead of parking every message. A statement that
//! fails on the data (a constraint, a bad cast, a trigger's `RAISE EXCEPTION`) makes the engine
//! split the batch until it finds the message, and park it with the SQLSTATE and the server's
//! message (`store::classify` decides by SQLSTATE). An upsert must expect two messages of one key
//! in a batch (SQLSTATE 21000 otherwise): aggregate per key in the `SELECT`, or `DISTINCT ON`
//! (docs/CONFIGURATION.md, "Two messages of one key in a batch").

use async_trait::async_trait;
use deadpool_postgres::Transaction;

use super::{Applied, BatchContext, Handler, HandlerError};
use crate::envelope::Envelope;

#[derive(Debug, Clone)]
pub struct SqlHandler {
    statement: String,
}

impl SqlHandler {
    pub fn new(statement: String) -> Self {
        Self { statement }
    }
}

#[async_trait]
impl Handler for SqlHandler {
    fn stages_payload(&self) -> bool {
        true
    }

    async fn prepare(&self, client: &tokio_postgres::Client) -> Result<(), HandlerError> {
        client
            .batch_execute(crate::store::copy::CREATE_SESSION_TABLES)
            .await?;
        let stmt = client.prepare(&self.statement).await.map_err(|e| {
            HandlerError::Fatal(format!(
                "the sql handler's statement does not prepare: {}",
                e.as_db_error().map(|d| d.message()).unwrap_or("unknown")
            ))
        })?;
        match stmt.params().len() {
            0 => Ok(()),
            1 if stmt.params()[0] == tokio_postgres::types::Type::TEXT => Ok(()),
            n => Err(HandlerError::Fatal(format!(
                "the sql handler's statement takes {n} parameter(s); only $1 (the consumer, text) is provided"
            ))),
        }
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        let stmt = tx.prepare_cached(&self.statement).await?;
        if stmt.params().is_empty() {
            tx.execute(&stmt, &[]).await?;
        } else {
            tx.execute(&stmt, &[&ctx.consumer]).await?;
        }
        Ok(Applied {
            effects: fresh.len() as u64,
            business_duplicates: 0,
            redelivered: 0,
        })
    }
}
