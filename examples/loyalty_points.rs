//! A library user's own handler: loyalty points for every order, in a table of its own.
//!
//! ```sh
//! source .stack/env                       # KAFKA_BROKERS and DATABASE_URL of `make up`
//! cargo run --example loyalty_points -- orders
//! ```
//!
//! What it shows:
//! - **A serde-typed payload**: each message's JSON becomes an [`OrderPlaced`]; one that does
//!   not fit is parked with the reason before any transaction ([`Handler::check`]).
//! - **A table of its own**, created at start ([`Handler::prepare`]) and written in the
//!   engine's transaction, beside the message's dedupe key and the partition's offset: the
//!   points are there exactly once, whatever Kafka redelivers.
//! - **A business-key duplicate answered once**: an upstream that places the same order twice
//!   under two event ids gets past the dedupe key (two ids), and the order id's primary key
//!   turns the second into a no-op, counted as a business duplicate.
//!
//! The consumer's dedupe key is the `event_id` header (a UUID), its date the order's
//! `placed_at`; `tests/example.rs` runs [`run`] against the real broker and database.

use std::sync::Arc;

use async_trait::async_trait;
use deadpool_postgres::Transaction;
use effectively::config::Config;
use effectively::envelope::{Envelope, Reason, Rejection};
use effectively::handler::{Applied, BatchContext, Handler, HandlerError, Registry};
use serde::Deserialize;

/// The payload producers send.
#[derive(Debug, Deserialize)]
pub struct OrderPlaced {
    pub order_id: String,
    pub customer: String,
    pub total_cents: i64,
    pub placed_at: chrono::DateTime<chrono::Utc>,
}

/// One point per whole currency unit spent.
pub fn points(order: &OrderPlaced) -> i64 {
    order.total_cents / 100
}

/// The handler: registered under [`NAME`], referred to by `handler = { kind = "custom", name =
/// "loyalty-points" }`.
pub struct LoyaltyPoints;

pub const NAME: &str = "loyalty-points";

impl LoyaltyPoints {
    fn order(msg: &Envelope) -> Result<OrderPlaced, Rejection> {
        let order: OrderPlaced = serde_json::from_slice(&msg.payload).map_err(|e| {
            Rejection::new(Reason::MissingField, format!("not an OrderPlaced: {e}"))
        })?;
        if order.total_cents < 0 {
            return Err(Rejection::new(
                Reason::HandlerRejected,
                format!("order {} has a negative total", order.order_id),
            ));
        }
        Ok(order)
    }
}

#[async_trait]
impl Handler for LoyaltyPoints {
    fn check(&self, msg: &Envelope) -> Result<(), Rejection> {
        Self::order(msg).map(|_| ())
    }

    async fn prepare(&self, client: &tokio_postgres::Client) -> Result<(), HandlerError> {
        client
            .batch_execute(
                "CREATE TABLE IF NOT EXISTS loyalty_points (
                     order_id  text        PRIMARY KEY,
                     customer  text        NOT NULL,
                     points    bigint      NOT NULL,
                     placed_at timestamptz NOT NULL,
                     event_id  uuid        NOT NULL
                 )",
            )
            .await?;
        Ok(())
    }

    async fn apply(
        &self,
        tx: &Transaction<'_>,
        _ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        let mut applied = Applied::default();
        let stmt = tx
            .prepare_cached(
                "INSERT INTO loyalty_points (order_id, customer, points, placed_at, event_id)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (order_id) DO NOTHING",
            )
            .await?;
        for msg in fresh {
            // `check` ran before the transaction: a message here decodes.
            let order = Self::order(msg).map_err(|r| HandlerError::Permanent(r.to_string()))?;
            let inserted = tx
                .execute(
                    &stmt,
                    &[
                        &order.order_id,
                        &order.customer,
                        &points(&order),
                        &order.placed_at,
                        &msg.message_id,
                    ],
                )
                .await?;
            if inserted == 1 {
                applied.effects += 1;
            } else {
                applied.business_duplicates += 1;
            }
        }
        Ok(applied)
    }
}

/// The consumer's config: the stack's broker and database, one consumer on `topic`.
pub fn config(brokers: &str, database_url: &str, consumer: &str, topic: &str) -> Config {
    let text = format!(
        r#"
[kafka]
brokers = "{brokers}"
[database]
url = "{database_url}"
[[consumer]]
name = "{consumer}"
topics = ["{topic}"]
handler = {{ kind = "custom", name = "{NAME}" }}
event_date = "/placed_at"
"#
    );
    Config::from_toml_str(&text).expect("the example's config is valid")
}

/// Runs the worker with this handler registered until `shutdown` completes.
pub async fn run(
    config: Config,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), effectively::worker::WorkerError> {
    let registry = Registry::new().with(NAME, Arc::new(LoyaltyPoints));
    effectively::worker::run(config, registry, shutdown).await
}

#[allow(dead_code)] // tests/example.rs includes this file for `run`, not for `main`
#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let topic = std::env::args().nth(1).unwrap_or_else(|| "orders".into());
    let env = |name: &str| {
        std::env::var(name).map_err(|_| anyhow::anyhow!("{name} is not set (source .stack/env)"))
    };
    let config = config(
        &env("KAFKA_BROKERS")?,
        &env("DATABASE_URL")?,
        "loyalty",
        &topic,
    );
    tracing_subscriber::fmt().with_env_filter("info").init();
    eprintln!("loyalty points for {topic}: Ctrl-C stops");
    run(config, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
