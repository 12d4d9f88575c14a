//! loadgen: produces the seed's payment stream with real-world duplicates, waits for the
//! engine to drain it (for an inbox consumer, also for its processors to finish the stored
//! rows), and verifies the ledger: for every acknowledged unique payment exactly
//! one effect, nothing unexpected, every poison record parked, wallets exact. Writes
//! `report.json` and a self-contained `report.html`, and exits non-zero unless verified.
//! `--via-outbox` writes the payments to the `outbox` table for `effectively relay` to
//! publish, and verifies the same ledger ([`outbox`]).

mod bench;
mod chaos;
mod cluster;
mod gaps;
mod orders;
mod outbox;
mod produce;
mod replay;
mod report;
mod verify;

use std::path::PathBuf;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::ClientConfig;

use produce::{Kind, Mix, Progress, Run};
use report::{LagPoint, LatencyPoint, RatePoint, Report};

/// Where the stack's services are; every subcommand takes them the same way.
#[derive(Debug, Clone, clap::Args)]
pub struct Services {
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub brokers: String,
    /// PostgreSQL: the engine's database, read to verify (the password is never printed).
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/effectively"
    )]
    pub database_url: String,
}

#[derive(Debug, clap::Args)]
struct Args {
    #[command(flatten)]
    services: crate::Services,
    /// Topic to produce to (created with --partitions if missing).
    #[arg(long, default_value = "payments")]
    topic: String,
    #[arg(long, default_value_t = 6)]
    partitions: i32,
    /// The engine consumer whose effects are verified.
    #[arg(long, default_value = "rewards")]
    consumer: String,
    /// Target rate in payments/s: a number, or steps `500:20s,2000:20s,max:20s`.
    #[arg(long, default_value = "2000")]
    rate: String,
    /// How long to produce at a plain rate.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Stop after this many payments, even if the rate plan goes on.
    #[arg(long)]
    count: Option<u64>,
    /// Distinct users (the record key: a user's payments stay in one partition, in order).
    #[arg(long, default_value_t = 1000)]
    users: u64,
    /// Fraction of payments published twice at once (a relay resend).
    #[arg(long, default_value_t = 0.10)]
    resend_rate: f64,
    /// Fraction of payments published again, byte for byte, after --redrive-delay.
    #[arg(long, default_value_t = 0.01)]
    redrive_rate: f64,
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    redrive_delay: Duration,
    /// Fraction of payments tapped twice: a new event id for the same payment id.
    #[arg(long, default_value_t = 0.01)]
    double_tap_rate: f64,
    /// Fraction of records that are poison (undecodable, or without an event id).
    #[arg(long, default_value_t = 0.001)]
    poison_rate: f64,
    /// The cashback rate the engine applies, in basis points.
    #[arg(long, default_value_t = 200)]
    rate_bp: i64,
    /// How long to wait for the engine to drain the topic after producing (and, for a consumer
    /// of the inbox strategy, for its processors to finish every stored row).
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Where report.json and report.html go.
    #[arg(long, default_value = "target/loadgen")]
    report_dir: PathBuf,
    /// Seed of the random choices (amounts, users, which payments get duplicates).
    #[arg(long)]
    seed: Option<u64>,
    /// Hide the progress bar (CI logs).
    #[arg(long)]
    quiet: bool,
    /// Write each payment (and double tap) as an `outbox` row, committed in batches of 100,
    /// for `effectively relay` to publish with `PaymentSucceeded` routed to --topic; a payment
    /// counts as sent once its row committed. No resends (the relay's own); redrives and poison
    /// still go straight to Kafka. Before the drain loadgen waits up to --drain-timeout for
    /// the relay to publish every row, then reads the topic back to count what the relay
    /// published more than once.
    #[arg(long)]
    via_outbox: bool,
}

#[derive(Debug, Parser)]
#[command(
    name = "loadgen",
    version,
    about,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: Args,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// `make bench`: the SQL ceiling, the batch and per-message strategies draining a
    /// pre-filled topic, and latency at 500 and 2,000 msg/s, side by side in one run.
    Bench(bench::BenchArgs),
    /// `make chaos`: fault-injection scenarios, each verified exactly-once.
    Chaos(chaos::ChaosArgs),
    /// Failover scenarios against the three-broker Kafka and the PostgreSQL primary with a
    /// standby of `scripts/cluster.sh`, each verified exactly-once, with recovery times.
    ChaosCluster(cluster::ClusterArgs),
    /// An order-status stream with out-of-order versions, stale copies and duplicates into
    /// an `order-status` consumer: every order must end at its newest version, never going back.
    Orders(orders::OrdersArgs),
    /// `make bench`'s pre-filter phase alone: a 100%-duplicate replay of a topic with and
    /// without the Redis pre-filter (Redis from REDIS_URL or `scripts/stack.sh redis-up`).
    Replay(replay::ReplayArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt().with_env_filter("warn").init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Bench(b)) => bench::run(b).await,
        Some(Command::Chaos(c)) => chaos::run(c).await,
        Some(Command::ChaosCluster(c)) => cluster::run(c).await,
        Some(Command::Orders(o)) => orders::run(o).await,
        Some(Command::Replay(r)) => replay::run(r).await,
        None => run(cli.run).await,
    };
    match result {
        Ok(true) => std::process::ExitCode::SUCCESS,
        Ok(false) => std::process::ExitCode::from(1),
        Err(e) => {
            eprintln!("loadgen: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

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
}

impl Spec {
    fn from_args(args: &Args) -> anyhow::Result<Spec> {
        Ok(Spec {
            brokers: args.services.brokers.clone(),
            database_url: args.services.database_url.clone(),
            topic: args.topic.clone(),
            partitions: args.partitions,
            consumer: args.consumer.clone(),
            plan: produce::parse_plan(&args.rate, args.duration).map_err(anyhow::Error::msg)?,
            limit: args.count,
            mix: Mix {
                // Via the outbox a resend is the relay's (it is counted on the topic).
                resend: if args.via_outbox {
                    0.0
                } else {
                    args.resend_rate
                },
                redrive: args.redrive_rate,
                redrive_delay: args.redrive_delay,
                double_tap: args.double_tap_rate,
                poison: args.poison_rate,
            },
            users: args.users,
            rate_bp: args.rate_bp,
            drain_timeout: args.drain_timeout,
            report_dir: args.report_dir.clone(),
            seed: args.seed,
            quiet: args.quiet,
        })
    }
}

/// Connections one run uses.
pub struct Session {
    db: Arc<tokio_postgres::Client>,
    producer: FutureProducer,
    watcher: LagWatcher,
    brokers: String,
    /// Set by [`Session::via_outbox`]: payments go to the `outbox` table.
    outbox: Option<outbox::Writer>,
}

impl Session {
    pub async fn open(spec: &Spec) -> anyhow::Result<Session> {
        Session::connect(
            &spec.brokers,
            &spec.database_url,
            &spec.topic,
            spec.partitions,
        )
        .await
    }

    /// Connects to both services, creating `topic` with `partitions` if it is missing.
    pub async fn connect(
        brokers: &str,
        database_url: &str,
        topic: &str,
        partitions: i32,
    ) -> anyhow::Result<Session> {
        let (db, conn) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
            .await
            .context("connecting to PostgreSQL for verification")?;
        tokio::spawn(conn);
        ensure_topic(brokers, topic, partitions).await?;
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .set("queue.buffering.max.messages", "1000000")
            .create()
            .context("creating the producer")?;
        warm_up(brokers, &producer, topic).await?;
        Ok(Session {
            db: Arc::new(db),
            producer,
            watcher: LagWatcher::new(brokers, topic, partitions)?,
            brokers: brokers.to_string(),
            outbox: None,
        })
    }

    /// Payments (and double taps) are written to the `outbox` table from now on.
    pub async fn via_outbox(mut self, database_url: &str) -> anyhow::Result<Session> {
        self.outbox = Some(outbox::Writer::connect(database_url).await?);
        Ok(self)
    }

    /// Waits up to `timeout` for the relay to publish every outbox row of `run`; returns the
    /// rows left unpublished (None: PostgreSQL did not answer).
    pub async fn wait_published(&self, run: &Run, timeout: Duration) -> Option<i64> {
        let start = Instant::now();
        loop {
            let left = outbox::unpublished(&self.db, &run.payment_prefix())
                .await
                .ok();
            if left == Some(0) || start.elapsed() > timeout {
                return left;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Waits up to `timeout` for `consumer` to drain the topic (PostgreSQL's stored offsets
    /// at the partitions' ends) and then, for an inbox consumer, for its processors to finish
    /// every stored row: the inbox moves the offsets as soon as a message is stored, and its
    /// effect comes when a processor applies the row.
    pub async fn drain(&self, consumer: &str, timeout: Duration) -> Drain {
        let start = Instant::now();
        let drained = loop {
            match self.watcher.lag(&self.db, consumer).await {
                Ok(0) => break true,
                Ok(_) | Err(_) if start.elapsed() > timeout => break false,
                _ => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        };
        let mut open = Some(0);
        if drained {
            loop {
                open = verify::inbox_open(&self.db, consumer).await.ok();
                if open == Some(0) || start.elapsed() > timeout {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
        Drain {
            consumer: consumer.to_string(),
            timeout,
            drained,
            open,
        }
    }
}

/// How [`Session::drain`] ended.
pub struct Drain {
    consumer: String,
    timeout: Duration,
    /// The stored offsets reached the partitions' ends.
    pub drained: bool,
    /// The consumer's PENDING or IN_PROGRESS inbox rows left (None: PostgreSQL did not answer).
    pub open: Option<i64>,
}

impl Drain {
    /// What was not done in time, if anything.
    pub fn problem(&self) -> Option<String> {
        if !self.drained {
            Some(format!(
                "the engine did not drain the topic within {:?}",
                self.timeout
            ))
        } else if self.open != Some(0) {
            Some(format!(
                "{} rows of consumer {:?} still PENDING or IN_PROGRESS in its inbox after {:?}",
                self.open
                    .map_or("unknown (PostgreSQL did not answer)".into(), |n| n
                        .to_string()),
                self.consumer,
                self.timeout
            ))
        } else {
            None
        }
    }
}

/// What producing left for the verification.
pub struct Produced {
    run: Run,
    started_at: chrono::DateTime<chrono::Utc>,
    duration_s: f64,
    log: Vec<produce::Sent>,
    lag: Arc<Mutex<Vec<LagPoint>>>,
    sampler: tokio::task::JoinHandle<()>,
    /// Via the outbox: the partitions' high watermarks when the run started.
    topic_start: Option<Vec<i64>>,
    /// The partitions' epochs and owners when producing started.
    owners: gaps::Owners,
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

    /// Stops sampling the engine consumer's lag: for a topic that no engine consumer drains.
    pub fn stop_sampling(&self) {
        self.sampler.abort();
    }
}

async fn run(args: Args) -> anyhow::Result<bool> {
    let spec = Spec::from_args(&args)?;
    let mut session = Session::open(&spec).await?;
    if args.via_outbox {
        session = session.via_outbox(&spec.database_url).await?;
    }
    let produced = produce_stage(&session, &spec).await?;
    let (report, via_outbox) = finish(&session, &spec, &produced).await?;
    println!("{}", report::summary_table(&report));
    if let Some(v) = &via_outbox {
        println!("{}", v.summary());
    }
    println!(
        "report: {} and {}",
        spec.report_dir.join("report.json").display(),
        spec.report_dir.join("report.html").display()
    );
    Ok(report.verified)
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
async fn finish(
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
        // report.rs knows nothing of the outbox: the object goes beside its fields.
        let mut doc = serde_json::to_value(&report)?;
        doc["via_outbox"] = serde_json::to_value(v)?;
        std::fs::write(&json, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    report::write_html(&report, &spec.report_dir.join("report.html"))?;
    Ok((report, via_outbox))
}

/// `report.json`'s `via_outbox`: how the run's payments went through the outbox and the relay.
#[derive(Debug, serde::Serialize)]
struct ViaOutbox {
    event_type: &'static str,
    /// Rows committed: payments and double taps (these count as sent and acked).
    rows_committed: u64,
    /// Rows of batches that failed (not counted as sent).
    rows_failed: u64,
    /// Records loadgen produced straight to Kafka and the broker acknowledged: redrives and
    /// poison.
    direct_records: u64,
    /// Rows the relay had not published when loadgen stopped waiting (None: unknown).
    unpublished: Option<i64>,
    /// `latency_ms` runs from the payment's `occurred_at` (when loadgen made it, before its
    /// row committed) to the credit, not from the record's timestamp (the relay's publish).
    latency_from: &'static str,
    /// What the topic holds of the run's rows (None: reading it back failed, said on stderr).
    topic: Option<outbox::Census>,
}

impl ViaOutbox {
    async fn measure(
        session: &Session,
        spec: &Spec,
        produced: &Produced,
        from: &[i64],
        unpublished: Option<i64>,
    ) -> anyhow::Result<ViaOutbox> {
        let rows = produced.log.iter().filter(|s| s.outbox);
        let direct = produced.log.iter().filter(|s| !s.outbox && s.acked);
        // Records expected of each committed row on the topic: the relay's, and the redrives.
        let mut expected: std::collections::HashMap<uuid::Uuid, u64> = rows
            .clone()
            .filter(|s| s.acked)
            .filter_map(|s| s.event_id.map(|id| (id, 1)))
            .collect();
        for s in direct.clone().filter(|s| s.kind == Kind::Redrive) {
            if let Some(n) = s.event_id.and_then(|id| expected.get_mut(&id)) {
                *n += 1;
            }
        }
        let to = session.watcher.highs().await?;
        let (brokers, topic, from) = (session.brokers.clone(), spec.topic.clone(), from.to_vec());
        let census = tokio::task::spawn_blocking(move || {
            outbox::census(&brokers, &topic, &from, &to, &expected)
        })
        .await?
        .inspect_err(|e| eprintln!("loadgen: {e:#}"))
        .ok();
        Ok(ViaOutbox {
            event_type: outbox::EVENT_TYPE,
            rows_committed: rows.clone().filter(|s| s.acked).count() as u64,
            rows_failed: rows.filter(|s| !s.acked).count() as u64,
            direct_records: direct.count() as u64,
            unpublished,
            latency_from: "occurred_at",
            topic: census,
        })
    }

    /// Lines for the terminal, below the summary table.
    fn summary(&self) -> String {
        let topic = match &self.topic {
            Some(t) => format!(
                "topic: {} records during the run, {} of them this run's rows: the relay \
                 published {} records again ({} rows), {} rows it never published",
                t.topic_records, t.row_records, t.republished, t.rows_republished, t.rows_missing
            ),
            None => "topic: not read back".into(),
        };
        format!(
            "via the outbox: {} rows committed ({} failed), {} records straight to Kafka \
             (redrives, poison); latency from the payment's occurred_at\n{topic}",
            self.rows_committed, self.rows_failed, self.direct_records,
        )
    }
}

/// Seconds the wall clock advanced since `wall` beyond what the monotonic clock did since
/// `mono` (both read at the run's start), to a tenth of a second.
fn clock_step(wall: chrono::DateTime<chrono::Utc>, mono: Instant) -> f64 {
    let step = (chrono::Utc::now() - wall).as_seconds_f64() - mono.elapsed().as_secs_f64();
    let tenths = (step * 10.0).round() / 10.0;
    // Not "-0.0" in the report for a few microseconds between the two readings.
    if tenths == 0.0 {
        0.0
    } else {
        tenths
    }
}

/// (a description, the mean offered rate) of a plan.
fn plan_summary(plan: &[produce::Step]) -> (String, f64) {
    let parts: Vec<String> = plan
        .iter()
        .map(|s| match s.rate {
            Some(r) => format!("{r}/s for {}", humantime::format_duration(s.duration)),
            None => format!("max for {}", humantime::format_duration(s.duration)),
        })
        .collect();
    let total: f64 = plan.iter().map(|s| s.duration.as_secs_f64()).sum();
    let rated: f64 = plan
        .iter()
        .filter_map(|s| s.rate.map(|r| r * s.duration.as_secs_f64()))
        .sum();
    (
        parts.join(" -> "),
        if total > 0.0 { rated / total } else { 0.0 },
    )
}

fn build_report(
    offered: &(String, f64),
    duration_s: f64,
    log: &[produce::Sent],
    expected: &verify::Expected,
    verdict: &verify::Verdict,
    latencies: &[(f64, f64)],
    lag: Vec<LagPoint>,
) -> Report {
    let mut hist = latency_histogram();
    for (_, ms) in latencies {
        hist.saturating_record((ms * 1000.0) as u64);
    }
    let pct = |h: &hdrhistogram::Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    // Per second of commit time.
    let mut per_second: std::collections::BTreeMap<i64, hdrhistogram::Histogram<u64>> =
        Default::default();
    for (t, ms) in latencies {
        per_second
            .entry(t.floor() as i64)
            .or_insert_with(latency_histogram)
            .saturating_record((ms * 1000.0) as u64);
    }
    let latency_series = per_second
        .iter()
        .map(|(t, h)| LatencyPoint {
            t_s: *t as f64,
            p50: pct(h, 0.5),
            p99: pct(h, 0.99),
            p999: pct(h, 0.999),
            max: h.max() as f64 / 1000.0,
        })
        .collect();
    let throughput = per_second
        .iter()
        .map(|(t, h)| RatePoint {
            t_s: *t as f64,
            per_s: h.len() as f64,
        })
        .collect();
    let mut acked_per_s: std::collections::BTreeMap<i64, u64> = Default::default();
    for s in log.iter().filter(|s| s.acked) {
        *acked_per_s.entry(s.acked_at_s.floor() as i64).or_default() += 1;
    }
    let produced = acked_per_s
        .iter()
        .map(|(t, n)| RatePoint {
            t_s: *t as f64,
            per_s: *n as f64,
        })
        .collect();
    let span = match (
        latencies.iter().map(|l| l.0).reduce(f64::min),
        latencies.iter().map(|l| l.0).reduce(f64::max),
    ) {
        (Some(a), Some(b)) => (b - a).max(1e-3),
        _ => 0.0,
    };
    let first20 = |v: &[String]| v.iter().take(20).cloned().collect::<Vec<_>>();
    let ms: Vec<f64> = latencies.iter().map(|l| l.1).collect();
    Report {
        offered_rate: offered.1,
        rate_plan: offered.0.clone(),
        duration_s,
        sent: log.len() as u64,
        acked: log.iter().filter(|s| s.acked).count() as u64,
        unique_events: expected.payments.len() as u64,
        duplicates_sent: report::DuplicatesSent {
            resend: verify::count_kind(log, Kind::Resend),
            redrive: verify::count_kind(log, Kind::Redrive),
            double_tap: verify::count_kind(log, Kind::DoubleTap),
        },
        poison_sent: expected.poison,
        effects: verdict.effects,
        lost: verdict.lost.len() as u64,
        duplicated: verdict.duplicated.len() as u64,
        unexpected: verdict.unexpected.len() as u64,
        parked: verdict.parked,
        wallet_mismatches: verdict.wallet_mismatches.len() as u64,
        throughput_msg_s: if span > 0.0 {
            latencies.len() as f64 / span
        } else {
            0.0
        },
        commit_span_s: span,
        latency_ms: report::Latency {
            p50: pct(&hist, 0.5),
            p90: pct(&hist, 0.9),
            p99: pct(&hist, 0.99),
            p999: pct(&hist, 0.999),
            max: hist.max() as f64 / 1000.0,
        },
        clock_step_s: 0.0,
        verified: verdict.verified,
        anomalies: report::Anomalies {
            lost: first20(&verdict.lost),
            duplicated: first20(&verdict.duplicated),
            unexpected: first20(&verdict.unexpected),
            wallets: first20(&verdict.wallet_mismatches),
            parked_not_poison: first20(&verdict.parked_not_poison),
        },
        partitions: Vec::new(),
        series: report::Series {
            latency: latency_series,
            histogram: report::histogram_buckets(&ms),
            throughput,
            produced,
            lag,
        },
    }
}

/// Microseconds from 1 µs to an hour, 3 significant digits. Fixed bounds: an auto-resizing
/// histogram's `saturating_record` saturates at its initial tiny bound instead of growing.
fn latency_histogram() -> hdrhistogram::Histogram<u64> {
    hdrhistogram::Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds")
}

/// Consumer lag: the partitions' high watermarks minus the offsets stored in PostgreSQL.
#[derive(Clone)]
struct LagWatcher {
    client: Arc<BaseConsumer>,
    topic: String,
    partitions: i32,
}

impl LagWatcher {
    fn new(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<Self> {
        let client: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .create()
            .context("creating the lag watcher")?;
        Ok(LagWatcher {
            client: Arc::new(client),
            topic: topic.to_string(),
            partitions,
        })
    }

    /// Each partition's high watermark: where the next record will go.
    async fn highs(&self) -> anyhow::Result<Vec<i64>> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<i64>> {
            (0..me.partitions)
                .map(|p| {
                    Ok(me
                        .client
                        .fetch_watermarks(&me.topic, p, Duration::from_secs(5))?
                        .1)
                })
                .collect()
        })
        .await?
    }

    async fn lag(&self, db: &tokio_postgres::Client, consumer: &str) -> anyhow::Result<i64> {
        let me = self.clone();
        let marks = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<(i64, i64)>> {
            (0..me.partitions)
                .map(|p| {
                    Ok(me
                        .client
                        .fetch_watermarks(&me.topic, p, Duration::from_secs(5))?)
                })
                .collect()
        })
        .await??;
        let rows = db
            .query(
                "SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $2",
                &[&consumer, &self.topic],
            )
            .await?;
        let stored: std::collections::HashMap<i32, i64> = rows
            .iter()
            .filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get::<_, i32>(0), o)))
            .collect();
        Ok(marks
            .iter()
            .enumerate()
            .map(|(p, (low, high))| {
                high - stored.get(&(p as i32)).copied().unwrap_or(*low).max(*low)
            })
            .sum())
    }
}

/// The topic a new producer's first record goes to, so that the measured run does not wait for
/// the producer's own start.
pub(crate) const WARM_UP_TOPIC: &str = "loadgen-warmup";

/// Waits until the producer can send at once: an idempotent producer holds every record until
/// it has its producer id (on a fresh broker the first one also waits for the transaction
/// coordinator to load: about a second), and the first record to a topic waits for its
/// metadata. Record timestamps are taken when loadgen produces, so without this the run's first
/// records would count the producer's start as the engine's latency. The warm-up record goes to
/// a topic of its own, which no consumer of a run reads.
async fn warm_up(brokers: &str, producer: &FutureProducer, topic: &str) -> anyhow::Result<()> {
    ensure_topic(brokers, WARM_UP_TOPIC, 1).await?;
    producer
        .send(
            FutureRecord::<(), [u8]>::to(WARM_UP_TOPIC).payload(b"warm-up"),
            Duration::from_secs(30),
        )
        .await
        .map_err(|(e, _)| anyhow::anyhow!("warming the producer up: {e}"))?;
    let (producer, topic) = (producer.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        producer
            .client()
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .map(drop)
    })
    .await?
    .context("fetching the topic's metadata")?;
    Ok(())
}

async fn ensure_topic(brokers: &str, topic: &str, partitions: i32) -> anyhow::Result<()> {
    create_topic(brokers, topic, partitions, 1).await
}

/// Creates `topic` with `partitions` and `replication` replicas of each, unless it exists.
pub(crate) async fn create_topic(
    brokers: &str,
    topic: &str,
    partitions: i32,
    replication: i32,
) -> anyhow::Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let results = admin
        .create_topics(
            &[NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(replication),
            )],
            &AdminOptions::new(),
        )
        .await?;
    for r in results {
        match r {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => anyhow::bail!("creating topic {t}: {e}"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wall_clock_ahead_of_the_monotonic_one_is_a_step() {
        let (wall, mono) = (chrono::Utc::now(), Instant::now());
        assert_eq!(clock_step(wall, mono).to_string(), "0");
        let stepped = wall - chrono::Duration::seconds(58);
        assert_eq!(clock_step(stepped, mono), 58.0);
    }
}
