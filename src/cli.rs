//! The command line. `main.rs` only parses; everything here calls into the library.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::store;

#[derive(Debug, Parser)]
#[command(name = "effectively", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply the schema migrations that the database does not have yet.
    Migrate {
        /// PostgreSQL URL (the password, if any, is never printed).
        #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
        database_url: String,
    },
}

/// Runs a parsed command line to completion.
pub fn main(cli: Cli) -> ExitCode {
    init_tracing();
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
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("info,tokio_postgres=warn,refinery_core=warn")
    });
    let _ = tracing_subscriber::fmt().with_env_filter(filter).try_init();
}
