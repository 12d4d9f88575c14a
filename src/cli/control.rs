//! `effectively offsets show | reset`, `pause`, `resume`, `throttle`: steer a running consumer.
//! Every change goes through [`crate::operator::control`], which audits it; the workers apply
//! it within about a second, with no restart (docs/OPERATIONS.md, "Replaying yesterday" and
//! "Stopping one partition").

use clap::{ArgGroup, Args, Subcommand};

use super::parked::{confirm_typed, pick_database, pool, ConfigArg};
use crate::config::{Config, ConsumerConfig};
use crate::operator::control::{self as op, KafkaLookup, Move, Target};
use crate::operator::Actor;
use crate::store::control::{Scope, Throttle};

/// Which of a consumer's partitions.
#[derive(Debug, Args, Clone)]
pub struct ScopeArgs {
    /// The consumer (its `name` in the config).
    #[arg(long)]
    pub consumer: String,
    /// One of its topics (default: all of them).
    #[arg(long)]
    pub topic: Option<String>,
    /// One partition of `--topic`.
    #[arg(long, requires = "topic")]
    pub partition: Option<i32>,
}

#[derive(Debug, Subcommand)]
pub enum OffsetsAction {
    /// Each partition's stored offset (where the consumer resumes), epoch and owner, beside
    /// Kafka's log (low and high watermarks), the lag, and whether it is paused.
    Show {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        consumer: String,
        #[arg(long)]
        topic: Option<String>,
        /// One JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Move the stored offsets, while workers run: each partition's offset and epoch change in
    /// one transaction, the worker holding it is fenced and claims it again from the new
    /// offset within about a second. Records read again are deduplicated (0 new effects) or,
    /// dated before the retention window, parked.
    #[command(group(ArgGroup::new("target").required(true).args(["to", "shift_by"])))]
    Reset {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        scope: ScopeArgs,
        /// `earliest`, `latest`, an RFC 3339 time (the first record at or after it, by Kafka's
        /// offsets-for-times) or an offset.
        #[arg(long)]
        to: Option<Target>,
        /// Move by N records from the stored offset (negative: back), kept inside the log.
        #[arg(long, allow_hyphen_values = true)]
        shift_by: Option<i64>,
        /// Print each partition's move, and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask to type the number of partitions.
        #[arg(long, short)]
        yes: bool,
        /// Why (kept in the audit row).
        #[arg(long)]
        note: Option<String>,
    },
}

/// `pause` and `resume`.
#[derive(Debug, Args)]
pub struct PauseArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// Why (kept in the audit row).
    #[arg(long)]
    pub note: Option<String>,
}

/// `throttle`.
#[derive(Debug, Args)]
#[command(group(ArgGroup::new("limit").required(true).args(["rate", "off"])))]
pub struct ThrottleArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    #[arg(long)]
    pub consumer: String,
    /// Messages a second, across each worker's partitions of the consumer.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Messages that may go at once after a quiet spell (default: half a second's worth).
    #[arg(long, requires = "rate")]
    pub burst: Option<u32>,
    /// Remove the run-time rate: the config's `max_rate`, if any, applies again.
    #[arg(long)]
    pub off: bool,
    /// Why (kept in the audit row).
    #[arg(long)]
    pub note: Option<String>,
}

fn consumer<'a>(config: &'a Config, name: &str) -> anyhow::Result<&'a ConsumerConfig> {
    config.consumer(name).map_err(anyhow::Error::msg)
}

/// A pool to consumer `name`'s database, where its offsets, pauses and throttle live (a
/// `--database` naming another is refused).
fn consumer_pool(
    config: &Config,
    arg: &ConfigArg,
    name: &str,
) -> anyhow::Result<deadpool_postgres::Pool> {
    consumer(config, name)?;
    let db = pick_database(config, Some(name), arg.database.as_deref())?;
    pool(config.database.get(Some(&db)).map_err(anyhow::Error::msg)?)
}

/// The scope, checked against the consumer's topics.
fn scope(config: &Config, args: &ScopeArgs) -> anyhow::Result<Scope> {
    let c = consumer(config, &args.consumer)?;
    op::topics(c, args.topic.as_deref()).map_err(anyhow::Error::msg)?;
    Ok(Scope {
        consumer: args.consumer.clone(),
        topic: args.topic.clone(),
        partition: args.partition,
    })
}

pub async fn offsets(action: OffsetsAction) -> anyhow::Result<()> {
    match action {
        OffsetsAction::Show {
            config,
            consumer: name,
            topic,
            json,
        } => {
            let arg = config;
            let config = Config::load(&arg.config)?;
            let c = consumer(&config, &name)?;
            let kafka = KafkaLookup::new(&config.kafka)?;
            let pool = consumer_pool(&config, &arg, &name)?;
            let view = op::show(&pool, &kafka, c, topic.as_deref()).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&view)?);
                return Ok(());
            }
            println!(
                "{:<24} {:>9} {:>12} {:>12} {:>12} {:>10} {:>6}  {:<7} owner",
                "topic", "partition", "stored", "low", "high", "lag", "epoch", "paused"
            );
            for p in &view.partitions {
                let (low, high) = match &p.log {
                    Ok(l) => (l.low.to_string(), l.high.to_string()),
                    Err(_) => ("?".into(), "?".into()),
                };
                println!(
                    "{:<24} {:>9} {:>12} {:>12} {:>12} {:>10} {:>6}  {:<7} {}",
                    p.topic,
                    p.partition,
                    p.stored.map_or("-".into(), |o| o.to_string()),
                    low,
                    high,
                    p.lag.map_or("?".into(), |l| l.to_string()),
                    p.epoch.map_or("-".into(), |e| e.to_string()),
                    if p.paused { "paused" } else { "" },
                    p.owner.as_deref().unwrap_or("-"),
                );
                if let Err(e) = &p.log {
                    println!("    (Kafka: {e})");
                }
            }
            for pause in &view.pauses {
                println!(
                    "paused: {} since {} by {}{}",
                    pause.scope,
                    pause.paused_at.to_rfc3339(),
                    pause.paused_by,
                    pause
                        .note
                        .as_deref()
                        .map_or(String::new(), |n| format!(" ({n})"))
                );
            }
            match (view.throttle, c.rate_limit()) {
                (Some(t), _) => println!(
                    "throttled at run time: {} msg/s, burst {} (effectively throttle --off lifts it)",
                    t.max_rate, t.burst
                ),
                (None, Some(t)) => println!("max_rate (config): {} msg/s, burst {}", t.max_rate, t.burst),
                (None, None) => {}
            }
            Ok(())
        }
        OffsetsAction::Reset {
            config,
            scope: args,
            to,
            shift_by,
            dry_run,
            yes,
            note,
        } => {
            let arg = config;
            let config = Config::load(&arg.config)?;
            let c = consumer(&config, &args.consumer)?;
            let target = match (to, shift_by) {
                (Some(t), _) => t,
                (None, Some(n)) => Target::ShiftBy(n),
                (None, None) => anyhow::bail!("--to or --shift-by is required"),
            };
            let kafka = KafkaLookup::new(&config.kafka)?;
            let pool = consumer_pool(&config, &arg, &args.consumer)?;
            let plan = op::plan_reset(
                &pool,
                &kafka,
                c,
                args.topic.as_deref(),
                args.partition,
                target,
            )
            .await?;
            print_moves(&plan);
            if dry_run {
                println!(
                    "dry run: would move {} partition(s) to {target}; nothing changed",
                    plan.len()
                );
                return Ok(());
            }
            let what = format!(
                "reset {} partition(s) of {:?} to {target}",
                plan.len(),
                c.name
            );
            if !confirm_typed(&what, plan.len() as u64, yes)? {
                anyhow::bail!("not confirmed: nothing changed");
            }
            let (done, moved) = op::reset(
                &pool,
                &c.name,
                target,
                &plan,
                &Actor::cli(),
                note.as_deref(),
            )
            .await?;
            if matches!(target, Target::ShiftBy(_)) {
                println!("as moved:");
                print_moves(&moved);
            }
            println!(
                "reset {} partition(s) (audit action {}); running workers claim them again from the new offsets within about a second",
                done.count, done.action
            );
            Ok(())
        }
    }
}

fn print_moves(moves: &[Move]) {
    println!(
        "{:<24} {:>9} {:>12} {:>12}   log",
        "topic", "partition", "from", "to"
    );
    for m in moves {
        println!(
            "{:<24} {:>9} {:>12} {:>12}   {}..{}{}",
            m.topic,
            m.partition,
            m.from.map_or("-".into(), |o| o.to_string()),
            m.to,
            m.log.low,
            m.log.high,
            match m.from {
                Some(f) if m.to < f => format!("  ({} records again)", f - m.to),
                Some(f) if m.to > f => format!("  ({} records skipped)", m.to - f),
                _ => String::new(),
            }
        );
    }
}

pub async fn pause(args: PauseArgs, resume: bool) -> anyhow::Result<()> {
    let config = Config::load(&args.config.config)?;
    let scope = scope(&config, &args.scope)?;
    let pool = consumer_pool(&config, &args.config, &args.scope.consumer)?;
    let actor = Actor::cli();
    if resume {
        let r = op::resume(&pool, &scope, &actor, args.note.as_deref()).await?;
        println!(
            "resumed {scope}: {} pause(s) lifted (audit action {})",
            r.done.count, r.done.action
        );
        for wider in &r.still_paused_by {
            println!("still paused by a wider pause: {wider} (resume that to read it again)");
        }
    } else {
        let d = op::pause(&pool, &scope, &actor, args.note.as_deref()).await?;
        match d.count {
            0 => println!("{scope} was paused already (audit action {})", d.action),
            _ => println!(
                "paused {scope} (audit action {}); its workers stop fetching within about a second",
                d.action
            ),
        }
    }
    Ok(())
}

pub async fn throttle(args: ThrottleArgs) -> anyhow::Result<()> {
    let config = Config::load(&args.config.config)?;
    let pool = consumer_pool(&config, &args.config, &args.consumer)?;
    let rate = match args.rate {
        Some(r) if r.is_finite() && r > 0.0 => Some(Throttle {
            max_rate: r,
            burst: args
                .burst
                .unwrap_or_else(|| crate::config::default_burst(r))
                .max(1),
        }),
        Some(r) => anyhow::bail!("--rate {r}: a number of messages a second above 0"),
        None => None,
    };
    let d = op::throttle(
        &pool,
        &args.consumer,
        rate,
        &Actor::cli(),
        args.note.as_deref(),
    )
    .await?;
    match rate {
        Some(t) => println!(
            "throttled {:?} to {} msg/s per worker, burst {} (audit action {})",
            args.consumer, t.max_rate, t.burst, d.action
        ),
        None => println!(
            "lifted the run-time rate of {:?} ({} row, audit action {})",
            args.consumer, d.count, d.action
        ),
    }
    Ok(())
}
