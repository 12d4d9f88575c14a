//! `loadgen chaos` (`make chaos`): exactly-once is a claim about failures, so inject them.
//!
//! Each scenario runs real worker processes of the engine (built with the `failpoints`
//! feature) against the local Kafka and PostgreSQL while loadgen produces, injects its fault,
//! then lets the engine drain and checks the ledger with loadgen's verifier (lost, duplicated,
//! unexpected, parked = poison), plus "Kafka's committed offset <= PostgreSQL's stored offset"
//! sampled throughout. Scenarios are seeded: `--seed` replays one. Results go to
//! `target/chaos/report.json`; the exit status is non-zero if any scenario fails.

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
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    #[arg(
        long,
        env = "DATABASE_URL",
        hide_env_values = true,
        default_value = "postgres://postgres@127.0.0.1:5432/effectively"
    )]
    database_url: String,
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
    #[arg(long, default_value = "target/chaos")]
    out: PathBuf,
}

/// One scenario's result, as `report.json` lists it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ScenarioResult {
    pub name: String,
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
];
const QUICK: &[&str] = &["hard-bounce", "poison-storm"];

pub async fn run(args: ChaosArgs) -> anyhow::Result<bool> {
    let bin = match &args.effectively {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("effectively"),
    };
    std::fs::create_dir_all(&args.out)?;
    let names: Vec<&str> = if !args.scenarios.is_empty() {
        args.scenarios.iter().map(String::as_str).collect()
    } else if args.quick {
        QUICK.to_vec()
    } else {
        ALL.to_vec()
    };
    let mut results = Vec::new();
    for name in names {
        anyhow::ensure!(
            ALL.contains(&name),
            "unknown scenario {name:?}; known: {ALL:?}"
        );
        let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
        eprintln!("== {name} (seed {seed})");
        let r = match scenario(&bin, &args, name, seed).await {
            Ok(r) => r,
            Err(e) => ScenarioResult {
                name: name.into(),
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
    let path = args.out.join("report.json");
    std::fs::write(&path, serde_json::to_string_pretty(&results)? + "\n")?;
    let passed = results.iter().filter(|r| r.passed).count();
    println!("chaos: {passed} passed, {} failed", results.len() - passed);
    eprintln!("report: {}", path.display());
    Ok(passed == results.len())
}

/// A worker process.
struct Proc {
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

    async fn stop(mut self) -> anyhow::Result<()> {
        self.signal("TERM");
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await??;
        anyhow::ensure!(
            status.success(),
            "worker exited with {status:?} after SIGTERM"
        );
        Ok(())
    }

    async fn kill(mut self) {
        self.signal("KILL");
        let _ = self.child.wait().await;
    }

    /// Waits for the process to die on its own (a failpoint), up to `secs`.
    async fn exited(&mut self, secs: u64) -> bool {
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
        self.workers += 1;
        let log = std::fs::File::create(
            self.args
                .out
                .join(format!("{}-w{}.log", self.name, self.workers)),
        )?;
        let mut cmd = tokio::process::Command::new(self.bin);
        cmd.args(["run", "--metrics-addr", "off", "--config"])
            .arg(&self.config)
            .env("KAFKA_BROKERS", &self.args.brokers)
            .env("DATABASE_URL", &self.database_url)
            .env(
                "EFFECTIVELY_WORKER_ID",
                format!("{}-w{}", self.name, self.workers),
            )
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
        .set("bootstrap.servers", &args.brokers)
        .set("group.id", name)
        .create()?;
    let observer = Arc::new(observer);
    let (url, name) = (args.database_url.clone(), name.to_string());
    Ok(tokio::spawn(async move {
        let db = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            Ok((db, conn)) => {
                tokio::spawn(conn);
                db
            }
            Err(_) => return,
        };
        while stop.load(Relaxed) == 0 {
            let mut tpl = TopicPartitionList::new();
            for p in 0..partitions {
                tpl.add_partition(&name, p);
            }
            let o = Arc::clone(&observer);
            let committed = tokio::task::spawn_blocking(move || {
                o.committed_offsets(tpl, Duration::from_secs(3))
            })
            .await;
            if let (Ok(Ok(committed)), Ok(rows)) = (
                committed,
                db.query("SELECT partition, next_offset FROM consumer_offsets WHERE consumer = $1 AND topic = $1", &[&name]).await,
            ) {
                let stored: HashMap<i32, i64> = rows.iter().filter_map(|r| r.get::<_, Option<i64>>(1).map(|o| (r.get(0), o))).collect();
                for e in committed.elements() {
                    if let Offset::Offset(k) = e.offset() {
                        if k > stored.get(&e.partition()).copied().unwrap_or(0) {
                            ahead.fetch_add(1, Relaxed);
                        }
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }))
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

async fn scenario(
    bin: &Path,
    args: &ChaosArgs,
    name: &str,
    seed: u64,
) -> anyhow::Result<ScenarioResult> {
    let mut rng = fastrand::Rng::with_seed(seed);
    let topic = format!("chaos-{name}-{:06x}", rng.u32(..0xffffff));
    let partitions = 3;
    let poison = if name == "poison-storm" { 0.05 } else { 0.002 };
    let pool_size = if name == "pool-exhaustion" { 2 } else { 8 };
    let config = args.out.join(format!("{topic}.toml"));
    std::fs::write(
        &config,
        format!(
            "[kafka]\nsession_timeout = \"6s\"\n[kafka.options]\n\"heartbeat.interval.ms\" = \"500\"\n\
             [database]\npool_size = {pool_size}\nidle_in_transaction_timeout = \"5s\"\n\
             [worker]\nrevoke_deadline = \"3s\"\n\
             [[consumer]]\nname = \"{topic}\"\ntopics = [\"{topic}\"]\nhandler = {{ kind = \"cashback\" }}\n\
             batch = {{ max_messages = 200 }}\nretry = {{ initial_backoff = \"50ms\", max_backoff = \"1s\" }}\n"
        ),
    )?;
    let seconds = if args.quick { 8 } else { 20 };
    let spec = Spec {
        brokers: args.brokers.clone(),
        database_url: args.database_url.clone(),
        topic: topic.clone(),
        partitions,
        consumer: topic.clone(),
        plan: vec![Step {
            rate: Some(500.0),
            duration: Duration::from_secs(seconds),
        }],
        limit: None,
        mix: Mix {
            resend: 0.10,
            redrive: 0.02,
            redrive_delay: Duration::from_secs(seconds / 2),
            double_tap: 0.01,
            poison,
        },
        users: 200,
        rate_bp: 200,
        drain_timeout: Duration::from_secs(120),
        report_dir: args.out.join(&topic),
        seed: Some(seed),
        quiet: true,
    };
    let session = Session::open(&spec).await?;
    // Workers reach PostgreSQL through a proxy the scenario can cut.
    let proxy = if name == "postgres-unreachable" {
        Some(Proxy::start(&args.database_url).await?)
    } else {
        None
    };
    let database_url = proxy
        .as_ref()
        .map_or(args.database_url.clone(), |p| p.url.clone());
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

    let (produced, faults) = tokio::join!(produce_stage(&session, &spec), async {
        let mut live: Vec<Proc> = Vec::new();
        match name {
            "hard-bounce" => {
                for fp in ["before_commit", "after_commit", "mid_copy"] {
                    let n = rng.u32(2..8);
                    let mut w = env.start(Some(&format!("{fp}={n}*off->return")))?;
                    let died = w.exited(30).await;
                    anyhow::ensure!(died, "the worker did not hit failpoint {fp} within 30 s");
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
                // Longer than the pool's connect timeout (5 s): established connections are
                // cut and new ones refused, then it comes back.
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
    let produced = produced?;
    let live = faults?;
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
                &args.brokers,
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
        let after = verify_effects(&args.database_url, &topic).await?;
        extra_ok = after == effects_before;
        note = format!("effects before reset {effects_before}, after restart {after}");
        if let Ok(r) = again {
            report = r;
        }
    } else {
        for w in live {
            w.stop().await?;
        }
    }
    stop.store(1, Relaxed);
    let _ = sampler.await;
    let kafka_ahead = ahead.load(Relaxed);
    Ok(ScenarioResult {
        name: name.into(),
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
        .set("bootstrap.servers", &args.brokers)
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
    let (db, conn) = tokio_postgres::connect(&args.database_url, tokio_postgres::NoTls).await?;
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
