//! The command line. `main.rs` only parses; everything here calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{Config, Strategy};
use crate::handler::Registry;
use crate::store;

mod control;
mod inbox;
mod parked;

pub use inbox::InboxAction;

#[derive(Debug, Parser)]
#[command(name = "effectively", version, about)]
pub struct Cli {
    /// Log format: human-readable text, or one JSON object per line for production.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum RetentionAction {
    /// Create partitions ahead and drop those past retention now (once; skipped if another
    /// instance holds the maintenance lock).
    Run {
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
    },
    /// Each partition with its date, estimated rows and size, and what the next run will do.
    Status {
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the configured consumers until SIGTERM or SIGINT.
    Run {
        /// The TOML config file (`KAFKA_BROKERS` and `DATABASE_URL` override it).
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
        /// Where to serve `/metrics`, `/healthz` and `/readyz`, or `off`. Default: the config's
        /// `worker.metrics_addr`, else 127.0.0.1:9464 (loopback unless configured).
        #[arg(long)]
        metrics_addr: Option<String>,
    },
    /// Publish the `outbox` table's rows to Kafka (the config's `[relay]`) until SIGTERM or
    /// SIGINT. Any number of relays may run against one database.
    Relay {
        /// The TOML config file (`KAFKA_BROKERS` and `DATABASE_URL` override it).
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
        /// Where to serve `/metrics`, `/healthz` and `/readyz`, or `off`. Default: the config's
        /// `worker.metrics_addr`, else 127.0.0.1:9474.
        #[arg(long)]
        metrics_addr: Option<String>,
        /// Relay this `[database.NAME]`'s outbox instead of `relay.database` (default:
        /// `[database]`). One relay process works one database.
        #[arg(long)]
        database: Option<String>,
    },
    /// Deliver the `notifications` table's intents to their providers (the config's `[sender]`)
    /// until SIGTERM or SIGINT, with idempotency keys. Any number of senders may run.
    Send {
        /// The TOML config file (`DATABASE_URL` overrides it).
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
        /// Where to serve `/metrics`, `/healthz` and `/readyz`, or `off`. Default: the config's
        /// `worker.metrics_addr`, else 127.0.0.1:9484.
        #[arg(long)]
        metrics_addr: Option<String>,
        /// Send this `[database.NAME]`'s notifications instead of `sender.database` (default:
        /// `[database]`). One sender process works one database.
        #[arg(long)]
        database: Option<String>,
    },
    /// Serve the web console (the config's `[console]`) until SIGTERM or SIGINT: lag, parked
    /// messages, the inbox, the outbox, notifications; redrive, replay and discard only with
    /// `writes = true`. Loopback unless a token is configured.
    Console {
        /// The TOML config file (`DATABASE_URL` and `KAFKA_BROKERS` override it).
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
        /// Where to listen (host:port), instead of `console.addr` (default 127.0.0.1:9470).
        #[arg(long)]
        addr: Option<std::net::SocketAddr>,
        /// Show this `[database.NAME]` and the consumers on it, instead of `console.database`
        /// (default: `[database]`). One console shows one database.
        #[arg(long)]
        database: Option<String>,
    },
    /// Apply the schema migrations that the database does not have yet: every database of
    /// `--config` (`[database]` and each `[database.NAME]`), or the one at `--database-url`.
    Migrate {
        /// Migrate every database this config file names, with its TLS settings (its
        /// variables override it as for `run`).
        #[arg(long, short)]
        config: Option<PathBuf>,
        /// PostgreSQL URL (the password, if any, is never printed), when there is no
        /// `--config`. TLS as libpq: `?sslmode=verify-full&sslrootcert=/path/ca.pem`.
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: Option<String>,
    },
    /// Load and validate a config file, and print what it configures.
    CheckConfig {
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
        /// Also connect: read the Kafka cluster's metadata and run a query on PostgreSQL, with
        /// the configured TLS and SASL settings; a failure says why and exits non-zero.
        #[arg(long)]
        connect: bool,
    },
    /// Print a complete, commented example config.
    ExampleConfig,
    /// Dedupe retention: daily partitions created ahead, dropped past retention.
    Retention {
        #[command(subcommand)]
        action: RetentionAction,
    },
    /// Parked messages (`dead_letters`): list, show, redrive, discard.
    DeadLetters {
        #[command(subcommand)]
        action: parked::DeadLetterAction,
    },
    /// A consumer's stored offsets beside Kafka's log (`show`), and moving them while workers
    /// run (`reset`: rewind to a time, an offset, the start or the end).
    Offsets {
        #[command(subcommand)]
        action: control::OffsetsAction,
    },
    /// Stop reading a consumer, one topic or one partition, without a restart or a rebalance:
    /// its partitions stay assigned, fetch nothing, and their lag grows. Survives restarts.
    Pause(control::PauseArgs),
    /// Read again what `pause` stopped (a resume of a consumer lifts its topics' and
    /// partitions' pauses too).
    Resume(control::PauseArgs),
    /// Set a consumer's rate at run time (messages a second per worker), or lift it.
    Throttle(control::ThrottleArgs),
    /// FAILED notifications: list, retry, discard.
    Notifications {
        #[command(subcommand)]
        action: parked::NotificationAction,
    },
    /// The inbox strategy's table: status, FAILED rows (list, show), replay, discard.
    Inbox {
        #[command(subcommand)]
        action: InboxAction,
    },
    /// Size the dedupe table: records = rate x period, bytes per row measured on the live table
    /// when it has rows (else the seed's 100 bytes).
    Size {
        /// Messages per second.
        #[arg(long)]
        rate: f64,
        /// Retention in days.
        #[arg(long, default_value_t = 15)]
        days: u64,
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Benchmark: dropping a daily partition against deleting its rows in batches (time and
    /// WAL). Prints one JSON object (used by `make bench`).
    #[command(hide = true)]
    BenchRetention {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[arg(long, default_value_t = 5_000_000)]
        keys: i64,
        #[arg(long, default_value_t = 10_000)]
        batch: i64,
        /// `compare` (fill two days, delete one, drop the other), or `prepare` / `drop` one
        /// day (`--date`), to drop it while a worker runs.
        #[arg(long, default_value = "compare")]
        mode: String,
        #[arg(long, default_value = "1999-01-03")]
        date: chrono::NaiveDate,
    },
    /// Benchmark: the batch transaction driven straight against PostgreSQL, no Kafka.
    /// Prints one JSON object (used by `make bench`).
    #[command(hide = true)]
    BenchCeiling {
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
        #[arg(long, default_value_t = 1)]
        connections: usize,
        #[arg(long, default_value_t = 100_000)]
        messages: usize,
        #[arg(long, default_value_t = 1_000)]
        batch: usize,
    },
}

/// Runs a parsed command line to completion.
pub fn main(cli: Cli) -> ExitCode {
    init_tracing(cli.log_format);
    // FAILPOINTS (only in builds with the `failpoints` feature: `make chaos`).
    let _failpoints = fail::FailScenario::setup();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run {
            config,
            metrics_addr,
        } => {
            let mut config = Config::load(&config)?;
            config.worker.metrics_addr =
                metrics_addr_of(metrics_addr, &config, crate::metrics::DEFAULT_ADDR)?;
            crate::worker::run(config, Registry::new(), shutdown_signal()).await?;
            Ok(())
        }
        Command::Relay {
            config,
            metrics_addr,
            database,
        } => {
            let mut config = Config::load(&config)?;
            let relay = config.relay.as_mut();
            let relay = relay.ok_or(crate::relay::RelayError::NotConfigured)?;
            relay.database = database.or(relay.database.take());
            let name = relay.database.clone();
            // The pool connects lazily: a wrong CA or host name must stop the start, not
            // repeat in the loop's retries.
            let db = config
                .database
                .get(name.as_deref())
                .map_err(anyhow::Error::msg)?;
            store::pool::connect_to(db).await?;
            let relay = crate::relay::Relay::new(&config)?;
            serve_metrics(
                metrics_addr,
                &config,
                crate::metrics::DEFAULT_RELAY_ADDR,
                relay.health(),
            )?;
            until_signal("outbox relay", |stop| relay.run(stop)).await
        }
        Command::Send {
            config,
            metrics_addr,
            database,
        } => {
            let mut config = Config::load(&config)?;
            let sender = config.sender.as_mut();
            let sender = sender.ok_or(crate::sender::SenderError::NotConfigured)?;
            sender.database = database.or(sender.database.take());
            let name = sender.database.clone();
            let db = config
                .database
                .get(name.as_deref())
                .map_err(anyhow::Error::msg)?;
            store::pool::connect_to(db).await?; // as for the relay
            let sender = crate::sender::Sender::new(&config)?;
            serve_metrics(
                metrics_addr,
                &config,
                crate::metrics::DEFAULT_SENDER_ADDR,
                sender.health(),
            )?;
            until_signal("notification sender", |stop| sender.run(stop)).await
        }
        Command::Console {
            config,
            addr,
            database,
        } => {
            let mut config = Config::load(&config)?;
            if database.is_some() {
                config.console.get_or_insert_with(Default::default).database = database;
                config.validate()?;
            }
            crate::console::serve(config, addr, shutdown_signal()).await?;
            Ok(())
        }
        Command::Migrate {
            config,
            database_url,
        } => {
            match (config, database_url) {
                (Some(path), _) => {
                    let config = Config::load(&path)?;
                    for (name, db) in config.database.iter() {
                        if !config.uses_database(name) {
                            println!(
                                "{name}: skipped, nothing of this config works on it (its \
                                 consumers, relay, sender and console are on other databases)"
                            );
                            continue;
                        }
                        let mut client = store::pool::connect_to(db).await?;
                        let applied = store::migrate::run(&mut client).await?;
                        print_migrated(&format!("{name} ({})", db.url), &applied.names);
                    }
                }
                (None, Some(url)) => {
                    let mut client = store::pool::connect(&url).await?;
                    let applied = store::migrate::run(&mut client).await?;
                    print_migrated(&store::pool::redact(&url), &applied.names);
                }
                (None, None) => anyhow::bail!(
                    "give --config FILE (every database it names) or --database-url URL \
                     (or DATABASE_URL)"
                ),
            }
            Ok(())
        }
        Command::CheckConfig {
            config: path,
            connect,
        } => {
            let config = Config::load(&path)?;
            let mut tls_of = Vec::new();
            for (_, db) in config.database.iter() {
                let (_, tls) = (db.tls.resolve(db.url.expose())).map_err(anyhow::Error::msg)?;
                // Reading the CA file now: a missing or unparseable one fails the check.
                store::tls::connector(&tls)?;
                tls_of.push(tls);
            }
            println!("{}: valid", path.display());
            println!("  kafka:    {}", config.kafka.brokers);
            println!("  kafka security: {}", kafka_security(&config.kafka));
            for ((name, db), tls) in config.database.iter().zip(&tls_of) {
                // `database:` for [database], as before there were others.
                let which = match name {
                    crate::config::DEFAULT_DATABASE => "database".to_string(),
                    n => format!("database {n}"),
                };
                println!("  {which}: {}", db.url);
                match &tls.ca_file {
                    Some(ca) => println!("  {which} tls: {}, ca_file {}", tls.mode, ca.display()),
                    None => println!("  {which} tls: {}", tls.mode),
                }
            }
            println!("  worker:   {}", config.worker_id());
            for c in &config.consumers {
                let strategy = match c.strategy {
                    Strategy::Batch => "batch",
                    Strategy::PerMessage => "per-message",
                    Strategy::Inbox => "inbox",
                };
                println!(
                    "  consumer {:?}: topics {:?}, group {:?}, strategy {strategy}, handler {:?}, \
                     database {}",
                    c.name,
                    c.topics,
                    c.group_id(),
                    c.handler,
                    c.database_name()
                );
                println!(
                    "    offsets: auto_offset_reset {} (no stored offset), on_offset_out_of_range {} (a stored offset outside the log)",
                    c.auto_offset_reset.as_librdkafka(),
                    c.on_offset_out_of_range.as_str()
                );
                if c.strategy == Strategy::Batch {
                    println!(
                        "    commit groups: {}",
                        match (c.commit_groups(), c.batch.group_partitions) {
                            (true, None) => "on (the default for this consumer)",
                            (true, Some(_)) => "on",
                            (false, None) =>
                                "off (they do not combine with versions or the prefilter)",
                            (false, Some(_)) => "off",
                        }
                    );
                }
                if let Some(v) = &c.version {
                    println!(
                        "    versions: aggregate {}, version {}, mode {:?}",
                        v.aggregate, v.version, v.mode
                    );
                }
                if let Some(f) = &c.prefilter {
                    println!(
                        "    prefilter: redis {}, ttl {}, timeout {}",
                        f.redis,
                        f.ttl,
                        humantime_serde::re::humantime::format_duration(f.timeout)
                    );
                }
            }
            if let Some(r) = &config.relay {
                println!(
                    "  relay: topics {:?}, default topic {:?}, batch {}, published {:?}",
                    r.topics, r.topic, r.batch, r.published
                );
            }
            if let Some(s) = &config.sender {
                let channels: Vec<&String> = s.channels.keys().collect();
                println!("  sender: channels {channels:?}, batch {}", s.batch);
            }
            if let Some(c) = &config.console {
                let token = match (&c.token_env, &c.token_file) {
                    (Some(v), _) => format!("token from ${v}"),
                    (_, Some(f)) => format!("token from {}", f.display()),
                    _ => "no token".into(),
                };
                println!(
                    "  console: {}, {token}, {}, mask {:?}",
                    c.addr,
                    if c.writes { "writes on" } else { "read-only" },
                    c.mask
                );
            }
            if connect {
                let kafka = config.kafka.clone();
                let brokers = tokio::task::spawn_blocking(move || {
                    crate::source::probe(&kafka, std::time::Duration::from_secs(10))
                })
                .await?
                .map_err(anyhow::Error::msg)?;
                println!("  connect kafka: ok ({brokers} broker(s) in the metadata)");
                for (name, db) in config.database.iter() {
                    if !config.uses_database(name) {
                        continue;
                    }
                    let client = store::pool::connect_to(db).await?;
                    // A database without V12 yet has nothing recorded to compare.
                    let keys: Option<String> = client
                        .query_one("SELECT to_regclass('consumer_keys')::text", &[])
                        .await?
                        .get(0);
                    if keys.is_some() {
                        for c in config
                            .consumers
                            .iter()
                            .filter(|c| c.database_name() == name)
                        {
                            key_drift(&client, c).await?;
                        }
                    }
                    let ssl: bool = client
                        .query_one(
                            "SELECT coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)",
                            &[],
                        )
                        .await?
                        .get(0);
                    let how = if ssl { "TLS" } else { "no TLS" };
                    match name {
                        crate::config::DEFAULT_DATABASE => {
                            println!("  connect database: ok ({how})")
                        }
                        n => println!("  connect database {n}: ok ({how})"),
                    }
                }
            }
            Ok(())
        }
        Command::ExampleConfig => {
            print!("{}", crate::config::EXAMPLE);
            Ok(())
        }
        Command::Retention { action } => retention(action).await,
        Command::Inbox { action } => inbox::run(action).await,
        Command::DeadLetters { action } => parked::dead_letters(action).await,
        Command::Notifications { action } => parked::notifications(action).await,
        Command::Offsets { action } => control::offsets(action).await,
        Command::Pause(args) => control::pause(args, false).await,
        Command::Resume(args) => control::pause(args, true).await,
        Command::Throttle(args) => control::throttle(args).await,
        Command::BenchRetention {
            database_url,
            keys,
            batch,
            mode,
            date,
        } => {
            let client = store::pool::connect(&database_url).await?;
            match mode.as_str() {
                "compare" => {
                    let r = store::retention::bench_drop_vs_delete(&client, keys, batch).await?;
                    println!("{}", serde_json::to_string(&r)?);
                }
                "prepare" => {
                    store::retention::bench_fill(&client, date, keys).await?;
                    println!("{{\"prepared\":\"{date}\",\"keys\":{keys}}}");
                }
                "drop" => {
                    let started = std::time::Instant::now();
                    store::retention::drop_partition(&client, date).await?;
                    let s = started.elapsed().as_secs_f64();
                    println!("{{\"dropped\":\"{date}\",\"drop_seconds\":{s}}}");
                }
                other => anyhow::bail!("--mode {other:?}: expected compare, prepare or drop"),
            }
            Ok(())
        }
        Command::Size {
            rate,
            days,
            database_url,
        } => {
            let client = store::pool::connect(&database_url).await?;
            let s = store::retention::size(&client, rate, days, 3).await?;
            let gb = |b: f64| b / 1e9;
            println!(
                "rate {rate} msg/s x {days} days = {:.0} rows ({:.1} million)",
                s.rows,
                s.rows / 1e6
            );
            println!(
                "bytes per row: {:.0} with indexes, {:.0} without ({})",
                s.bytes_per_row,
                s.heap_bytes_per_row,
                if s.measured {
                    "measured on the live table"
                } else {
                    "the seed's estimate: the table has too few rows to measure"
                }
            );
            println!(
                "size: {:.1} GB with indexes, {:.1} GB without",
                gb(s.bytes),
                gb(s.heap_bytes)
            );
            println!(
                "daily partitions: {} ({days} kept + 1 day margin + today + 3 ahead)",
                s.partitions
            );
            Ok(())
        }
        Command::BenchCeiling {
            database_url,
            connections,
            messages,
            batch,
        } => {
            let c = crate::ceiling::run(&database_url, connections, messages, batch).await?;
            println!("{}", serde_json::to_string(&c)?);
            Ok(())
        }
    }
}

/// What `migrate` did to one database.
fn print_migrated(database: &str, applied: &[String]) {
    if applied.is_empty() {
        println!("{database}: schema is up to date");
    }
    for name in applied {
        println!("{database}: applied {name}");
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` (of `health`) where [`metrics_addr_of`] says,
/// if anywhere. An endpoint that cannot bind is logged, not fatal, as for `run`.
fn serve_metrics(
    arg: Option<String>,
    config: &Config,
    fallback: std::net::SocketAddr,
    health: std::sync::Arc<crate::health::Health>,
) -> anyhow::Result<()> {
    if let Some(addr) = metrics_addr_of(arg, config, fallback)? {
        if let Err(e) = crate::endpoint::serve(addr, health) {
            tracing::error!(error = %e, "monitoring endpoint not started");
        }
    }
    Ok(())
}

/// Runs a loop that stops when its token is cancelled (a relay's, a sender's) until SIGTERM or
/// SIGINT. A round in flight is abandoned: its transaction rolls back, or its claim is taken
/// over later.
async fn until_signal<F>(
    what: &str,
    task: impl FnOnce(tokio_util::sync::CancellationToken) -> F,
) -> anyhow::Result<()>
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let stop = tokio_util::sync::CancellationToken::new();
    let handle = tokio::spawn(task(stop.clone()));
    tracing::info!("{what} started");
    shutdown_signal().await;
    stop.cancel();
    handle.await?;
    tracing::info!("{what} stopped");
    Ok(())
}

/// `--metrics-addr` (`off`, or host:port), else the config's `worker.metrics_addr`, else
/// `fallback`.
fn metrics_addr_of(
    arg: Option<String>,
    config: &Config,
    fallback: std::net::SocketAddr,
) -> anyhow::Result<Option<std::net::SocketAddr>> {
    Ok(match arg.as_deref() {
        Some("off") => None,
        Some(a) => Some(a.parse().map_err(|e| {
            anyhow::anyhow!("--metrics-addr {a:?}: {e} (expected host:port or off)")
        })?),
        None => config.worker.metrics_addr.or(Some(fallback)),
    })
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,tokio_postgres=warn,refinery_core=warn")
    });
    // Logs go to stderr: stdout is for what a command prints (migrate, check-config).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

async fn retention(action: RetentionAction) -> anyhow::Result<()> {
    let (path, run) = match &action {
        RetentionAction::Run { config } => (config, true),
        RetentionAction::Status { config } => (config, false),
    };
    let config = Config::load(path)?;
    // Each database keeps its own consumers' keys: its own partitions, its own maintenance.
    let mut names: Vec<&str> = config.consumers.iter().map(|c| c.database_name()).collect();
    if names.is_empty() {
        names.push(crate::config::DEFAULT_DATABASE);
    }
    names.sort_unstable();
    names.dedup();
    for name in names {
        if !config.database.named.is_empty() {
            println!("database {name}:");
        }
        retention_of(&config, name, run).await?;
    }
    Ok(())
}

/// `retention run | status` for the database called `name` and its consumers.
async fn retention_of(config: &Config, name: &str, run: bool) -> anyhow::Result<()> {
    let db = config
        .database
        .get(Some(name))
        .map_err(anyhow::Error::msg)?;
    let client = store::pool::connect_to(db).await?;
    let on: Vec<&crate::config::ConsumerConfig> = (config.consumers.iter())
        .filter(|c| c.database_name() == name)
        .collect();
    let ahead = on.iter().map(|c| c.partitions_ahead).max().unwrap_or(3);
    // `run` declares this config's retention (as a worker does); `status` only reads.
    let mut days = 1;
    for c in &on {
        let d = crate::worker::retention_days(c.retention);
        if run {
            store::retention::declare(&client, &c.name, d).await?;
        }
        days = days.max(d);
    }
    let days = store::retention::longest(&client)
        .await?
        .map_or(days, |db| db.max(days));
    let today = chrono::Utc::now().date_naive();
    if run {
        let known = store::partitions::Known::default();
        match store::retention::run(&client, &known, today, ahead, days).await? {
            store::retention::Ran::Skipped => {
                println!("skipped: another instance is running maintenance")
            }
            store::retention::Ran::Done { created, dropped } => {
                println!("created {} partition(s): {created:?}", created.len());
                println!("dropped {} partition(s): {dropped:?}", dropped.len());
            }
        }
        return Ok(());
    }
    let plan = store::retention::plan(&client, today, ahead, days).await?;
    println!(
        "today {today}; longest retention {days} days; partitions before {} are dropped",
        plan.drop_before
    );
    println!(
        "{:<12} {:>14} {:>12}  next run",
        "date", "rows (est.)", "size"
    );
    for p in &plan.partitions {
        let action = if plan.drop.contains(&p.date) {
            "drop"
        } else {
            "keep"
        };
        println!(
            "{:<12} {:>14.0} {:>10.1}MB  {action}",
            p.date,
            p.rows,
            p.bytes / 1e6
        );
    }
    for d in &plan.create {
        println!("{d:<12} {:>14} {:>12}  create", "-", "-");
    }
    Ok(())
}

/// `[kafka.tls]` and `[kafka.sasl]` in one line, the password's source but never the password.
fn kafka_security(k: &crate::config::KafkaConfig) -> String {
    use crate::config::kafka_security::protocol;
    let mut out = protocol(k.tls.as_ref(), k.sasl.as_ref()).to_string();
    if let Some(t) = &k.tls {
        match &t.ca_file {
            Some(ca) => out += &format!(", ca_file {}", ca.display()),
            None => out += ", the system's CAs",
        }
        if let Some(c) = &t.cert_file {
            out += &format!(", client certificate {}", c.display());
        }
        if !t.verify_hostname {
            out += ", host name not checked";
        }
    }
    if let Some(s) = &k.sasl {
        let from = match (&s.password_env, &s.password_file) {
            (Some(v), _) => format!("${v}"),
            (_, Some(f)) => f.display().to_string(),
            _ => "nowhere".into(),
        };
        out += &format!(
            ", {} as {:?} (password from {from})",
            s.mechanism.as_librdkafka(),
            s.username
        );
    }
    out
}

/// Warns (`check-config --connect`) when a consumer's ledger holds keys made by other
/// `message_id` / `event_date` settings than the file's (see [`store::keys`]).
async fn key_drift<C: tokio_postgres::GenericClient + Sync>(
    db: &C,
    c: &crate::config::ConsumerConfig,
) -> anyhow::Result<()> {
    let now = c.keys_made_by();
    match store::keys::recorded(db, &c.name).await? {
        Some(r) if r.made_by != now => println!(
            "  WARNING consumer {:?}: its ledger's keys were made by {} (since {}); this file \
             makes them by {now}. Copies of events applied before the change get other keys \
             and would be applied again, until the old keys pass retention ({}). Keep the old \
             settings unless such copies cannot arrive any more (docs/CONFIGURATION.md, \
             \"Changing how keys are made\").",
            c.name,
            r.made_by,
            r.since.to_rfc3339(),
            humantime_serde::re::humantime::format_duration(c.retention)
        ),
        Some(_) => println!("  consumer {:?}: keys made as the ledger's", c.name),
        None => println!(
            "  consumer {:?}: no keys recorded yet (a first start)",
            c.name
        ),
    }
    Ok(())
}
