//! Lag and rates for the overview: each partition's stored offset (PostgreSQL, the source of
//! truth for where it resumes) against Kafka's high watermark, and records per second between
//! two samples of the stored offsets.
//!
//! Watermarks come from one librdkafka client the console keeps, queried in `spawn_blocking`
//! with a short timeout and cached for a few seconds, so a page reload does not cost a round of
//! broker requests. When Kafka does not answer, that is cached too (for longer): the page
//! renders at once and says so, instead of waiting out a timeout per partition.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};

use crate::config::KafkaConfig;

/// How long a watermark read is reused.
const FRESH: Duration = Duration::from_secs(2);
/// How long "Kafka did not answer" is believed before asking again.
const DOWN_FOR: Duration = Duration::from_secs(10);
/// One watermark request's limit.
const TIMEOUT: Duration = Duration::from_millis(1500);
/// Two samples of an offset closer than this give no new rate (the last one is shown).
const MIN_SPAN: Duration = Duration::from_secs(1);

type Key = (String, i32);

/// High watermarks, cached.
pub struct Watermarks {
    client: Result<Arc<BaseConsumer>, String>,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    highs: HashMap<Key, (Instant, i64)>,
    down: Option<(Instant, String)>,
}

impl Watermarks {
    /// A client for `kafka` (with its TLS and SASL settings). A config librdkafka refuses is
    /// reported on the page, not at start: the console is still useful without lag.
    pub fn new(kafka: &KafkaConfig) -> Watermarks {
        let client = kafka
            .client_config(&[
                ("enable.auto.commit", "false".into()),
                ("socket.timeout.ms", "3000".into()),
            ])
            .and_then(|c| c.create::<BaseConsumer>().map_err(|e| e.to_string()))
            .map(Arc::new)
            .map_err(|e| format!("kafka client: {e}"));
        Watermarks {
            client,
            cache: Mutex::new(Cache::default()),
        }
    }

    /// The high watermark of each of `partitions`, or why Kafka could not say.
    pub async fn highs(&self, partitions: &[Key]) -> Result<HashMap<Key, i64>, String> {
        let client = self.client.clone()?;
        let now = Instant::now();
        let stale: Vec<Key> = {
            let cache = self.cache.lock().expect("not poisoned");
            if let Some((at, why)) = &cache.down {
                if now.duration_since(*at) < DOWN_FOR {
                    return Err(why.clone());
                }
            }
            (partitions.iter())
                .filter(|k| {
                    cache
                        .highs
                        .get(*k)
                        .is_none_or(|(at, _)| now.duration_since(*at) >= FRESH)
                })
                .cloned()
                .collect()
        };
        if !stale.is_empty() {
            let fetched = tokio::task::spawn_blocking(move || {
                let mut out = Vec::with_capacity(stale.len());
                for (topic, p) in stale {
                    // The first failure stops the round: the broker is down or the topic is
                    // gone, and every further partition would wait out the same timeout.
                    let (_, high) = client
                        .fetch_watermarks(&topic, p, TIMEOUT)
                        .map_err(|e| format!("Kafka did not answer ({topic} [{p}]): {e}"))?;
                    out.push(((topic, p), high));
                }
                Ok::<_, String>(out)
            })
            .await
            .map_err(|e| format!("watermark query: {e}"))?;
            let mut cache = self.cache.lock().expect("not poisoned");
            match fetched {
                Ok(highs) => {
                    cache.down = None;
                    for (k, h) in highs {
                        cache.highs.insert(k, (now, h));
                    }
                }
                Err(why) => {
                    cache.down = Some((now, why.clone()));
                    return Err(why);
                }
            }
        }
        let cache = self.cache.lock().expect("not poisoned");
        Ok((partitions.iter())
            .filter_map(|k| cache.highs.get(k).map(|(_, h)| (k.clone(), *h)))
            .collect())
    }
}

/// Records per second per partition, from the stored offsets seen at successive page loads.
#[derive(Default)]
pub struct Rates {
    samples: Mutex<HashMap<(String, String, i32), Sample>>,
}

struct Sample {
    at: Instant,
    offset: i64,
    rate: Option<f64>,
}

impl Rates {
    /// Records `offset` for `(consumer, topic, partition)` and returns the rate since the
    /// previous sample (`None` on the first look).
    pub fn observe(&self, consumer: &str, topic: &str, partition: i32, offset: i64) -> Option<f64> {
        self.observe_at(consumer, topic, partition, offset, Instant::now())
    }

    fn observe_at(
        &self,
        consumer: &str,
        topic: &str,
        partition: i32,
        offset: i64,
        now: Instant,
    ) -> Option<f64> {
        let mut samples = self.samples.lock().expect("not poisoned");
        let key = (consumer.to_string(), topic.to_string(), partition);
        match samples.get_mut(&key) {
            None => {
                samples.insert(
                    key,
                    Sample {
                        at: now,
                        offset,
                        rate: None,
                    },
                );
                None
            }
            Some(s) => {
                let span = now.duration_since(s.at);
                if span >= MIN_SPAN {
                    s.rate = Some((offset - s.offset).max(0) as f64 / span.as_secs_f64());
                    s.at = now;
                    s.offset = offset;
                }
                s.rate
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_come_from_samples_at_least_a_second_apart() {
        let r = Rates::default();
        let t0 = Instant::now();
        assert_eq!(r.observe_at("c", "t", 0, 100, t0), None);
        // Too soon: no rate yet, and the first sample stays the base.
        assert_eq!(
            r.observe_at("c", "t", 0, 150, t0 + Duration::from_millis(200)),
            None
        );
        assert_eq!(
            r.observe_at("c", "t", 0, 300, t0 + Duration::from_secs(2)),
            Some(100.0)
        );
        // Too soon again: the last rate is shown.
        assert_eq!(
            r.observe_at("c", "t", 0, 310, t0 + Duration::from_millis(2100)),
            Some(100.0)
        );
    }
}
