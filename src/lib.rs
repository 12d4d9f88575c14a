//! # effectively
//!
//! Consumes Apache Kafka and applies every message's effect to PostgreSQL exactly once, although
//! Kafka delivers at least once. Per partition, one PostgreSQL transaction per batch holds the
//! batch's dedupe keys, the effect on the fresh messages, and the partition's next offset
//! (fenced against zombies); Kafka hears about it only after `COMMIT`.
//!
//! # Your own handler
//!
//! The effect is a [`handler::Handler`]: it gets the batch's fresh messages (those whose dedupe
//! key was new) inside the engine's open transaction, and writes whatever it writes there; the
//! engine commits it with the dedupe keys and the partition's offset, or not at all. Register it
//! by name and run a worker; a consumer refers to it with `handler = { kind = "custom", name =
//! "..." }`. The whole example, with a serde-typed payload, a table of its own and a
//! business-key duplicate answered once, is `examples/loyalty_points.rs` (`cargo run --example
//! loyalty_points`), which `tests/example.rs` runs against the real broker and database.
//!
//! ```no_run
//! use std::sync::Arc;
//!
//! use effectively::envelope::Envelope;
//! use effectively::handler::{Applied, BatchContext, Handler, HandlerError, Registry};
//!
//! struct Audit;
//!
//! #[async_trait::async_trait]
//! impl Handler for Audit {
//!     async fn apply(
//!         &self,
//!         tx: &deadpool_postgres::Transaction<'_>,
//!         ctx: &BatchContext<'_>,
//!         fresh: &[&Envelope],
//!     ) -> Result<Applied, HandlerError> {
//!         for msg in fresh {
//!             tx.execute(
//!                 "INSERT INTO audit (consumer, event_id, body) VALUES ($1, $2, $3)",
//!                 &[&ctx.consumer, &msg.message_id, &msg.json],
//!             )
//!             .await?;
//!         }
//!         Ok(Applied { effects: fresh.len() as u64, ..Applied::default() })
//!     }
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let config = effectively::config::Config::load("effectively.toml".as_ref())?;
//! let registry = Registry::new().with("audit", Arc::new(Audit));
//! effectively::worker::run(config, registry, async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//!
//! Each module uses only the ones listed below it (`tests/layers.rs` checks it: no import
//! circle). The README's "Where to find what" names every file.
//!
//! - [`cli`]: the command line (`effectively run | relay | send | console | migrate |
//!   check-config | inbox | dead-letters | notifications | retention`).
//! - [`ceiling`]: the SQL ceiling benchmark (the batch transaction without Kafka).
//! - [`console`]: the web console: server-rendered pages of lag, parked messages, the inbox,
//!   the outbox and notifications, and the operator's actions behind typed confirmations; its
//!   read-only queries in [`store::browse`].
//! - [`worker`]: wires config, pool, handlers and one source per consumer; shutdown.
//! - [`endpoint`]: the monitoring endpoint of `run`, `relay` and `send`: `/metrics`,
//!   `/healthz`, `/readyz`.
//! - [`relay`]: the outbox relay: publishes `outbox` rows to Kafka in order per aggregate.
//! - [`sender`]: the notification sender: delivers `notifications` to providers with
//!   idempotency keys (the tests' provider, which honours them as Stripe's API does, is the
//!   workspace member `provider-stub/`, outside the engine).
//! - [`operator`]: the operator's way back for parked rows: redrive or discard dead letters,
//!   replay or discard FAILED inbox rows, retry or discard FAILED notifications, each audited in
//!   the change's own transaction ([`store::audit`]); [`operator::show`] renders a parked record.
//! - [`inbox`]: the inbox strategy's processors ([`inbox::processor`]: claim with `SKIP
//!   LOCKED` or a lease, apply, retry, park) and its status and replay ([`inbox::admin`]).
//! - [`source`]: Kafka group membership and rebalances ([`source::consumer`]: claim and seek
//!   on assignment, drain on revocation; [`source::context`]: librdkafka's callbacks), one task
//!   per partition that batches ([`source::partition`]), a stored offset outside the log
//!   ([`source::range`]), a partition stuck on a Kafka error or stalled in a batch
//!   ([`source::watch`]).
//! - [`strategy`]: what a batch does to the database: [`strategy::batched`] (the default, one
//!   transaction per batch; [`strategy::group`]: several partitions' batches in one),
//!   [`strategy::per_message`] (the seed's idempotent consumer) and [`strategy::inbox`] (the
//!   inbox's receiver: store, commit, ack).
//! - [`prefilter`]: the optional Redis pre-filter the batch and per-message strategies consult
//!   before their transaction and feed after `COMMIT` (never the authority: any Redis failure
//!   falls through to PostgreSQL).
//! - [`stats`]: in-process counters per consumer (what tests and the demo read).
//! - [`metrics`]: every Prometheus metric, its description, and one function per event that
//!   moves it; it owns its label types, so the modules that report to it stay above it.
//! - [`batch`]: records between the source and a strategy, and what a batch amounted to
//!   ([`batch::Outcome`]).
//! - [`handler`]: the effect: the trait, [`handler::cashback`], [`handler::sql`],
//!   [`handler::order_status`].
//! - [`health`]: liveness (every loop's heartbeat) and readiness (the database probe, group
//!   membership, drains, failovers), fed by [`source`], [`inbox`], [`worker`], [`relay`] and
//!   [`sender`]; it imports none of them.
//! - [`store`]: every SQL statement, each function taking the caller's transaction: offsets
//!   and fencing ([`store::offsets`]), staging by `COPY` ([`store::copy`]), the dedupe insert
//!   ([`store::dedupe`]), daily partitions ([`store::partitions`]), dead letters
//!   ([`store::dead_letters`]), what waits for an operator ([`store::parked`]), the audit of
//!   operator actions ([`store::audit`]), the inbox table ([`store::inbox`]), versions
//!   ([`store::versions`]), the outbox ([`store::outbox`]) and notifications
//!   ([`store::notifications`]), what the owner of a partition sees wrong with it
//!   ([`store::partition_health`]), migrations ([`store::migrate`]); every connection, and
//!   the pools of a process by database ([`store::pool::Pools`]: a consumer asks for its own
//!   database's, `[database]` or a `[database.NAME]`).
//! - [`version`]: versioned writes, which of a batch's events each aggregate can take and in
//!   what rounds (pure; `[consumer.version]`).
//! - [`envelope`]: decoding a record: message id, event date, rejections.
//! - [`telemetry`]: OpenTelemetry traces (`[tracing]`, off by default): W3C trace context read
//!   from records and rows ([`telemetry::context`]), the transaction, publish and call spans
//!   and their parent-and-links rule ([`telemetry::spans`]), the OTLP/HTTP exporter.
//! - [`config`]: the typed configuration, one file per section, and its checks
//!   (`[database]` and the named databases beside it: [`config::Databases`]).

pub mod batch;
pub mod ceiling;
pub mod cli;
pub mod config;
pub mod console;
pub mod endpoint;
pub mod envelope;
pub mod handler;
pub mod health;
pub mod inbox;
pub mod metrics;
pub mod operator;
pub mod prefilter;
pub mod relay;
pub mod sender;
pub mod source;
pub mod stats;
pub mod store;
pub mod strategy;
pub mod telemetry;
pub mod version;
pub mod worker;
