//! How each partition fared over a run: the longest time it went without an effect while the
//! run was producing to it, and how often its ownership moved.
//!
//! A rebalance that stops every partition shows as a long gap on all of them; one that moves
//! only the partitions changing owner (cooperative-sticky assignment) leaves the others' gaps at
//! their steady-state size. The gap is measured between consecutive credits of payments whose
//! first record the broker stored in that partition (`credited_at`, written inside the batch
//! transaction, a few hundred microseconds before its `COMMIT`): at the demo's rates a partition
//! commits an effect every few milliseconds, so the longest gap is the longest commit gap.
//! Ownership comes from PostgreSQL: every claim of a partition bumps its `epoch` in
//! `consumer_offsets`, so the epochs before and after the run count the claims in between.

use std::collections::{BTreeMap, HashMap};

use crate::produce::{Kind, Sent};
use crate::report::PartitionRun;

/// Each partition's `(epoch, owner)` in `consumer_offsets`, for one consumer and topic.
pub type Owners = HashMap<i32, (i64, String)>;

pub async fn owners(
    db: &tokio_postgres::Client,
    consumer: &str,
    topic: &str,
) -> Result<Owners, tokio_postgres::Error> {
    let rows = db
        .query(
            "SELECT partition, epoch, owner FROM consumer_offsets WHERE consumer = $1 AND topic = $2",
            &[&consumer, &topic],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect())
}

/// One entry per partition the run's payments went to, in partition order. `credited_s`: each
/// credit's payment id and time (seconds since the run started); `before` and `after`: the
/// owners when the run started producing and when it was verified.
pub fn partitions(
    log: &[Sent],
    credited_s: &[(String, f64)],
    before: &Owners,
    after: &Owners,
) -> Vec<PartitionRun> {
    // A payment's partition is its first copy's: the one whose credit the run waits for.
    let mut partition_of: HashMap<&str, i32> = HashMap::new();
    for s in log.iter().filter(|s| s.kind == Kind::Original) {
        if let (Some(id), Some(p)) = (s.payment_id.as_deref(), s.partition) {
            partition_of.entry(id).or_insert(p);
        }
    }
    let mut times: BTreeMap<i32, Vec<f64>> = BTreeMap::new();
    for (id, t) in credited_s {
        if let Some(p) = partition_of.get(id.as_str()) {
            times.entry(*p).or_default().push(*t);
        }
    }
    times
        .into_iter()
        .map(|(partition, mut t)| {
            t.sort_by(f64::total_cmp);
            let (gap, ends_at) = t
                .windows(2)
                .map(|w| (w[1] - w[0], w[1]))
                .fold((0.0, t[0]), |best, g| if g.0 > best.0 { g } else { best });
            let epoch_after = after.get(&partition).map_or(0, |o| o.0);
            let epoch_before = before.get(&partition).map_or(0, |o| o.0);
            PartitionRun {
                partition,
                longest_commit_gap_ms: (gap * 1000.0 * 10.0).round() / 10.0,
                gap_ended_at_s: (ends_at * 10.0).round() / 10.0,
                claims: (epoch_after - epoch_before).max(0) as u64,
                owner: after.get(&partition).map(|o| o.1.clone()),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(payment: &str, partition: i32, kind: Kind) -> Sent {
        Sent {
            kind,
            payment_id: Some(payment.into()),
            user_id: "u".into(),
            amount_paise: 100,
            event_id: None,
            outbox: false,
            acked: true,
            acked_at_s: 0.0,
            partition: Some(partition),
        }
    }

    #[test]
    fn the_longest_gap_between_a_partitions_credits_and_its_claims() {
        let log = vec![
            sent("a", 0, Kind::Original),
            sent("b", 0, Kind::Original),
            sent("c", 0, Kind::Original),
            // A resend on another partition does not move payment c.
            sent("c", 1, Kind::Resend),
            sent("d", 1, Kind::Original),
        ];
        let credited = vec![
            ("c".to_string(), 3.5),
            ("a".to_string(), 1.0),
            ("b".to_string(), 1.2),
            ("d".to_string(), 2.0),
        ];
        let before = Owners::from([(0, (4, "w-a".to_string())), (1, (7, "w-b".to_string()))]);
        let after = Owners::from([(0, (6, "w-a".to_string())), (1, (7, "w-b".to_string()))]);
        let runs = partitions(&log, &credited, &before, &after);
        assert_eq!(runs.len(), 2);
        assert_eq!(
            (
                runs[0].partition,
                runs[0].longest_commit_gap_ms,
                runs[0].gap_ended_at_s
            ),
            (0, 2300.0, 3.5)
        );
        assert_eq!((runs[0].claims, runs[0].owner.as_deref()), (2, Some("w-a")));
        // One credit: no gap, and the partition kept its owner.
        assert_eq!((runs[1].longest_commit_gap_ms, runs[1].claims), (0.0, 0));
    }
}
