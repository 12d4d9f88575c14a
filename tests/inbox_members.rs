//! The inbox processors' membership across processes (`inbox_members`, `src/inbox/members.rs`)
//! against the real PostgreSQL: two processes' processors take disjoint slices numbered across
//! both, a member that leaves gives its slices back at the others' next beat, and a member that
//! dies without leaving is dropped once its beat is older than the time-to-live.
//!
//! Two `Members` in one test process stand for two worker processes: each has its own member
//! id and beats on its own, as a worker's does.

mod common;

use std::sync::Arc;
use std::time::Duration;

use effectively::inbox::members::{Members, TIME_TO_LIVE};
use effectively::store::inbox::Slice;
use tokio_util::sync::CancellationToken;

/// The slices of a member's processors now.
fn slices(m: &Members, n: usize) -> Vec<Slice> {
    (0..n).map(|k| m.slice(k)).collect()
}

/// The consumer's rows in `inbox_members`.
async fn rows(db: &tokio_postgres::Client, consumer: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM inbox_members WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap()
    .get(0)
}

fn of(index: std::ops::Range<i32>, of: i32) -> Vec<Slice> {
    index.map(|index| Slice { index, of }).collect()
}

#[tokio::test]
async fn two_processes_take_disjoint_slices_and_give_them_back() {
    let consumer: Arc<str> = Arc::from(common::unique("members").as_str());
    let pool = common::pool(4);
    let first = Members::new(Arc::clone(&consumer), "worker-a", 4);
    let second = Members::new(Arc::clone(&consumer), "worker-b", 4);
    // Alone before its first beat: its own processors' slices only.
    assert_eq!(slices(&first, 4), of(0..4, 4));

    let stop_first = CancellationToken::new();
    let stop_second = CancellationToken::new();
    let a = tokio::spawn(first.clone().run(pool.clone(), stop_first.clone()));
    // The first joins first: it is the older member, its slices come first.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = tokio::spawn(second.clone().run(pool.clone(), stop_second.clone()));

    common::eventually(5, "two members, slices 0..4 and 4..8 of 8", || {
        let (first, second) = (first.clone(), second.clone());
        async move { slices(&first, 4) == of(0..4, 8) && slices(&second, 4) == of(4..8, 8) }
    })
    .await;
    let db = common::pg().await;
    assert_eq!(rows(&db, &consumer).await, 2);

    // The older one leaves: the other takes every slice at its next beat.
    stop_first.cancel();
    a.await.unwrap();
    common::eventually(3, "the member left: the other has 0..4 of 4", || {
        let second = second.clone();
        async move { slices(&second, 4) == of(0..4, 4) }
    })
    .await;

    // A third member that dies without leaving (its task aborted mid-sleep) is dropped by the
    // survivor's beats once its row is older than the time-to-live.
    let third = Members::new(Arc::clone(&consumer), "worker-c", 2);
    let c = tokio::spawn(third.clone().run(pool.clone(), CancellationToken::new()));
    common::eventually(3, "a third member of 2 processors: 0..4 of 6", || {
        let second = second.clone();
        async move { slices(&second, 4) == of(0..4, 6) }
    })
    .await;
    c.abort();
    let died = tokio::time::Instant::now();
    common::eventually(
        TIME_TO_LIVE.as_secs() + 3,
        "the dead member is dropped",
        || {
            let second = second.clone();
            async move { slices(&second, 4) == of(0..4, 4) }
        },
    )
    .await;
    assert!(
        died.elapsed() >= TIME_TO_LIVE - Duration::from_millis(500),
        "a member that stopped beating was dropped before its time-to-live ({:?})",
        died.elapsed()
    );

    stop_second.cancel();
    b.await.unwrap();
    assert_eq!(
        rows(&db, &consumer).await,
        0,
        "members that stop delete their rows"
    );
}
