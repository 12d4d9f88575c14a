//! `consumer_pauses` and `consumer_throttles`: what an operator set on a running consumer
//! (`effectively pause | resume | throttle`, the console), read by its workers about once a
//! second ([`crate::source::control`]). Writes take the caller's transaction, which also writes
//! the audit row.

use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::StoreError;
/// A rate set at run time: the config's type (`max_rate` and its burst).
pub use crate::config::Throttle;

/// What a pause or resume covers: a whole consumer, one of its topics, or one partition.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Scope {
    pub consumer: String,
    pub topic: Option<String>,
    /// Only with a topic.
    pub partition: Option<i32>,
}

impl Scope {
    /// Whether this scope covers partition `partition` of `topic` (of its consumer).
    pub fn covers(&self, topic: &str, partition: i32) -> bool {
        self.topic.as_deref().is_none_or(|t| t == topic)
            && self.partition.is_none_or(|p| p == partition)
    }

    /// Whether `self` covers every partition `other` covers.
    pub fn contains(&self, other: &Scope) -> bool {
        self.consumer == other.consumer
            && match (&self.topic, &other.topic) {
                (None, _) => true,
                (Some(_), None) => false,
                (Some(a), Some(b)) => {
                    a == b
                        && match (self.partition, other.partition) {
                            (None, _) => true,
                            (Some(_), None) => false,
                            (Some(x), Some(y)) => x == y,
                        }
                }
            }
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "consumer {:?}", self.consumer)?;
        if let Some(t) = &self.topic {
            write!(f, ", topic {t:?}")?;
        }
        if let Some(p) = self.partition {
            write!(f, ", partition {p}")?;
        }
        Ok(())
    }
}

/// One paused scope.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Pause {
    pub scope: Scope,
    pub paused_at: chrono::DateTime<chrono::Utc>,
    pub paused_by: String,
    pub note: Option<String>,
}

const PAUSES: &str = "\
SELECT topic, partition, paused_at, paused_by, note FROM consumer_pauses
WHERE consumer = $1 ORDER BY topic NULLS FIRST, partition NULLS FIRST";

/// Every paused scope of `consumer`, widest first.
pub async fn pauses<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<Vec<Pause>, StoreError> {
    let rows = client.query(PAUSES, &[&consumer]).await?;
    Ok(rows
        .iter()
        .map(|r| Pause {
            scope: Scope {
                consumer: consumer.to_string(),
                topic: r.get(0),
                partition: r.get(1),
            },
            paused_at: r.get(2),
            paused_by: r.get(3),
            note: r.get(4),
        })
        .collect())
}

const PAUSE: &str = "\
INSERT INTO consumer_pauses (consumer, topic, partition, paused_by, action, note)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer, coalesce(topic, ''), coalesce(partition, -1)) DO NOTHING";

/// Pauses `scope`; `false` when it was paused already (nothing changed).
pub async fn pause<C: GenericClient + Sync>(
    client: &C,
    scope: &Scope,
    by: &str,
    action: Uuid,
    note: Option<&str>,
) -> Result<bool, StoreError> {
    let n = client
        .execute(
            PAUSE,
            &[
                &scope.consumer,
                &scope.topic,
                &scope.partition,
                &by,
                &action,
                &note,
            ],
        )
        .await?;
    Ok(n == 1)
}

const RESUME: &str = "\
DELETE FROM consumer_pauses
WHERE consumer = $1 AND ($2::text IS NULL OR topic = $2) AND ($3::int IS NULL OR partition = $3)";

/// Deletes every pause inside `scope` (a resume of a topic also lifts its partitions' pauses);
/// returns how many. A wider pause that covers `scope` is not touched: see [`covering`].
pub async fn resume<C: GenericClient + Sync>(client: &C, scope: &Scope) -> Result<u64, StoreError> {
    Ok(client
        .execute(RESUME, &[&scope.consumer, &scope.topic, &scope.partition])
        .await?)
}

/// The pauses wider than `scope` that still cover it after a resume of `scope`.
pub fn covering<'a>(pauses: &'a [Pause], scope: &Scope) -> Vec<&'a Pause> {
    pauses
        .iter()
        .filter(|p| p.scope.contains(scope) && p.scope != *scope)
        .collect()
}

const THROTTLE: &str = "SELECT max_rate, burst FROM consumer_throttles WHERE consumer = $1";

/// The rate set at run time for `consumer`, if any.
pub async fn throttle<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<Option<Throttle>, StoreError> {
    Ok(client
        .query_opt(THROTTLE, &[&consumer])
        .await?
        .map(|r| Throttle {
            max_rate: r.get(0),
            burst: r.get::<_, i32>(1).max(1) as u32,
        }))
}

const SET_THROTTLE: &str = "\
INSERT INTO consumer_throttles (consumer, max_rate, burst, set_by, action, note)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (consumer) DO UPDATE SET max_rate = EXCLUDED.max_rate, burst = EXCLUDED.burst,
    set_at = now(), set_by = EXCLUDED.set_by, action = EXCLUDED.action, note = EXCLUDED.note";

/// Sets (or replaces) `consumer`'s rate.
pub async fn set_throttle<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    t: Throttle,
    by: &str,
    action: Uuid,
    note: Option<&str>,
) -> Result<(), StoreError> {
    let burst = i32::try_from(t.burst).unwrap_or(i32::MAX);
    client
        .execute(
            SET_THROTTLE,
            &[&consumer, &t.max_rate, &burst, &by, &action, &note],
        )
        .await?;
    Ok(())
}

/// Removes `consumer`'s run-time rate (the config's `max_rate`, if any, applies again);
/// `false` when none was set.
pub async fn clear_throttle<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
) -> Result<bool, StoreError> {
    let n = client
        .execute(
            "DELETE FROM consumer_throttles WHERE consumer = $1",
            &[&consumer],
        )
        .await?;
    Ok(n == 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(topic: Option<&str>, partition: Option<i32>) -> Scope {
        Scope {
            consumer: "c".into(),
            topic: topic.map(str::to_string),
            partition,
        }
    }

    #[test]
    fn a_scope_covers_its_partitions() {
        assert!(scope(None, None).covers("t", 3));
        assert!(scope(Some("t"), None).covers("t", 3));
        assert!(!scope(Some("u"), None).covers("t", 3));
        assert!(scope(Some("t"), Some(3)).covers("t", 3));
        assert!(!scope(Some("t"), Some(2)).covers("t", 3));
    }

    #[test]
    fn wider_scopes_contain_narrower_ones() {
        let all = scope(None, None);
        let topic = scope(Some("t"), None);
        let one = scope(Some("t"), Some(1));
        assert!(all.contains(&topic) && all.contains(&one) && topic.contains(&one));
        assert!(!one.contains(&topic) && !topic.contains(&all));
        assert!(!scope(Some("u"), None).contains(&one));
        let other_consumer = Scope {
            consumer: "d".into(),
            ..all.clone()
        };
        assert!(!other_consumer.contains(&one));
    }
}
