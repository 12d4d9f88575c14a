//! `/`: per consumer, lag and rate per partition (and the partitions that cannot progress:
//! stuck on a Kafka error, or stalled in a batch, as their owners report them), the inbox's
//! counts and the oldest PENDING row's age, dead letters by reason; the outbox's backlog;
//! notifications by status.

use std::sync::Arc;

use askama::Template;
use axum::extract::State;
use axum::http::Uri;
use axum::response::Response;
use chrono::Utc;

use crate::console::render::{ago, capped, thousands};
use crate::console::{html, Chrome, ConsoleError, Shared};
use crate::store::browse::{self, Capped, CAP};
use crate::store::partition_health;

use super::{encode, query};

#[derive(Template)]
#[template(path = "console/overview.html")]
struct Page {
    c: Chrome,
    kafka_error: Option<String>,
    consumers: Vec<ConsumerView>,
    outbox: Vec<[String; 3]>,
    notifications: Vec<(String, String, String)>,
    estimates: Vec<(&'static str, String)>,
}

struct ConsumerView {
    name: String,
    /// The consumer's own page.
    href: String,
    strategy: &'static str,
    topics: String,
    partitions: Vec<PartitionView>,
    lag: String,
    rate: String,
    inbox: Option<InboxView>,
    dead_letters: Vec<(String, String, String)>,
    parked_href: String,
    /// Partitions stuck or stalled (0: none).
    troubled: usize,
}

struct PartitionView {
    topic: String,
    partition: i32,
    stored: String,
    high: String,
    lag: String,
    lag_class: &'static str,
    rate: String,
    owner: String,
    updated: String,
    /// "stuck 2m: <the Kafka error>", as its owner reports it.
    stuck: Option<String>,
    /// "stalled 3m": a batch retrying past stall_after.
    stalled: Option<String>,
}

struct InboxView {
    pending: String,
    in_progress: String,
    failed: String,
    held: String,
    oldest_pending: String,
    href: String,
}

fn count(c: Capped) -> String {
    capped(c.count, c.more)
}

pub async fn page(State(s): State<Arc<Shared>>, uri: Uri) -> Result<Response, ConsoleError> {
    let db = s.db().await?;
    let now = Utc::now();
    let mut consumers = Vec::new();
    let mut offsets = Vec::new();
    for info in &s.consumers {
        offsets.push(browse::offsets(&**db, &info.name).await?);
    }
    // One watermark round for every partition of every consumer.
    let mut keys: Vec<(String, i32)> = (offsets.iter().flatten())
        .map(|o| (o.topic.clone(), o.partition))
        .collect();
    keys.sort();
    keys.dedup();
    let (highs, kafka_error) = match s.watermarks.highs(&keys).await {
        Ok(h) => (h, None),
        Err(e) => (Default::default(), Some(e)),
    };
    for (info, offsets) in s.consumers.iter().zip(offsets) {
        let marks: std::collections::HashMap<(String, i32), partition_health::Marks> =
            partition_health::of_consumer(&**db, &info.name)
                .await?
                .into_iter()
                .map(|r| ((r.topic, r.partition), r.marks))
                .collect();
        let (mut lag_sum, mut lag_known, mut rate_sum) = (0i64, true, 0f64);
        let mut partitions = Vec::new();
        for o in offsets {
            let high = highs.get(&(o.topic.clone(), o.partition)).copied();
            let stored = o.next_offset;
            let lag = match (high, stored) {
                (Some(h), Some(n)) => Some((h - n).max(0)),
                // Nothing applied yet: everything in the log is ahead of it.
                (Some(h), None) => Some(h),
                _ => None,
            };
            match lag {
                Some(l) => lag_sum += l,
                None => lag_known = false,
            }
            let rate = stored.and_then(|n| s.rates.observe(&info.name, &o.topic, o.partition, n));
            rate_sum += rate.unwrap_or(0.0);
            let m = marks
                .get(&(o.topic.clone(), o.partition))
                .cloned()
                .unwrap_or_default();
            partitions.push(PartitionView {
                stuck: m
                    .stuck
                    .map(|(since, error)| format!("stuck for {}: {error}", ago(since, now))),
                stalled: m
                    .stalled_since
                    .map(|since| format!("stalled for {}", ago(since, now))),
                topic: o.topic,
                partition: o.partition,
                stored: stored.map_or_else(|| "-".into(), thousands),
                high: high.map_or_else(|| "?".into(), thousands),
                lag: lag.map_or_else(|| "?".into(), thousands),
                lag_class: match lag {
                    Some(0) => "ok",
                    Some(l) if l > 10_000 => "bad",
                    Some(_) => "warn",
                    None => "muted",
                },
                rate: rate.map_or_else(|| "…".into(), |r| format!("{r:.1}")),
                owner: o.owner,
                updated: ago(o.updated_at, now),
            });
        }
        let inbox = match info.uses_inbox {
            false => None,
            true => {
                let n = browse::inbox_counts(&**db, &info.name, CAP).await?;
                Some(InboxView {
                    pending: count(n.pending),
                    in_progress: count(n.in_progress),
                    failed: count(n.failed),
                    held: count(n.held),
                    oldest_pending: n.oldest_pending.map_or_else(|| "-".into(), |t| ago(t, now)),
                    href: format!("/inbox?consumer={}", encode(&info.name)),
                })
            }
        };
        let dead_letters = browse::dead_letters_by_reason(&**db, &info.name, CAP)
            .await?
            .into_iter()
            .map(|(reason, n)| {
                let href = format!(
                    "/parked{}",
                    query(&[
                        ("consumer", Some(info.name.clone())),
                        ("reason", Some(reason.clone()))
                    ])
                );
                (reason, count(n), href)
            })
            .collect();
        consumers.push(ConsumerView {
            name: info.name.clone(),
            href: format!("/consumer?name={}", encode(&info.name)),
            strategy: info.strategy,
            topics: info.topics.join(", "),
            lag: match (lag_known, partitions.is_empty()) {
                (_, true) => "-".into(),
                (true, false) => thousands(lag_sum),
                (false, false) => "?".into(),
            },
            rate: format!("{rate_sum:.1}"),
            partitions,
            inbox,
            dead_letters,
            parked_href: format!("/parked?consumer={}", encode(&info.name)),
            troubled: 0,
        });
        if let Some(k) = consumers.last_mut() {
            k.troubled = (k.partitions.iter())
                .filter(|p| p.stuck.is_some() || p.stalled.is_some())
                .count();
        }
    }
    let outbox = browse::outbox_backlog(&**db, CAP)
        .await?
        .into_iter()
        .map(|b| {
            let oldest = b.oldest.map_or_else(|| "-".into(), |t| ago(t, now));
            [b.event_type, count(b.unpublished), oldest]
        })
        .collect();
    let notifications = browse::notifications_by_status(&**db, CAP)
        .await?
        .into_iter()
        .map(|(status, n)| {
            let href = format!("/notifications?status={status}");
            (status, count(n), href)
        })
        .collect();
    let mut estimates = Vec::new();
    for table in [
        "dead_letters",
        "inbox",
        "outbox",
        "notifications",
        "processed_messages",
    ] {
        let n = browse::estimate(&**db, table).await?;
        estimates.push((table, format!("≈ {}", thousands(n as i64))));
    }
    html(Page {
        c: Chrome::new(&s, "Overview", "overview", &uri, true),
        kafka_error,
        consumers,
        outbox,
        notifications,
        estimates,
    })
}
