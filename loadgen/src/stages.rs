//! A load run in two stages, which every command shares: producing a [`Spec`]'s stream while
//! sampling the consumer's lag ([`produce_stage`]), then finishing it ([`finish_stage`]: wait
//! for the drain, verify the ledger, write the reports).

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::measure::{build_report, clock_step, plan_summary};
use crate::produce::{self, Mix, Progress, Run};
use crate::report::{self, LagPoint, Report};
use crate::via_outbox::ViaOutbox;
use crate::{gaps, outbox, verify, Session};

/// Everything one load run needs, from the command line or from the benchmark.
#[derive(Debug, Clone)]
pub struct Spec {
    pub brokers: String,
    pub database_url: String,
    pub topic: String,
    pub partitions: i32,
    pub consumer: String,
    pub plan: Vec<produce::Step>,
    /// Stop after this many payments even if the plan goes on.
    pub limit: Option<u64>,
    pub mix: Mix,
    pub users: u64,
    pub rate_bp: i64,
    pub drain_timeout: Duration,
    pub report_dir: PathBuf,
    pub seed: Option<u64>,
    pub quiet: bool,
    /// The producer's `compression.type`.
    pub compression: crate::session::Compression,
}

/// What producing left for the verification.
pub struct Produced {
    pub run: Run,
    pub started_at: chrono::DateTime<chrono::Utc>,
    pub duration_s: f64,
    pub log: Vec<produce::Sent>,
    pub lag: Arc<Mutex<Vec<LagPoint>>>,
    pub sampler: tokio::task::JoinHandle<()>,
    /// Via the outbox: the partitions' high watermarks when the run started.
    pub topic_start: Option<Vec<i64>>,
    /// The partitions' epochs and owners when producing started.
    pub owners: gaps::Owners,
}

impl Produced {
    /// Records the broker acknowledged.
    pub fn acked(&self) -> u64 {
        self.log.iter().filter(|s| s.acked).count() as u64
    }

    /// Each acknowledged payment's amount by event id, once (a resend shares its original's
    /// id): what a table upserted by event id must hold once the topic is sunk.
    pub fn amounts_by_event(&self) -> std::collections::HashMap<uuid::Uuid, i64> {
        self.log
            .iter()
            .filter(|s| s.acked && !s.kind.is_poison())
            .filter_map(|s| Some((s.event_id?, s.amount_paise)))
            .collect()
    }

    /// How many acknowledged records each payment's event id has (an original and its resends
    /// share it): how many times a table that counts its writes must have applied each.
    pub fn copies_by_event(&self) -> std::collections::HashMap<uuid::Uuid, u32> {
        let mut copies = std::collections::HashMap::new();
        for s in self.log.iter().filter(|s| s.acked && !s.kind.is_poison()) {
            if let Some(id) = s.event_id {
                *copies.entry(id).or_default() += 1;
            }
        }
        copies
    }

    /// Stops sampling the engine consumer's lag: for a topic that no engine consumer drains.
    pub fn stop_sampling(&self) {
        self.sampler.abort();
    }
}

/// Produces the spec's stream, sampling the consumer's lag every second (until the run is
/// finished).
pub async fn produce_stage(session: &Session, spec: &Spec) -> anyhow::Result<Produced> {
    produce_stage_with(session, spec, Arc::new(Progress::default())).await
}

/// [`produce_stage`] with the caller's counters: setting `progress.stop` ends the plan early.
pub async fn produce_stage_with(
    session: &Session,
    spec: &Spec,
    progress: Arc<Progress>,
) -> anyhow::Result<Produced> {
    let seed = spec.seed.unwrap_or_else(|| fastrand::u64(..));
    let mut rng = fastrand::Rng::with_seed(seed);
    let run = Run {
        id: format!("{:08x}", rng.u32(..)),
        topic: spec.topic.clone(),
        users: spec.users,
        started: Instant::now(),
        ids: session.ids,
        envelope: session.envelope,
        traced: session.traced,
    };
    let started_at = chrono::Utc::now();
    let offered = plan_summary(&spec.plan);
    eprintln!(
        "loadgen run {} (seed {seed}): {}{} to {} ({} partitions){}, verifying consumer {:?}",
        run.id,
        offered.0,
        spec.limit
            .map(|l| format!(", at most {l} payments"))
            .unwrap_or_default(),
        spec.topic,
        spec.partitions,
        if session.outbox.is_some() {
            format!(
                " via the outbox table ({} rows for the relay; its resends are its own)",
                outbox::EVENT_TYPE
            )
        } else {
            String::new()
        },
        spec.consumer
    );
    let topic_start = match session.outbox {
        Some(_) => Some(session.watcher.highs().await?),
        None => None,
    };
    let owners = gaps::owners(&session.db, &spec.consumer, &spec.topic).await?;
    let lag: Arc<Mutex<Vec<LagPoint>>> = Arc::default();
    let sampler = {
        let (lag, db, watcher, consumer, started) = (
            Arc::clone(&lag),
            Arc::clone(&session.db),
            session.watcher.clone(),
            spec.consumer.clone(),
            run.started,
        );
        tokio::spawn(async move {
            loop {
                if let Ok(l) = watcher.lag(&db, &consumer).await {
                    lag.lock().unwrap().push(LagPoint {
                        t_s: started.elapsed().as_secs_f64(),
                        lag: l,
                    });
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        })
    };
    let bar = (!spec.quiet).then(|| {
        let bar = indicatif::ProgressBar::new_spinner();
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} {elapsed_precise} {msg}")
                .expect("a valid template"),
        );
        bar
    });
    let ticker = {
        let (progress, bar, lag) = (Arc::clone(&progress), bar.clone(), Arc::clone(&lag));
        tokio::spawn(async move {
            loop {
                if let Some(bar) = &bar {
                    let l = lag.lock().unwrap().last().map_or(0, |p| p.lag);
                    bar.set_message(format!(
                        "sent {} acked {} lag {l}",
                        progress.sent.load(Relaxed),
                        progress.acked.load(Relaxed)
                    ));
                    bar.tick();
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let log = produce::produce(
        &session.producer,
        &run,
        &spec.plan,
        spec.limit,
        &spec.mix,
        &mut rng,
        Arc::clone(&progress),
        session.outbox.as_ref(),
        session.wire.as_ref(),
    )
    .await;
    let duration_s = run.started.elapsed().as_secs_f64();
    ticker.abort();
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    Ok(Produced {
        run,
        started_at,
        duration_s,
        log,
        lag,
        sampler,
        topic_start,
        owners,
    })
}

/// Waits for the engine to drain the topic (and an inbox consumer's processors to finish its
/// rows), verifies the ledger, writes the reports.
pub async fn finish_stage(
    session: &Session,
    spec: &Spec,
    produced: &Produced,
) -> anyhow::Result<Report> {
    Ok(finish(session, spec, produced).await?.0)
}

/// [`finish_stage`], and via the outbox: first waits for the relay to publish every row of
/// the run; after the verification reads the topic back ([`outbox::census`]); adds
/// `via_outbox` to `report.json`.
pub async fn finish(
    session: &Session,
    spec: &Spec,
    produced: &Produced,
) -> anyhow::Result<(Report, Option<ViaOutbox>)> {
    let unpublished = match session.outbox {
        Some(_) => {
            let left = session
                .wait_published(&produced.run, spec.drain_timeout)
                .await;
            if left != Some(0) {
                eprintln!(
                    "loadgen: {} outbox rows of this run still unpublished after {:?} \
                     (is `effectively relay` running, with {} routed to {}?)",
                    left.map_or("unknown (PostgreSQL did not answer)".into(), |n| n
                        .to_string()),
                    spec.drain_timeout,
                    outbox::EVENT_TYPE,
                    spec.topic
                );
            }
            left
        }
        None => Some(0),
    };
    let drain = session.drain(&spec.consumer, spec.drain_timeout).await;
    produced.sampler.abort();
    if let Some(problem) = drain.problem() {
        eprintln!("loadgen: {problem}");
    }
    let expected = verify::Expected::from_log(&produced.log, spec.rate_bp);
    let latency_from = match session.outbox {
        Some(_) => verify::LatencyFrom::OccurredAt,
        None => verify::LatencyFrom::Record,
    };
    let (observed, latencies) = verify::observe(
        &session.db,
        &spec.consumer,
        &produced.run,
        produced.started_at,
        latency_from,
    )
    .await?;
    let verdict = verify::check(&expected, &observed);
    let lag = produced.lag.lock().unwrap().clone();
    let offered = plan_summary(&spec.plan);
    let mut report = build_report(
        &offered,
        produced.duration_s,
        &produced.log,
        &expected,
        &verdict,
        &latencies,
        lag,
    );
    report.clock_step_s = clock_step(produced.started_at, produced.run.started);
    let owners = gaps::owners(&session.db, &spec.consumer, &spec.topic).await?;
    report.partitions = gaps::partitions(
        &produced.log,
        &observed.credited_s,
        &produced.owners,
        &owners,
    );
    if report::clock_stepped(report.clock_step_s) {
        eprintln!(
            "loadgen: the system clock moved {:+.1} s against the monotonic clock during the run \
             (NTP, or a paused VM): latencies of the records in flight then are off by as much",
            report.clock_step_s
        );
    }
    let via_outbox = match &produced.topic_start {
        Some(from) => {
            report.rate_plan += " via the outbox";
            Some(ViaOutbox::measure(session, spec, produced, from, unpublished).await?)
        }
        None => None,
    };
    let json = spec.report_dir.join("report.json");
    report::write_json(&report, &json)?;
    if let Some(v) = &via_outbox {
        // report/ knows nothing of the outbox: the object goes beside its fields.
        let mut doc = serde_json::to_value(&report)?;
        doc["via_outbox"] = serde_json::to_value(v)?;
        std::fs::write(&json, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    report::write_html(&report, &spec.report_dir.join("report.html"))?;
    Ok((report, via_outbox))
}
