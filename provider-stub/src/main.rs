//! `provider-stub [--addr HOST:PORT]`: serves the stub (see the library's docs) until SIGTERM or
//! SIGINT.

use clap::Parser;

/// A notification provider stub with Stripe-like idempotency keys, for tests and demos.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:8099")]
    addr: String,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    provider_stub::serve(args.addr, shutdown_signal()).await
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM: stopping"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: stopping"),
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
