//! The outbox relay (`effectively relay -c FILE`): publishes the rows a service committed to its
//! `outbox` table, in the same transaction as its state change, to Kafka.
//!
//! One round, in one PostgreSQL transaction:
//! 1. claim up to `relay.batch` unpublished rows with `FOR UPDATE SKIP LOCKED`, the oldest row
//!    of each aggregate and the rows behind it (`store::outbox`), in `seq` order;
//! 2. publish each with the idempotent producer to its event type's topic: the aggregate id as
//!    the key (one aggregate, one partition: its order holds), the row's id in the `event_id`
//!    header (what consumers dedupe on), the event type in `event_type`, the payload as value;
//! 3. wait for the broker's acknowledgement of every record;
//! 4. mark the rows published (or delete them), and commit.
//!
//! A crash between 3 and 4 leaves the rows unpublished: the next round (of this relay or any
//! other) publishes them again, under the same event id, which a consumer of this engine skips.
//! Delivery is at least once; the consumer makes it exactly once. Any number of relays may run:
//! the row locks keep them off each other's rows, and each aggregate's rows are taken by one
//! relay at a time, so its order holds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio_util::sync::CancellationToken;

use crate::config::{
    Config, DatabaseConfig, Published, RelayConfig, RetryConfig, DEFAULT_DATABASE,
};
use crate::health::Health;
use crate::store::{outbox, pool, StoreError};
use crate::telemetry::{self, context::TRACEPARENT, context::TRACESTATE};

/// Why the relay stopped, or a round failed.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error("this config has no [relay] section")]
    NotConfigured,
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("kafka settings: {0}")]
    KafkaSettings(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error("the broker did not acknowledge {rows} record(s): {error}")]
    Publish { rows: usize, error: String },
    #[error(transparent)]
    Telemetry(#[from] telemetry::TelemetryError),
}

impl From<deadpool_postgres::PoolError> for RelayError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        RelayError::Store(e.into())
    }
}

impl From<tokio_postgres::Error> for RelayError {
    fn from(e: tokio_postgres::Error) -> Self {
        RelayError::Store(e.into())
    }
}

/// One relay: a connection pool and an idempotent producer.
pub struct Relay {
    config: RelayConfig,
    /// The event types claimed (`None`: all).
    types: Option<Vec<String>>,
    pool: Pool,
    producer: FutureProducer,
    /// For the readiness probe, on a connection of its own: the name and settings of the
    /// database whose outbox this relay works.
    database: (String, DatabaseConfig),
    health: Arc<Health>,
}

impl Relay {
    /// Builds the relay of `config`'s `[relay]` (no connection is made yet).
    pub fn new(config: &Config) -> Result<Relay, RelayError> {
        let relay = config.relay.clone().ok_or(RelayError::NotConfigured)?;
        telemetry::install(&config.tracing, telemetry::Component::Relay)?;
        let producer = config.kafka.client_config(&[
            // No duplicates or reordering from the producer's own retries: what is left is the
            // resend after a crash, which the event id covers.
            ("enable.idempotence", "true".into()),
            ("acks", "all".into()),
            ("linger.ms", "5".into()),
            (
                "message.timeout.ms",
                relay.publish_timeout.as_millis().to_string(),
            ),
        ]);
        let producer = producer.map_err(RelayError::KafkaSettings)?;
        let name = relay.database.as_deref().unwrap_or(DEFAULT_DATABASE);
        let db = (config.database.get(Some(name))).map_err(pool::PoolError::Unknown)?;
        let opts = pool::PoolOptions {
            size: 2,
            ..pool::PoolOptions::of(db)
        };
        Ok(Relay {
            types: relay.event_types(),
            pool: pool::build_for(db, &opts)?,
            producer: producer.create()?,
            database: (name.to_string(), db.clone()),
            config: relay,
            health: Health::new(),
        })
    }

    /// The relay's liveness and readiness (PostgreSQL reachable), for `/healthz` and `/readyz`.
    pub fn health(&self) -> Arc<Health> {
        Arc::clone(&self.health)
    }

    /// The longest gap between two rounds' starts when nothing is wrong: the longest wait
    /// (the poll interval, or a backoff of up to 5 s), the broker's acknowledgement
    /// (`publish_timeout`) and a silent database's statements.
    fn period(&self) -> Duration {
        self.config.poll_interval.max(Duration::from_secs(5))
            + self.config.publish_timeout
            + pool::SILENT_SERVER_TIMEOUT
    }

    /// One round (module docs, 1 to 4); returns how many rows it published.
    pub async fn round(&self) -> Result<usize, RelayError> {
        let mut conn = self.pool.get().await?;
        let tx = conn.transaction().await?;
        let rows = outbox::claim(&tx, self.types.as_deref(), self.config.batch as i64).await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let started = Instant::now();
        let mut deliveries = Vec::with_capacity(rows.len());
        let mut spans = Vec::new();
        for r in &rows {
            let topic = self
                .config
                .topic_for(&r.event_type)
                .expect("only event types with a topic are claimed");
            let id = r.id.to_string();
            let mut headers = OwnedHeaders::new()
                .insert(Header {
                    key: "event_id",
                    value: Some(id.as_bytes()),
                })
                .insert(Header {
                    key: "event_type",
                    value: Some(r.event_type.as_bytes()),
                });
            // The row's trace context goes on: through a span of this relay when the row's
            // context is sampled (and tracing is on), else as the row holds it.
            let span = (r.traceparent.as_deref())
                .filter(|_| telemetry::enabled())
                .and_then(|tp| telemetry::context::from_columns(Some(tp), r.tracestate.as_deref()))
                .and_then(|cx| {
                    let attrs = [
                        ("messaging.message.id", id.as_str()),
                        ("effectively.event_type", r.event_type.as_str()),
                        ("effectively.aggregate_id", r.aggregate_id.as_str()),
                    ];
                    telemetry::Publish::send(topic, &cx, &attrs)
                });
            let carrier = match &span {
                Some(s) => Some(s.carrier()),
                None => (r.traceparent.clone()).map(|tp| (tp, r.tracestate.clone())),
            };
            if let Some((parent, state)) = &carrier {
                headers = headers.insert(Header {
                    key: TRACEPARENT,
                    value: Some(parent.as_bytes()),
                });
                if let Some(state) = state {
                    headers = headers.insert(Header {
                        key: TRACESTATE,
                        value: Some(state.as_bytes()),
                    });
                }
            }
            if span.is_some() {
                spans.resize_with(deliveries.len(), || None);
                spans.push(span);
            }
            let record = FutureRecord::to(topic)
                .key(&r.aggregate_id)
                .payload(&r.payload)
                .headers(headers);
            // Enqueued in `seq` order; the idempotent producer keeps that order per partition.
            match self.producer.send_result(record) {
                Ok(d) => deliveries.push(d),
                Err((e, _)) => {
                    return Err(RelayError::Publish {
                        rows: rows.len(),
                        error: e.to_string(),
                    })
                }
            }
        }
        for (i, d) in deliveries.into_iter().enumerate() {
            // Only rows with a span have a place in `spans` (nothing is pushed when off).
            let mut span = spans.get_mut(i).and_then(Option::take);
            let failed = match d.await {
                Ok(Ok(delivery)) => {
                    if let Some(mut s) = span.take() {
                        s.attribute(
                            "messaging.destination.partition.id",
                            delivery.partition.into(),
                        );
                        s.attribute("messaging.kafka.offset", delivery.offset);
                        s.end(None);
                    }
                    None
                }
                Ok(Err((e, _))) => Some(e.to_string()),
                Err(_) => Some("the producer was dropped".to_string()),
            };
            if let Some(error) = failed {
                if let Some(s) = span {
                    s.end(Some(&error));
                }
                // Nothing is marked: the rows published so far go out again next round.
                return Err(RelayError::Publish {
                    rows: rows.len(),
                    error,
                });
            }
        }
        // Chaos: published and acknowledged, not marked.
        fail::fail_point!("relay_after_publish", |_| std::process::abort());
        let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.id).collect();
        outbox::published(&tx, &ids, self.config.published == Published::Delete).await?;
        tx.commit().await?;
        let now = chrono::Utc::now();
        crate::metrics::outbox_published(
            rows.iter()
                .map(|r| (now - r.created_at).to_std().unwrap_or_default()),
        );
        tracing::debug!(
            rows = rows.len(),
            ms = started.elapsed().as_millis() as u64,
            "outbox relay: published"
        );
        Ok(rows.len())
    }

    /// Rounds until `stop`: a full round is followed by another at once; otherwise the relay
    /// waits `poll_interval`. A failed round is retried after a backoff. Samples the backlog
    /// gauges every 15 s.
    pub async fn run(self, stop: CancellationToken) {
        let retry = RetryConfig {
            max_attempts: u32::MAX,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        };
        let mut failures = 0u32;
        let mut sampled: Option<Instant> = None;
        let beat = self.health.register("relay", self.period());
        let _probe = crate::health::spawn_database_watch(
            &self.database.0,
            self.database.1.clone(),
            self.health(),
            &stop,
        );
        loop {
            beat.beat();
            if sampled.is_none_or(|t| t.elapsed() >= Duration::from_secs(15)) {
                sampled = Some(Instant::now());
                self.sample().await;
            }
            let wait = tokio::select! {
                _ = stop.cancelled() => break,
                r = self.round() => match r {
                    Ok(n) => {
                        failures = 0;
                        if n >= self.config.batch {
                            continue;
                        }
                        self.config.poll_interval
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(attempt = failures, error = %e,
                            "outbox relay: round failed; nothing marked, retrying");
                        crate::strategy::backoff(&retry, failures)
                    }
                },
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        // Ends on purpose: not a dead loop for `/healthz`.
        self.health.stopping();
        telemetry::flush().await;
    }

    async fn sample(&self) {
        let backlog = match self.pool.get().await {
            Ok(c) => outbox::backlog(&c, self.types.as_deref()).await,
            Err(e) => Err(e.into()),
        };
        match backlog {
            Ok((rows, oldest_s)) => crate::metrics::outbox_backlog(rows, oldest_s),
            Err(e) => tracing::debug!(error = %e, "outbox relay: sampling the backlog failed"),
        }
    }
}
