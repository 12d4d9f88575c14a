//! One scenario from its setup to its result: its topic, worker config and load; its faults
//! while loadgen produces (each family's in its own file); then the verification, with the
//! offsets sampled throughout, into a [`ScenarioResult`].

use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use super::checks::{sample_offsets, verify_effects};
use super::inbox::{inbox_burst, BURST};
use super::outages::Proxy;
use super::workers::{worker_config, Env, Proc};
use super::{bounces, outages, ChaosArgs, ScenarioResult};
use crate::harness::run::{inbox_parked, Counts};
use crate::produce::{Mix, Step};
use crate::{finish_stage, produce_stage, Session, Spec};

pub(super) async fn scenario(
    bin: &Path,
    args: &ChaosArgs,
    name: &str,
    seed: u64,
) -> anyhow::Result<ScenarioResult> {
    if matches!(name, "postgres-crash" | "broker-crash") {
        crate::harness::stack::check_stack(&args.services).await?;
    }
    let inbox = args.inbox();
    let burst = name == "inbox-burst";
    let mut rng = fastrand::Rng::with_seed(seed);
    let prefix = match args.label() {
        "batch" => "chaos-".to_string(),
        _ if name.starts_with("inbox") => "chaos-".to_string(),
        label => format!("chaos-{label}-"),
    };
    let topic = format!("{prefix}{name}-{:06x}", rng.u32(..0xffffff));
    let partitions = 3;
    let poison = if name == "poison-storm" { 0.05 } else { 0.002 };
    // Under the inbox each processor holds a connection while it works (the engine wants
    // processors + 2): pool exhaustion there is 3 connections for 3 receivers and 1 processor.
    let (pool_size, processors) = match name {
        "pool-exhaustion" if inbox => (3, 1),
        "pool-exhaustion" => (2, 4),
        _ => (8, 4),
    };
    let config = args.out.join(format!("{topic}.toml"));
    std::fs::write(&config, worker_config(args, &topic, pool_size, processors))?;
    // inbox-burst's first worker only receives (`processors = 0`): processors that lag.
    let receiver = args.out.join(format!("{topic}-receiver.toml"));
    if burst {
        std::fs::write(&receiver, worker_config(args, &topic, pool_size, 0))?;
    }
    let seconds = if args.quick { 8 } else { 20 };
    let spec = Spec {
        brokers: args.services.brokers.clone(),
        database_url: args.services.database_url.clone(),
        topic: topic.clone(),
        partitions,
        consumer: topic.clone(),
        plan: vec![Step {
            rate: if burst { None } else { Some(500.0) },
            duration: Duration::from_secs(if burst { 600 } else { seconds }),
        }],
        limit: burst.then_some(BURST),
        mix: Mix {
            resend: 0.10,
            redrive: 0.02,
            redrive_delay: Duration::from_secs(if burst { 2 } else { seconds / 2 }),
            double_tap: 0.01,
            poison,
        },
        // The burst's payments spread over more users (ordering keys): 10 per user.
        users: args.users.unwrap_or(if burst { 10_000 } else { 200 }),
        rate_bp: 200,
        drain_timeout: Duration::from_secs(if burst { 600 } else { 120 }),
        report_dir: args.out.join(&topic),
        seed: Some(seed),
        quiet: true,
        compression: Default::default(),
    };
    let session = Session::open(&spec).await?;
    // Workers reach PostgreSQL through a proxy the scenario can cut.
    let proxy = if name == "postgres-unreachable" {
        Some(Proxy::start(&args.services.database_url).await?)
    } else {
        None
    };
    let database_url = proxy
        .as_ref()
        .map_or(args.services.database_url.clone(), |p| p.url.clone());
    let mut env = Env {
        bin,
        args,
        name: topic.clone(),
        config,
        database_url,
        workers: 0,
    };
    let stop = Arc::new(AtomicU64::new(0));
    let ahead = Arc::new(AtomicU64::new(0));
    let sampler = sample_offsets(
        args,
        &topic,
        partitions,
        Arc::clone(&stop),
        Arc::clone(&ahead),
    )?;
    let mut note = String::new();
    let mut clean_ok = true;

    let (produced, live) = if burst {
        let (produced, live, burst_note, ok) =
            inbox_burst(&mut env, &session, &spec, &receiver, processors).await?;
        note = burst_note;
        clean_ok = ok;
        (produced, live)
    } else {
        let (produced, faults) = tokio::join!(produce_stage(&session, &spec), async {
            let mut live: Vec<Proc> = Vec::new();
            match name {
                "hard-bounce" => {
                    bounces::hard_bounce(
                        args, &mut env, &mut rng, &topic, inbox, &mut live, &mut note,
                    )
                    .await?
                }
                "clean-bounce" => {
                    clean_ok = bounces::clean_bounce(
                        args, &mut env, &mut rng, &topic, partitions, &mut live, &mut note,
                    )
                    .await?
                }
                "rebalance-storm" => {
                    bounces::rebalance_storm(&mut env, &mut rng, &mut live).await?
                }
                "zombie" => bounces::zombie(&mut env, &mut live, &mut note).await?,
                "postgres-crash" => outages::postgres_crash(&mut env, &mut rng, &mut live).await?,
                "postgres-unreachable" => {
                    outages::postgres_unreachable(&mut env, &mut rng, &proxy, &mut live, &mut note)
                        .await?
                }
                "broker-crash" => outages::broker_crash(&mut env, &mut rng, &mut live).await?,
                "pool-exhaustion" | "poison-storm" => {
                    live.push(env.start(None)?);
                }
                "offsets-reset" => {
                    live.push(env.start(None)?);
                }
                _ => anyhow::bail!("unknown scenario"),
            }
            Ok::<_, anyhow::Error>(live)
        });
        (produced?, faults?)
    };
    // A fresh session for the verification: a crashed PostgreSQL took the first one's
    // connection with it.
    let session = Session::open(&spec).await?;
    let mut report = finish_stage(&session, &spec, &produced).await?;
    let mut extra_ok = true;
    if name == "offsets-reset" {
        // Stop the group, rewind Kafka's offsets to the start, restart: PostgreSQL's offsets
        // win, nothing is applied again.
        let effects_before = report.effects;
        for w in live {
            w.stop().await?;
        }
        let status = tokio::process::Command::new("scripts/stack.sh")
            .args([
                "kafka",
                "org.apache.kafka.tools.consumer.group.ConsumerGroupCommand",
                "--bootstrap-server",
                &args.services.brokers,
                "--group",
                &topic,
                "--topic",
                &topic,
                "--reset-offsets",
                "--to-earliest",
                "--execute",
            ])
            .stdout(Stdio::null())
            .status()
            .await?;
        anyhow::ensure!(status.success(), "resetting the group's offsets failed");
        let w = env.start(None)?;
        tokio::time::sleep(Duration::from_secs(8)).await;
        let again = finish_stage(&session, &spec, &produced).await;
        w.stop().await?;
        let after = verify_effects(&args.services.database_url, &topic).await?;
        extra_ok = after == effects_before;
        note = format!("effects before reset {effects_before}, after restart {after}");
        if let Ok(r) = again {
            report = r;
        }
    } else {
        // A worker that does not stop cleanly fails the scenario, with what was measured.
        for w in live {
            if let Err(e) = w.stop().await {
                extra_ok = false;
                let sep = if note.is_empty() { "" } else { "; " };
                note = format!("{note}{sep}a worker did not stop cleanly: {e:#}");
            }
        }
    }
    stop.store(1, Relaxed);
    let _ = sampler.await;
    let kafka_ahead = ahead.load(Relaxed);
    if inbox {
        let url = &args.services.database_url;
        let parked = inbox_parked(url, &topic, report.parked).await?;
        let sep = if note.is_empty() { "" } else { "; " };
        note = format!("{note}{sep}{parked}");
    }
    Ok(ScenarioResult {
        name: name.into(),
        strategy: args.label().into(),
        seed,
        counts: Counts::of(&produced, &report, kafka_ahead),
        passed: report.verified && kafka_ahead == 0 && extra_ok && clean_ok,
        note,
    })
}
