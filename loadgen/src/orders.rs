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

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::stream::{FuturesUnordered, StreamExt};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use uuid::Uuid;

use crate::chaos::{worker_settings, Proc, StrategyArg, Worker};
use crate::Session;

/// Partitions of the run's topic.
const PARTITIONS: i32 = 4;

/// The lifecycles an order follows, one picked at random per order. A version past the end
/// keeps the last status (a full-state event that changes other fields).
const LIFECYCLES: &[&[&str]] = &[
    &[
        "PLACED",
        "PAID",
        "PACKED",
        "SHIPPED",
        "OUT_FOR_DELIVERY",
        "DELIVERED",
    ],
    &[
        "PLACED",
        "PAID",
        "SHIPPED",
        "DELIVERED",
        "RETURNED",
        "REFUNDED",
    ],
    &[
        "PLACED",
        "PAID",
        "CANCELLED",
        "REFUND_PENDING",
        "REFUNDED",
        "CLOSED",
    ],
];

/// How many failing orders of each kind the report prints in full, with their rows.
const SHOW: usize = 5;

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

/// The stream's shape.
#[derive(Debug, Clone)]
struct Shape {
    orders: u64,
    versions: i64,
    stale: f64,
    duplicates: f64,
    window: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Original,
    /// The same event again with a new event id, after its order's newest version.
    Stale,
    /// The same record again: same key, bytes and event id.
    Duplicate,
}

/// One record to produce.
#[derive(Debug, Clone)]
struct Record {
    kind: Kind,
    order: String,
    version: i64,
    status: &'static str,
    event_id: Uuid,
    key: String,
    payload: Vec<u8>,
}

/// The order ids of a run start with this (so its rows are told from other runs').
fn order_prefix(run: &str) -> String {
    format!("o-{run}-")
}

fn random_key(rng: &mut fastrand::Rng) -> String {
    format!("k-{:08x}", rng.u32(..))
}

/// The stream, in the order it is produced.
fn plan(run: &str, shape: &Shape, rng: &mut fastrand::Rng) -> Vec<Record> {
    let occurred_at = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
    let window = shape.window as f64;
    // Each order's versions one after the other, every one moved up to `window` places later.
    let mut originals: Vec<(f64, Record)> = Vec::new();
    for n in 0..shape.orders {
        let order = format!("{}{n}", order_prefix(run));
        let life = LIFECYCLES[rng.usize(..LIFECYCLES.len())];
        for version in 1..=shape.versions {
            let status = life[(version as usize - 1).min(life.len() - 1)];
            let payload = serde_json::to_vec(&serde_json::json!({
                "order_id": order,
                "version": version,
                "status": status,
                "occurred_at": occurred_at,
            }))
            .expect("a JSON object serialises");
            let at = originals.len() as f64 + rng.f64() * window;
            originals.push((
                at,
                Record {
                    kind: Kind::Original,
                    order: order.clone(),
                    version,
                    status,
                    event_id: Uuid::now_v7(),
                    key: random_key(rng),
                    payload,
                },
            ));
        }
    }
    originals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut stream: Vec<(f64, Record)> = originals
        .into_iter()
        .enumerate()
        .map(|(i, (_, r))| (i as f64, r))
        .collect();
    let mut newest_at: HashMap<String, f64> = HashMap::new();
    for (at, r) in &stream {
        newest_at.insert(r.order.clone(), *at);
    }
    let mut copies = Vec::new();
    for (at, r) in &stream {
        if rng.f64() < shape.stale {
            let after = newest_at[&r.order] + 0.5 + rng.f64() * 4.0 * window;
            copies.push((
                after,
                Record {
                    kind: Kind::Stale,
                    event_id: Uuid::now_v7(),
                    key: random_key(rng),
                    ..r.clone()
                },
            ));
        }
        if rng.f64() < shape.duplicates {
            let after = at + 0.25 + rng.f64() * 2.0 * window;
            copies.push((
                after,
                Record {
                    kind: Kind::Duplicate,
                    ..r.clone()
                },
            ));
        }
    }
    stream.extend(copies);
    stream.sort_by(|a, b| a.0.total_cmp(&b.0));
    stream.into_iter().map(|(_, r)| r).collect()
}

/// The worker config: the `order-status` handler, versions in `mode`.
fn worker_config(topic: &str, strategy: StrategyArg, mode: ModeArg) -> String {
    let mut text = worker_settings(8);
    text.push_str(&format!(
        "[[consumer]]\nname = \"{topic}\"\ntopics = [\"{topic}\"]\n\
         handler = {{ kind = \"order-status\" }}\n\
         batch = {{ max_messages = 200 }}\nretry = {{ initial_backoff = \"50ms\", max_backoff = \"1s\" }}\n"
    ));
    if strategy == StrategyArg::Inbox {
        text.push_str("strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 4\n");
    }
    text.push_str(&format!(
        "[consumer.version]\naggregate = \"/order_id\"\nversion = \"/version\"\nmode = \"{}\"\n",
        mode.as_str()
    ));
    text
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

/// The last `n` lines of a worker's log.
fn tail(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Sends `records` in order at `rate` per second; whether the broker acknowledged each. They
/// are enqueued one by one (`send_result`), so within a partition the broker keeps this order
/// (the producer is idempotent): a stale copy lands after its order's newest version there.
async fn produce(
    producer: &FutureProducer,
    topic: &str,
    records: &[Record],
    rate: f64,
) -> anyhow::Result<Vec<bool>> {
    let start = Instant::now();
    let mut acked = vec![false; records.len()];
    let mut pending = FuturesUnordered::new();
    for (i, r) in records.iter().enumerate() {
        let due = start + Duration::from_secs_f64(i as f64 / rate);
        while Instant::now() < due {
            tokio::select! {
                _ = tokio::time::sleep_until(due.into()) => {}
                Some((i, ok)) = pending.next(), if !pending.is_empty() => acked[i] = ok,
            }
        }
        let id = r.event_id.to_string();
        let headers = OwnedHeaders::new().insert(Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        });
        let mut record = FutureRecord::to(topic)
            .key(&r.key)
            .payload(&r.payload)
            .headers(headers);
        let delivery = loop {
            match producer.send_result(record) {
                Ok(delivery) => break delivery,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err((e, _)) => return Err(e).context("producing an order event"),
            }
        };
        pending.push(async move { (i, matches!(delivery.await, Ok(Ok(_)))) });
    }
    while let Some((i, ok)) = pending.next().await {
        acked[i] = ok;
    }
    Ok(acked)
}

/// SIGKILLs `worker` once `consumer` has stored offsets past `records` records (a third of the
/// stream: mid-way through the work, whether or not producing is over), and starts another.
async fn bounce(
    db: &tokio_postgres::Client,
    consumer: &str,
    records: i64,
    worker: Proc,
    restart: impl FnOnce() -> anyhow::Result<Proc>,
) -> anyhow::Result<Proc> {
    let (started, mut worker) = (Instant::now(), worker);
    loop {
        anyhow::ensure!(
            !worker.exited(0).await,
            "the first worker exited on its own before the bounce"
        );
        let stored: i64 = db
            .query_one(
                "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offsets
                 WHERE consumer = $1 AND topic = $1",
                &[&consumer],
            )
            .await?
            .get(0);
        if stored >= records {
            break;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the worker took only {stored} of {records} records within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    worker.kill().await;
    restart()
}

/// What the engine should have left, from what was produced.
struct Expected {
    /// Per order: the newest version acknowledged, and the newest produced (the same unless a
    /// record's acknowledgement was lost; it may have been written all the same).
    newest: BTreeMap<String, (i64, i64)>,
    /// The status of every version of every order.
    statuses: HashMap<(String, i64), &'static str>,
    /// Every event id produced: its order and version.
    ids: HashMap<Uuid, (String, i64)>,
}

impl Expected {
    fn from(records: &[Record], acked: &[bool]) -> Expected {
        let mut e = Expected {
            newest: BTreeMap::new(),
            statuses: HashMap::new(),
            ids: HashMap::new(),
        };
        for (r, acked) in records.iter().zip(acked) {
            let newest = e.newest.entry(r.order.clone()).or_insert((0, 0));
            if *acked {
                newest.0 = newest.0.max(r.version);
            }
            newest.1 = newest.1.max(r.version);
            e.statuses.insert((r.order.clone(), r.version), r.status);
            e.ids.insert(r.event_id, (r.order.clone(), r.version));
        }
        e
    }
}

/// One row of `order_status_history`.
#[derive(Debug, Clone)]
struct Move {
    id: i64,
    status: String,
    from: Option<i64>,
    to: i64,
    message_id: Uuid,
}

/// What the engine left for this run.
#[derive(Debug, Default)]
struct Observed {
    /// `order_status_view`: status and version per order.
    view: HashMap<String, (String, i64)>,
    /// `order_status_history` per order, in apply (id) order.
    history: BTreeMap<String, Vec<Move>>,
    /// `aggregate_versions` of the consumer.
    stored: HashMap<String, i64>,
    dead_letters: i64,
    failed: i64,
    held: i64,
}

async fn observe(
    db: &tokio_postgres::Client,
    consumer: &str,
    prefix: &str,
) -> anyhow::Result<Observed> {
    // The prefix is `o-<hex>-`: no LIKE wildcard in it.
    let like = format!("{prefix}%");
    let mut o = Observed::default();
    for r in db
        .query(
            "SELECT order_id, status, version FROM order_status_view WHERE order_id LIKE $1",
            &[&like],
        )
        .await
        .context("reading order_status_view")?
    {
        o.view.insert(r.get(0), (r.get(1), r.get(2)));
    }
    for r in db
        .query(
            "SELECT order_id, id, status, from_version, to_version, message_id
             FROM order_status_history WHERE order_id LIKE $1 ORDER BY order_id, id",
            &[&like],
        )
        .await
        .context("reading order_status_history")?
    {
        o.history.entry(r.get(0)).or_default().push(Move {
            id: r.get(1),
            status: r.get(2),
            from: r.get(3),
            to: r.get(4),
            message_id: r.get(5),
        });
    }
    for r in db
        .query(
            "SELECT aggregate, version FROM aggregate_versions WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .context("reading aggregate_versions")?
    {
        o.stored.insert(r.get(0), r.get(1));
    }
    o.dead_letters = db
        .query_one(
            "SELECT count(*) FROM dead_letters WHERE consumer = $1",
            &[&consumer],
        )
        .await?
        .get(0);
    let row = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'FAILED'), count(*) FILTER (WHERE status = 'HELD')
             FROM inbox WHERE consumer = $1",
            &[&consumer],
        )
        .await?;
    (o.failed, o.held) = (row.get(0), row.get(1));
    Ok(o)
}

/// What the verifier found, as lists of order ids (with the reason).
#[derive(Debug, Default)]
struct Verdict {
    at_newest: usize,
    /// Orders without a view row.
    missing: Vec<String>,
    /// View rows at another version or status than the order's newest (or of no order produced).
    wrong: Vec<String>,
    /// Orders whose stored version (`aggregate_versions`) is not the view's.
    stored_off: Vec<String>,
    /// Orders whose history went back or skipped: the chain of versions is broken.
    broken: Vec<String>,
    /// Moves with the status or a message id of another version than the one moved to.
    bad_moves: Vec<String>,
    /// Orders whose last move does not reach the view's version and status.
    view_vs_history: Vec<String>,
    moves: usize,
    /// Dead letters and FAILED or HELD inbox rows: full-state mode applies or skips everything.
    parked: i64,
}

impl Verdict {
    fn verified(&self) -> bool {
        self.missing.is_empty()
            && self.wrong.is_empty()
            && self.stored_off.is_empty()
            && self.broken.is_empty()
            && self.bad_moves.is_empty()
            && self.view_vs_history.is_empty()
            && self.parked == 0
    }

    /// The failing orders, up to `SHOW` of each kind, with their rows in full.
    fn details(&self, expected: &Expected, observed: &Observed) -> String {
        let mut out = String::new();
        for (what, list) in [
            ("missing from order_status_view", &self.missing),
            ("wrong in order_status_view", &self.wrong),
            ("stored version off", &self.stored_off),
            ("history going back or broken", &self.broken),
            ("moves with a wrong status or message id", &self.bad_moves),
            ("last move is not the view's row", &self.view_vs_history),
        ] {
            if list.is_empty() {
                continue;
            }
            out.push_str(&format!("{} {what}:\n", list.len()));
            for problem in list.iter().take(SHOW) {
                out.push_str(&format!("  {problem}\n"));
                let order = problem.split(':').next().unwrap_or_default();
                out.push_str(&describe(order, expected, observed));
            }
        }
        if self.parked > 0 {
            out.push_str(&format!(
                "{} records parked (dead letters, FAILED or HELD inbox rows)\n",
                self.parked
            ));
        }
        out
    }
}

/// An order's produced versions, view row, stored version and every move, for the report.
fn describe(order: &str, expected: &Expected, observed: &Observed) -> String {
    let mut out = format!(
        "    produced: newest version {:?}; view: {:?}; stored version: {:?}\n",
        expected.newest.get(order).map(|n| n.1),
        observed.view.get(order),
        observed.stored.get(order)
    );
    for m in observed.history.get(order).into_iter().flatten() {
        let from = m.from.map_or("NULL".to_string(), |v| v.to_string());
        out.push_str(&format!(
            "    history id {} {} from_version {from} to_version {} message_id {} ({})\n",
            m.id,
            m.status,
            m.to,
            m.message_id,
            match expected.ids.get(&m.message_id) {
                Some((o, v)) if o == order => format!("produced as version {v}"),
                Some((o, v)) => format!("produced for order {o} version {v}"),
                None => "not produced by this run".into(),
            }
        ));
    }
    out
}

/// Why an order's moves are not a chain of strictly rising versions (with `delta`: of every
/// version, one at a time), if they are not.
fn chain_break(moves: &[Move], delta: bool) -> Option<String> {
    let mut reached: Option<i64> = None;
    for m in moves {
        if m.from != reached {
            return Some(format!(
                "move {} starts from version {:?}, but the order was at {:?}",
                m.id, m.from, reached
            ));
        }
        if reached.is_some_and(|r| m.to <= r) {
            return Some(format!(
                "move {} goes from version {:?} back to {} ({})",
                m.id, m.from, m.to, m.status
            ));
        }
        if delta && m.to != reached.unwrap_or(0) + 1 {
            return Some(format!(
                "move {} skips from version {:?} to {} (delta applies every version)",
                m.id, m.from, m.to
            ));
        }
        reached = Some(m.to);
    }
    None
}

/// `delta`: every version must have been applied, one move each, in order.
fn check(expected: &Expected, observed: &Observed, delta: bool) -> Verdict {
    let mut v = Verdict {
        parked: observed.dead_letters + observed.failed + observed.held,
        ..Verdict::default()
    };
    for (order, &(acked, produced)) in &expected.newest {
        let Some((status, version)) = observed.view.get(order) else {
            v.missing.push(format!("{order}: no row"));
            continue;
        };
        // The newest acknowledged version, or a newer one whose acknowledgement was lost.
        let want = expected.statuses.get(&(order.clone(), *version));
        if (acked..=produced).contains(version) && want == Some(&status.as_str()) {
            v.at_newest += 1;
        } else {
            v.wrong.push(format!(
                "{order}: {status} at version {version}, not {} at version {acked}",
                expected.statuses[&(order.clone(), acked.max(1))]
            ));
        }
        if observed.stored.get(order) != Some(version) {
            v.stored_off.push(format!(
                "{order}: stored version {:?}, view at {version}",
                observed.stored.get(order)
            ));
        }
    }
    for order in observed.view.keys() {
        if !expected.newest.contains_key(order) {
            v.wrong
                .push(format!("{order}: a row for an order never produced"));
        }
    }
    for (order, moves) in &observed.history {
        v.moves += moves.len();
        if let Some(why) = chain_break(moves, delta) {
            v.broken.push(format!("{order}: {why}"));
        }
        for m in moves {
            let status = expected.statuses.get(&(order.clone(), m.to));
            let source = expected.ids.get(&m.message_id);
            if status != Some(&m.status.as_str()) || source != Some(&(order.clone(), m.to)) {
                v.bad_moves.push(format!(
                    "{order}: move {} to version {} with status {} and message {}",
                    m.id, m.to, m.status, m.message_id
                ));
            }
        }
        let last = moves.last().map(|m| (m.status.clone(), m.to));
        if last.as_ref() != observed.view.get(order) {
            v.view_vs_history.push(format!(
                "{order}: last move {last:?}, view {:?}",
                observed.view.get(order)
            ));
        }
    }
    for order in observed.view.keys() {
        if !observed.history.contains_key(order) {
            v.view_vs_history
                .push(format!("{order}: a view row without any move"));
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> Shape {
        Shape {
            orders: 50,
            versions: 6,
            stale: 0.2,
            duplicates: 0.05,
            window: 24,
        }
    }

    #[test]
    fn the_stream_is_out_of_order_with_stale_copies_after_the_newest() {
        let records = plan("t", &shape(), &mut fastrand::Rng::with_seed(3));
        let originals: Vec<&Record> = records
            .iter()
            .filter(|r| r.kind == Kind::Original)
            .collect();
        assert_eq!(originals.len(), 300);
        // Some order has a later version before an earlier one.
        let mut seen: HashMap<&str, i64> = HashMap::new();
        let mut inversions = 0;
        for r in &originals {
            let top = seen.entry(r.order.as_str()).or_insert(0);
            if r.version < *top {
                inversions += 1;
            }
            *top = (*top).max(r.version);
        }
        assert!(inversions > 30, "only {inversions} versions out of order");
        // Every stale copy comes after every original of its order, with a new id and the
        // same bytes; a duplicate is the same record.
        for (i, r) in records.iter().enumerate() {
            match r.kind {
                Kind::Original => {}
                Kind::Stale => {
                    assert!(records[i..]
                        .iter()
                        .all(|o| o.kind != Kind::Original || o.order != r.order));
                    let original = records
                        .iter()
                        .find(|o| {
                            o.kind == Kind::Original && o.order == r.order && o.version == r.version
                        })
                        .unwrap();
                    assert_ne!(original.event_id, r.event_id);
                    assert_eq!(original.payload, r.payload);
                }
                Kind::Duplicate => {
                    let original = records[..i]
                        .iter()
                        .find(|o| o.kind == Kind::Original && o.event_id == r.event_id)
                        .unwrap();
                    assert_eq!((&original.key, &original.payload), (&r.key, &r.payload));
                }
            }
        }
        let stale = records.iter().filter(|r| r.kind == Kind::Stale).count();
        assert!((30..=90).contains(&stale), "{stale} stale copies");
    }

    fn moves(chain: &[(Option<i64>, i64)]) -> Vec<Move> {
        chain
            .iter()
            .enumerate()
            .map(|(i, (from, to))| Move {
                id: i as i64 + 1,
                status: "S".into(),
                from: *from,
                to: *to,
                message_id: Uuid::nil(),
            })
            .collect()
    }

    #[test]
    fn a_chain_must_start_from_nothing_and_only_rise() {
        assert_eq!(chain_break(&moves(&[(None, 2), (Some(2), 6)]), false), None);
        assert!(chain_break(&moves(&[(Some(1), 2)]), false).is_some());
        assert!(chain_break(&moves(&[(None, 4), (Some(4), 3)]), false).is_some());
        assert!(chain_break(&moves(&[(None, 4), (Some(4), 4)]), false).is_some());
        assert!(chain_break(&moves(&[(None, 2), (Some(3), 5)]), false).is_some());
        // Delta: every version, one at a time.
        assert_eq!(chain_break(&moves(&[(None, 1), (Some(1), 2)]), true), None);
        assert!(chain_break(&moves(&[(None, 2), (Some(2), 6)]), true).is_some());
        assert!(chain_break(&moves(&[(None, 1), (Some(1), 3)]), true).is_some());
    }

    #[test]
    fn the_verifier_passes_a_right_ledger_and_names_a_regression() {
        let records = plan("t", &shape(), &mut fastrand::Rng::with_seed(5));
        let acked = vec![true; records.len()];
        let expected = Expected::from(&records, &acked);
        // The engine applied version 2, then the newest, of every order.
        let mut observed = Observed::default();
        let id_of = |order: &str, version: i64| {
            records
                .iter()
                .find(|r| r.order == order && r.version == version)
                .unwrap()
                .event_id
        };
        for order in expected.newest.keys() {
            let status = |v: i64| expected.statuses[&(order.clone(), v)].to_string();
            observed.view.insert(order.clone(), (status(6), 6));
            observed.stored.insert(order.clone(), 6);
            observed.history.insert(
                order.clone(),
                vec![
                    Move {
                        id: 1,
                        status: status(2),
                        from: None,
                        to: 2,
                        message_id: id_of(order, 2),
                    },
                    Move {
                        id: 2,
                        status: status(6),
                        from: Some(2),
                        to: 6,
                        message_id: id_of(order, 6),
                    },
                ],
            );
        }
        let v = check(&expected, &observed, false);
        assert!(v.verified(), "{v:?}");
        assert_eq!((v.at_newest, v.moves), (50, 100));

        // "PAID after REFUNDED": a stale copy of version 2 applied over version 6.
        let order = expected.newest.keys().next().unwrap().clone();
        let paid = expected.statuses[&(order.clone(), 2)].to_string();
        observed.history.get_mut(&order).unwrap().push(Move {
            id: 3,
            status: paid.clone(),
            from: Some(6),
            to: 2,
            message_id: id_of(&order, 2),
        });
        observed.view.insert(order.clone(), (paid, 2));
        let v = check(&expected, &observed, false);
        assert!(!v.verified());
        assert_eq!(v.broken.len(), 1);
        assert_eq!(v.wrong.len(), 1);
        assert_eq!(v.stored_off.len(), 1);
        assert!(v.details(&expected, &observed).contains(&order));
    }
}
