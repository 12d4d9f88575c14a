//! The payment stream: `PaymentSucceeded` events at a target rate, with the duplicates of the
//! real world mixed in, each kind at its own rate, and a record of every attempt and its ack.
//!
//! - resend: the same record again at once (a relay that published twice: same event id, new
//!   offset);
//! - redrive: the same bytes again after `redrive_delay` (an operator redriving dead letters);
//! - double tap: a new event id for an existing payment (a business-key duplicate);
//! - poison: an undecodable payload (with an event id header), a JSON payload without one, or
//!   a JSON payload with an event id but none of a payment's fields (the batch strategy parks
//!   it in `dead_letters` as soon as it arrives; the inbox stores it and its processor parks
//!   the row as `FAILED`).
//!
//! Via the outbox (`--via-outbox`, [`crate::outbox`]), payments and double taps are written as
//! outbox rows, committed in small batches, for `effectively relay` to publish: a payment is
//! sent when its row committed. Resends are then the relay's own (it publishes a row again
//! after a crash between the broker's acknowledgement and its commit), so loadgen makes none.
//! A redrive still goes straight to Kafka, as an operator's would, once its row committed:
//! the record the relay publishes (key = payment id, the `event_id` and `event_type` headers,
//! the payload as stored). Poison never passes an outbox: it goes straight to Kafka too.
//!
//! One payment's records, as the generator draws them, are made in [`records`]; in a registry
//! format (Avro, Protobuf, JSON Schema) [`wire`] encodes them.

mod records;
pub mod shape;
pub mod wire;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::Either;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use uuid::Uuid;

use crate::outbox;
use records::{draw, Record};

/// One step of the rate plan: `rate` msg/s (None: as fast as the broker takes them) for `for_`.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub rate: Option<f64>,
    pub duration: Duration,
}

/// Parses `2000` (with `default`) or `500:20s,2000:20s,max:20s`.
pub fn parse_plan(text: &str, default: Duration) -> Result<Vec<Step>, String> {
    text.split(',')
        .map(|part| {
            let (rate, dur) = match part.split_once(':') {
                Some((r, d)) => (
                    r.trim(),
                    humantime::parse_duration(d.trim()).map_err(|e| format!("{part:?}: {e}"))?,
                ),
                None => (part.trim(), default),
            };
            let rate = if rate == "max" {
                None
            } else {
                let r: f64 = rate
                    .parse()
                    .map_err(|_| format!("{part:?}: rate must be a number or max"))?;
                if r <= 0.0 {
                    return Err(format!("{part:?}: rate must be positive"));
                }
                Some(r)
            };
            Ok(Step {
                rate,
                duration: dur,
            })
        })
        .collect()
}

/// What to mix in, as fractions of the payments produced.
#[derive(Debug, Clone)]
pub struct Mix {
    pub resend: f64,
    pub redrive: f64,
    pub redrive_delay: Duration,
    pub double_tap: f64,
    pub poison: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Original,
    Resend,
    Redrive,
    DoubleTap,
    PoisonUndecodable,
    PoisonNoEventId,
    PoisonBadField,
    /// A registry format's record whose schema id the registry does not know.
    PoisonUnknownSchema,
    /// A registry format's record whose bytes do not fit the schema its id names.
    PoisonSchemaMismatch,
}

impl Kind {
    pub fn is_poison(self) -> bool {
        matches!(
            self,
            Kind::PoisonUndecodable
                | Kind::PoisonNoEventId
                | Kind::PoisonBadField
                | Kind::PoisonUnknownSchema
                | Kind::PoisonSchemaMismatch
        )
    }
}

/// One record attempted.
#[derive(Debug, Clone)]
pub struct Sent {
    pub kind: Kind,
    pub payment_id: Option<String>,
    pub user_id: String,
    pub amount_paise: i64,
    /// The `event_id` header (None: poison without one).
    pub event_id: Option<Uuid>,
    /// Written as an outbox row, not produced: `acked` then means its transaction committed.
    pub outbox: bool,
    pub acked: bool,
    /// Seconds since the run started, when the broker acknowledged it (or the row committed).
    pub acked_at_s: f64,
    /// The partition the broker stored it in (None: not acknowledged, or an outbox row).
    pub partition: Option<i32>,
}

/// The run's identity: payment and user ids carry it, so a verifier finds this run's effects.
#[derive(Debug, Clone)]
pub struct Run {
    pub id: String,
    pub topic: String,
    pub users: u64,
    pub started: Instant,
    /// How event ids look (`--ids`).
    pub ids: shape::Ids,
    /// How records wrap their payments (`--envelope`).
    pub envelope: shape::Envelope,
    /// Each record gets a `traceparent` of its own: a new trace, sampled (flags 01).
    pub traced: bool,
}

impl Run {
    pub fn payment_prefix(&self) -> String {
        format!("pay_{}_", self.id)
    }
}

/// An outbox row waiting for its batch, with its place in the log; `redrive`: the redrive to
/// schedule once the row committed.
struct Pending {
    idx: usize,
    row: outbox::Row,
    redrive: Option<Record>,
}

/// A record acknowledged (or not), or a batch of outbox rows committed (or not).
enum Done {
    Record {
        idx: usize,
        /// Where the broker stored it; None: not acknowledged.
        partition: Option<i32>,
        at: f64,
    },
    Batch {
        rows: Vec<Pending>,
        committed: Result<std::collections::HashMap<Uuid, String>, String>,
        at: f64,
    },
}

/// Live counters for the progress bar.
#[derive(Debug, Default)]
pub struct Progress {
    pub sent: AtomicU64,
    pub acked: AtomicU64,
    /// Set by the caller: the plan ends now (what is in flight, and the redrives still due,
    /// still go out).
    pub stop: AtomicBool,
}

/// Produces the plan (or `limit` payments, whichever ends first), then the redrives still
/// due, and waits for every acknowledgement. With `outbox`, payments and double taps are
/// written there instead (module docs). With `wire`, records are written in its registry format.
#[allow(clippy::too_many_arguments)]
pub async fn produce(
    producer: &FutureProducer,
    run: &Run,
    plan: &[Step],
    limit: Option<u64>,
    mix: &Mix,
    rng: &mut fastrand::Rng,
    progress: Arc<Progress>,
    outbox: Option<&outbox::Writer>,
    wire: Option<&wire::Serializer>,
) -> Vec<Sent> {
    let mut log: Vec<Sent> = Vec::new();
    let mut inflight = FuturesUnordered::new();
    let mut redrives: VecDeque<(Instant, Record)> = VecDeque::new();
    // Outbox rows waiting for their batch, since when, and batches being written.
    let mut pending: Vec<Pending> = Vec::new();
    let mut pending_since = Instant::now();
    let mut batches: usize = 0;
    let mut seq: u64 = 0;
    const MAX_INFLIGHT: usize = 20_000;

    let send = |rec: Record, idx: usize| {
        let producer = producer.clone();
        let topic = run.topic.clone();
        let progress = Arc::clone(&progress);
        let started = run.started;
        let rec = match run.envelope {
            shape::Envelope::Plain => rec,
            shape::Envelope::CloudEvents => shape::as_cloudevent(run, rec),
        };
        let traceparent = run.traced.then(|| {
            format!(
                "00-{:032x}-{:016x}-01",
                fastrand::u128(1..),
                fastrand::u64(1..)
            )
        });
        Either::Left(async move {
            let mut headers = OwnedHeaders::new();
            if let Some(tp) = &traceparent {
                headers = headers.insert(Header {
                    key: "traceparent",
                    value: Some(tp.as_bytes()),
                });
            }
            if let Some(id) = &rec.event_id {
                headers = headers.insert(Header {
                    key: "event_id",
                    value: Some(id.as_bytes()),
                });
            }
            if let Some(t) = rec.event_type {
                headers = headers.insert(Header {
                    key: "event_type",
                    value: Some(t.as_bytes()),
                });
            }
            for (key, value) in &rec.headers {
                headers = headers.insert(Header {
                    key,
                    value: Some(value.as_bytes()),
                });
            }
            let record = FutureRecord::to(&topic)
                .key(&rec.key)
                .payload(&rec.payload)
                .headers(headers);
            progress.sent.fetch_add(1, Relaxed);
            let partition = producer
                .send(record, Duration::from_secs(60))
                .await
                .ok()
                .map(|delivery| delivery.partition);
            if partition.is_some() {
                progress.acked.fetch_add(1, Relaxed);
            }
            Done::Record {
                idx,
                partition,
                at: started.elapsed().as_secs_f64(),
            }
        })
    };
    let write = |rows: Vec<Pending>| {
        let writer = outbox.expect("outbox rows only with a writer");
        let started = run.started;
        Either::Right(async move {
            let batch: Vec<outbox::Row> = rows.iter().map(|p| p.row.clone()).collect();
            let committed = writer.write(&batch).await;
            Done::Batch {
                rows,
                committed,
                at: started.elapsed().as_secs_f64(),
            }
        })
    };

    let limit = limit.unwrap_or(u64::MAX);
    'plan: for step in plan {
        let step_start = Instant::now();
        let mut step_sent: u64 = 0;
        while step_start.elapsed() < step.duration {
            if seq >= limit || progress.stop.load(Relaxed) {
                break 'plan;
            }
            // How many payments this step should have produced by now.
            let due = match step.rate {
                Some(r) => (step_start.elapsed().as_secs_f64() * r) as u64 + 1,
                None => step_sent + 256,
            };
            while step_sent < due && inflight.len() < MAX_INFLIGHT && seq < limit {
                if pending.len() >= outbox::BATCH {
                    if batches >= outbox::MAX_BATCHES_IN_FLIGHT {
                        break;
                    }
                    inflight.push(write(std::mem::take(&mut pending)));
                    batches += 1;
                }
                let mut d = draw(run, mix, rng, &mut seq, wire.is_some());
                if let Some(w) = wire {
                    // The schema's id is cached since registration: no registry call here.
                    w.encode(&mut d)
                        .await
                        .expect("a payment encodes in its format");
                }
                if outbox.is_none() {
                    if let Some(r) = d.redrive {
                        redrives.push_back((Instant::now() + mix.redrive_delay, r));
                    }
                    for rec in [Some(d.original), d.resend, d.double_tap, d.poison]
                        .into_iter()
                        .flatten()
                    {
                        let idx = log.len();
                        log.push(rec.sent.clone());
                        inflight.push(send(rec, idx));
                    }
                } else {
                    // No resend: that is the relay's (module docs).
                    if pending.is_empty() {
                        pending_since = Instant::now();
                    }
                    let rows = [(d.original, d.redrive)]
                        .into_iter()
                        .chain(d.double_tap.map(|r| (r, None)));
                    for (rec, redrive) in rows {
                        let idx = log.len();
                        log.push(Sent {
                            outbox: true,
                            ..rec.sent.clone()
                        });
                        progress.sent.fetch_add(1, Relaxed);
                        pending.push(Pending {
                            idx,
                            row: outbox::Row {
                                id: rec.sent.event_id.expect("a payment has an event id"),
                                aggregate_id: rec.sent.payment_id.clone().expect("a payment"),
                                payload: String::from_utf8(rec.payload)
                                    .expect("serde_json writes UTF-8"),
                            },
                            redrive,
                        });
                    }
                    if let Some(rec) = d.poison {
                        let idx = log.len();
                        log.push(rec.sent.clone());
                        inflight.push(send(rec, idx));
                    }
                }
                step_sent += 1;
            }
            // A batch whose first row has waited its window.
            if !pending.is_empty()
                && pending_since.elapsed() >= outbox::BATCH_WINDOW
                && batches < outbox::MAX_BATCHES_IN_FLIGHT
            {
                inflight.push(write(std::mem::take(&mut pending)));
                batches += 1;
            }
            // Redrives that are due.
            while redrives
                .front()
                .is_some_and(|(due, _)| *due <= Instant::now())
            {
                let (_, rec) = redrives.pop_front().expect("checked");
                let idx = log.len();
                log.push(rec.sent.clone());
                inflight.push(send(rec, idx));
            }
            // Collect acks until the next millisecond tick.
            let tick = tokio::time::sleep(Duration::from_millis(1));
            tokio::pin!(tick);
            loop {
                tokio::select! {
                    _ = &mut tick => break,
                    Some(done) = inflight.next(), if !inflight.is_empty() => {
                        settle(done, &mut log, &mut redrives, mix, &mut batches, &progress);
                    }
                }
            }
        }
    }
    if !pending.is_empty() {
        inflight.push(write(std::mem::take(&mut pending)));
        batches += 1;
    }
    // Redrives scheduled near the end still go out, when they are due (via the outbox, a batch
    // committing now may schedule more).
    loop {
        let next_redrive = redrives.front().map(|(due, _)| *due);
        if inflight.is_empty() && next_redrive.is_none() {
            break;
        }
        let far = Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            Some(done) = inflight.next(), if !inflight.is_empty() => {
                settle(done, &mut log, &mut redrives, mix, &mut batches, &progress);
            }
            _ = tokio::time::sleep_until(next_redrive.unwrap_or(far).into()), if next_redrive.is_some() => {
                let (_, rec) = redrives.pop_front().expect("checked");
                let idx = log.len();
                log.push(rec.sent.clone());
                inflight.push(send(rec, idx));
            }
        }
    }
    log
}

/// Books a record's acknowledgement, or a batch's commit; a committed row due for a redrive
/// schedules it, as the relay will have published it.
fn settle(
    done: Done,
    log: &mut [Sent],
    redrives: &mut VecDeque<(Instant, Record)>,
    mix: &Mix,
    batches: &mut usize,
    progress: &Progress,
) {
    match done {
        Done::Record { idx, partition, at } => {
            log[idx].acked = partition.is_some();
            log[idx].partition = partition;
            log[idx].acked_at_s = at;
        }
        Done::Batch {
            rows,
            committed,
            at,
        } => {
            *batches = batches.saturating_sub(1);
            let stored = match committed {
                Ok(stored) => stored,
                Err(e) => {
                    eprintln!("loadgen: {e}; its payments count as not sent");
                    return;
                }
            };
            progress.acked.fetch_add(rows.len() as u64, Relaxed);
            for p in rows {
                log[p.idx].acked = true;
                log[p.idx].acked_at_s = at;
                if let Some(mut rec) = p.redrive {
                    rec.key = p.row.aggregate_id;
                    rec.event_type = Some(outbox::EVENT_TYPE);
                    if let Some(payload) = stored.get(&p.row.id) {
                        rec.payload = payload.clone().into_bytes();
                    }
                    rec.sent.outbox = false;
                    redrives.push_back((Instant::now() + mix.redrive_delay, rec));
                }
            }
        }
    }
}

/// The records for one more payment straight to Kafka: the original and the duplicates or
/// poison it draws (a redrive goes on `redrives`, due after the mix's delay).
#[cfg(test)]
fn next_records(
    run: &Run,
    mix: &Mix,
    rng: &mut fastrand::Rng,
    seq: &mut u64,
    redrives: &mut VecDeque<(Instant, Record)>,
) -> Vec<Record> {
    let d = draw(run, mix, rng, seq, false);
    if let Some(r) = d.redrive {
        redrives.push_back((Instant::now() + mix.redrive_delay, r));
    }
    [Some(d.original), d.resend, d.double_tap, d.poison]
        .into_iter()
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_parse() {
        let d = Duration::from_secs(60);
        assert_eq!(
            parse_plan("2000", d).unwrap(),
            vec![Step {
                rate: Some(2000.0),
                duration: d
            }]
        );
        let steps = parse_plan("500:20s,2000:20s,max:10s", d).unwrap();
        assert_eq!(steps.len(), 3);
        assert_eq!(
            steps[2],
            Step {
                rate: None,
                duration: Duration::from_secs(10)
            }
        );
        assert!(parse_plan("fast", d).is_err());
        assert!(parse_plan("-5", d).is_err());
    }

    #[test]
    fn duplicates_keep_the_event_and_double_taps_the_payment() {
        let run = Run {
            id: "t".into(),
            topic: "x".into(),
            users: 10,
            started: Instant::now(),
            ids: Default::default(),
            envelope: Default::default(),
            traced: false,
        };
        let mix = Mix {
            resend: 1.0,
            redrive: 1.0,
            redrive_delay: Duration::ZERO,
            double_tap: 1.0,
            poison: 0.0,
        };
        let mut rng = fastrand::Rng::with_seed(7);
        let mut redrives = VecDeque::new();
        let recs = next_records(&run, &mix, &mut rng, &mut 0, &mut redrives);
        assert_eq!(recs.len(), 3);
        assert_eq!(
            recs[0].payload, recs[1].payload,
            "a resend is the same bytes"
        );
        assert_eq!(
            redrives[0].1.payload, recs[0].payload,
            "a redrive is the same bytes"
        );
        assert_eq!(recs[2].sent.payment_id, recs[0].sent.payment_id);
        assert_ne!(
            recs[2].event_id, recs[0].event_id,
            "a double tap has a new event id"
        );
    }

    /// Via the outbox: a committed batch acks its rows and schedules the redrive as the relay
    /// publishes the row (the payment id as key, the stored payload, the event type header); a
    /// failed batch acks nothing and schedules nothing.
    #[test]
    fn a_committed_row_is_sent_and_its_redrive_repeats_the_relays_record() {
        let run = Run {
            id: "t".into(),
            topic: "x".into(),
            users: 10,
            started: Instant::now(),
            ids: Default::default(),
            envelope: Default::default(),
            traced: false,
        };
        let mix = Mix {
            resend: 0.0,
            redrive: 1.0,
            redrive_delay: Duration::ZERO,
            double_tap: 0.0,
            poison: 0.0,
        };
        let batch = |rng: &mut fastrand::Rng, seq: &mut u64| {
            let d = draw(&run, &mix, rng, seq, false);
            let id = d.original.sent.event_id.unwrap();
            let row = outbox::Row {
                id,
                aggregate_id: d.original.sent.payment_id.clone().unwrap(),
                payload: String::from_utf8(d.original.payload.clone()).unwrap(),
            };
            (
                id,
                d.original.sent.clone(),
                vec![Pending {
                    idx: (*seq - 1) as usize,
                    row,
                    redrive: d.redrive,
                }],
            )
        };
        let (mut rng, mut seq, progress) = (fastrand::Rng::with_seed(7), 0, Progress::default());
        let (mut redrives, mut batches) = (VecDeque::new(), 2);
        let (id, sent, rows) = batch(&mut rng, &mut seq);
        let (_, sent2, rows2) = batch(&mut rng, &mut seq);
        let mut log = vec![sent, sent2];
        let stored = r#"{"event_id": "as stored"}"#.to_string();
        let committed = Ok([(id, stored.clone())].into());
        let done = Done::Batch {
            rows,
            committed,
            at: 1.5,
        };
        settle(done, &mut log, &mut redrives, &mix, &mut batches, &progress);
        let failed = Done::Batch {
            rows: rows2,
            committed: Err("connection lost".into()),
            at: 2.0,
        };
        settle(
            failed,
            &mut log,
            &mut redrives,
            &mix,
            &mut batches,
            &progress,
        );
        assert_eq!((log[0].acked, log[0].acked_at_s), (true, 1.5));
        assert!(!log[1].acked, "a failed batch's payment is not sent");
        assert_eq!((batches, progress.acked.load(Relaxed)), (0, 1));
        assert_eq!(redrives.len(), 1, "only the committed row is redriven");
        let redrive = &redrives[0].1;
        assert_eq!(redrive.key, log[0].payment_id.clone().unwrap());
        assert_eq!(redrive.payload, stored.into_bytes());
        assert_eq!(redrive.event_type, Some(outbox::EVENT_TYPE));
        assert_eq!(redrive.event_id, Some(id.to_string()));
        assert_eq!(redrive.sent.kind, Kind::Redrive);
    }
}
