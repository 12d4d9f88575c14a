//! `loadgen orders`: versioned writes against the disorder of a real stream.
//!
//! An order-status stream (one full state per version: `PLACED`, `PAID`, ...) into a consumer
//! of the built-in `order-status` handler with `[consumer.version]` in full-state mode, as
//! disordered as real ones get:
//!
//! - out of order: every record has a random key, so one order's versions land on different
//!   partitions, and the stream is shuffled within a window, so a later version often comes
//!   first;
//! - stale copies: some events are produced again, with a new event id, after their order's
//!   newest version (`PAID` after `REFUNDED`: an outbox re-publishing old state). The dedupe key
//!   cannot catch them; only the version can;
//! - exact duplicates: some records again, same bytes and event id (a relay's resend).
//!
//! One worker process (`--strategy batch|inbox`; SIGKILLed and replaced mid-stream with
//! `--bounce`) drains the topic. Then the tables the handler writes must show that every order
//! ended at its newest version and never went back: its `order_status_view` row holds the
//! status and version of its newest event, the engine's stored version agrees, and in
//! `order_status_history`, in apply order, `to_version` strictly increases and each
//! `from_version` is the previous move's `to_version` (NULL for the first), each move with the
//! status and one of the message ids of the version it moved to. Nothing may be parked.
//!
//! This file holds the flags and the run; [`stream`] makes the disordered stream and produces
//! it, [`worker`] runs and bounces the worker process, and [`verify`] reads the tables back and
//! judges them.

mod stream;
#[cfg(test)]
mod tests;
mod verify;
mod worker;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::chaos::{StrategyArg, Worker};
use crate::Session;
use stream::{order_prefix, plan, produce, Kind, Shape};
use verify::{check, observe, Expected};
use worker::{bounce, tail, worker_config};

/// Partitions of the run's topic.
const PARTITIONS: i32 = 4;

#[derive(Debug, clap::Args)]
pub struct OrdersArgs {
    #[command(flatten)]
    services: crate::Services,
    /// The engine's binary (default: next to this one).
    #[arg(long)]
    effectively: Option<PathBuf>,
    /// Orders to produce [default: 2000, or 300 with --quick].
    #[arg(long)]
    orders: Option<u64>,
    /// Versions of every order (1 to this).
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(i64).range(1..))]
    versions: i64,
    /// Fraction of events produced again with a new event id after their order's newest
    /// version.
    #[arg(long, default_value_t = 0.2)]
    stale: f64,
    /// Fraction of events produced again byte for byte, with the same event id.
    #[arg(long, default_value_t = 0.05)]
    duplicates: f64,
    /// Records within which the stream is shuffled [default: 4 x --versions].
    #[arg(long)]
    window: Option<usize>,
    /// Records produced per second.
    #[arg(long, default_value_t = 2000.0)]
    rate: f64,
    /// The worker's strategy: `batch`, or `inbox` (store first, process later).
    #[arg(long, value_enum, default_value_t = StrategyArg::Batch)]
    strategy: StrategyArg,
    /// SIGKILL the worker once it has taken a third of the records, and start another.
    #[arg(long)]
    bounce: bool,
    /// `[consumer.version]` mode: `full-state` (the newest version wins; older copies are
    /// stale) or `delta` (every version applies, in order: out-of-order ones wait HELD).
    #[arg(long, value_enum, default_value_t = ModeArg::FullState)]
    mode: ModeArg,
    /// The short run `make test` does (300 orders).
    #[arg(long)]
    quick: bool,
    /// Replay with this seed (default: random, printed).
    #[arg(long)]
    seed: Option<u64>,
    /// How long the engine may take to drain the topic after producing.
    #[arg(long, default_value = "120s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Where the worker config and logs go.
    #[arg(long, default_value = "target/orders")]
    out: PathBuf,
}

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeArg {
    FullState,
    Delta,
}

impl ModeArg {
    fn as_str(self) -> &'static str {
        match self {
            ModeArg::FullState => "full-state",
            ModeArg::Delta => "delta",
        }
    }
}

impl OrdersArgs {
    fn label(&self) -> String {
        let strategy = match self.strategy {
            StrategyArg::Batch => "batch",
            StrategyArg::Inbox => "inbox",
        };
        match self.mode {
            ModeArg::FullState => strategy.to_string(),
            ModeArg::Delta => format!("{strategy}, delta"),
        }
    }
}

pub async fn run(args: OrdersArgs) -> anyhow::Result<bool> {
    let shape = Shape {
        orders: args.orders.unwrap_or(if args.quick { 300 } else { 2000 }),
        versions: args.versions,
        stale: args.stale,
        duplicates: args.duplicates,
        window: args.window.unwrap_or(4 * args.versions as usize),
    };
    anyhow::ensure!(
        (0.0..=1.0).contains(&shape.stale) && (0.0..=1.0).contains(&shape.duplicates),
        "--stale and --duplicates are fractions, from 0 to 1"
    );
    anyhow::ensure!(args.rate > 0.0, "--rate must be positive");
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let mut rng = fastrand::Rng::with_seed(seed);
    let run = format!("{:08x}", rng.u32(..));
    // The topic names the consumer too: one of each per run.
    let topic = format!("orders-{}-{run}", args.label().replace(", ", "-"));
    std::fs::create_dir_all(&args.out)?;
    let records = plan(&run, &shape, &mut rng);
    eprintln!(
        "loadgen orders [{}{}] (seed {seed}): {} records to {topic}",
        args.label(),
        if args.bounce { ", bounce" } else { "" },
        records.len()
    );

    let session = Session::connect(
        &args.services.brokers,
        &args.services.database_url,
        &topic,
        PARTITIONS,
        crate::session::Compression::None,
    )
    .await?;
    let config = args.out.join(format!("{topic}.toml"));
    std::fs::write(&config, worker_config(&topic, args.strategy, args.mode))?;
    let bin = Worker::binary(args.effectively.as_deref())?;
    let worker = Worker {
        bin: &bin,
        brokers: &args.services.brokers,
        database_url: &args.services.database_url,
    };
    let start = |n: u32| {
        let id = format!("{topic}-w{n}");
        worker.start(&config, &id, &args.out.join(format!("{id}.log")), None)
    };

    let first = start(1)?;
    let producing = async {
        let acked = produce(&session.producer, &topic, &records, args.rate).await;
        (acked, Instant::now())
    };
    let ((acked, produced_at), mut live) = if args.bounce {
        let third = records.len() as i64 / 3;
        let (produced, live) = tokio::join!(
            producing,
            bounce(&session.db, &topic, third, first, || start(2)),
        );
        (produced, live?)
    } else {
        (producing.await, first)
    };
    let acked = acked?;
    let drain = tokio::select! {
        drain = session.drain(&topic, args.drain_timeout) => drain,
        _ = live.exited(args.drain_timeout.as_secs() + 60) => {
            let log = args.out.join(format!("{topic}-w{}.log", if args.bounce { 2 } else { 1 }));
            anyhow::bail!(
                "the worker exited on its own before the topic drained; the end of {}:\n{}",
                log.display(),
                tail(&log, 10)
            );
        }
    };
    let drain_s = produced_at.elapsed().as_secs_f64();
    let stopped = live.stop().await;

    let expected = Expected::from(&records, &acked);
    let observed = observe(&session.db, &topic, &order_prefix(&run)).await?;
    let verdict = check(&expected, &observed, args.mode == ModeArg::Delta);
    let mut problems: Vec<String> = Vec::new();
    problems.extend(drain.problem());
    if let Err(e) = &stopped {
        problems.push(format!("the worker did not stop cleanly: {e:#}"));
    }
    let verified = verdict.verified() && problems.is_empty();

    let count = |k: Kind| records.iter().filter(|r| r.kind == k).count();
    let stale_newest = records
        .iter()
        .filter(|r| r.kind == Kind::Stale && r.version == shape.versions)
        .count();
    let originals = count(Kind::Original);
    println!(
        "orders [{}{}] run {run} (seed {seed}): {} orders x {} versions = {originals} events, \
         {} stale copies (a new event id, produced after the order's newest version; {} of an \
         older version, {stale_newest} of the newest) and {} exact duplicates: {} records, {} \
         acknowledged, to {topic} ({PARTITIONS} partitions, random keys, shuffled within {} \
         records){}; drained {drain_s:.1} s after the last acknowledgement. \
         order_status_view: {} of {} orders at their newest version and status ({} missing, \
         {} wrong, {} stored versions off); order_status_history: {} moves for {originals} \
         versions (the others were superseded before they applied, or stale), {} orders \
         going back or with a broken chain, {} moves with the wrong status or message id, {} \
         whose last move is not the view's row; {} dead letters, {} FAILED and {} HELD inbox \
         rows.{} {}",
        args.label(),
        if args.bounce { ", bounce" } else { "" },
        shape.orders,
        shape.versions,
        count(Kind::Stale),
        count(Kind::Stale) - stale_newest,
        count(Kind::Duplicate),
        records.len(),
        acked.iter().filter(|a| **a).count(),
        shape.window,
        if args.bounce {
            "; the worker SIGKILLed after a third of them and replaced"
        } else {
            ""
        },
        verdict.at_newest,
        expected.newest.len(),
        verdict.missing.len(),
        verdict.wrong.len(),
        verdict.stored_off.len(),
        verdict.moves,
        verdict.broken.len(),
        verdict.bad_moves.len(),
        verdict.view_vs_history.len(),
        observed.dead_letters,
        observed.failed,
        observed.held,
        problems
            .iter()
            .map(|p| format!(" Harness: {p}."))
            .collect::<String>(),
        if verified { "VERIFIED" } else { "NOT VERIFIED" },
    );
    if !verified {
        eprintln!("{}", verdict.details(&expected, &observed));
        eprintln!(
            "worker config and logs: {}",
            args.out.join(format!("{topic}*")).display()
        );
    }
    Ok(verified)
}
