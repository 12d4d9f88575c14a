//! The connections one load run uses (PostgreSQL, an idempotent producer, a watcher of the
//! consumer's lag), and the waits on them: for the relay to publish a run's outbox rows, for
//! the engine to drain the topic ([`Session::drain`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::FutureProducer;
use rdkafka::ClientConfig;

use crate::produce::{wire, Run};
use crate::topics::{ensure_topic, warm_up};
use crate::{outbox, verify, Spec};

/// The producer's `compression.type`: how the payments are written to the topic (the engine
/// must read every codec a producer may use).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Compression {
    #[default]
    None,
    Gzip,
    Snappy,
    Lz4,
    Zstd,
}

impl Compression {
    /// librdkafka's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Compression::None => "none",
            Compression::Gzip => "gzip",
            Compression::Snappy => "snappy",
            Compression::Lz4 => "lz4",
            Compression::Zstd => "zstd",
        }
    }
}

/// Connections one run uses.
pub struct Session {
    pub db: Arc<tokio_postgres::Client>,
    pub producer: FutureProducer,
    pub watcher: LagWatcher,
    pub brokers: String,
    /// Set by [`Session::via_outbox`]: payments go to the `outbox` table.
    pub outbox: Option<outbox::Writer>,
    /// Set by [`Session::in_format`]: records are written in a registry format.
    pub wire: Option<wire::Serializer>,
    /// Set by [`Session::shaped`]: how event ids look and how records wrap payments.
    pub ids: crate::produce::shape::Ids,
    pub envelope: crate::produce::shape::Envelope,
    /// Each record carries a W3C `traceparent` of its own (a new trace, sampled): the tracing
    /// phase of the bench.
    pub traced: bool,
}

impl Session {
    pub async fn open(spec: &Spec) -> anyhow::Result<Session> {
        Session::connect(
            &spec.brokers,
            &spec.database_url,
            &spec.topic,
            spec.partitions,
            spec.compression,
        )
        .await
    }

    /// Connects to both services, creating `topic` with `partitions` if it is missing; the
    /// producer compresses with `compression`.
    pub async fn connect(
        brokers: &str,
        database_url: &str,
        topic: &str,
        partitions: i32,
        compression: Compression,
    ) -> anyhow::Result<Session> {
        let (db, conn) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
            .await
            .context("connecting to PostgreSQL for verification")?;
        tokio::spawn(conn);
        ensure_topic(brokers, topic, partitions).await?;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .set("queue.buffering.max.messages", "1000000")
            .set("compression.type", compression.as_str())
            .create()
            .context("creating the producer")?;
        warm_up(brokers, &producer, topic).await?;
        Ok(Session {
            db: Arc::new(db),
            producer,
            watcher: LagWatcher::new(brokers, topic, partitions)?,
            brokers: brokers.to_string(),
            outbox: None,
            wire: None,
            ids: Default::default(),
            envelope: Default::default(),
            traced: false,
        })
    }

    /// Event ids as `ids` says, records wrapped as `envelope` says (`--ids`, `--envelope`).
    pub fn shaped(
        mut self,
        ids: crate::produce::shape::Ids,
        envelope: crate::produce::shape::Envelope,
    ) -> Session {
        self.ids = ids;
        self.envelope = envelope;
        self
    }

    /// Every record gets a `traceparent` header, each its own trace (see [`Session::traced`]).
    pub fn traced(mut self) -> Session {
        self.traced = true;
        self
    }

    /// Payments (and double taps) are written to the `outbox` table from now on.
    pub async fn via_outbox(mut self, database_url: &str) -> anyhow::Result<Session> {
        self.outbox = Some(outbox::Writer::connect(database_url).await?);
        Ok(self)
    }

    /// Records are written in `format` from now on, its schema registered for `topic` at
    /// `registry` (nothing changes for JSON).
    pub async fn in_format(
        mut self,
        format: wire::Format,
        registry: Option<&str>,
        topic: &str,
    ) -> anyhow::Result<Session> {
        self.wire = wire::Serializer::register(format, registry, topic).await?;
        Ok(self)
    }

    /// Waits up to `timeout` for the relay to publish every outbox row of `run`; returns the
    /// rows left unpublished (None: PostgreSQL did not answer).
    pub async fn wait_published(&self, run: &Run, timeout: Duration) -> Option<i64> {
        let start = Instant::now();
        loop {
            let left = outbox::unpublished(&self.db, &run.payment_prefix())
                .await
                .ok();
            if left == Some(0) || start.elapsed() > timeout {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits up to `timeout` for `consumer` to drain the topic (PostgreSQL's stored offsets
    /// at the partitions' ends) and then, for an inbox consumer, for its processors to finish
    /// every stored row: the inbox moves the offsets as soon as a message is stored, and its
    /// effect comes when a processor applies the row.
    pub async fn drain(&self, consumer: &str, timeout: Duration) -> Drain {
        let start = Instant::now();
        let drained = loop {
            match self.watcher.lag(&self.db, consumer).await {
                Ok(0) => break true,
                Ok(_) | Err(_) if start.elapsed() > timeout => break false,
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        };
        let mut open = Some(0);
        if drained {
            loop {
                open = verify::inbox_open(&self.db, consumer).await.ok();
                if open == Some(0) || start.elapsed() > timeout {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        Drain {
            consumer: consumer.to_string(),
            timeout,
            drained,
            open,
        }
    }
}

/// How [`Session::drain`] ended.
pub struct Drain {
    consumer: String,
    timeout: Duration,
    /// The stored offsets reached the partitions' ends.
    pub drained: bool,
    /// The consumer's PENDING or IN_PROGRESS inbox rows left (None: PostgreSQL did not answer).
    pub open: Option<i64>,
}

impl Drain {
    /// What was not done in time, if anything.
    pub fn problem(&self) -> Option<String> {
        if !self.drained {
            Some(format!(
                "the engine did not drain the topic within {:?}",
                self.timeout
            ))
        } else if self.open != Some(0) {
            Some(format!(
                "{} rows of consumer {:?} still PENDING or IN_PROGRESS in its inbox after {:?}",
                self.open
                    .map_or("unknown (PostgreSQL did not answer)".into(), |n| n
                        .to_string()),
                self.consumer,
                self.timeout
            ))
        } else {
            None
        }
    }
}

/// Consumer lag: the partitions' high watermarks minus the offsets stored in PostgreSQL.
#[derive(Clone)]
pub struct LagWatcher {
    client: Arc<BaseConsumer>,
    topic: String,
    partitions: i32,
}

impl LagWatcher {
    fn new(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<Self> {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .context("creating the lag watcher")?;
        Ok(LagWatcher {
            client: Arc::new(client),
            topic: topic.to_string(),
            partitions,
        })
    }

    /// Each partition's high watermark: where the next record will go.
    pub async fn highs(&self) -> anyhow::Result<Vec<i64>> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<i64>> {
            (0..me.partitions)
                .map(|p| {
                    Ok(me
                        .client
                        .fetch_watermarks(&me.topic, p, Duration::from_secs(5))?
                        .1)
                })
                .collect()
        })
        .await?
    }

    pub async fn lag(&self, db: &tokio_postgres::Client, consumer: &str) -> anyhow::Result<i64> {
        let me = self.clone();
        let marks = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(i64, i64)>> {
            (0..me.partitions)
                .map(|p| {
                    Ok(me
                        .client
                        .fetch_watermarks(&me.topic, p, Duration::from_secs(5))?)
                })
                .collect()
        })
        .await??;
        let rows = db
            .query(
                "SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $2",
                &[&consumer, &self.topic],
            )
            .await?;
        let stored: std::collections::HashMap<i32, i64> = rows
            .iter()
            .filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get::<_, i32>(0), o)))
            .collect();
        Ok(marks
            .iter()
            .enumerate()
            .map(|(p, (low, high))| {
                high - stored.get(&(p as i32)).copied().unwrap_or(*low).max(*low)
            })
            .sum())
    }
}
