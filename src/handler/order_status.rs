//! The built-in versioned example: the last status of each order, as the seed's "Conditional
//! and versioned writes" keeps it.
//!
//! ```toml
//! handler = { kind = "order-status" }    # status = "/status" by default
//! [consumer.version]
//! aggregate = "/order_id"
//! version = "/version"
//! mode = "full-state"
//! ```
//!
//! The engine decides which events apply (newest above the stored version; see
//! `crate::version`) and hands them over with [`BatchContext::version_of`]. The handler then
//! writes them in one statement for the whole round: an insert for an order the engine has no
//! version of, else `UPDATE ... WHERE version = <the stored version>`, the seed's
//! `UPDATE ... WHERE order_id = $1 AND version = 7` for a batch at once. Every move is also
//! recorded in `order_status_history` (from, to), so a verifier can prove no order ever went
//! back. A row the condition does not move (the view was written by something else) changes
//! nothing and is counted as a business duplicate, with a warning.

use async_trait::async_trait;
use deadpool_postgres::Transaction;
use serde_json::Value;
use uuid::Uuid;

use super::{Applied, BatchContext, Handler, HandlerError};
use crate::envelope::{Envelope, Reason, Rejection};

// Rows arrive sorted by order id (one per order: the engine's rounds never hold two versions of
// one aggregate), so two transactions lock shared rows in one order.
const APPLY: &str = "\
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::uuid[])
        AS t(order_id, status, version, stored, message_id)
), moved AS (
    INSERT INTO order_status_view AS v (order_id, status, version)
    SELECT order_id, status, version FROM input ORDER BY order_id
    ON CONFLICT (order_id) DO UPDATE
    SET status = EXCLUDED.status, version = EXCLUDED.version, updated_at = now()
    WHERE v.version = (SELECT i.stored FROM input i WHERE i.order_id = EXCLUDED.order_id)
    RETURNING v.order_id
), history AS (
    INSERT INTO order_status_history (order_id, status, from_version, to_version, message_id)
    SELECT i.order_id, i.status, i.stored, i.version, i.message_id
    FROM input i JOIN moved m USING (order_id)
    ORDER BY i.order_id
)
SELECT count(*) FROM moved";

/// The built-in order-status handler.
#[derive(Debug, Clone)]
pub struct OrderStatus {
    status: String,
}

impl OrderStatus {
    /// `status`: the JSON pointer to the status in the payload.
    pub fn new(status: String) -> Self {
        Self { status }
    }

    fn status<'a>(&self, msg: &'a Envelope) -> Result<&'a str, Rejection> {
        match msg.json.as_ref().and_then(|j| j.pointer(&self.status)) {
            Some(Value::String(s)) if !s.is_empty() => Ok(s),
            Some(other) => Err(Rejection::new(
                Reason::MissingField,
                format!(
                    "status at {} must be a non-empty string, not {other}",
                    self.status
                ),
            )),
            None => Err(Rejection::new(
                Reason::MissingField,
                format!("no status at {}", self.status),
            )),
        }
    }
}

#[async_trait]
impl Handler for OrderStatus {
    fn check(&self, msg: &Envelope) -> Result<(), Rejection> {
        self.status(msg).map(|_| ())
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        let mut rows = Vec::with_capacity(fresh.len());
        for (i, msg) in fresh.iter().enumerate() {
            let status = self
                .status(msg)
                .map_err(|r| HandlerError::Reject(vec![(i, r.to_string())]))?;
            let v = ctx.version_of(msg).ok_or_else(|| {
                HandlerError::Fatal(
                    "the order-status handler needs [consumer.version] (aggregate, version)".into(),
                )
            })?;
            rows.push((v, status, msg.message_id));
        }
        rows.sort_by(|a, b| a.0.aggregate.cmp(&b.0.aggregate));
        let ids: Vec<&str> = rows.iter().map(|r| r.0.aggregate.as_str()).collect();
        let statuses: Vec<&str> = rows.iter().map(|r| r.1).collect();
        let versions: Vec<i64> = rows.iter().map(|r| r.0.version).collect();
        let stored: Vec<Option<i64>> = rows.iter().map(|r| r.0.stored).collect();
        let message_ids: Vec<Uuid> = rows.iter().map(|r| r.2).collect();
        let stmt = tx.prepare_cached(APPLY).await?;
        let moved: i64 = tx
            .query_one(&stmt, &[&ids, &statuses, &versions, &stored, &message_ids])
            .await?
            .get(0);
        let unmoved = rows.len() as u64 - moved as u64;
        if unmoved > 0 {
            tracing::warn!(
                consumer = ctx.consumer,
                rows = unmoved,
                "order_status_view: rows not at the version the engine stored were left alone \
                 (written by something else?)"
            );
        }
        Ok(Applied {
            effects: moved as u64,
            business_duplicates: unmoved,
            redelivered: 0,
        })
    }
}
