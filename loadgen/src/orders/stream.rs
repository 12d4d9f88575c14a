//! The order stream: every order's versions, shuffled within a window, with stale copies and
//! exact duplicates mixed in ([`plan`]), and producing it at a rate ([`produce`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

/// The lifecycles an order follows, one picked at random per order. A version past the end
/// keeps the last status (a full-state event that changes other fields).
const LIFECYCLES: &[&[&str]] = &[
    &[
        "PLACED",
        "PAID",
        "PACKED",
        "SHIPPED",
        "OUT_FOR_DELIVERY",
        "DELIVERED",
    ],
    &[
        "PLACED",
        "PAID",
        "SHIPPED",
        "DELIVERED",
        "RETURNED",
        "REFUNDED",
    ],
    &[
        "PLACED",
        "PAID",
        "CANCELLED",
        "REFUND_PENDING",
        "REFUNDED",
        "CLOSED",
    ],
];

/// The stream's shape.
#[derive(Debug, Clone)]
pub(super) struct Shape {
    pub(super) orders: u64,
    pub(super) versions: i64,
    pub(super) stale: f64,
    pub(super) duplicates: f64,
    pub(super) window: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Original,
    /// The same event again with a new event id, after its order's newest version.
    Stale,
    /// The same record again: same key, bytes and event id.
    Duplicate,
}

/// One record to produce.
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) kind: Kind,
    pub(super) order: String,
    pub(super) version: i64,
    pub(super) status: &'static str,
    pub(super) event_id: Uuid,
    pub(super) key: String,
    pub(super) payload: Vec<u8>,
}

/// The order ids of a run start with this (so its rows are told from other runs').
pub(super) fn order_prefix(run: &str) -> String {
    format!("o-{run}-")
}

fn random_key(rng: &mut fastrand::Rng) -> String {
    format!("k-{:08x}", rng.u32(..))
}

/// The stream, in the order it is produced.
pub(super) fn plan(run: &str, shape: &Shape, rng: &mut fastrand::Rng) -> Vec<Record> {
    let occurred_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let window = shape.window as f64;
    // Each order's versions one after the other, every one moved up to `window` places later.
    let mut originals: Vec<(f64, Record)> = Vec::new();
    for n in 0..shape.orders {
        let order = format!("{}{n}", order_prefix(run));
        let life = LIFECYCLES[rng.usize(..LIFECYCLES.len())];
        for version in 1..=shape.versions {
            let status = life[(version as usize - 1).min(life.len() - 1)];
            let payload = serde_json::to_vec(&serde_json::json!({
                "order_id": order,
                "version": version,
                "status": status,
                "occurred_at": occurred_at,
            }))
            .expect("a JSON object serialises");
            let at = originals.len() as f64 + rng.f64() * window;
            originals.push((
                at,
                Record {
                    kind: Kind::Original,
                    order: order.clone(),
                    version,
                    status,
                    event_id: Uuid::now_v7(),
                    key: random_key(rng),
                    payload,
                },
            ));
        }
    }
    originals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut stream: Vec<(f64, Record)> = originals
        .into_iter()
        .enumerate()
        .map(|(i, (_, r))| (i as f64, r))
        .collect();
    let mut newest_at: HashMap<String, f64> = HashMap::new();
    for (at, r) in &stream {
        newest_at.insert(r.order.clone(), *at);
    }
    let mut copies = Vec::new();
    for (at, r) in &stream {
        if rng.f64() < shape.stale {
            let after = newest_at[&r.order] + 0.5 + rng.f64() * 4.0 * window;
            copies.push((
                after,
                Record {
                    kind: Kind::Stale,
                    event_id: Uuid::now_v7(),
                    key: random_key(rng),
                    ..r.clone()
                },
            ));
        }
        if rng.f64() < shape.duplicates {
            let after = at + 0.25 + rng.f64() * 2.0 * window;
            copies.push((
                after,
                Record {
                    kind: Kind::Duplicate,
                    ..r.clone()
                },
            ));
        }
    }
    stream.extend(copies);
    stream.sort_by(|a, b| a.0.total_cmp(&b.0));
    stream.into_iter().map(|(_, r)| r).collect()
}

/// Sends `records` in order at `rate` per second; whether the broker acknowledged each. They
/// are enqueued one by one (`send_result`), so within a partition the broker keeps this order
/// (the producer is idempotent): a stale copy lands after its order's newest version there.
pub(super) async fn produce(
    producer: &FutureProducer,
    topic: &str,
    records: &[Record],
    rate: f64,
) -> anyhow::Result<Vec<bool>> {
    let start = Instant::now();
    let mut acked = vec![false; records.len()];
    let mut pending = FuturesUnordered::new();
    for (i, r) in records.iter().enumerate() {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        while Instant::now() < due {
            tokio::select! {
                _ = tokio::time::sleep_until(due.into()) => {}
                Some((i, ok)) = pending.next(), if !pending.is_empty() => acked[i] = ok,
            }
        }
        let id = r.event_id.to_string();
        let headers = OwnedHeaders::new().insert(Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        });
        let mut record = FutureRecord::to(topic)
            .key(&r.key)
            .payload(&r.payload)
            .headers(headers);
        let delivery = loop {
            match producer.send_result(record) {
                Ok(delivery) => break delivery,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((e, _)) => return Err(e).context("producing an order event"),
            }
        };
        pending.push(async move { (i, matches!(delivery.await, Ok(Ok(_)))) });
    }
    while let Some((i, ok)) = pending.next().await {
        acked[i] = ok;
    }
    Ok(acked)
}
