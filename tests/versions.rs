//! Versioned writes against the real PostgreSQL: the planner's verdicts on versions read from
//! and moved in `aggregate_versions`, and two transactions racing for a new aggregate.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use effectively::store::versions;
use effectively::version::{plan, Stamp, Verdict, VersionMode};

fn stamps(list: &[(&str, i64)]) -> Vec<Stamp> {
    list.iter()
        .map(|(a, v)| Stamp {
            aggregate: a.to_string(),
            version: *v,
        })
        .collect()
}

/// One batch: read the versions, plan, move them, commit. Returns the verdicts.
async fn batch(
    db: &mut deadpool_postgres::Object,
    consumer: &str,
    mode: VersionMode,
    events: &[(&str, i64)],
) -> Vec<Verdict> {
    let events = stamps(events);
    let tx = db.transaction().await.unwrap();
    let aggregates: Vec<&str> = events.iter().map(|e| e.aggregate.as_str()).collect();
    let stored = versions::read(&tx, consumer, &aggregates).await.unwrap();
    let p = plan(mode, &stored, &events);
    versions::advance(&tx, consumer, &stored, &p.advanced)
        .await
        .unwrap()
        .unwrap();
    tx.commit().await.unwrap();
    p.verdicts
}

async fn stored(db: &deadpool_postgres::Object, consumer: &str) -> HashMap<String, i64> {
    db.query(
        "SELECT aggregate, version FROM aggregate_versions WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[tokio::test]
async fn a_redelivered_older_state_changes_nothing() {
    let mut db = common::pool(2).get().await.unwrap();
    let consumer = common::unique("versions-full");
    // PAID (v7), then REFUNDED (v8), then PAID redelivered.
    use Verdict::*;
    let full = VersionMode::FullState;
    assert_eq!(
        batch(&mut db, &consumer, full, &[("o1", 7)]).await,
        [Apply { round: 0 }]
    );
    assert_eq!(
        batch(&mut db, &consumer, full, &[("o1", 8)]).await,
        [Apply { round: 0 }]
    );
    assert_eq!(batch(&mut db, &consumer, full, &[("o1", 7)]).await, [Stale]);
    assert_eq!(
        batch(&mut db, &consumer, full, &[("o1", 8)]).await,
        [Duplicate]
    );
    assert_eq!(stored(&db, &consumer).await["o1"], 8);
}

#[tokio::test]
async fn deltas_across_batches_move_one_version_at_a_time() {
    let mut db = common::pool(2).get().await.unwrap();
    let consumer = common::unique("versions-delta");
    use Verdict::*;
    let delta = VersionMode::Delta;
    assert_eq!(
        batch(&mut db, &consumer, delta, &[("a", 1), ("a", 2), ("b", 2)]).await,
        [Apply { round: 0 }, Apply { round: 1 }, Gap]
    );
    assert_eq!(
        batch(&mut db, &consumer, delta, &[("a", 4), ("b", 1), ("a", 2)]).await,
        [Gap, Apply { round: 0 }, Duplicate]
    );
    assert_eq!(
        stored(&db, &consumer).await,
        HashMap::from([("a".into(), 2), ("b".into(), 1)])
    );
}

#[tokio::test]
async fn two_transactions_racing_for_a_new_aggregate_cannot_both_move_it() {
    let pool = common::pool(2);
    let mut first = pool.get().await.unwrap();
    let mut second = pool.get().await.unwrap();
    let consumer = common::unique("versions-race");
    let t1 = first.transaction().await.unwrap();
    let t2 = second.transaction().await.unwrap();
    // Both read before either stores: no row to lock, each plans version 1.
    let s1 = versions::read(&t1, &consumer, &["x"]).await.unwrap();
    let s2 = versions::read(&t2, &consumer, &["x"]).await.unwrap();
    assert!(s1.is_empty() && s2.is_empty());
    let to = HashMap::from([("x".to_string(), 1)]);
    versions::advance(&t1, &consumer, &s1, &to)
        .await
        .unwrap()
        .unwrap();
    // t2's insert waits for t1's row; once t1 commits, t2 finds the version moved.
    let started = Instant::now();
    let commit_later = async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        t1.commit().await.unwrap();
    };
    let (moved, ()) = tokio::join!(versions::advance(&t2, &consumer, &s2, &to), commit_later);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "t2 waited for t1"
    );
    assert_eq!(moved.unwrap().unwrap_err().aggregate, "x");
    t2.rollback().await.unwrap();
    assert_eq!(stored(&second, &consumer).await["x"], 1);
}
