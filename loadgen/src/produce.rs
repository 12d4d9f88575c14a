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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;

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
}

impl Kind {
    pub fn is_poison(self) -> bool {
        matches!(
            self,
            Kind::PoisonUndecodable | Kind::PoisonNoEventId | Kind::PoisonBadField
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
    pub acked: bool,
    /// Seconds since the run started, when the broker acknowledged it.
    pub acked_at_s: f64,
}

/// The run's identity: payment and user ids carry it, so a verifier finds this run's effects.
#[derive(Debug, Clone)]
pub struct Run {
    pub id: String,
    pub topic: String,
    pub users: u64,
    pub started: Instant,
}

impl Run {
    pub fn payment_prefix(&self) -> String {
        format!("pay_{}_", self.id)
    }
}

struct Record {
    key: String,
    payload: Vec<u8>,
    event_id: Option<String>,
    sent: Sent,
}

/// Live counters for the progress bar.
#[derive(Debug, Default)]
pub struct Progress {
    pub sent: AtomicU64,
    pub acked: AtomicU64,
}

/// Produces the plan (or `limit` payments, whichever ends first), then the redrives still
/// due, and waits for every acknowledgement.
pub async fn produce(
    producer: &FutureProducer,
    run: &Run,
    plan: &[Step],
    limit: Option<u64>,
    mix: &Mix,
    rng: &mut fastrand::Rng,
    progress: Arc<Progress>,
) -> Vec<Sent> {
    let mut log: Vec<Sent> = Vec::new();
    let mut inflight = FuturesUnordered::new();
    let mut redrives: VecDeque<(Instant, Record)> = VecDeque::new();
    let mut seq: u64 = 0;
    const MAX_INFLIGHT: usize = 20_000;

    let send = |rec: Record, idx: usize| {
        let producer = producer.clone();
        let topic = run.topic.clone();
        let progress = Arc::clone(&progress);
        let started = run.started;
        async move {
            let mut headers = OwnedHeaders::new();
            if let Some(id) = &rec.event_id {
                headers = headers.insert(Header {
                    key: "event_id",
                    value: Some(id.as_bytes()),
                });
            }
            let record = FutureRecord::to(&topic)
                .key(&rec.key)
                .payload(&rec.payload)
                .headers(headers);
            progress.sent.fetch_add(1, Relaxed);
            let ok = producer.send(record, Duration::from_secs(60)).await.is_ok();
            if ok {
                progress.acked.fetch_add(1, Relaxed);
            }
            (idx, ok, started.elapsed().as_secs_f64())
        }
    };

    let limit = limit.unwrap_or(u64::MAX);
    'plan: for step in plan {
        let step_start = Instant::now();
        let mut step_sent: u64 = 0;
        while step_start.elapsed() < step.duration {
            if seq >= limit {
                break 'plan;
            }
            // How many payments this step should have produced by now.
            let due = match step.rate {
                Some(r) => (step_start.elapsed().as_secs_f64() * r) as u64 + 1,
                None => step_sent + 256,
            };
            while step_sent < due && inflight.len() < MAX_INFLIGHT && seq < limit {
                for rec in next_records(run, mix, rng, &mut seq, &mut redrives) {
                    let idx = log.len();
                    log.push(rec.sent.clone());
                    inflight.push(send(rec, idx));
                }
                step_sent += 1;
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
                    Some((idx, ok, at)) = inflight.next(), if !inflight.is_empty() => {
                        log[idx].acked = ok;
                        log[idx].acked_at_s = at;
                    }
                }
            }
        }
    }
    // Redrives scheduled near the end still go out, when they are due.
    while let Some((due, rec)) = redrives.pop_front() {
        tokio::time::sleep_until(due.into()).await;
        let idx = log.len();
        log.push(rec.sent.clone());
        inflight.push(send(rec, idx));
    }
    while let Some((idx, ok, at)) = inflight.next().await {
        log[idx].acked = ok;
        log[idx].acked_at_s = at;
    }
    log
}

/// The records for one more payment: the original and the duplicates or poison it draws.
fn next_records(
    run: &Run,
    mix: &Mix,
    rng: &mut fastrand::Rng,
    seq: &mut u64,
    redrives: &mut VecDeque<(Instant, Record)>,
) -> Vec<Record> {
    *seq += 1;
    let n = *seq;
    let user_id = format!("u_{}_{}", run.id, rng.u64(0..run.users.max(1)));
    let payment_id = format!("{}{n}", run.payment_prefix());
    let amount_paise = 100 * rng.i64(1..=5_000);
    let original = payment_record(&payment_id, &user_id, amount_paise, Kind::Original);
    let mut out = Vec::with_capacity(2);
    if rng.f64() < mix.resend {
        out.push(copy_as(&original, Kind::Resend));
    }
    if rng.f64() < mix.redrive {
        redrives.push_back((
            Instant::now() + mix.redrive_delay,
            copy_as(&original, Kind::Redrive),
        ));
    }
    if rng.f64() < mix.double_tap {
        out.push(payment_record(
            &payment_id,
            &user_id,
            amount_paise,
            Kind::DoubleTap,
        ));
    }
    if rng.f64() < mix.poison {
        out.push(poison(run, n, &user_id, rng.bool()));
    }
    out.insert(0, original);
    out
}

fn payment_record(payment_id: &str, user_id: &str, amount_paise: i64, kind: Kind) -> Record {
    let event_id = uuid::Uuid::now_v7();
    let payload = serde_json::to_vec(&serde_json::json!({
        "event_id": event_id,
        "payment_id": payment_id,
        "user_id": user_id,
        "amount_paise": amount_paise,
        "occurred_at": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
    }))
    .expect("a JSON object serialises");
    Record {
        key: user_id.to_string(),
        payload,
        event_id: Some(event_id.to_string()),
        sent: Sent {
            kind,
            payment_id: Some(payment_id.to_string()),
            user_id: user_id.to_string(),
            amount_paise,
            acked: false,
            acked_at_s: 0.0,
        },
    }
}

fn copy_as(r: &Record, kind: Kind) -> Record {
    Record {
        key: r.key.clone(),
        payload: r.payload.clone(),
        event_id: r.event_id.clone(),
        sent: Sent {
            kind,
            ..r.sent.clone()
        },
    }
}

/// Poison that names its run inside the bytes, so the verifier can tell this run's dead
/// letters (and failed inbox rows) from others'. Half of it is undecodable; of the rest, odd
/// payments' poison has no event id and even ones' has an id but no payment fields (decided by
/// `n`, not by the random generator, so a seed draws the same amounts, users and duplicates
/// as before this kind existed).
fn poison(run: &Run, n: u64, user_id: &str, undecodable: bool) -> Record {
    let (payload, event_id, kind) = if undecodable {
        (
            format!("\u{1}not json: loadgen run {} poison {n}", run.id).into_bytes(),
            Some(uuid::Uuid::now_v7().to_string()),
            Kind::PoisonUndecodable,
        )
    } else if n % 2 == 1 {
        (
            serde_json::to_vec(&serde_json::json!({"loadgen_run": run.id, "poison": n}))
                .expect("json"),
            None,
            Kind::PoisonNoEventId,
        )
    } else {
        // A valid event id and JSON, but no payment_id or amount: stored by an inbox receiver,
        // refused by the handler's check.
        (
            serde_json::to_vec(&serde_json::json!({
                "loadgen_run": run.id,
                "poison": n,
                "user_id": user_id,
                "amount_paise": "not a number",
            }))
            .expect("json"),
            Some(uuid::Uuid::now_v7().to_string()),
            Kind::PoisonBadField,
        )
    };
    Record {
        key: user_id.to_string(),
        payload,
        event_id,
        sent: Sent {
            kind,
            payment_id: None,
            user_id: user_id.to_string(),
            amount_paise: 0,
            acked: false,
            acked_at_s: 0.0,
        },
    }
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
}
