//! Records as the engine holds them between the Kafka source and a strategy: the raw record
//! (kept whole, so a parked message keeps its exact key, headers and bytes) and what decoding
//! made of it; and what a processed batch amounted to ([`Outcome`], [`Phases`]), which the
//! strategies return and [`crate::metrics`] and [`crate::stats`] count.

use std::time::Duration;

use bytes::Bytes;

use crate::config::ConsumerConfig;
use crate::envelope::{check_window, Decoder, Envelope, RawRecord, Reason, Rejection};
use crate::handler::Handler;
use crate::store::dead_letters::Parked;

/// One Kafka record, owned.
#[derive(Debug, Clone)]
pub struct Raw {
    pub partition: i32,
    pub offset: i64,
    pub timestamp_ms: Option<i64>,
    pub key: Option<Bytes>,
    pub payload: Option<Bytes>,
    pub headers: Vec<(String, Option<Bytes>)>,
}

impl Raw {
    /// Copies a record out of librdkafka's buffer.
    pub fn from_message<M: rdkafka::Message>(m: &M) -> Raw {
        use rdkafka::message::Headers;
        let headers = m
            .headers()
            .map(|hs| {
                hs.iter()
                    .map(|h| (h.key.to_string(), h.value.map(Bytes::copy_from_slice)))
                    .collect()
            })
            .unwrap_or_default();
        Raw {
            partition: m.partition(),
            offset: m.offset(),
            timestamp_ms: m.timestamp().to_millis(),
            key: m.key().map(Bytes::copy_from_slice),
            payload: m.payload().map(Bytes::copy_from_slice),
            headers,
        }
    }

    /// Bytes this record holds, for the batch's byte bound.
    pub fn size(&self) -> usize {
        self.key.as_ref().map_or(0, |k| k.len())
            + self.payload.as_ref().map_or(0, |p| p.len())
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.as_ref().map_or(0, |v| v.len()))
                .sum::<usize>()
    }

    /// Runs `f` over a borrowed view of this record (what the decoder reads).
    pub fn with_view<T>(&self, f: impl FnOnce(&RawRecord<'_>) -> T) -> T {
        let headers: Vec<(&str, Option<&[u8]>)> = self
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_deref()))
            .collect();
        f(&RawRecord {
            partition: self.partition,
            offset: self.offset,
            timestamp_ms: self.timestamp_ms,
            key: self.key.as_deref(),
            payload: self.payload.as_deref(),
            headers: &headers,
        })
    }

    /// This record as a dead letter.
    pub fn parked<'a>(
        &'a self,
        topic: &'a str,
        rejection: &'a Rejection,
        attempts: i32,
    ) -> Parked<'a> {
        Parked {
            topic,
            partition: self.partition,
            offset: self.offset,
            message_id: rejection.message_id,
            message_key: rejection.message_key.as_deref(),
            reason: rejection.reason.as_str(),
            detail: &rejection.detail,
            key: self.key.as_deref(),
            header_names: self.headers.iter().map(|(k, _)| k.as_str()).collect(),
            header_values: self.headers.iter().map(|(_, v)| v.as_deref()).collect(),
            payload: self.payload.as_deref(),
            kafka_ts: self
                .timestamp_ms
                .and_then(chrono::DateTime::from_timestamp_millis),
            attempts,
        }
    }
}

/// A record and the decoder's verdict on it.
#[derive(Debug, Clone)]
pub struct Record {
    pub raw: Raw,
    pub decoded: Result<Envelope, Rejection>,
}

impl Record {
    /// Decodes `raw` and applies every check a message passes before any transaction: the
    /// retention window (a copy older than the window may have lost its dedupe key; one far in
    /// the future is suspect) and the handler's own check. `today` comes from the caller, so
    /// tests can move it.
    pub fn admit(
        raw: Raw,
        decoder: &Decoder,
        handler: &dyn Handler,
        config: &ConsumerConfig,
        today: chrono::NaiveDate,
    ) -> Record {
        Record::admit_with(raw, decoder, Some(handler), config, today)
    }

    /// [`Record::admit`], with the handler's check only when `handler` is given (the inbox
    /// receiver stores what the handler would refuse: its processor parks it as FAILED, and a
    /// fixed handler can replay it).
    pub fn admit_with(
        raw: Raw,
        decoder: &Decoder,
        handler: Option<&dyn Handler>,
        config: &ConsumerConfig,
        today: chrono::NaiveDate,
    ) -> Record {
        // Under `dedupe = "business-row"` a key lives as long as its row: no copy is too old.
        let retention = match config.dedupe {
            crate::config::Dedupe::Ledger => config.retention,
            crate::config::Dedupe::BusinessRow => std::time::Duration::MAX,
        };
        let decoded = raw.with_view(|view| decoder.decode(view)).and_then(|env| {
            check_window(env.event_date, today, retention, config.future_tolerance)
                .and_then(|()| handler.map_or(Ok(()), |h| h.check(&env)))
                // A versioned event without its aggregate or version cannot be ordered.
                .and_then(|()| match (&config.version, handler) {
                    (Some(v), Some(_)) => crate::version::read(v, &env).map(|_| ()),
                    _ => Ok(()),
                })
                .map_err(|r| r.for_envelope(&env))?;
            Ok(env)
        });
        Record { raw, decoded }
    }
}

/// A run of consecutive records of one partition, in offset order.
#[derive(Debug, Default)]
pub struct Batch {
    pub records: Vec<Record>,
    pub bytes: usize,
    /// Where the partition's stored offset stands before this batch: the worker's claim or its
    /// last commit. The batch's first transaction moves the offset from there, and is refused
    /// if PostgreSQL holds something else (see [`crate::store::offsets`]).
    pub stored: Option<i64>,
}

impl Batch {
    pub fn push(&mut self, record: Record) {
        self.bytes += record.raw.size();
        self.records.push(record);
    }

    pub fn len(&self) -> usize {
        self.records.len()
    }

    /// The oldest Kafka timestamp among the records (ms since the epoch), if any has one.
    pub fn oldest_timestamp_ms(&self) -> Option<i64> {
        self.records.iter().filter_map(|r| r.raw.timestamp_ms).min()
    }

    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// The offset the partition resumes at once this batch is applied.
    pub fn next_offset(&self) -> Option<i64> {
        self.records.last().map(|r| r.raw.offset + 1)
    }
}

/// Time spent in each phase of the batch transactions (summed over a batch's transactions).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Phases {
    /// Getting a connection, `BEGIN` and the fenced offset update.
    pub fence: Duration,
    /// Binary `COPY` into the staging table.
    pub stage: Duration,
    /// The dedupe insert.
    pub dedupe: Duration,
    /// The handler.
    pub effect: Duration,
    /// `COMMIT`.
    pub commit: Duration,
}

impl Phases {
    pub fn add(&mut self, o: &Phases) {
        self.fence += o.fence;
        self.stage += o.stage;
        self.dedupe += o.dedupe;
        self.effect += o.effect;
        self.commit += o.commit;
    }
}

/// What a processed batch amounted to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub records: u64,
    /// Messages whose dedupe key was new.
    pub fresh: u64,
    /// Effects the handler applied.
    pub effects: u64,
    /// Copies whose dedupe key existed already (or repeated inside the batch), the pre-filter's
    /// hits among them.
    pub duplicates: u64,
    /// Copies the Redis pre-filter knew as committed: skipped before the transaction's dedupe.
    pub prefilter_hits: u64,
    /// Fresh messages whose effect existed under a business key (a double tap).
    pub business_duplicates: u64,
    pub parked: Vec<Reason>,
    /// Records passed over on purpose (tombstones under `on_tombstone = "skip"`), by reason.
    pub skipped: Vec<Reason>,
    /// Transactions rolled back and tried again.
    pub retries: u64,
    /// PostgreSQL commits.
    pub commits: u64,
    pub phases: Phases,
    /// Under `[consumer.version]`: events acked without applying them, and held gaps.
    pub versions: crate::version::Skipped,
}

impl Outcome {
    pub fn add(&mut self, other: Outcome) {
        self.records += other.records;
        self.fresh += other.fresh;
        self.effects += other.effects;
        self.duplicates += other.duplicates;
        self.prefilter_hits += other.prefilter_hits;
        self.business_duplicates += other.business_duplicates;
        self.parked.extend(other.parked);
        self.skipped.extend(other.skipped);
        self.retries += other.retries;
        self.commits += other.commits;
        self.phases.add(&other.phases);
        self.versions.add(&other.versions);
    }
}
