//! The soak's faults, one every `--fault-every`, in rotation. Adding a kind is one variant of
//! [`Fault`], one entry of [`ROTATION`] and one arm of [`inject`].

use std::time::Duration;

use serde::Serialize;

use super::processes::Fleet;
use crate::harness::marks::Mark;
use crate::harness::stack::stack;
use crate::harness::watch::{now_s, Commit};
use crate::net::{self, To};
use crate::session::LagWatcher;
use crate::Produced;

/// A kind of fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(super) enum Fault {
    /// A worker SIGKILLed and started again (worker a and b in turn).
    WorkerKill,
    /// The Kafka broker crashed (`scripts/stack.sh kafka-crash`) and started again.
    BrokerRestart,
    /// PostgreSQL crashed (`pg-crash`: immediate shutdown) and started again.
    PgRestart,
    /// A worker's link to PostgreSQL cut (packets dropped silently) for [`CUT`], Kafka still
    /// reachable: `chaos-net`'s `pg-cut` (worker a and b in turn).
    PgCut,
}

/// The order faults come in, round and round. PostgreSQL and the cut before the broker: they
/// are over in seconds, where a broker took 50 to 180 s to start on a loaded machine, so a
/// 3-minute run still gets the first three kinds.
pub(super) const ROTATION: &[Fault] = &[
    Fault::WorkerKill,
    Fault::PgRestart,
    Fault::PgCut,
    Fault::BrokerRestart,
];

/// How long a worker's link to PostgreSQL stays cut.
const CUT: Duration = Duration::from_secs(20);

/// How long a crashed service stays down before `scripts/stack.sh up`.
const DOWN: Duration = Duration::from_secs(3);

/// The `n`-th fault of the run (0-based) and its kind.
pub(super) fn nth(n: usize) -> Fault {
    ROTATION[n % ROTATION.len()]
}

/// One fault injected.
pub(super) struct Injected {
    pub fault: Fault,
    /// When it was issued (epoch seconds).
    pub at: f64,
    /// For a service: when `scripts/stack.sh up` returned; for a cut, when the link came
    /// back (epoch seconds). Recovery is
    /// measured from here: how long a broker takes to start on a loaded machine is not the
    /// engine's (it is reported as `down_s`).
    pub back: Option<f64>,
    /// From the fault: the partitions with traffic after it must commit past their end at it,
    /// in batches begun once it took effect (for a service, once it was back).
    pub mark: Mark,
}

/// Injects the `n`-th fault; its mark is taken just before, and counts commits begun only
/// once the fault took effect (the process dead, the service crashed).
pub(super) async fn inject(
    n: usize,
    watcher: &LagWatcher,
    fleet: &tokio::sync::Mutex<Fleet>,
) -> anyhow::Result<Injected> {
    let fault = nth(n);
    let mut mark = match fault {
        Fault::WorkerKill => {
            // Worker a and b in turn: the n-th worker kill hits worker (n / len) % 2.
            let role = (n / ROTATION.len()) % 2;
            let label = format!("SIGKILL worker-{}", ["a", "b"][role]);
            let mark = Mark::take(watcher, label, true).await;
            fleet.lock().await.kill_and_restart(role).await?;
            mark
        }
        Fault::BrokerRestart => {
            let mark = Mark::take(watcher, "broker restart", true).await;
            stack("kafka-crash").await?;
            mark
        }
        Fault::PgRestart => {
            let mark = Mark::take(watcher, "PostgreSQL restart", true).await;
            stack("pg-crash").await?;
            mark
        }
        Fault::PgCut => {
            let role = (n / ROTATION.len()) % 2;
            let label = format!("worker-{} cut off from PostgreSQL", ["a", "b"][role]);
            let mark = Mark::take(watcher, label, true).await;
            let fleet = fleet.lock().await;
            let cut = net::Fault::Cut { to: To::Postgres };
            fleet.links[role].apply(cut).await?;
            tokio::time::sleep(CUT).await;
            fleet.links[role].heal().await?;
            mark
        }
    };
    let at = mark.from;
    mark.valid_after = now_s();
    let mut back = None;
    if fault == Fault::PgCut {
        // Measured from the link's return.
        (mark.valid_after, back) = (now_s(), Some(now_s()));
    }
    if matches!(fault, Fault::BrokerRestart | Fault::PgRestart) {
        tokio::time::sleep(DOWN).await;
        stack("up").await?;
        let t = now_s();
        (mark.valid_after, back) = (t, Some(t));
    }
    Ok(Injected {
        fault,
        at,
        back,
        mark,
    })
}

impl Injected {
    /// Seconds from the kill, or from the service's return, until every partition with traffic
    /// after the fault committed past its end at the fault (None: never).
    pub(super) fn recovery(&self, commits: &[Commit], produced: &Produced) -> Option<f64> {
        let from_fault = self.mark.recovery(commits, produced).ok()?;
        Some(from_fault - self.back.map_or(0.0, |b| b - self.at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rotation_goes_round() {
        let kinds: Vec<Fault> = (0..5).map(nth).collect();
        assert_eq!(
            kinds,
            [
                Fault::WorkerKill,
                Fault::PgRestart,
                Fault::PgCut,
                Fault::BrokerRestart,
                Fault::WorkerKill
            ]
        );
    }
}
