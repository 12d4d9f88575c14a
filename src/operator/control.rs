//! The operator's control of a running consumer: where it reads (`effectively offsets show |
//! reset`), whether it reads (`pause | resume`) and how fast (`throttle`). The CLI and the
//! console call these functions; each change commits with its audit row.
//!
//! A reset works while workers run: one transaction stores each partition's new offset and
//! bumps its epoch ([`offsets::reset`]). The worker holding the partition sees the bump within
//! about a second ([`crate::source::control`]) and claims the partition again from the new
//! offset, with no restart and no rebalance; a batch it was committing meanwhile is fenced and
//! rolls back whole. What the rewind reads again is deduplicated like any redelivery.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use uuid::Uuid;

use super::{Actor, Done, OperatorError};
use crate::config::{ConsumerConfig, KafkaConfig};
use crate::store::control::{self, Pause, Scope, Throttle};
use crate::store::{audit, offsets};

/// How long one Kafka lookup (metadata, watermarks, offsets for a time) may take.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a reset moves the partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// The log's start (its low watermark).
    Earliest,
    /// The log's end (its high watermark): nothing left to read.
    Latest,
    /// The first record at or after this time (Kafka's offsets-for-times, by record
    /// timestamp); the end when none is.
    Time(DateTime<Utc>),
    /// This offset, which must lie inside the log.
    Offset(i64),
    /// The stored offset moved by this many records (negative: back), kept inside the log.
    ShiftBy(i64),
}

impl std::str::FromStr for Target {
    type Err = String;

    /// `--to`: `earliest`, `latest`, an RFC 3339 time or an offset.
    fn from_str(s: &str) -> Result<Target, String> {
        match s.trim() {
            "earliest" => Ok(Target::Earliest),
            "latest" => Ok(Target::Latest),
            s => {
                if let Ok(o) = s.parse::<i64>() {
                    return match o >= 0 {
                        true => Ok(Target::Offset(o)),
                        false => Err(format!(
                            "--to {s}: an offset is 0 or more (to move back by N records, use --shift-by -N)"
                        )),
                    };
                }
                DateTime::parse_from_rfc3339(s)
                    .map(|t| Target::Time(t.with_timezone(&Utc)))
                    .map_err(|e| {
                        format!(
                            "--to {s:?}: expected earliest, latest, an offset or an RFC 3339 time \
                             such as 2026-12-06T09:00:00Z ({e})"
                        )
                    })
            }
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Earliest => f.write_str("earliest"),
            Target::Latest => f.write_str("latest"),
            Target::Time(t) => write!(f, "{}", t.to_rfc3339()),
            Target::Offset(o) => write!(f, "offset {o}"),
            Target::ShiftBy(n) => write!(f, "shift by {n}"),
        }
    }
}

/// A partition's log: `low` is its first offset, `high` the next one to be written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Log {
    pub low: i64,
    pub high: i64,
}

/// Kafka's side of the commands: partitions, watermarks, offsets for a time. One client,
/// every call in `spawn_blocking` (librdkafka's calls block).
#[derive(Clone)]
pub struct KafkaLookup {
    client: Arc<BaseConsumer>,
}

impl KafkaLookup {
    pub fn new(kafka: &KafkaConfig) -> Result<KafkaLookup, OperatorError> {
        let client = kafka
            .client_config(&[
                ("enable.auto.commit", "false".into()),
                ("socket.timeout.ms", "5000".into()),
            ])
            .map_err(OperatorError::KafkaSettings)?
            .create::<BaseConsumer>()?;
        Ok(KafkaLookup {
            client: Arc::new(client),
        })
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&BaseConsumer) -> Result<T, rdkafka::error::KafkaError> + Send + 'static,
    ) -> Result<T, OperatorError> {
        let client = Arc::clone(&self.client);
        tokio::task::spawn_blocking(move || f(&client))
            .await
            .map_err(|e| {
                OperatorError::KafkaSettings(format!("a Kafka lookup did not finish: {e}"))
            })?
            .map_err(OperatorError::from)
    }

    /// The partitions of `topic`, in order; an error when Kafka does not know the topic.
    pub async fn partitions(&self, topic: &str) -> Result<Vec<i32>, OperatorError> {
        let t = topic.to_string();
        let meta = self
            .blocking(move |c| c.fetch_metadata(Some(&t), KAFKA_TIMEOUT))
            .await?;
        let found = meta.topics().iter().find(|m| m.name() == topic);
        match found {
            Some(m) if m.error().is_none() && !m.partitions().is_empty() => {
                let mut ps: Vec<i32> = m.partitions().iter().map(|p| p.id()).collect();
                ps.sort_unstable();
                Ok(ps)
            }
            _ => Err(OperatorError::KafkaSettings(format!(
                "Kafka does not know topic {topic:?}"
            ))),
        }
    }

    /// One partition's log.
    pub async fn log(&self, topic: &str, partition: i32) -> Result<Log, OperatorError> {
        let t = topic.to_string();
        let (low, high) = self
            .blocking(move |c| c.fetch_watermarks(&t, partition, KAFKA_TIMEOUT))
            .await?;
        Ok(Log { low, high })
    }

    /// For each of `partitions` of `topic`, the first offset whose record's timestamp is at or
    /// after `at`; `None` when no record is (the caller takes the log's end).
    pub async fn offsets_for_time(
        &self,
        topic: &str,
        partitions: &[i32],
        at: DateTime<Utc>,
    ) -> Result<HashMap<i32, Option<i64>>, OperatorError> {
        let mut tpl = TopicPartitionList::new();
        for p in partitions {
            tpl.add_partition_offset(topic, *p, Offset::Offset(at.timestamp_millis()))?;
        }
        let found = self
            .blocking(move |c| c.offsets_for_times(tpl, KAFKA_TIMEOUT))
            .await?;
        Ok(found
            .elements()
            .iter()
            .map(|e| {
                let offset = match e.offset() {
                    Offset::Offset(o) if o >= 0 => Some(o),
                    _ => None,
                };
                (e.partition(), offset)
            })
            .collect())
    }
}

/// One partition as `offsets show` prints it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PartitionView {
    pub topic: String,
    pub partition: i32,
    /// Where PostgreSQL says the consumer resumes (`None`: nothing applied yet).
    pub stored: Option<i64>,
    pub epoch: Option<i64>,
    /// The worker that holds the epoch, or `reset:<actor>` after a reset not yet claimed.
    pub owner: Option<String>,
    /// Kafka's log, or why it could not be read.
    pub log: Result<Log, String>,
    /// Records between the stored offset and the log's end.
    pub lag: Option<i64>,
    pub paused: bool,
}

/// A consumer's state for `offsets show` and the console's consumer page.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConsumerView {
    pub consumer: String,
    pub partitions: Vec<PartitionView>,
    pub pauses: Vec<Pause>,
    /// The rate set at run time, if any (the config's `max_rate` is the caller's to add).
    pub throttle: Option<Throttle>,
}

/// The topics a command works on: `--topic` (which must be one of the consumer's) or all of
/// the consumer's.
pub fn topics(consumer: &ConsumerConfig, topic: Option<&str>) -> Result<Vec<String>, String> {
    match topic {
        None => Ok(consumer.topics.clone()),
        Some(t) if consumer.topics.iter().any(|c| c == t) => Ok(vec![t.to_string()]),
        Some(t) => Err(format!(
            "consumer {:?} does not read topic {t:?} (its topics: {})",
            consumer.name,
            consumer.topics.join(", ")
        )),
    }
}

/// Stored offsets beside Kafka's watermarks, every partition of the consumer's topics (or of
/// `topic`).
pub async fn show(
    pool: &deadpool_postgres::Pool,
    kafka: &KafkaLookup,
    consumer: &ConsumerConfig,
    topic: Option<&str>,
) -> Result<ConsumerView, OperatorError> {
    let topics = topics(consumer, topic).map_err(OperatorError::KafkaSettings)?;
    let client = pool.get().await?;
    let pauses = control::pauses(&**client, &consumer.name).await?;
    let throttle = control::throttle(&**client, &consumer.name).await?;
    let mut partitions = Vec::new();
    for t in &topics {
        let stored: HashMap<i32, offsets::Stored> = offsets::load(&**client, &consumer.name, t)
            .await?
            .into_iter()
            .map(|s| (s.partition, s))
            .collect();
        let mut ids: Vec<i32> = match kafka.partitions(t).await {
            Ok(ps) => ps,
            // Kafka down: still show what PostgreSQL has.
            Err(_) => stored.keys().copied().collect(),
        };
        ids.sort_unstable();
        for p in ids {
            let log = kafka.log(t, p).await.map_err(|e| e.to_string());
            let row = stored.get(&p);
            let next = row.and_then(|r| r.next_offset);
            let lag = match (&log, next) {
                (Ok(l), Some(n)) => Some((l.high - n).max(0)),
                (Ok(l), None) => Some(l.high - l.low),
                _ => None,
            };
            partitions.push(PartitionView {
                topic: t.clone(),
                partition: p,
                stored: next,
                epoch: row.map(|r| r.epoch),
                owner: row.map(|r| r.owner.clone()),
                log,
                lag,
                paused: pauses.iter().any(|x| x.scope.covers(t, p)),
            });
        }
    }
    Ok(ConsumerView {
        consumer: consumer.name.clone(),
        partitions,
        pauses,
        throttle,
    })
}

/// One partition's planned move.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Move {
    pub topic: String,
    pub partition: i32,
    pub from: Option<i64>,
    /// For `--shift-by`, computed again from the stored offset inside the transaction (the
    /// consumer may have moved since the plan).
    pub to: i64,
    pub log: Log,
}

/// What a reset would do, partition by partition, without changing anything.
pub async fn plan_reset(
    pool: &deadpool_postgres::Pool,
    kafka: &KafkaLookup,
    consumer: &ConsumerConfig,
    topic: Option<&str>,
    partition: Option<i32>,
    target: Target,
) -> Result<Vec<Move>, OperatorError> {
    let topics = topics(consumer, topic).map_err(OperatorError::KafkaSettings)?;
    let client = pool.get().await?;
    let mut moves = Vec::new();
    for t in &topics {
        let all = kafka.partitions(t).await?;
        let ps: Vec<i32> = match partition {
            Some(p) if all.contains(&p) => vec![p],
            Some(p) => {
                return Err(OperatorError::KafkaSettings(format!(
                    "topic {t:?} has no partition {p} (it has {})",
                    all.len()
                )))
            }
            None => all,
        };
        let stored: HashMap<i32, Option<i64>> = offsets::load(&**client, &consumer.name, t)
            .await?
            .into_iter()
            .map(|s| (s.partition, s.next_offset))
            .collect();
        let at_time = match target {
            Target::Time(at) => Some(kafka.offsets_for_time(t, &ps, at).await?),
            _ => None,
        };
        for p in ps {
            let log = kafka.log(t, p).await?;
            let from = stored.get(&p).copied().flatten();
            let to = resolve(
                target,
                from,
                log,
                at_time.as_ref().and_then(|m| m.get(&p).copied()),
            )
            .map_err(|why| OperatorError::KafkaSettings(format!("{t}/{p}: {why}")))?;
            moves.push(Move {
                topic: t.clone(),
                partition: p,
                from,
                to,
                log,
            });
        }
    }
    Ok(moves)
}

/// Where `target` puts one partition whose stored offset is `from`; `found` is what
/// offsets-for-times said for a time target (`None`: no record that late).
fn resolve(
    target: Target,
    from: Option<i64>,
    log: Log,
    found: Option<Option<i64>>,
) -> Result<i64, String> {
    match target {
        Target::Earliest => Ok(log.low),
        Target::Latest => Ok(log.high),
        Target::Time(_) => Ok(found.flatten().unwrap_or(log.high).clamp(log.low, log.high)),
        Target::Offset(o) if (log.low..=log.high).contains(&o) => Ok(o),
        Target::Offset(o) => Err(format!(
            "offset {o} is outside the log ({}..{}): the consumer would stop there \
             (on_offset_out_of_range); pick an offset inside it",
            log.low, log.high
        )),
        Target::ShiftBy(n) => match from {
            Some(f) => Ok(f.saturating_add(n).clamp(log.low, log.high)),
            None => Err("nothing is stored yet, so there is nothing to shift; use --to".into()),
        },
    }
}

/// Applies a planned reset in one transaction with its audit row: each partition's offset
/// stored and its epoch bumped, which fences the worker holding it (it claims the partition
/// again from the new offset within about a second).
pub async fn reset(
    pool: &deadpool_postgres::Pool,
    consumer: &str,
    target: Target,
    moves: &[Move],
    actor: &Actor,
    note: Option<&str>,
) -> Result<(Done, Vec<Move>), OperatorError> {
    let action = Uuid::new_v4();
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let mut done = Vec::with_capacity(moves.len());
    for m in moves {
        let row = offsets::lock_one(&tx, consumer, &m.topic, m.partition).await?;
        let from = row.and_then(|(o, _)| o);
        let to = match target {
            Target::ShiftBy(_) => resolve(target, from, m.log, None).map_err(|why| {
                OperatorError::KafkaSettings(format!("{}/{}: {why}", m.topic, m.partition))
            })?,
            _ => m.to,
        };
        offsets::reset(&tx, consumer, &m.topic, m.partition, to, &actor.0).await?;
        done.push(Move {
            from,
            to,
            ..m.clone()
        });
    }
    let filter = serde_json::json!({
        "consumer": consumer,
        "to": target.to_string(),
        "moves": done.iter().map(|m| serde_json::json!({
            "topic": m.topic, "partition": m.partition, "from": m.from, "to": m.to,
        })).collect::<Vec<_>>(),
    });
    audit::record(
        &*tx,
        &audit::Entry {
            action,
            actor: &actor.0,
            verb: "reset",
            target: "consumer_offsets",
            filter: &filter,
            count: done.len() as i64,
            note,
        },
    )
    .await?;
    tx.commit().await?;
    Ok((
        Done {
            action,
            count: done.len() as u64,
        },
        done,
    ))
}

/// What a resume left in place.
#[derive(Debug, Clone, PartialEq)]
pub struct Resumed {
    pub done: Done,
    /// Wider pauses that still cover the scope (resume them to read it again).
    pub still_paused_by: Vec<Scope>,
}

/// Pauses `scope`, audited. `count` is 0 when it was paused already.
pub async fn pause(
    pool: &deadpool_postgres::Pool,
    scope: &Scope,
    actor: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    let what = Audited::new(
        actor,
        "pause",
        "consumer_pauses",
        super::describe(scope),
        note,
    );
    let (done, ()) = what
        .run(pool, async |tx, action| {
            let n = control::pause(&**tx, scope, &actor.0, action, note).await?;
            Ok((u64::from(n), ()))
        })
        .await?;
    Ok(done)
}

/// Resumes `scope` and every narrower pause inside it, audited.
pub async fn resume(
    pool: &deadpool_postgres::Pool,
    scope: &Scope,
    actor: &Actor,
    note: Option<&str>,
) -> Result<Resumed, OperatorError> {
    let what = Audited::new(
        actor,
        "resume",
        "consumer_pauses",
        super::describe(scope),
        note,
    );
    let (done, left) = what
        .run(pool, async |tx, _| {
            let n = control::resume(&**tx, scope).await?;
            Ok((n, control::pauses(&**tx, &scope.consumer).await?))
        })
        .await?;
    Ok(Resumed {
        done,
        still_paused_by: control::covering(&left, scope)
            .into_iter()
            .map(|p| p.scope.clone())
            .collect(),
    })
}

/// Sets (`Some`) or clears (`None`) the consumer's run-time rate, audited.
pub async fn throttle(
    pool: &deadpool_postgres::Pool,
    consumer: &str,
    rate: Option<Throttle>,
    actor: &Actor,
    note: Option<&str>,
) -> Result<Done, OperatorError> {
    let filter = serde_json::json!({ "consumer": consumer, "rate": rate });
    let what = Audited::new(actor, "throttle", "consumer_throttles", filter, note);
    let (done, ()) = what
        .run(pool, async |tx, action| {
            let n = match rate {
                Some(t) => {
                    control::set_throttle(&**tx, consumer, t, &actor.0, action, note).await?;
                    1
                }
                None => u64::from(control::clear_throttle(&**tx, consumer).await?),
            };
            Ok((n, ()))
        })
        .await?;
    Ok(done)
}

/// One control change and its audit row, committed together.
struct Audited<'a> {
    actor: &'a Actor,
    verb: &'a str,
    target: &'a str,
    filter: serde_json::Value,
    note: Option<&'a str>,
}

impl<'a> Audited<'a> {
    fn new(
        actor: &'a Actor,
        verb: &'a str,
        target: &'a str,
        filter: serde_json::Value,
        note: Option<&'a str>,
    ) -> Audited<'a> {
        Audited {
            actor,
            verb,
            target,
            filter,
            note,
        }
    }

    /// Runs `change` in a transaction under a new action id, records the rows it changed (its
    /// count) in the audit, and commits.
    async fn run<T>(
        self,
        pool: &deadpool_postgres::Pool,
        change: impl AsyncFnOnce(
            &deadpool_postgres::Transaction<'_>,
            Uuid,
        ) -> Result<(u64, T), OperatorError>,
    ) -> Result<(Done, T), OperatorError> {
        let action = Uuid::new_v4();
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        let (count, out) = change(&tx, action).await?;
        audit::record(
            &*tx,
            &audit::Entry {
                action,
                actor: &self.actor.0,
                verb: self.verb,
                target: self.target,
                filter: &self.filter,
                count: count as i64,
                note: self.note,
            },
        )
        .await?;
        tx.commit().await?;
        Ok((Done { action, count }, out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: Log = Log {
        low: 100,
        high: 500,
    };

    #[test]
    fn to_parses_every_form() {
        assert_eq!("earliest".parse::<Target>(), Ok(Target::Earliest));
        assert_eq!("latest".parse::<Target>(), Ok(Target::Latest));
        assert_eq!("42".parse::<Target>(), Ok(Target::Offset(42)));
        assert_eq!(
            "2026-12-06T09:00:00+01:00".parse::<Target>(),
            Ok(Target::Time("2026-12-06T08:00:00Z".parse().unwrap()))
        );
        assert!("-5".parse::<Target>().unwrap_err().contains("--shift-by"));
        assert!("yesterday"
            .parse::<Target>()
            .unwrap_err()
            .contains("RFC 3339"));
    }

    #[test]
    fn targets_resolve_inside_the_log() {
        assert_eq!(resolve(Target::Earliest, Some(300), LOG, None), Ok(100));
        assert_eq!(resolve(Target::Latest, Some(300), LOG, None), Ok(500));
        assert_eq!(resolve(Target::Offset(250), Some(300), LOG, None), Ok(250));
        assert!(resolve(Target::Offset(50), Some(300), LOG, None).is_err());
        assert!(resolve(Target::Offset(501), Some(300), LOG, None).is_err());
        assert_eq!(resolve(Target::ShiftBy(-50), Some(300), LOG, None), Ok(250));
        assert_eq!(
            resolve(Target::ShiftBy(-500), Some(300), LOG, None),
            Ok(100)
        );
        assert_eq!(resolve(Target::ShiftBy(900), Some(300), LOG, None), Ok(500));
        assert!(resolve(Target::ShiftBy(-5), None, LOG, None).is_err());
    }

    #[test]
    fn a_time_after_the_last_record_is_the_end() {
        let t = Target::Time(Utc::now());
        assert_eq!(resolve(t, Some(300), LOG, Some(Some(210))), Ok(210));
        assert_eq!(resolve(t, Some(300), LOG, Some(None)), Ok(500));
        // Kafka answered for an offset retention has removed since: inside the log.
        assert_eq!(resolve(t, Some(300), LOG, Some(Some(7))), Ok(100));
    }
}
