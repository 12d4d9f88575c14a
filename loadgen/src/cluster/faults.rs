//! The faults of each scenario, injected through [`Cluster`] while the traffic runs. Each
//! fault leaves a [`Mark`]: when it was issued (or when it ended, for a fault that lasts) and
//! each partition's high watermark at that moment, from which the recovery is measured.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::stack::Cluster;
use super::PartitionRollback;
use crate::harness::marks::Mark;
use crate::harness::watch::{self, now_s, AheadSampler, CommitWatch};
use crate::Session;

/// What the faults act on.
pub(super) struct Ctx<'a> {
    pub cluster: &'a Cluster,
    pub session: &'a Session,
    pub topic: &'a str,
    pub partitions: i32,
    pub watch: &'a CommitWatch,
    pub ahead: &'a AheadSampler,
    pub rng: fastrand::Rng,
    pub quick: bool,
    pub inbox: bool,
}

/// What the faults did and saw.
#[derive(Debug, Default)]
pub(super) struct Faults {
    pub marks: Vec<Mark>,
    pub promotion_s: Vec<f64>,
    pub notes: Vec<String>,
    /// A PostgreSQL failover happened: the standby must be rebuilt.
    pub pg_failover: bool,
    /// pg-async-loss: each partition's stored offset before the crash and after the promotion.
    pub rollback: Option<Vec<PartitionRollback>>,
    /// pg-async-loss under the inbox: rows the old primary held and the promoted one lacked.
    pub lacked: Vec<uuid::Uuid>,
    /// Spans (epoch seconds) in which commits cannot succeed by design: brokers down, the
    /// synchronous standby down.
    pub outages: Vec<(f64, f64)>,
    /// The scenario's own checks that failed.
    pub failed: Vec<String>,
}

impl Faults {
    /// The last mark's fault took effect at `t`.
    fn effective_from(&mut self, t: f64) {
        if let Some(m) = self.marks.last_mut() {
            m.valid_after = m.valid_after.max(t);
        }
    }

    /// A failover subcommand; the script measures the promotion from its stop of the primary
    /// to the new primary's first write, so the primary stopped that long before it returned.
    async fn failover(&mut self, cluster: &Cluster, cmd: &str) -> anyhow::Result<()> {
        self.pg_failover = true;
        let s = cluster.pg_failover(cmd).await?;
        self.promotion_s.push(s);
        self.effective_from(now_s() - s);
        let port = cluster.pg_node_port(cluster.pg_primary().await?)?;
        if let Some(m) = self.marks.last_mut() {
            m.server = Some(port);
        }
        Ok(())
    }

    /// `SIGKILL`s broker `node`: it is gone when the script returns.
    async fn kill_broker(&mut self, cluster: &Cluster, node: u32) -> anyhow::Result<()> {
        cluster.kafka_signal(node, "KILL").await?;
        self.effective_from(now_s());
        Ok(())
    }
}

fn pause(d: Duration) -> tokio::time::Sleep {
    tokio::time::sleep(d)
}

impl Ctx<'_> {
    /// A mark at this moment ([`Mark::take`]).
    async fn mark(&self, label: impl Into<String>, counted: bool) -> Mark {
        Mark::take(&self.session.watcher, label, counted).await
    }

    /// Waits until both workers run: every partition has committed (up to 90 s), then a little.
    async fn settle(&self) -> anyhow::Result<()> {
        let started = Instant::now();
        loop {
            let done: HashSet<i32> = self.watch.commits().iter().map(|c| c.partition).collect();
            if done.len() as i32 >= self.partitions {
                break;
            }
            anyhow::ensure!(
                started.elapsed() < Duration::from_secs(90),
                "only {} of {} partitions committed within 90 s of the workers' start",
                done.len(),
                self.partitions
            );
            pause(Duration::from_millis(200)).await;
        }
        pause(Duration::from_secs(2)).await;
        Ok(())
    }

    /// A partition chosen by the seed, and the broker leading it now.
    async fn leader(&mut self) -> anyhow::Result<(i32, u32)> {
        let p = self.rng.i32(0..self.partitions);
        Ok((p, self.cluster.kafka_leader(self.topic, p).await?))
    }

    /// Another broker than `node`, chosen by the seed.
    fn other(&mut self, node: u32) -> u32 {
        let others: Vec<u32> = (1..=3).filter(|n| *n != node).collect();
        others[self.rng.usize(..others.len())]
    }

    /// `SIGTERM` (a controlled shutdown), wait for the broker to be gone, restart it, wait
    /// for its replicas to be in sync again.
    async fn clean_bounce(&self, node: u32) -> anyhow::Result<()> {
        // The script returns once the broker has exited.
        self.cluster.kafka_signal(node, "TERM").await?;
        self.cluster.kafka_start(node).await?;
        self.cluster.kafka_wait_isr(Some(self.topic)).await
    }

    /// Restarts `node`, `SIGKILL`ed at `killed`, once the broker session timeout has passed
    /// since (the controller has fenced it and moved its leaderships), then waits for ISR.
    async fn restart_after_session(&self, node: u32, killed: Instant) -> anyhow::Result<()> {
        let wait = self.cluster.broker_session_timeout() + Duration::from_secs(1);
        pause(wait.saturating_sub(killed.elapsed())).await;
        self.cluster.kafka_start(node).await?;
        self.cluster.kafka_wait_isr(Some(self.topic)).await
    }
}

/// Runs scenario `name`'s faults (the workers already started), then the traffic's tail.
pub(super) async fn inject(ctx: &mut Ctx<'_>, name: &str) -> anyhow::Result<Faults> {
    let mut f = Faults::default();
    ctx.settle().await?;
    let cluster = ctx.cluster;
    let between = |rng: &mut fastrand::Rng| Duration::from_millis(rng.u64(2000..4000));
    match name {
        "kafka-clean-bounce" => {
            for i in 1..=5 {
                let (p, n) = ctx.leader().await?;
                f.marks.push(
                    ctx.mark(format!("{i}: SIGTERM broker {n} (leads {p})"), true)
                        .await,
                );
                ctx.clean_bounce(n).await?;
                pause(between(&mut ctx.rng)).await;
            }
        }
        "kafka-hard-bounce" => {
            for i in 1..=5 {
                let (p, n) = ctx.leader().await?;
                f.marks.push(
                    ctx.mark(format!("{i}: SIGKILL broker {n} (leads {p})"), true)
                        .await,
                );
                let killed = Instant::now();
                f.kill_broker(cluster, n).await?;
                ctx.restart_after_session(n, killed).await?;
                pause(between(&mut ctx.rng)).await;
            }
        }
        "kafka-pause" => {
            let (p, n) = ctx.leader().await?;
            let secs = if ctx.quick { 15 } else { 30 };
            f.marks.push(
                ctx.mark(format!("SIGSTOP broker {n} (leads {p})"), false)
                    .await,
            );
            cluster.kafka_signal(n, "STOP").await?;
            f.effective_from(now_s());
            let stopped = Instant::now();
            // Whether the controller moved the partition off the paused broker (the clients
            // may still wait on their requests to it).
            pause(Duration::from_secs(10)).await;
            let during = cluster.kafka_leader(ctx.topic, p).await?;
            f.notes.push(format!(
                "partition {p}'s leader {:.0} s into the pause: broker {during}",
                stopped.elapsed().as_secs_f64()
            ));
            pause(Duration::from_secs(secs).saturating_sub(stopped.elapsed())).await;
            cluster.kafka_signal(n, "CONT").await?;
            f.outages.push((f.marks[0].from, now_s()));
            f.marks.push(
                ctx.mark(format!("SIGCONT broker {n} after {secs} s"), true)
                    .await,
            );
            f.notes.push("recovery from the SIGCONT".into());
            cluster.kafka_wait_isr(Some(ctx.topic)).await?;
        }
        "kafka-two-down" => {
            let (p, a) = ctx.leader().await?;
            let b = ctx.other(a);
            f.marks.push(
                ctx.mark(format!("SIGKILL brokers {a} (leads {p}) and {b}"), false)
                    .await,
            );
            cluster.kafka_signal(a, "KILL").await?;
            cluster.kafka_signal(b, "KILL").await?;
            let down = if ctx.quick { 10 } else { 20 };
            pause(Duration::from_secs(down)).await;
            let during = commits_seen(ctx.watch, f.marks[0].from + 1.0, now_s());
            cluster.kafka_start(a).await?;
            f.outages.push((f.marks[0].from, now_s()));
            f.marks.push(
                ctx.mark(format!("broker {a} back (two of three up)"), true)
                    .await,
            );
            cluster.kafka_start(b).await?;
            f.marks.push(
                ctx.mark(
                    format!("brokers {a} and {b} restarted after {down} s"),
                    true,
                )
                .await,
            );
            f.notes.push(format!(
                "recovery from the first restart (min ISR 2 possible again) and from both; \
                 {during} commits seen while two were down"
            ));
            cluster.kafka_wait_isr(Some(ctx.topic)).await?;
        }
        "kafka-rolling" => {
            for n in 1..=3 {
                f.marks
                    .push(ctx.mark(format!("SIGTERM broker {n}"), true).await);
                ctx.clean_bounce(n).await?;
                pause(between(&mut ctx.rng)).await;
            }
        }
        "pg-switchover" => {
            f.marks.push(ctx.mark("switchover", true).await);
            f.failover(cluster, "pg-switchover").await?;
        }
        "pg-crash" => {
            f.marks.push(ctx.mark("primary crashed", true).await);
            f.failover(cluster, "pg-crash-failover").await?;
        }
        "pg-standby-down" => standby_down(ctx, &mut f).await?,
        "pg-pause-fence" => {
            f.marks.push(ctx.mark("primary SIGSTOPped", true).await);
            cluster.run(&["pg-pause"]).await?;
            pause(Duration::from_secs(5)).await;
            f.failover(cluster, "pg-fence-failover").await?;
            f.notes
                .push("recovery from the SIGSTOP (5 s paused, then fenced)".into());
        }
        "pg-async-loss" => async_loss(ctx, &mut f).await?,
        "both" => {
            let (p, n) = ctx.leader().await?;
            f.marks.push(
                ctx.mark(
                    format!("SIGKILL broker {n} (leads {p}) and primary crashed"),
                    true,
                )
                .await,
            );
            let killed = Instant::now();
            f.kill_broker(cluster, n).await?;
            f.failover(cluster, "pg-crash-failover").await?;
            ctx.restart_after_session(n, killed).await?;
        }
        _ => anyhow::bail!("unknown scenario {name:?}"),
    }
    // The traffic goes on a little after the last fault.
    pause(Duration::from_secs(if ctx.quick { 4 } else { 6 })).await;
    Ok(f)
}

/// How many commits the watch first saw between epoch seconds `from` and `to`.
fn commits_seen(watch: &CommitWatch, from: f64, to: f64) -> usize {
    watch
        .commits()
        .iter()
        .filter(|c| c.seen > from && c.seen < to)
        .count()
}

/// `pg-standby-down`: the synchronous standby stopped for 10 s. Commits must stall (nothing
/// new seen while it is down, after the first second), then resume.
async fn standby_down(ctx: &mut Ctx<'_>, f: &mut Faults) -> anyhow::Result<()> {
    let cluster = ctx.cluster;
    cluster.run(&["pg-standby-stop"]).await?;
    let stopped = now_s();
    pause(Duration::from_secs(10)).await;
    let during = commits_seen(ctx.watch, stopped + 1.0, now_s());
    cluster.run(&["pg-standby-start"]).await?;
    f.outages.push((stopped, now_s()));
    f.marks
        .push(ctx.mark("standby restarted after 10 s", true).await);
    f.notes.push(format!(
        "recovery from the standby's restart; {during} commits seen while it was down"
    ));
    if during > 0 {
        f.failed.push(format!(
            "{during} commits completed while the synchronous standby was down: replication is \
             not synchronous, the scenario tested nothing"
        ));
    }
    Ok(())
}

/// `pg-async-loss`: asynchronous replication (set before the workers started), the standby
/// detached so that the primary commits what it lacks, the primary crashed and the standby
/// promoted. The detached standby's state is frozen: once it has replayed all it received,
/// its stored offsets are the ones the promoted server starts from (read there, before the
/// crash: after the promotion the engine commits within a fraction of a second). The old
/// primary's are read right after, just before the crash: how far each partition went back.
async fn async_loss(ctx: &mut Ctx<'_>, f: &mut Faults) -> anyhow::Result<()> {
    let cluster = ctx.cluster;
    pause(Duration::from_secs(2)).await;
    cluster.run(&["pg-detach-standby"]).await?;
    pause(Duration::from_secs(if ctx.quick { 3 } else { 5 })).await;
    let (old, standby) = (cluster.pg_primary().await?, cluster.pg_standby().await?);
    let (old_url, standby_url) = (cluster.pg_node_url(old)?, cluster.pg_node_url(standby)?);
    watch::replayed(standby_url, Duration::from_secs(10)).await?;
    let after = watch::stored_offsets(standby_url, ctx.topic).await?;
    let inbox_after = match ctx.inbox {
        true => Some(watch::inbox_ids(standby_url, ctx.topic).await?),
        false => None,
    };
    let before = watch::stored_offsets(old_url, ctx.topic).await?;
    let inbox_before = match ctx.inbox {
        true => Some(watch::inbox_ids(old_url, ctx.topic).await?),
        false => None,
    };
    f.marks.push(
        ctx.mark(format!("primary (node {old}) crashed"), true)
            .await,
    );
    // From here Kafka may be ahead: the lost commits were acknowledged to it.
    ctx.ahead.lossy();
    f.failover(cluster, "pg-crash-failover").await?;
    let new = cluster.pg_primary().await?;
    anyhow::ensure!(
        new == standby,
        "node {new} is the primary after the failover, not the standby {standby}"
    );
    // The promoted server holds at least what the detached standby had (the engine may have
    // committed since): else the frozen standby was not what got promoted.
    let promoted = watch::stored_offsets(cluster.pg_node_url(new)?, ctx.topic).await?;
    let behind: Vec<i32> = after
        .iter()
        .filter(|(p, o)| promoted.get(p).is_none_or(|n| n < o))
        .map(|(p, _)| *p)
        .collect();
    if !behind.is_empty() {
        f.failed.push(format!(
            "partitions {behind:?}: the promoted server's offsets are behind what the detached \
             standby held"
        ));
    }
    let rollback: Vec<PartitionRollback> = before
        .iter()
        .map(|(p, b)| PartitionRollback {
            partition: *p,
            before: *b,
            after: after.get(p).copied(),
            rollback: b - after.get(p).copied().unwrap_or(0),
        })
        .collect();
    let total: i64 = rollback.iter().map(|r| r.rollback).sum();
    if total <= 0 {
        f.failed.push(
            "no stored offset went back: the promoted server was not behind, the loss was \
             not exercised"
                .into(),
        );
    }
    f.rollback = Some(rollback);
    if let (Some(before), Some(after)) = (inbox_before, inbox_after) {
        f.lacked = before.difference(&after).copied().collect();
    }
    Ok(())
}
