//! The six scenarios of `chaos-net`, as faults on the workers' links while the traffic runs.
//! Worker 1 runs in namespace `effnet1`, worker 2 in `effnet2`. Latency and loss are on both
//! links (the network is bad for everyone); the cuts, the stalled COMMIT and the flapping are
//! on worker 1's only (one worker cut off, the other healthy). Each fault that ends leaves a
//! counted [`Mark`] (recovery is measured from the link's return); a fault during which
//! commits cannot be expected (a cut, 30% loss, the flapping) is also an outage, left out of
//! the stall check.

use std::path::Path;
use std::time::{Duration, Instant};

use super::{Fault, Link, To};
use crate::chaos::{Proc, Worker};
use crate::harness::marks::{self, Mark};
use crate::harness::pause;
use crate::harness::run::Run;
use crate::harness::watch::{self, now_s};

/// What the faults act on.
pub(super) struct Ctx<'a> {
    pub links: &'a [Link; 2],
    pub worker: &'a Worker<'a>,
    pub run: &'a Run,
    pub out: &'a Path,
    pub rng: fastrand::Rng,
    pub quick: bool,
    /// The worker processes, started by [`inject`]; stopped by the caller.
    pub workers: Vec<Proc>,
}

/// What the faults did and saw.
#[derive(Debug, Default)]
pub(super) struct Faults {
    pub marks: Vec<Mark>,
    /// Spans (epoch seconds) in which commits cannot be expected by design.
    pub outages: Vec<(f64, f64)>,
    pub notes: Vec<String>,
}

impl Ctx<'_> {
    /// Worker `n` (1 or 2) in its namespace, with these failpoints armed if any.
    fn start(&mut self, n: usize, failpoints: Option<&str>) -> anyhow::Result<()> {
        let id = format!("{}-w{n}", self.run.topic);
        let link = &self.links[n - 1];
        let proc = self.worker.spawn(
            link.command(self.worker.bin),
            "run",
            &self.run.config,
            &id,
            &self.out.join(format!("{id}.log")),
            failpoints,
        )?;
        self.workers.push(proc);
        Ok(())
    }

    /// `full` seconds, or half of it with `--quick`.
    fn secs(&self, full: u64) -> u64 {
        if self.quick {
            full / 2
        } else {
            full
        }
    }

    /// `fault` on the links of `on` for `secs` seconds, then lifted; a counted mark at the
    /// link's return, and an outage if commits cannot be expected meanwhile.
    async fn hold(
        &self,
        f: &mut Faults,
        on: &[&Link],
        fault: Fault,
        secs: u64,
        outage: bool,
        label: &str,
    ) -> anyhow::Result<()> {
        let from = now_s();
        for l in on {
            l.apply(fault).await?;
        }
        pause(secs * 1000).await;
        for l in on {
            l.heal().await?;
        }
        if outage {
            f.outages.push((from, now_s()));
        }
        f.marks
            .push(Mark::now(&self.run.session, label, true).await);
        Ok(())
    }

    fn both(&self) -> [&Link; 2] {
        [&self.links[0], &self.links[1]]
    }
}

/// Runs scenario `name`: starts the two workers, waits for them to commit, injects its
/// faults, then lets the traffic run 10 s more.
pub(super) async fn inject(ctx: &mut Ctx<'_>, name: &str) -> anyhow::Result<Faults> {
    let mut f = Faults::default();
    // commit-stall: worker 1 waits 4 s before 1% of its COMMITs, the moments the harness
    // stalls its connection (a count would be missed if it fell before the workers settle).
    let failpoints = (name == "commit-stall").then_some("before_commit=1%sleep(4000)");
    for l in ctx.links {
        l.route(name == "latency").await?;
    }
    ctx.start(1, failpoints)?;
    ctx.start(2, None)?;
    marks::settle(&ctx.run.watch, ctx.run.partitions).await?;
    let w1 = [&ctx.links[0]];
    match name {
        "latency" => {
            for (to, what) in [(To::Postgres, "PostgreSQL"), (To::Kafka, "Kafka")] {
                let fault = Fault::Latency {
                    to,
                    ms: 300,
                    jitter_ms: 100,
                };
                let label = format!("300 ± 100 ms to {what} lifted");
                ctx.hold(&mut f, &ctx.both(), fault, ctx.secs(30), false, &label)
                    .await?;
                pause(5000).await;
            }
        }
        "loss" => {
            for (to, percent, what) in [
                (To::Postgres, 5.0, "PostgreSQL"),
                (To::Kafka, 5.0, "Kafka"),
                (To::Postgres, 30.0, "PostgreSQL"),
            ] {
                let fault = Fault::Loss { to, percent };
                let label = format!("{percent}% loss to {what} lifted");
                let outage = percent > 10.0;
                ctx.hold(&mut f, &ctx.both(), fault, ctx.secs(30), outage, &label)
                    .await?;
                pause(5000).await;
            }
        }
        "pg-cut" => {
            let secs = ctx.secs(30);
            let fault = Fault::Cut { to: To::Postgres };
            let label = format!("worker 1's link to PostgreSQL back after {secs} s");
            ctx.hold(&mut f, &w1, fault, secs, true, &label).await?;
        }
        "kafka-cut" => {
            // Longer than the session timeout (6 s): the group gives worker 1's partitions to
            // worker 2 while worker 1 may be inside a transaction, still able to commit.
            let secs = ctx.secs(40).max(15);
            f.marks
                .push(Mark::now(&ctx.run.session, "worker 1 cut off from Kafka", false).await);
            let fault = Fault::Cut { to: To::Kafka };
            let label = format!("worker 1's link to Kafka back after {secs} s");
            ctx.hold(&mut f, &w1, fault, secs, true, &label).await?;
        }
        "commit-stall" => commit_stall(ctx, &mut f).await?,
        "flapping" => {
            let until = Instant::now() + Duration::from_secs(ctx.secs(60));
            let from = now_s();
            let mut flaps = 0;
            while Instant::now() < until {
                ctx.links[0].apply(Fault::Cut { to: To::Both }).await?;
                pause(ctx.rng.u64(2000..5000)).await;
                ctx.links[0].heal().await?;
                pause(ctx.rng.u64(2000..5000)).await;
                flaps += 1;
            }
            f.outages.push((from, now_s()));
            f.notes.push(format!(
                "worker 1's link to both cut {flaps} times in {} s",
                ctx.secs(60)
            ));
            f.marks
                .push(Mark::now(&ctx.run.session, "the flapping ended", true).await);
        }
        other => anyhow::bail!("unknown scenario {other:?}"),
    }
    pause(10_000).await;
    Ok(f)
}

/// Waits (up to `limit`) for a transaction of worker 1 held before its COMMIT by the
/// failpoint: an engine session idle in transaction for over a second (worker 2's batches
/// take milliseconds).
async fn held_before_commit(url: &str, limit: Duration) -> anyhow::Result<()> {
    let db = watch::connect(url, Duration::from_secs(5)).await?;
    let started = Instant::now();
    loop {
        let n: i64 = db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'effectively' \
                 AND state = 'idle in transaction' AND now() - state_change > interval '1 s'",
                &[],
            )
            .await?
            .get(0);
        if n > 0 {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < limit,
            "no transaction held before its COMMIT within {limit:?}"
        );
        pause(100).await;
    }
}

/// `commit-stall`: twice, worker 1's connection to PostgreSQL stalls while a transaction is
/// held before its COMMIT, so the COMMIT goes out into the stall. First only the answers are
/// dropped (the COMMIT arrives and commits, the worker never hears it), then everything (the
/// COMMIT never arrives; PostgreSQL ends the idle session). Each stall outlasts the worker's
/// 10 s transaction deadline.
async fn commit_stall(ctx: &mut Ctx<'_>, f: &mut Faults) -> anyhow::Result<()> {
    let secs = ctx.secs(30).max(15);
    for (fault, what) in [
        (Fault::Deaf { to: To::Postgres }, "answers dropped"),
        (Fault::Cut { to: To::Postgres }, "everything dropped"),
    ] {
        held_before_commit(&ctx.run.spec.database_url, Duration::from_secs(90)).await?;
        let label = format!("COMMIT stalled ({what}) for {secs} s");
        ctx.hold(f, &[&ctx.links[0]], fault, secs, true, &label)
            .await?;
        pause(5000).await;
    }
    Ok(())
}
