//! Scenarios that bounce a worker's process: `hard-bounce` (crashes at failpoints),
//! `clean-bounce` (clean stops), `rebalance-storm` (workers joining, killed and stopped) and
//! `zombie` (a worker paused past its session timeout, then resumed).

use super::checks::{offsets_equal, Db};
use super::workers::{Env, Proc};
use super::ChaosArgs;
use crate::harness::pause;

/// `hard-bounce`: a worker per failpoint (before the commit, after it, mid-COPY) that dies there
/// after a few hits; under the inbox with its processors blocked, then a worker SIGKILLed while
/// its processors drain the backlog.
pub(super) async fn hard_bounce(
    args: &ChaosArgs,
    env: &mut Env<'_>,
    rng: &mut fastrand::Rng,
    topic: &str,
    inbox: bool,
    live: &mut Vec<Proc>,
    note: &mut String,
) -> anyhow::Result<()> {
    // Under the inbox the failpoints are the receiver's; processors have none.
    // So the processors are blocked from the start (the effect's table
    // locked): each failpoint worker dies with its processors waiting in their
    // handler call, holding claimed rows, and a backlog builds up.
    let block = match inbox {
        true => Some(Blocker::lock(&args.services.database_url).await?),
        false => None,
    };
    for fp in ["before_commit", "after_commit", "mid_copy"] {
        let n = rng.u32(2..8);
        let mut w = env.start(Some(&format!("{fp}={n}*off->return")))?;
        let died = w.exited(30).await;
        anyhow::ensure!(died, "the worker did not hit failpoint {fp} within 30 s");
    }
    if let Some(block) = block {
        // Then the processors are let loose on the backlog, and their worker
        // is SIGKILLed while they drain it: a lock claim's rows are free when
        // its connections die, a lease claim's when the lease expires.
        let db = Db::connect(&args.services.database_url).await?;
        let w = env.start(None)?;
        pause(2000).await;
        let backlog = db.open(topic).await?;
        block.release().await?;
        pause(rng.u64(30..300)).await;
        let before = db.open(topic).await?;
        w.kill().await;
        let (open, leased) = (db.open(topic).await?, db.in_progress(topic).await?);
        *note = format!(
            "3 failpoint deaths in the receiver, processors blocked meanwhile \
             ({backlog} rows waiting); SIGKILL while draining them ({before} \
             open before the kill, {open} after, {leased} IN_PROGRESS)"
        );
    }
    live.push(env.start(None)?);
    Ok(())
}

/// `clean-bounce`: three workers in turn, each stopped cleanly; whether Kafka's offsets equalled
/// PostgreSQL's after every stop.
pub(super) async fn clean_bounce(
    args: &ChaosArgs,
    env: &mut Env<'_>,
    rng: &mut fastrand::Rng,
    topic: &str,
    partitions: i32,
    live: &mut Vec<Proc>,
    note: &mut String,
) -> anyhow::Result<bool> {
    let mut equal = 0;
    for _ in 0..3 {
        let w = env.start(None)?;
        pause(rng.u64(1500..3500)).await;
        w.stop().await?;
        // A clean stop commits to Kafka exactly what PostgreSQL stored.
        if offsets_equal(args, topic, partitions).await? {
            equal += 1;
        }
    }
    let clean_ok = equal == 3;
    *note = format!("stopped cleanly 3 times; Kafka offset = stored offset after {equal} of 3");
    live.push(env.start(None)?);
    Ok(clean_ok)
}

/// `rebalance-storm`: workers join, one is SIGKILLed and replaced, one stops cleanly.
pub(super) async fn rebalance_storm(
    env: &mut Env<'_>,
    rng: &mut fastrand::Rng,
    live: &mut Vec<Proc>,
) -> anyhow::Result<()> {
    let w1 = env.start(None)?;
    pause(2000).await;
    let w2 = env.start(None)?;
    let w3 = env.start(None)?;
    pause(rng.u64(1500..3000)).await;
    w2.kill().await;
    let w2 = env.start(None)?;
    pause(rng.u64(1500..3000)).await;
    w3.stop().await?;
    live.extend([w1, w2]);
    Ok(())
}

/// `zombie`: a worker SIGSTOPped past its session timeout while another takes its partitions,
/// then resumed.
pub(super) async fn zombie(
    env: &mut Env<'_>,
    live: &mut Vec<Proc>,
    note: &mut String,
) -> anyhow::Result<()> {
    let w1 = env.start(None)?;
    pause(2000).await;
    let w2 = env.start(None)?;
    pause(2000).await;
    // Longer than the session timeout (6 s): the group moves w1's partitions.
    w1.signal("STOP");
    pause(10_000).await;
    w1.signal("CONT");
    *note = "w1 stopped 10 s (session timeout 6 s), then resumed".into();
    live.extend([w1, w2]);
    Ok(())
}

/// Holds the cashback handler's table locked against writes (`EXCLUSIVE`: reads go on) in a
/// transaction of its own: inbox processors wait in their handler call, with their claimed
/// rows, while receivers, which never touch it, go on storing. Released by [`Blocker::release`]
/// (or when dropped, with its connection).
struct Blocker(tokio_postgres::Client);

impl Blocker {
    async fn lock(url: &str) -> anyhow::Result<Blocker> {
        let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        db.batch_execute("BEGIN; LOCK TABLE cashback_credits IN EXCLUSIVE MODE")
            .await?;
        Ok(Blocker(db))
    }

    async fn release(self) -> anyhow::Result<()> {
        self.0.batch_execute("COMMIT").await?;
        Ok(())
    }
}
