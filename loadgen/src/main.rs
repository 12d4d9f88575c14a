//! loadgen: produces the seed's payment stream with real-world duplicates, waits for the
//! engine to drain it (for an inbox consumer, also for its processors to finish the stored
//! rows), and verifies the ledger: for every acknowledged unique payment exactly
//! one effect, nothing unexpected, every poison record parked, wallets exact. Writes
//! `report.json` and a self-contained `report.html`, and exits non-zero unless verified.
//! `--via-outbox` writes the payments to the `outbox` table for `effectively relay` to
//! publish, and verifies the same ledger ([`outbox`]).
//!
//! This file holds the flags and the dispatch. The default command is [`demo`]; the load run
//! every command shares is in [`stages`] (producing, then finishing), [`session`] (the
//! connections), [`measure`] (the report's numbers), [`via_outbox`] and [`topics`].

mod bench;
mod chaos;
mod cluster;
mod demo;
mod gaps;
mod harness;
mod measure;
mod net;
mod orders;
mod outbox;
mod produce;
mod report;
mod session;
mod soak;
mod stages;
mod topics;
mod verify;
mod via_outbox;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

// What the commands share, named from the crate's root as before the split.
pub(crate) use session::Session;
pub(crate) use stages::{finish_stage, produce_stage, produce_stage_with, Produced, Spec};
pub(crate) use topics::{create_topic, WARM_UP_TOPIC};

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
    /// The payload format: json (the JSON object), or, in the Confluent wire format, avro,
    /// protobuf or json-schema, the schema (loadgen/schemas/) registered under `<topic>-value`.
    #[arg(long, value_enum, default_value_t = produce::wire::Format::Json)]
    format: produce::wire::Format,
    /// The schema registry's Confluent-compatible base URL, for a registry --format (Apicurio:
    /// http://HOST:PORT/apis/ccompat/v7).
    #[arg(long, env = "SCHEMA_REGISTRY_URL")]
    schema_registry: Option<String>,
    /// The producer's compression codec (`compression.type`): the engine reads them all.
    #[arg(long, value_enum, default_value = "none")]
    compression: session::Compression,
    /// Event ids: uuid (UUIDv7), or stripe (`evt_` and 32 hex digits: the consumer needs
    /// `message_id = { header = "event_id", any_string = true }` and `event_date = "/occurred_at"`).
    #[arg(long, value_enum, default_value = "uuid")]
    ids: produce::shape::Ids,
    /// Records: plain (an `event_id` header, the payment as the value), or cloudevents
    /// (CloudEvents 1.0: originals and double taps in binary mode, resends and redrives in
    /// structured mode; the consumer needs `envelope = "cloudevents"`).
    #[arg(long, value_enum, default_value = "plain")]
    envelope: produce::shape::Envelope,
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
    /// Network faults (latency, loss, cuts, a stalled COMMIT, flapping) between workers in
    /// network namespaces of their own and the stack, each verified exactly-once (as root).
    ChaosNet(net::NetArgs),
    /// An order-status stream with out-of-order versions, stale copies and duplicates into
    /// an `order-status` consumer: every order must end at its newest version, never going back.
    Orders(orders::OrdersArgs),
    /// `make bench`'s pre-filter phase alone: a 100%-duplicate replay of a topic with and
    /// without the Redis pre-filter (Redis from REDIS_URL or `scripts/stack.sh redis-up`).
    Replay(bench::replay::ReplayArgs),
    /// `make soak`: two workers, the relay and the sender under the demo's traffic for
    /// `SOAK_DURATION` (1 h), a fault every few minutes, sampling RSS, descriptors, threads,
    /// connections, lag and p99; fails on a loss, a double, an unrecovered fault or growth.
    Soak(soak::SoakArgs),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt().with_env_filter("warn").init();
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Bench(b)) => bench::run(b).await,
        Some(Command::Chaos(c)) => chaos::run(c).await,
        Some(Command::ChaosCluster(c)) => cluster::run(c).await,
        Some(Command::ChaosNet(n)) => net::run(n).await,
        Some(Command::Orders(o)) => orders::run(o).await,
        Some(Command::Replay(r)) => bench::replay::run(r).await,
        Some(Command::Soak(s)) => soak::run(s).await,
        None => demo::run(cli.run).await,
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
