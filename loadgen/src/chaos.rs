//! `loadgen chaos` (`make chaos`): exactly-once is a claim about failures, so inject them.
//!
//! Each scenario runs real worker processes of the engine (built with the `failpoints`
//! feature) against the local Kafka and PostgreSQL while loadgen produces, injects its fault,
//! then lets the engine drain and checks the ledger with loadgen's verifier (lost, duplicated,
//! unexpected, parked = poison), plus "Kafka's committed offset <= PostgreSQL's stored offset"
//! sampled throughout. Scenarios are seeded: `--seed` replays one. Results go to
//! `target/chaos/report.json`; the exit status is non-zero if any scenario fails.
//!
//! `--strategy inbox` runs the workers with `strategy = "inbox"`: the receiver stores each
//! message in the `inbox` table and moves the offset at once, processors apply the effects
//! later. The verifier then also waits for the consumer's inbox to have no PENDING or
//! IN_PROGRESS row, and counts its FAILED rows as parked. `inbox-burst` runs only under it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;

use crate::produce::{Mix, Step};
use crate::{finish_stage, produce_stage, Session, Spec};

#[derive(Debug, clap::Args)]
pub struct ChaosArgs {
    #[command(flatten)]
    services: crate::Services,
    /// The engine's binary, built with `--features failpoints` (default: next to this one).
    #[arg(long)]
    effectively: Option<PathBuf>,
    /// Run only these scenarios (repeatable); default all.
    #[arg(long = "scenario")]
    scenarios: Vec<String>,
    /// The short subset `make test` runs.
    #[arg(long)]
    quick: bool,
    /// Replay with this seed (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// The workers' strategy: `batch`, or `inbox` (store first, process later).
    #[arg(long, value_enum, default_value_t = StrategyArg::Batch)]
    strategy: StrategyArg,
    /// With `--strategy inbox`: how processors claim rows (`lease`: a 10 s lease).
    #[arg(long, value_enum, default_value_t = ClaimArg::Lock)]
    inbox_claim: ClaimArg,
    /// With `--strategy batch`: commit groups (`batch.group_partitions = true`), several
    /// partitions' batches in one transaction.
    #[arg(long)]
    group_partitions: bool,
    /// Distinct users (the records' keys, and the inbox's ordering keys) of every scenario;
    /// default 200, and 10,000 for inbox-burst (10 payments each).
    #[arg(long)]
    users: Option<u64>,
    #[arg(long, default_value = "target/chaos")]
    out: PathBuf,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StrategyArg {
    Batch,
    Inbox,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ClaimArg {
    Lock,
    Lease,
}

impl ChaosArgs {
    fn inbox(&self) -> bool {
        self.strategy == StrategyArg::Inbox
    }

    /// `batch`, `inbox` or `inbox-lease`: in the report, its file name and the topics' names.
    fn label(&self) -> &'static str {
        match (self.strategy, self.inbox_claim) {
            (StrategyArg::Batch, _) if self.group_partitions => "batch-grouped",
            (StrategyArg::Batch, _) => "batch",
            (StrategyArg::Inbox, ClaimArg::Lock) => "inbox",
            (StrategyArg::Inbox, ClaimArg::Lease) => "inbox-lease",
        }
    }
}

/// One scenario's result, as `report.json` lists it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScenarioResult {
    pub name: String,
    /// The workers' strategy: `batch`, `inbox`, or `inbox-lease` (`--inbox-claim lease`).
    pub strategy: String,
    pub seed: u64,
    pub sent: u64,
    pub acked: u64,
    pub effects: u64,
    pub lost: u64,
    pub duplicated: u64,
    pub unexpected: u64,
    pub parked: u64,
    /// Samples where Kafka's committed offset was ahead of PostgreSQL's.
    pub kafka_ahead: u64,
    pub passed: bool,
    pub note: String,
}

const ALL: &[&str] = &[
    "hard-bounce",
    "clean-bounce",
    "rebalance-storm",
    "zombie",
    "postgres-crash",
    "postgres-unreachable",
    "broker-crash",
    "pool-exhaustion",
    "poison-storm",
    "offsets-reset",
    "inbox-burst",
];
const QUICK: &[&str] = &["hard-bounce", "poison-storm"];

/// Why `name` does not apply to the strategy of `args` (it is skipped), if it does not.
fn not_applicable(name: &str, args: &ChaosArgs) -> Option<&'static str> {
    match name {
        "inbox-burst" if !args.inbox() => Some("only under --strategy inbox"),
        _ => None,
    }
}

pub async fn run(args: ChaosArgs) -> anyhow::Result<bool> {
    anyhow::ensure!(
        !(args.group_partitions && args.inbox()),
        "--group-partitions works with --strategy batch only"
    );
    let bin = Worker::binary(args.effectively.as_deref())?;
    std::fs::create_dir_all(&args.out)?;
    let explicit = !args.scenarios.is_empty();
    let names: Vec<&str> = if explicit {
        args.scenarios.iter().map(String::as_str).collect()
    } else if args.quick {
        QUICK.to_vec()
    } else {
        ALL.to_vec()
    };
    for name in &names {
        anyhow::ensure!(
            ALL.contains(name),
            "unknown scenario {name:?}; known: {ALL:?}"
        );
    }
    let mut results = Vec::new();
    let mut skipped = Vec::new();
    for name in names {
        if let Some(why) = not_applicable(name, &args) {
            // Named on the command line: say so. Left out of the default list: quietly.
            if explicit {
                eprintln!(
                    "== {name}: skipped under --strategy {}: {why}",
                    args.label()
                );
            }
            skipped.push(name);
            continue;
        }
        let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
        eprintln!("== {name} [{}] (seed {seed})", args.label());
        let r = match scenario(&bin, &args, name, seed).await {
            Ok(r) => r,
            Err(e) => ScenarioResult {
                name: name.into(),
                strategy: args.label().into(),
                seed,
                note: format!("harness error: {e:#}"),
                ..ScenarioResult::default()
            },
        };
        eprintln!(
            "   {}: sent {} acked {} effects {} lost {} duplicated {} unexpected {} parked {} kafka-ahead {} {}",
            if r.passed { "PASS" } else { "FAIL" },
            r.sent, r.acked, r.effects, r.lost, r.duplicated, r.unexpected, r.parked, r.kafka_ahead, r.note
        );
        results.push(r);
    }
    // One report per strategy, so that `make chaos` keeps both runs.
    let path = args.out.join(match args.label() {
        "batch" => "report.json".to_string(),
        other => format!("report-{other}.json"),
    });
    std::fs::write(&path, serde_json::to_string_pretty(&results)? + "\n")?;
    let passed = results.iter().filter(|r| r.passed).count();
    let skipped = if skipped.is_empty() {
        String::new()
    } else {
        format!(
            ", {} skipped ({}: not under --strategy {})",
            skipped.len(),
            skipped.join(", "),
            args.label()
        )
    };
    println!(
        "chaos [{}]: {passed} passed, {} failed{skipped}",
        args.label(),
        results.len() - passed
    );
    eprintln!("report: {}", path.display());
    Ok(passed == results.len())
}

/// A worker process.
pub(crate) struct Proc {
    child: tokio::process::Child,
}

impl Proc {
    fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            let _ = std::process::Command::new("kill")
                .args([&format!("-{sig}"), &pid.to_string()])
                .status();
        }
    }

    pub(crate) async fn stop(mut self) -> anyhow::Result<()> {
        self.signal("TERM");
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .context("the worker did not exit within 60 s of SIGTERM")??;
        anyhow::ensure!(
            status.success(),
            "worker exited with {status:?} after SIGTERM"
        );
        Ok(())
    }

    pub(crate) async fn kill(mut self) {
        self.signal("KILL");
        let _ = self.child.wait().await;
    }

    /// Waits for the process to die on its own (a failpoint), up to `secs`.
    pub(crate) async fn exited(&mut self, secs: u64) -> bool {
        tokio::time::timeout(Duration::from_secs(secs), self.child.wait())
            .await
            .is_ok()
    }
}

/// What a scenario shares: names, config, the worker binary.
struct Env<'a> {
    bin: &'a Path,
    args: &'a ChaosArgs,
    name: String,
    config: PathBuf,
    database_url: String,
    workers: u32,
}

impl Env<'_> {
    fn start(&mut self, failpoints: Option<&str>) -> anyhow::Result<Proc> {
        let config = self.config.clone();
        self.start_with(&config, failpoints)
    }

    /// The worker id the next [`Env::start`] gives its process.
    fn next_id(&self) -> String {
        format!("{}-w{}", self.name, self.workers + 1)
    }

    fn start_with(&mut self, config: &Path, failpoints: Option<&str>) -> anyhow::Result<Proc> {
        self.workers += 1;
        let id = format!("{}-w{}", self.name, self.workers);
        let worker = Worker {
            bin: self.bin,
            brokers: &self.args.services.brokers,
            database_url: &self.database_url,
        };
        worker.start(
            config,
            &id,
            &self.args.out.join(format!("{id}.log")),
            failpoints,
        )
    }
}

/// How to start worker processes of the engine: its binary and the stack they connect to.
pub(crate) struct Worker<'a> {
    pub bin: &'a Path,
    pub brokers: &'a str,
    pub database_url: &'a str,
}

impl Worker<'_> {
    /// The engine's binary: `explicit`, or the one next to this one.
    pub(crate) fn binary(explicit: Option<&Path>) -> anyhow::Result<PathBuf> {
        Ok(match explicit {
            Some(p) => p.to_path_buf(),
            None => std::env::current_exe()?.with_file_name("effectively"),
        })
    }

    /// `effectively run --config <config>` as worker `id` (its stderr in `log`), with these
    /// failpoints armed if any.
    pub(crate) fn start(
        &self,
        config: &Path,
        id: &str,
        log: &Path,
        failpoints: Option<&str>,
    ) -> anyhow::Result<Proc> {
        let log = std::fs::File::create(log)?;
        let mut cmd = tokio::process::Command::new(self.bin);
        cmd.args(["run", "--metrics-addr", "off", "--config"])
            .arg(config)
            .env("KAFKA_BROKERS", self.brokers)
            .env("DATABASE_URL", self.database_url)
            .env("EFFECTIVELY_WORKER_ID", id)
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true);
        if let Some(f) = failpoints {
            cmd.env("FAILPOINTS", f);
        }
        Ok(Proc {
            child: cmd
                .spawn()
                .with_context(|| format!("starting {}", self.bin.display()))?,
        })
    }
}

/// Samples Kafka's committed offsets against PostgreSQL's stored ones until stopped.
fn sample_offsets(
    args: &ChaosArgs,
    name: &str,
    partitions: i32,
    stop: Arc<AtomicU64>,
    ahead: Arc<AtomicU64>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let observer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.services.brokers)
        .set("group.id", name)
        .create()?;
    let observer = Arc::new(observer);
    let (url, name) = (args.services.database_url.clone(), name.to_string());
    Ok(tokio::spawn(async move {
        let db = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            Ok((db, conn)) => {
                tokio::spawn(conn);
                db
            }
            Err(_) => return,
        };
        while stop.load(Relaxed) == 0 {
            if let Some(n) = partitions_ahead(&observer, &db, &name, partitions).await {
                ahead.fetch_add(n, Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }))
}

/// One sample: on how many partitions of consumer (and group, and topic) `name` Kafka's
/// committed offset is ahead of the offset stored in PostgreSQL (None: either did not answer).
pub(crate) async fn partitions_ahead(
    observer: &Arc<BaseConsumer>,
    db: &tokio_postgres::Client,
    name: &str,
    partitions: i32,
) -> Option<u64> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(name, p);
    }
    let o = Arc::clone(observer);
    let committed =
        tokio::task::spawn_blocking(move || o.committed_offsets(tpl, Duration::from_secs(3))).await;
    let (Ok(Ok(committed)), Ok(rows)) = (
        committed,
        db.query("SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $1", &[&name]).await,
    ) else {
        return None;
    };
    let stored: HashMap<i32, i64> = rows
        .iter()
        .filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get(0), o)))
        .collect();
    let ahead = committed
        .elements()
        .iter()
        .filter(|e| match e.offset() {
            Offset::Offset(k) => k > stored.get(&e.partition()).copied().unwrap_or(0),
            _ => false,
        })
        .count();
    Some(ahead as u64)
}

/// Makes sure `scripts/stack.sh` (with the `STACK_DIR` this process inherited) manages the
/// Kafka and PostgreSQL this run uses, before a scenario crashes one of them: a run against
/// another stack must not crash the default one under `.stack/`.
async fn check_stack(args: &ChaosArgs) -> anyhow::Result<()> {
    let out = tokio::process::Command::new("scripts/stack.sh")
        .arg("env")
        .stderr(Stdio::null())
        .output()
        .await?;
    let env = String::from_utf8_lossy(&out.stdout);
    let var = |name: &str| {
        env.lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .map(str::to_string)
    };
    let dir = std::env::var("STACK_DIR").unwrap_or_else(|_| ".stack".into());
    anyhow::ensure!(
        out.status.success()
            && var("KAFKA_BROKERS").as_deref() == Some(args.services.brokers.as_str())
            && var("DATABASE_URL").as_deref() == Some(args.services.database_url.as_str()),
        "this scenario crashes and restarts services with scripts/stack.sh, whose stack \
         (STACK_DIR={dir}) is not the one this run uses (KAFKA_BROKERS={}): set STACK_DIR to \
         the stack's folder and source its env file",
        args.services.brokers
    );
    Ok(())
}

async fn stack(cmd: &str) -> anyhow::Result<()> {
    let status = tokio::process::Command::new("scripts/stack.sh")
        .arg(cmd)
        .stdout(Stdio::null())
        .status()
        .await?;
    anyhow::ensure!(status.success(), "scripts/stack.sh {cmd} failed");
    Ok(())
}

/// The worker-wide part of a worker config, before its `[[consumer]]`: a short session timeout
/// (6 s) and revoke deadline (3 s), so that a killed worker's partitions move on quickly.
pub(crate) fn worker_settings(pool_size: usize) -> String {
    format!(
        "[kafka]\nsession_timeout = \"6s\"\n[kafka.options]\n\"heartbeat.interval.ms\" = \"500\"\n\
         [database]\npool_size = {pool_size}\nidle_in_transaction_timeout = \"5s\"\n\
         [worker]\nrevoke_deadline = \"3s\"\n"
    )
}

/// The worker config of a scenario: `processors` only matters under `--strategy inbox`.
fn worker_config(args: &ChaosArgs, topic: &str, pool_size: usize, processors: usize) -> String {
    consumer_config(
        topic,
        pool_size,
        processors,
        args.strategy,
        args.inbox_claim,
        args.group_partitions,
    )
}

/// A worker config with one cashback consumer named `topic` reading `topic`, of `strategy`
/// (`processors` and `claim` only matter for the inbox, `grouped` for the batch strategy).
pub(crate) fn consumer_config(
    topic: &str,
    pool_size: usize,
    processors: usize,
    strategy: StrategyArg,
    claim: ClaimArg,
    grouped: bool,
) -> String {
    let mut text = worker_settings(pool_size);
    let group = if grouped {
        ", group_partitions = true"
    } else {
        ""
    };
    text.push_str(&format!(
        "[[consumer]]\nname = \"{topic}\"\ntopics = [\"{topic}\"]\nhandler = {{ kind = \"cashback\" }}\n\
         batch = {{ max_messages = 200{group} }}\nretry = {{ initial_backoff = \"50ms\", max_backoff = \"1s\" }}\n"
    ));
    if strategy == StrategyArg::Inbox {
        text.push_str(&format!(
            "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = {processors}\n"
        ));
        if claim == ClaimArg::Lease {
            // Short enough that a killed or stopped processor's rows come back within the
            // drain timeout; far longer than a round of the cashback handler.
            text.push_str("claim = \"lease\"\nlease = \"10s\"\n");
        }
    }
    text
}

/// Payments `inbox-burst` produces, as fast as the broker acknowledges them.
const BURST: u64 = 100_000;

async fn scenario(
    bin: &Path,
    args: &ChaosArgs,
    name: &str,
    seed: u64,
) -> anyhow::Result<ScenarioResult> {
    if matches!(name, "postgres-crash" | "broker-crash") {
        check_stack(args).await?;
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
    let pause = |s: u64| tokio::time::sleep(Duration::from_millis(s));

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
                        let backlog = db.open(&topic).await?;
                        block.release().await?;
                        pause(rng.u64(30..300)).await;
                        let before = db.open(&topic).await?;
                        w.kill().await;
                        let (open, leased) =
                            (db.open(&topic).await?, db.in_progress(&topic).await?);
                        note = format!(
                            "3 failpoint deaths in the receiver, processors blocked meanwhile \
                             ({backlog} rows waiting); SIGKILL while draining them ({before} \
                             open before the kill, {open} after, {leased} IN_PROGRESS)"
                        );
                    }
                    live.push(env.start(None)?);
                }
                "clean-bounce" => {
                    let mut equal = 0;
                    for _ in 0..3 {
                        let w = env.start(None)?;
                        pause(rng.u64(1500..3500)).await;
                        w.stop().await?;
                        // A clean stop commits to Kafka exactly what PostgreSQL stored.
                        if offsets_equal(args, &topic, partitions).await? {
                            equal += 1;
                        }
                    }
                    clean_ok = equal == 3;
                    note = format!(
                        "stopped cleanly 3 times; Kafka offset = stored offset after {equal} of 3"
                    );
                    live.push(env.start(None)?);
                }
                "rebalance-storm" => {
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
                }
                "zombie" => {
                    let w1 = env.start(None)?;
                    pause(2000).await;
                    let w2 = env.start(None)?;
                    pause(2000).await;
                    // Longer than the session timeout (6 s): the group moves w1's partitions.
                    w1.signal("STOP");
                    pause(10_000).await;
                    w1.signal("CONT");
                    note = "w1 stopped 10 s (session timeout 6 s), then resumed".into();
                    live.extend([w1, w2]);
                }
                "postgres-crash" => {
                    live.push(env.start(None)?);
                    for _ in 0..2 {
                        pause(rng.u64(2000..4000)).await;
                        stack("pg-crash").await?;
                        pause(3000).await;
                        stack("up").await?;
                    }
                }
                "postgres-unreachable" => {
                    live.push(env.start(None)?);
                    let proxy = proxy.as_ref().expect("started above");
                    pause(rng.u64(2000..4000)).await;
                    // Longer than the pool's connect timeout (5 s): established connections
                    // are cut and new ones refused, then it comes back.
                    proxy.cut(true);
                    pause(8000).await;
                    proxy.cut(false);
                    note = "connections cut and refused for 8 s".into();
                }
                "broker-crash" => {
                    live.push(env.start(None)?);
                    pause(rng.u64(2000..4000)).await;
                    stack("kafka-crash").await?;
                    pause(2000).await;
                    stack("up").await?;
                }
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
    let sent = produced.log.len() as u64;
    let acked = produced.acked();
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
        let failed = Db::connect(&args.services.database_url)
            .await?
            .failed(&topic)
            .await?;
        let sep = if note.is_empty() { "" } else { "; " };
        note = format!(
            "{note}{sep}parked = {} dead letters + {failed} FAILED inbox rows",
            report.parked.saturating_sub(failed)
        );
    }
    Ok(ScenarioResult {
        name: name.into(),
        strategy: args.label().into(),
        seed,
        sent,
        acked,
        effects: report.effects,
        lost: report.lost,
        duplicated: report.duplicated,
        unexpected: report.unexpected,
        parked: report.parked,
        kafka_ahead,
        passed: report.verified && kafka_ahead == 0 && extra_ok && clean_ok,
        note,
    })
}

/// `inbox-burst`: `BURST` payments (and their duplicates and poison) as fast as the broker
/// takes them, into an inbox consumer whose processors lag: a worker with no processors
/// (`processors = 0`) receives everything, so Kafka's offsets must move at insert speed with
/// nothing applied. It stops cleanly (Kafka's committed offsets must then equal PostgreSQL's),
/// and a worker with `processors` processors drains the inbox. Returns what was produced, the
/// live worker, the note with the ingest and drain rates, and whether the burst's own checks
/// held.
async fn inbox_burst(
    env: &mut Env<'_>,
    session: &Session,
    spec: &Spec,
    receiver_config: &Path,
    processors: usize,
) -> anyhow::Result<(crate::Produced, Vec<Proc>, String, bool)> {
    let args = env.args;
    let topic = spec.topic.as_str();
    let (db, conn) =
        tokio_postgres::connect(&args.services.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    // 1. The receiver owns every partition before the burst.
    let owner = env.next_id();
    let receiver = env.start_with(receiver_config, None)?;
    let claimed = async {
        loop {
            let n: i64 = db
                .query_one(
                    "SELECT count(*) FROM consumer_offsets
                     WHERE consumer = $1 AND topic = $1 AND owner = $2",
                    &[&topic, &owner],
                )
                .await?
                .get(0);
            if n >= i64::from(spec.partitions) {
                return Ok::<_, anyhow::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), claimed)
        .await
        .context("the receiver did not claim every partition within 60 s")??;

    // 2. The burst; the receiver stores while it comes.
    let t0 = std::time::Instant::now();
    let produced = produce_stage(session, spec).await?;
    let acked = produced.acked();
    let produce_s = produced.duration_s;
    let ingested = loop {
        match session.watcher.lag(&session.db, topic).await {
            Ok(0) => break true,
            _ if t0.elapsed() > spec.drain_timeout => break false,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let ingest_s = t0.elapsed().as_secs_f64();
    anyhow::ensure!(
        ingested,
        "the receiver did not store the burst within {:?}",
        spec.drain_timeout
    );
    let peak_lag = produced
        .lag
        .lock()
        .unwrap()
        .iter()
        .map(|p| p.lag)
        .max()
        .unwrap_or(0);
    // Server side: rows stored, over the span of their transactions' start times.
    let row = db
        .query_one(
            "SELECT count(*),
                    coalesce(extract(epoch FROM max(received_at) - min(received_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&topic],
        )
        .await?;
    let (rows, store_span): (i64, f64) = (row.get(0), row.get(1));
    let effects_before = verify_effects(&args.services.database_url, topic).await?;
    let open_before = crate::verify::inbox_open(&db, topic).await?;
    // 3. A clean stop commits to Kafka exactly what PostgreSQL stored.
    receiver.stop().await?;
    let equal = offsets_equal(args, topic, spec.partitions).await?;

    // 4. A worker with processors drains the inbox.
    let t1 = std::time::Instant::now();
    let worker = env.start(None)?;
    // A drain that makes no progress for STALL is stalled: the scenario fails, with the
    // claim queries PostgreSQL was running at that moment in the note.
    const STALL: Duration = Duration::from_secs(60);
    let mut stalled: Option<String> = None;
    let (mut least, mut progress_at) = (i64::MAX, std::time::Instant::now());
    let drained = loop {
        match crate::verify::inbox_open(&db, topic).await {
            Ok(0) => break true,
            Ok(n) if n < least => (least, progress_at) = (n, std::time::Instant::now()),
            Ok(n) if progress_at.elapsed() > STALL => {
                stalled = Some(format!(
                    "drain STALLED: {n} rows open and none done for {} s ({}); ",
                    STALL.as_secs(),
                    slow_claims(&db).await?
                ));
                break false;
            }
            _ => {}
        }
        if t1.elapsed() > spec.drain_timeout {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drain_s = t1.elapsed().as_secs_f64();
    let left = crate::verify::inbox_open(&db, topic).await.unwrap_or(0);
    let row = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'DONE'),
                    count(*) FILTER (WHERE status = 'FAILED'),
                    coalesce(extract(epoch FROM max(done_at) - min(done_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&topic],
        )
        .await?;
    let (done, failed, done_span): (i64, i64, f64) = (row.get(0), row.get(1), row.get(2));
    let rate = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
    let note = format!(
        "ingest (0 processors): {acked} records acked in {produce_s:.1} s ({:.0}/s), all \
         stored {ingest_s:.1} s after producing began: {:.0} records/s ({rows} rows, {:.0} rows/s by \
         received_at), peak lag {peak_lag}; {open_before} rows open and {effects_before} \
         effects; Kafka offset = stored offset after a clean stop: {equal}. drain \
         ({processors} processors): {}{} rows in {:.1} s: {:.0} rows/s ({:.0} \
         rows/s by done_at){}, {failed} FAILED",
        rate(acked as f64, produce_s),
        rate(acked as f64, ingest_s),
        rate(rows as f64, store_span),
        stalled.as_deref().unwrap_or(""),
        open_before - left,
        drain_s,
        rate((open_before - left) as f64, drain_s),
        rate(done as f64, done_span),
        if drained {
            String::new()
        } else {
            format!(" NOT DRAINED ({left} rows open)")
        },
    );
    let ok = drained && stalled.is_none() && equal && effects_before == 0 && open_before == rows;
    Ok((produced, vec![worker], note, ok))
}

/// What a stalled drain's processors are doing: the inbox claims running for more than 10 s.
async fn slow_claims(db: &tokio_postgres::Client) -> anyhow::Result<String> {
    let rows = db
        .query(
            "SELECT extract(epoch FROM now() - query_start)::int, left(query, 40)
             FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
               AND now() - query_start > interval '10 seconds'",
            &[],
        )
        .await?;
    if rows.is_empty() {
        return Ok("no query running for more than 10 s".into());
    }
    let each: Vec<String> = rows
        .iter()
        .map(|r| format!("{} s: {:?}", r.get::<_, i32>(0), r.get::<_, String>(1)))
        .collect();
    Ok(format!("queries running: {}", each.join(", ")))
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

/// A connection for a scenario's own checks of the inbox.
pub(crate) struct Db(tokio_postgres::Client);

impl Db {
    pub(crate) async fn connect(url: &str) -> anyhow::Result<Db> {
        let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(conn);
        Ok(Db(db))
    }

    async fn count(&self, consumer: &str, statuses: &[&str]) -> anyhow::Result<u64> {
        let n: i64 = self
            .0
            .query_one(
                "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = ANY($2)",
                &[&consumer, &statuses],
            )
            .await?
            .get(0);
        Ok(n as u64)
    }

    /// Rows processors have yet to finish.
    async fn open(&self, consumer: &str) -> anyhow::Result<u64> {
        Ok(crate::verify::inbox_open(&self.0, consumer).await? as u64)
    }

    /// Rows leased by a processor (`claim = "lease"`).
    async fn in_progress(&self, consumer: &str) -> anyhow::Result<u64> {
        self.count(consumer, &["IN_PROGRESS"]).await
    }

    /// Parked rows (the verifier counts them with the dead letters).
    pub(crate) async fn failed(&self, consumer: &str) -> anyhow::Result<u64> {
        self.count(consumer, &["FAILED"]).await
    }
}

async fn verify_effects(url: &str, consumer: &str) -> anyhow::Result<u64> {
    let (db, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let n: i64 = db
        .query_one(
            "SELECT count(*) FROM cashback_credits WHERE consumer = $1",
            &[&consumer],
        )
        .await?
        .get(0);
    Ok(n as u64)
}

/// Whether Kafka's committed offset equals PostgreSQL's stored one on every partition.
async fn offsets_equal(args: &ChaosArgs, topic: &str, partitions: i32) -> anyhow::Result<bool> {
    let observer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.services.brokers)
        .set("group.id", topic)
        .create()?;
    let mut tpl = TopicPartitionList::new();
    for p in 0..partitions {
        tpl.add_partition(topic, p);
    }
    let committed = tokio::task::spawn_blocking(move || {
        observer.committed_offsets(tpl, Duration::from_secs(5))
    })
    .await??;
    let (db, conn) =
        tokio_postgres::connect(&args.services.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    let rows = db
        .query(
            "SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $1",
            &[&topic],
        )
        .await?;
    let stored: HashMap<i32, i64> = rows
        .iter()
        .filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get(0), o)))
        .collect();
    Ok(committed.elements().iter().all(|e| match e.offset() {
        Offset::Offset(k) => stored.get(&e.partition()) == Some(&k),
        _ => !stored.contains_key(&e.partition()),
    }))
}

/// A TCP proxy in front of PostgreSQL that can cut every connection and refuse new ones.
struct Proxy {
    url: String,
    cut: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Proxy {
    async fn start(database_url: &str) -> anyhow::Result<Proxy> {
        let cfg: tokio_postgres::Config = database_url.parse()?;
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        let upstream = format!("127.0.0.1:{port}");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let local = listener.local_addr()?;
        let url = database_url.replacen(&format!(":{port}/"), &format!(":{}/", local.port()), 1);
        anyhow::ensure!(
            url != database_url,
            "cannot point {database_url:?} at the proxy"
        );
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if *rx.borrow() {
                    drop(client); // refused: closed at once
                    continue;
                }
                let upstream = upstream.clone();
                let mut cut = rx.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (mut c, mut s) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut c, &mut s) => {}
                        // Dropping both ends cuts the connection.
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Ok(Proxy {
            url,
            cut: Arc::new(tx),
        })
    }

    fn cut(&self, on: bool) {
        let _ = self.cut.send(on);
    }
}
