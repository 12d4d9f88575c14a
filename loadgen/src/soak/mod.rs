//! `loadgen soak` (`make soak`): the engine for a long time under the demo's traffic, with a
//! fault every few minutes, watching for what only time shows: leaks and drift.
//!
//! Two workers, the outbox relay and the notification sender run as processes of the engine
//! ([`processes`]: the workers' credits give the relay its outbox rows and the sender its
//! notifications, delivered to the provider stub run in-process here), while loadgen produces
//! the demo's traffic (10% resends, 1% redrives, 1% double taps, 0.1% poison) at `--rate` for
//! `--duration`. A fault every `--fault-every`, in rotation ([`faults`]): a worker SIGKILLed and
//! restarted, the broker restarted, PostgreSQL restarted; each one's recovery is measured from
//! the stored offsets (every partition with traffic commits past where it ended at the fault)
//! and must come within `--recovery-limit`. Every `--sample` ([`sample`]): each process's RSS,
//! descriptors and threads, PostgreSQL's connections, the lag, and the interval's p99.
//!
//! It passes when nothing was lost or doubled (the ledger's checker, `parked` = the poison),
//! Kafka's committed offsets were never ahead of PostgreSQL's, every notification reached the
//! provider once and every outbox row was published ([`checks`]), every fault recovered, and
//! no resource grew beyond its threshold after the warm-up ([`verdict`], [`trend`]). Writes
//! `report.json` and `report.svg` ([`report`], [`chart`]) under `--out` (`target/soak`).
//!
//! It crashes the stack's Kafka and PostgreSQL through `scripts/stack.sh`: run it alone, or on
//! a stack of its own (`STACK_DIR`).

mod chart;
mod checks;
mod faults;
mod processes;
mod report;
mod sample;
mod trend;
mod verdict;

use std::sync::Arc;
use std::time::Duration;

use crate::chaos::Worker;
use crate::harness::watch::{self, now_s};
use crate::harness::HarnessArgs;
use crate::net::{Link, Ports};
use crate::produce::{Mix, Step};
use crate::session::LagWatcher;
use crate::{finish_stage, produce_stage, Session, Spec};
use faults::Injected;
use processes::{Fleet, Names};
use report::{FaultResult, Ledger, Settings, SoakReport};

#[derive(Debug, clap::Args)]
#[command(mut_arg("out", |a| a.default_value("target/soak")))]
pub struct SoakArgs {
    #[command(flatten)]
    harness: HarnessArgs,
    /// How long the traffic runs.
    #[arg(long, env = "SOAK_DURATION", default_value = "1h", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Payments per second.
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// Payments per second of the second stream, whose credits also record a notification for
    /// the sender (a pace it keeps on two shared cores; see `soak/processes.rs`).
    #[arg(long, default_value_t = 50.0)]
    notify_rate: f64,
    /// How often to sample (default 30 s, or a sixtieth of the duration if that is shorter,
    /// at least 5 s: a short run gets enough samples to fit a slope).
    #[arg(long, value_parser = humantime::parse_duration)]
    sample: Option<Duration>,
    /// A fault this often (default a sixth of the duration, from 45 s to 5 min: 3 faults in
    /// 3 minutes, 11 in the hour).
    #[arg(long, value_parser = humantime::parse_duration)]
    fault_every: Option<Duration>,
    /// Each process's first samples left out of the trends (default a tenth of the duration,
    /// at least two samples).
    #[arg(long, value_parser = humantime::parse_duration)]
    warm_up: Option<Duration>,
    /// A fault not recovered within this fails the soak.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    recovery_limit: Duration,
    /// Distinct users (the records' keys).
    #[arg(long, default_value_t = 1000)]
    users: u64,
}

impl std::ops::Deref for SoakArgs {
    type Target = HarnessArgs;
    fn deref(&self) -> &HarnessArgs {
        &self.harness
    }
}

/// The soak's timing, from the flags and the duration.
#[derive(Debug, Clone, Copy)]
struct Plan {
    duration: f64,
    sample: f64,
    fault_every: f64,
    warm_up: f64,
    /// Samples this long after a fault are not fitted: a third of the fault interval, at most
    /// 60 s.
    settle: f64,
}

impl Plan {
    fn of(args: &SoakArgs) -> Plan {
        let duration = args.duration.as_secs_f64();
        let sample = args
            .sample
            .map_or((duration / 60.0).clamp(5.0, 30.0), |s| s.as_secs_f64());
        let fault_every = args
            .fault_every
            .map_or((duration / 6.0).clamp(45.0, 300.0), |s| s.as_secs_f64());
        let warm_up = args
            .warm_up
            .map_or((duration / 10.0).max(2.0 * sample), |s| s.as_secs_f64());
        Plan {
            duration,
            sample,
            fault_every,
            warm_up,
            settle: (fault_every / 3.0).min(60.0),
        }
    }

    /// When the faults happen (seconds since the start): every `fault_every`, as long as the
    /// traffic goes on for half an interval (at most 60 s) after it, so its recovery is seen.
    fn fault_times(&self) -> Vec<f64> {
        let tail = (self.fault_every / 2.0).min(60.0);
        (1..)
            .map(|k| k as f64 * self.fault_every)
            .take_while(|t| *t <= self.duration - tail)
            .collect()
    }
}

/// One stream's load run: its topic is its consumer's name.
fn stream(args: &SoakArgs, topic: &str, rate: f64, seed: u64) -> Spec {
    Spec {
        brokers: args.services.brokers.clone(),
        database_url: args.services.database_url.clone(),
        topic: topic.to_string(),
        partitions: PARTITIONS,
        consumer: topic.to_string(),
        plan: vec![Step {
            rate: Some(rate),
            duration: args.duration,
        }],
        limit: None,
        // The demo's mix (scripts/demo.sh).
        mix: Mix {
            resend: 0.10,
            redrive: 0.01,
            redrive_delay: Duration::from_secs(30),
            double_tap: 0.01,
            poison: 0.001,
        },
        users: args.users,
        rate_bp: 200,
        drain_timeout: Duration::from_secs(300),
        report_dir: args.out.join(topic),
        seed: Some(seed),
        quiet: true,
        compression: Default::default(),
    }
}

const PARTITIONS: i32 = 6;

pub async fn run(args: SoakArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.scenarios.is_empty() && !args.quick,
        "the soak has no scenarios: its faults rotate (--duration, --fault-every)"
    );
    crate::harness::stack::check_stack(&args.services).await?;
    let plan = Plan::of(&args);
    let bin = Worker::binary(args.effectively.as_deref())?;
    std::fs::create_dir_all(&args.out)?;
    let seed = args.seed();
    let mut rng = fastrand::Rng::with_seed(seed);
    let (brokers, url) = (&args.services.brokers, &args.services.database_url);
    let topic = format!("soak-{:06x}", rng.u32(..0xffffff));
    let notify_topic = format!("{topic}-n");
    let credited_topic = format!("{topic}-credited");
    let channel = format!("{topic}-sms");
    for t in [&topic, &notify_topic, &credited_topic] {
        crate::create_topic(brokers, t, PARTITIONS, 1).await?;
    }
    let stub = provider_stub::ProviderStub::start("127.0.0.1:0").await?;
    let names = Names {
        topic: &topic,
        notify_topic: &notify_topic,
        credited_topic: &credited_topic,
        channel: &channel,
        provider: &stub.url(),
    };
    let config = args.out.join(format!("{topic}.toml"));
    std::fs::write(&config, processes::config(&names, args.strategy))?;
    let spec = stream(&args, &topic, args.rate, seed);
    let notify_spec = stream(&args, &notify_topic, args.notify_rate, rng.u64(..));
    let strategy = args.strategy_name();
    eprintln!(
        "soak {topic} (seed {seed}, {strategy}): {} msg/s (and {} msg/s notifying) for {:.0} s, \
         a fault every {:.0} s ({} faults), a sample every {:.0} s, warm-up {:.0} s",
        args.rate,
        args.notify_rate,
        plan.duration,
        plan.fault_every,
        plan.fault_times().len(),
        plan.sample,
        plan.warm_up
    );
    let session = Session::open(&spec).await?;
    let notify_session = Session::open(&notify_spec).await?;
    let worker = Worker {
        bin: &bin,
        brokers,
        database_url: url,
    };
    // Worker a and b in network namespaces of their own (11 and 12: chaos-net's are 1 and 2),
    // for the network fault.
    let ports = Ports::of(brokers, url)?;
    let links = [
        Link::create(11, &ports).await?,
        Link::create(12, &ports).await?,
    ];
    let fleet = Fleet::start(&worker, links, config, &args.out, &topic)?;
    let running = fleet.running.clone();
    let fleet = Arc::new(tokio::sync::Mutex::new(fleet));
    let watch = watch::CommitWatch::start(url, &topic);
    let ahead = watch::AheadSampler::start(brokers, url, &topic, PARTITIONS)?;
    let started = now_s();
    let sampler = sample::Sampler::start(
        Duration::from_secs_f64(plan.sample),
        started,
        running,
        url.clone(),
        session.watcher.clone(),
        topic.clone(),
    );
    // The faults and the second stream in tasks of their own: at 2,000 msg/s the producing
    // future seldom yields, and joined with it in one task they would wait for it.
    let rotation = tokio::spawn(rotate(
        plan,
        started,
        session.watcher.clone(),
        Arc::clone(&fleet),
    ));
    let notify_producing = {
        let spec = notify_spec.clone();
        tokio::spawn(async move { produce_stage(&notify_session, &spec).await })
    };
    let produced = produce_stage(&session, &spec).await;
    let notify_produced = notify_producing.await?;
    let mut samples = sampler.finish().await;
    let (produced, notify_produced) = (produced?, notify_produced?);
    let (marks, notes, mut failures) = rotation.await?;

    // Fresh sessions for the verification: a PostgreSQL restart took the first ones'.
    let verified = finish_stage(&Session::open(&spec).await?, &spec, &produced).await?;
    let notify_verified = finish_stage(
        &Session::open(&notify_spec).await?,
        &notify_spec,
        &notify_produced,
    )
    .await?;
    let limit = Duration::from_secs(300);
    let delivery = checks::delivery(url, &channel, &stub, notify_verified.effects, limit).await?;
    let consumers = [topic.as_str(), notify_topic.as_str()];
    let relayed = checks::relayed(
        url,
        brokers,
        &consumers,
        &credited_topic,
        verified.effects + notify_verified.effects,
        limit,
    )
    .await?;
    let fleet = Arc::try_unwrap(fleet)
        .map_err(|_| anyhow::anyhow!("the fault rotation still holds the processes"))?;
    failures.extend(fleet.into_inner().stop().await);
    let commits = watch.finish().await;
    let (kafka_ahead, _) = ahead.finish().await;
    stub.stop().await?;

    for (name, v) in [("", &verified), ("notifying stream's ", &notify_verified)] {
        if !v.verified {
            failures.push(format!(
                "the {name}ledger did not verify: lost {}, duplicated {}, unexpected {}, \
                 parked {} of {} poison",
                v.lost, v.duplicated, v.unexpected, v.parked, v.poison_sent
            ));
        }
    }
    if kafka_ahead > 0 {
        failures.push(format!(
            "Kafka's committed offset ahead of PostgreSQL's in {kafka_ahead} samples"
        ));
    }
    if !delivery.passed {
        failures.push(format!("the sender's check failed: {delivery:?}"));
    }
    if !relayed.passed {
        failures.push(format!("the relay's check failed: {relayed:?}"));
    }
    let results: Vec<FaultResult> = (marks.iter())
        .map(|f| {
            let recover_s = f.recovery(&commits, &produced);
            let passed = recover_s.is_some_and(|s| s <= args.recovery_limit.as_secs_f64());
            if !passed {
                failures.push(format!(
                    "\"{}\" not recovered within {:?} ({})",
                    f.mark.label,
                    args.recovery_limit,
                    recover_s.map_or("never".into(), |s| format!("{s:.1} s"))
                ));
            }
            FaultResult {
                kind: f.fault,
                label: f.mark.label.clone(),
                at_s: round2(f.at - started),
                down_s: f.back.map(|b| round2(b - f.at)),
                recover_s: recover_s.map(round2),
                passed,
            }
        })
        .collect();
    if results.is_empty() {
        failures.push("no fault was injected (a duration too short for --fault-every)".into());
    }
    // Outages by design: a service from its crash until it was back.
    let outages: Vec<(f64, f64)> = (marks.iter())
        .filter_map(|f| Some((f.at, f.back?)))
        .collect();
    let (stall, engine_stall) = watch::longest_stall(&commits, &outages);

    if let Err(e) = sample::fill_p99(url, &topic, started, &mut samples).await {
        eprintln!("soak: the intervals' p99 could not be read: {e:#}");
    }
    let fault_at: Vec<(f64, f64)> = (results.iter())
        .map(|r| (r.at_s, r.at_s + r.down_s.unwrap_or(0.0)))
        .collect();
    let trends = verdict::trends(
        &samples,
        &fault_at,
        plan.warm_up,
        plan.settle,
        plan.duration,
        args.rate,
    );
    for t in trends.iter().filter(|t| !t.passed) {
        failures.push(format!("{}: {}", t.series, t.note));
    }
    let report = SoakReport {
        passed: failures.is_empty(),
        failures,
        notes,
        settings: Settings {
            topic: topic.clone(),
            seed,
            strategy,
            duration_s: plan.duration,
            rate: args.rate,
            notify_rate: args.notify_rate,
            sample_s: plan.sample,
            fault_every_s: plan.fault_every,
            warm_up_s: plan.warm_up,
            settle_s: plan.settle,
            recovery_limit_s: args.recovery_limit.as_secs_f64(),
            redis: "off (the pre-filter is not on in the soak)",
        },
        ledger: Ledger::of(&verified),
        notify_ledger: Ledger::of(&notify_verified),
        kafka_ahead,
        delivery,
        relay: relayed,
        faults: results,
        stall_s: round2(stall),
        engine_stall_s: round2(engine_stall),
        thresholds: report::thresholds(),
        trends,
        samples,
    };
    report.write(&args.out)?;
    report.print();
    eprintln!(
        "report: {} and {}",
        args.out.join("report.json").display(),
        args.out.join("report.svg").display()
    );
    Ok(report.passed)
}

/// Injects the faults at their times while the traffic runs: what was injected, the faults left
/// out (the ones before ran too long: a note), and the faults that failed.
async fn rotate(
    plan: Plan,
    started: f64,
    watcher: LagWatcher,
    fleet: Arc<tokio::sync::Mutex<Fleet>>,
) -> (Vec<Injected>, Vec<String>, Vec<String>) {
    let (mut marks, mut notes, mut failed) = (Vec::new(), Vec::new(), Vec::new());
    let last = plan.fault_times().last().copied().unwrap_or(0.0);
    for (n, at) in plan.fault_times().into_iter().enumerate() {
        let wait = started + at - now_s();
        if wait > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(wait)).await;
        }
        // A slow fault (a broker that took a minute to start) delays the next ones; none is
        // injected later than the last one was due (a second of slack for the timer), so each
        // has traffic after it.
        if now_s() - started > last + 1.0 {
            notes.push(format!(
                "fault {} ({:?}) not injected: the faults before it ran past {last:.0} s",
                n + 1,
                faults::nth(n)
            ));
            break;
        }
        eprintln!("   {:.0} s: {:?}", now_s() - started, faults::nth(n));
        match faults::inject(n, &watcher, &fleet).await {
            Ok(m) => marks.push(m),
            Err(e) => {
                // A service that did not come back ends the faults: the rest would measure it.
                failed.push(format!("fault {} ({:?}): {e:#}", n + 1, faults::nth(n)));
                let _ = crate::harness::stack::stack("up").await;
                break;
            }
        }
    }
    (marks, notes, failed)
}

/// Seconds to two decimals, for the report.
fn round2(s: f64) -> f64 {
    (s * 100.0).round() / 100.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(duration: f64) -> Plan {
        let sample = (duration / 60.0).clamp(5.0, 30.0);
        let fault_every = (duration / 6.0).clamp(45.0, 300.0);
        Plan {
            duration,
            sample,
            fault_every,
            warm_up: (duration / 10.0).max(2.0 * sample),
            settle: (fault_every / 3.0).min(60.0),
        }
    }

    #[test]
    fn three_minutes_get_three_faults_and_an_hour_eleven() {
        let p = plan(180.0);
        assert_eq!(p.sample, 5.0);
        assert_eq!(p.fault_times(), [45.0, 90.0, 135.0]);
        assert_eq!(p.warm_up, 18.0);
        assert_eq!(p.settle, 15.0);
        let p = plan(3600.0);
        assert_eq!(p.sample, 30.0);
        assert_eq!(p.fault_times().len(), 11);
        assert_eq!(p.settle, 60.0);
        assert_eq!(plan(600.0).fault_times().len(), 5);
    }
}
