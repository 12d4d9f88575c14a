//! The command line. `main.rs` only parses; everything here calls into the library.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::{Config, Strategy};
use crate::handler::Registry;
use crate::store;

#[derive(Debug, Parser)]
#[command(name = "effectively", version, about)]
pub struct Cli {
    /// Log format: human-readable text, or one JSON object per line for production.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
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
        /// Where to serve Prometheus metrics (`/metrics`), or `off`. Default: the config's
        /// `worker.metrics_addr`, else 127.0.0.1:9464 (loopback unless configured).
        #[arg(long)]
        metrics_addr: Option<String>,
    },
    /// Apply the schema migrations that the database does not have yet.
    Migrate {
        /// PostgreSQL URL (the password, if any, is never printed).
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
    /// Load and validate a config file, and print what it configures.
    CheckConfig {
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
    },
    /// Print a complete, commented example config.
    ExampleConfig,
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
            config.worker.metrics_addr = match metrics_addr.as_deref() {
                Some("off") => None,
                Some(a) => Some(a.parse().map_err(|e| {
                    anyhow::anyhow!("--metrics-addr {a:?}: {e} (expected host:port or off)")
                })?),
                None => config
                    .worker
                    .metrics_addr
                    .or(Some(crate::metrics::DEFAULT_ADDR)),
            };
            crate::worker::run(config, Registry::new(), shutdown_signal()).await?;
            Ok(())
        }
        Command::Migrate { database_url } => {
            let mut client = store::pool::connect(&database_url).await?;
            let applied = store::migrate::run(&mut client).await?;
            if applied.names.is_empty() {
                println!(
                    "{}: schema is up to date",
                    store::pool::redact(&database_url)
                );
            } else {
                for name in &applied.names {
                    println!("applied {name}");
                }
            }
            Ok(())
        }
        Command::CheckConfig { config: path } => {
            let config = Config::load(&path)?;
            println!("{}: valid", path.display());
            println!("  kafka:    {}", config.kafka.brokers);
            println!("  database: {}", config.database.url);
            println!("  worker:   {}", config.worker_id());
            for c in &config.consumers {
                let strategy = match c.strategy {
                    Strategy::Batch => "batch",
                    Strategy::PerMessage => "per-message",
                };
                println!(
                    "  consumer {:?}: topics {:?}, group {:?}, strategy {strategy}, handler {:?}",
                    c.name,
                    c.topics,
                    c.group_id(),
                    c.handler
                );
            }
            Ok(())
        }
        Command::ExampleConfig => {
            print!("{}", crate::config::EXAMPLE);
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

/// Resolves on SIGTERM or SIGINT.
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
