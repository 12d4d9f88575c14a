//! The Redis pre-filter's benchmark: the seed's "day-long replay", a topic read again from its
//! first offset after every message was applied, so 100% of it is duplicates. A phase of
//! `loadgen bench` (`prefilter_replay_speedup` in report.json), and `loadgen replay` alone.
//!
//! 1. pre-fill a topic (6 partitions, 10% relay resends, as the batch drain's);
//! 2. drain it once with a worker that has the pre-filter: PostgreSQL and Redis both hold
//!    every key; verified exactly-once (just before, a second fresh topic of the same kind is
//!    drained without the pre-filter: what the pre-filter costs where nothing hits);
//! 3. replay the whole topic eight times (the consumer's stored offsets set back to 0), with
//!    and without the pre-filter in the order with, without, without, with, twice, so that both
//!    see the same stretch of a shared, noisy machine; each replay verified: the ledger exactly as
//!    it was, no new effect, no new dedupe key; a replay with the pre-filter must also have hit
//!    for every record (else it measured something else).
//!
//! A replay's rate is its records from its first to its last commit over that time, polled
//! every 5 ms from `consumer_offsets` (the worker's start-up and group join are left out).
//! Redis comes from `REDIS_URL`, or `scripts/stack.sh redis-up`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;

use crate::produce::{Mix, Step};
use crate::{finish_stage, produce_stage, Session, Spec};

/// `loadgen replay`: this phase alone.
#[derive(Debug, clap::Args)]
pub struct ReplayArgs {
    #[command(flatten)]
    services: crate::Services,
    /// Payments in the topic (10% more records with the resends).
    #[arg(long, default_value_t = 100_000)]
    events: u64,
    /// The engine's binary (default: `effectively` next to this one).
    #[arg(long)]
    effectively: Option<PathBuf>,
    /// Where replay.json and the workers' configs and logs go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

#[derive(Debug, Default, Serialize)]
pub struct ReplayReport {
    pub events: u64,
    pub records: u64,
    /// Records/s of the replays with the pre-filter, over their summed time.
    pub with_prefilter_msg_s: f64,
    /// The same without it: every record goes through staging and the dedupe insert.
    pub without_prefilter_msg_s: f64,
    /// with / without.
    pub speedup: f64,
    /// What the pre-filter saves in the unit that matters on a busy primary: PostgreSQL's CPU
    /// per replayed record (µs), and buffer accesses on the dedupe ledger per record, the mean
    /// of the replays with it and of those without.
    pub pg_cpu_us_per_record_with: f64,
    pub pg_cpu_us_per_record_without: f64,
    pub dedupe_buffers_per_record_with: f64,
    pub dedupe_buffers_per_record_without: f64,
    /// The first drain (fresh keys, with the pre-filter): what a replay is compared with.
    pub first_drain_msg_s: f64,
    /// Where it cannot pay off: a fresh topic of the same kind drained without the pre-filter,
    /// just before the first drain. `fresh_cost` = first drain / this (one pair: indicative).
    pub fresh_without_prefilter_msg_s: f64,
    pub fresh_cost: f64,
    pub first_drain: ReplayRun,
    /// After the first drain, the share of the events whose dedupe key is in Redis (the keys
    /// counted with `SCAN`, over the events): what a later replay can hit at best. A SET that timed
    /// out or failed loses only a future hit, never a message, so this is reported beside
    /// `verified`, not in it.
    pub coverage: f64,
    /// The lowest share of records that hit, over the replays with the pre-filter.
    pub min_hit_rate: f64,
    pub runs: Vec<ReplayRun>,
    /// Exactly-once and nothing else: every run's ledger verified and unchanged by the
    /// replays. Coverage and hit rates are beside it.
    pub verified: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Debug, Default, Serialize)]
pub struct ReplayRun {
    pub prefilter: bool,
    /// Records between the first and the last commit seen.
    pub records: u64,
    pub seconds: f64,
    pub msg_s: f64,
    /// The worker's pre-filter hits (its /metrics), and the keys it fell through on.
    pub hits: u64,
    pub errors: u64,
    /// `hits / records`.
    pub hit_rate: f64,
    /// Dedupe keys written to Redis after the commits, and those whose SET failed or timed out
    /// (`effectively_prefilter_sets_total` by result).
    pub keys_set: u64,
    pub keys_not_set: u64,
    /// Batches the worker committed (its /metrics): one transaction each.
    pub batches: u64,
    /// Mean Redis round trip of the pre-filter's lookups (one `MGET` per batch) and sets (one
    /// pipeline per commit), in ms, from the worker's /metrics.
    pub lookup_ms_mean: f64,
    pub set_ms_mean: f64,
    /// What the run cost PostgreSQL, per record replayed, from the worker's start to its exit:
    /// the CPU of all its processes (`bench::pg_cpu_seconds`), and the buffer accesses (hits
    /// and reads, heap and index) on the dedupe ledger `processed_messages`: the index probes
    /// a hit in Redis saves.
    pub pg_cpu_us_per_record: f64,
    pub dedupe_buffers_per_record: f64,
    pub verified: bool,
}

/// `loadgen replay`.
pub async fn run(args: ReplayArgs) -> anyhow::Result<bool> {
    let bin = match &args.effectively {
        Some(p) => p.clone(),
        None => std::env::current_exe()?.with_file_name("effectively"),
    };
    std::fs::create_dir_all(&args.out)?;
    let report = phase(
        &bin,
        &args.services.brokers,
        &args.services.database_url,
        &args.out,
        args.events,
    )
    .await;
    let path = args.out.join("replay.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)? + "\n")?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    eprintln!("report: {}", path.display());
    Ok(report.verified)
}

/// The phase, for `loadgen bench`: never fails the other phases; a failure is in `error`.
pub async fn phase(
    bin: &Path,
    brokers: &str,
    database_url: &str,
    out: &Path,
    events: u64,
) -> ReplayReport {
    eprintln!("== pre-filter: a 100%-duplicate replay of {events} events, with and without Redis");
    let mut report = ReplayReport {
        events,
        ..ReplayReport::default()
    };
    if let Err(e) = measure(bin, brokers, database_url, out, &mut report).await {
        eprintln!("   the pre-filter phase failed: {e:#}");
        report.error = Some(format!("{e:#}"));
        report.verified = false;
    }
    report
}

async fn measure(
    bin: &Path,
    brokers: &str,
    database_url: &str,
    out: &Path,
    report: &mut ReplayReport,
) -> anyhow::Result<()> {
    let redis = redis_url()?;
    let name = format!("bench-replay-{:06x}", fastrand::u32(..0xffffff));
    let spec = spec_of(brokers, database_url, out, &name, report.events);
    let session = Session::open(&spec).await?;
    let produced = produce_stage(&session, &spec).await?;
    let records = produced.acked();
    report.records = records;
    let (db, conn) = tokio_postgres::connect(database_url, tokio_postgres::NoTls)
        .await
        .context("connecting to PostgreSQL")?;
    tokio::spawn(conn);

    // What the pre-filter costs where it cannot pay off: the same kind of fresh topic drained
    // without it, just before the first drain (which has it).
    let plain_name = format!("{name}-plain");
    let plain_spec = spec_of(brokers, database_url, out, &plain_name, report.events);
    let plain_session = Session::open(&plain_spec).await?;
    let plain_produced = produce_stage(&plain_session, &plain_spec).await?;
    let plain_records = plain_produced.acked();
    eprintln!("   fresh topic of {plain_records} records drained without the pre-filter");
    let plain = replay(
        bin,
        database_url,
        brokers,
        out,
        &db,
        &plain_name,
        None,
        plain_records,
    )
    .await?;
    let ledger = finish_stage(&plain_session, &plain_spec, &plain_produced).await?;
    anyhow::ensure!(
        ledger.verified,
        "the fresh drain without the pre-filter did not verify"
    );
    report.fresh_without_prefilter_msg_s = plain.msg_s;

    eprintln!("   topic pre-filled: {records} records; first drain with the pre-filter ({redis})");
    let mut first = replay(
        bin,
        database_url,
        brokers,
        out,
        &db,
        &name,
        Some(&redis),
        records,
    )
    .await?;
    let ledger = finish_stage(&session, &spec, &produced).await?;
    anyhow::ensure!(
        ledger.verified,
        "the first drain did not verify exactly-once (see {})",
        spec.report_dir.display()
    );
    first.verified = ledger.verified;
    report.first_drain_msg_s = first.msg_s;
    let held = keys_held(&redis, &name).await?;
    report.coverage = share(held, report.events);
    eprintln!(
        "   first drain: {:.0} msg/s; Redis round trips: lookup {} ms, set {} ms (means); {held} keys in Redis for {} events (coverage {:.4}; SETs ok {}, failed {})",
        first.msg_s, first.lookup_ms_mean, first.set_ms_mean, report.events, report.coverage, first.keys_set, first.keys_not_set
    );
    report.first_drain = first;
    report.fresh_cost = if report.fresh_without_prefilter_msg_s > 0.0 {
        (report.first_drain_msg_s / report.fresh_without_prefilter_msg_s * 100.0).round() / 100.0
    } else {
        0.0
    };
    let before = counts(&db, &name).await?;

    let mut verified = true;
    for with in [true, false, false, true, true, false, false, true] {
        db.execute(
            "UPDATE consumer_offsets SET next_offset = 0 WHERE consumer = $1",
            &[&name],
        )
        .await?;
        let url = with.then_some(redis.as_str());
        let mut run = replay(bin, database_url, brokers, out, &db, &name, url, records).await?;
        let ledger = finish_stage(&session, &spec, &produced).await?;
        let unchanged = counts(&db, &name).await? == before;
        run.hit_rate = share(run.hits, records);
        run.verified = ledger.verified && unchanged;
        eprintln!(
            "   replay {} the pre-filter: {:.0} msg/s ({} records in {:.2} s, {} batches, {} hits (rate {:.4}), {} fell through), verified: {} (ledger {}, unchanged {unchanged})",
            if with { "with" } else { "without" },
            run.msg_s, run.records, run.seconds, run.batches, run.hits, run.hit_rate, run.errors, run.verified, ledger.verified
        );
        verified &= run.verified;
        report.runs.push(run);
    }
    let rate = |with: bool| {
        let (r, s) = (report.runs.iter())
            .filter(|r| r.prefilter == with)
            .fold((0u64, 0.0), |(r, s), run| {
                (r + run.records, s + run.seconds)
            });
        if s > 0.0 {
            (r as f64 / s).round()
        } else {
            0.0
        }
    };
    report.min_hit_rate = (report.runs.iter())
        .filter(|r| r.prefilter)
        .map(|r| r.hit_rate)
        .fold(1.0, f64::min);
    report.with_prefilter_msg_s = rate(true);
    report.without_prefilter_msg_s = rate(false);
    let mean = |with: bool, f: fn(&ReplayRun) -> f64| {
        let xs: Vec<f64> = (report.runs.iter())
            .filter(|r| r.prefilter == with)
            .map(f)
            .collect();
        (xs.iter().sum::<f64>() / xs.len().max(1) as f64 * 10.0).round() / 10.0
    };
    report.pg_cpu_us_per_record_with = mean(true, |r| r.pg_cpu_us_per_record);
    report.pg_cpu_us_per_record_without = mean(false, |r| r.pg_cpu_us_per_record);
    report.dedupe_buffers_per_record_with = mean(true, |r| r.dedupe_buffers_per_record);
    report.dedupe_buffers_per_record_without = mean(false, |r| r.dedupe_buffers_per_record);
    report.speedup = if report.without_prefilter_msg_s > 0.0 {
        (report.with_prefilter_msg_s / report.without_prefilter_msg_s * 100.0).round() / 100.0
    } else {
        0.0
    };
    report.verified = verified;
    eprintln!(
        "   replay: {:.0} msg/s with the pre-filter, {:.0} without: {:.2}x; PostgreSQL CPU per \
         record {:.1} µs with, {:.1} without; dedupe-ledger buffers per record {:.1} with, {:.1} \
         without",
        report.with_prefilter_msg_s,
        report.without_prefilter_msg_s,
        report.speedup,
        report.pg_cpu_us_per_record_with,
        report.pg_cpu_us_per_record_without,
        report.dedupe_buffers_per_record_with,
        report.dedupe_buffers_per_record_without
    );
    Ok(())
}

/// A pre-filled topic of `events` payments and 10% resends, as the batch drain's.
fn spec_of(brokers: &str, database_url: &str, out: &Path, name: &str, events: u64) -> Spec {
    Spec {
        brokers: brokers.to_string(),
        database_url: database_url.to_string(),
        topic: name.to_string(),
        partitions: 6,
        consumer: name.to_string(),
        plan: vec![Step {
            rate: None,
            duration: Duration::from_secs(3600),
        }],
        limit: Some(events),
        mix: Mix {
            resend: 0.10,
            redrive: 0.0,
            redrive_delay: Duration::ZERO,
            double_tap: 0.0,
            poison: 0.0,
        },
        users: 1000,
        rate_bp: 200,
        drain_timeout: Duration::from_secs(900),
        report_dir: out.join(name),
        seed: None,
        quiet: true,
        compression: Default::default(),
    }
}

/// `REDIS_URL`, or the stack's Redis (started if it is not running).
fn redis_url() -> anyhow::Result<String> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        if !url.trim().is_empty() {
            return Ok(url);
        }
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/stack.sh");
    let out = std::process::Command::new("bash")
        .args([script, "redis-up"])
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/stack.sh redis-up")?;
    anyhow::ensure!(out.status.success(), "scripts/stack.sh redis-up failed");
    let text = String::from_utf8(out.stdout)?;
    text.lines()
        .last()
        .map(|l| l.trim().to_string())
        .filter(|l| l.starts_with("redis://"))
        .context("scripts/stack.sh redis-up printed no URL")
}

/// The consumer's credits and dedupe keys: a replay must change neither.
async fn counts(db: &tokio_postgres::Client, consumer: &str) -> anyhow::Result<(i64, i64)> {
    let r = db
        .query_one(
            "SELECT (SELECT count(*) FROM cashback_credits WHERE consumer = $1),
                    (SELECT count(*) FROM processed_messages WHERE consumer = $1)",
            &[&consumer],
        )
        .await?;
    Ok((r.get(0), r.get(1)))
}

/// Runs a worker of `consumer` (with the pre-filter at `redis`, if given) until PostgreSQL's
/// stored offsets reach `records`; its rate from its first to its last commit.
#[allow(clippy::too_many_arguments)]
async fn replay(
    bin: &Path,
    database_url: &str,
    brokers: &str,
    out: &Path,
    db: &tokio_postgres::Client,
    consumer: &str,
    redis: Option<&str>,
    records: u64,
) -> anyhow::Result<ReplayRun> {
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    let file = format!(
        "{consumer}-{}",
        if redis.is_some() { "with" } else { "without" }
    );
    let prefilter = redis
        .map(|u| format!("[consumer.prefilter]\nredis = \"{u}\"\n"))
        .unwrap_or_default();
    let config = out.join(format!("{file}.toml"));
    std::fs::write(
        &config,
        format!(
            "[worker]\nid = \"bench-replay\"\n[[consumer]]\nname = \"{consumer}\"\n\
             topics = [\"{consumer}\"]\nstrategy = \"batch\"\nhandler = {{ kind = \"cashback\" }}\n\
             {prefilter}"
        ),
    )?;
    let log_path = out.join(format!("{file}.log"));
    let (cpu_before, buffers_before) = pg_work(db).await?;
    let mut child = tokio::process::Command::new(bin)
        .args(["run", "--metrics-addr", &addr.to_string(), "--config"])
        .arg(&config)
        .env("KAFKA_BROKERS", brokers)
        .env("DATABASE_URL", database_url)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let started = Instant::now();
    let mut first: Option<(Instant, i64)> = None;
    let end = loop {
        let done: i64 = db
            .query_one(
                "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offsets
                 WHERE consumer = $1",
                &[&consumer],
            )
            .await?
            .get(0);
        let now = Instant::now();
        if done > 0 && first.is_none() {
            first = Some((now, done));
        }
        if done as u64 >= records {
            break now;
        }
        if let Ok(Some(status)) = child.try_wait() {
            anyhow::bail!("the worker exited: {status} (see {})", log_path.display());
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(900),
            "the replay did not finish in 900 s (see {})",
            log_path.display()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let text = scrape(addr).unwrap_or_default();
    // The sum of a metric's samples whose line holds `with`.
    let metric = |name: &str, with: &str| -> u64 {
        (text.lines())
            .filter(|l| l.starts_with(name) && l.contains(with))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    let lookups = "effectively_prefilter_lookups_total{";
    let (hits, errors) = (
        metric(lookups, "result=\"hit\""),
        metric(lookups, "result=\"error\""),
    );
    let batches = metric("effectively_batch_size_records_count{", "");
    let sets = "effectively_prefilter_sets_total{";
    let (keys_set, keys_not_set) = (
        metric(sets, "result=\"ok\""),
        metric(sets, "result=\"error\""),
    );
    let mean_ms = |op: &str| {
        let with = format!("op=\"{op}\"");
        let sum = (text.lines())
            .filter(|l| {
                l.starts_with("effectively_prefilter_duration_seconds_sum{") && l.contains(&with)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        let count = metric("effectively_prefilter_duration_seconds_count{", &with);
        if count > 0 {
            (sum / count as f64 * 1e4).round() / 10.0
        } else {
            0.0
        }
    };
    let (lookup_ms_mean, set_ms_mean) = (mean_ms("lookup"), mean_ms("set"));
    if let Some(pid) = child.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await??;
    anyhow::ensure!(
        status.success(),
        "the worker did not exit cleanly: {status}"
    );
    let (cpu_after, buffers_after) = pg_work(db).await?;
    let per_record = |x: f64| (x / records.max(1) as f64 * 10.0).round() / 10.0;
    let (t0, at_first) = first.context("no commit seen")?;
    let counted = records - at_first as u64;
    let seconds = (end - t0).as_secs_f64();
    Ok(ReplayRun {
        prefilter: redis.is_some(),
        records: counted,
        seconds: (seconds * 1000.0).round() / 1000.0,
        msg_s: if seconds > 0.0 {
            (counted as f64 / seconds).round()
        } else {
            0.0
        },
        hits,
        errors,
        hit_rate: 0.0,
        keys_set,
        keys_not_set,
        batches,
        lookup_ms_mean,
        set_ms_mean,
        pg_cpu_us_per_record: per_record((cpu_after - cpu_before) * 1e6),
        dedupe_buffers_per_record: per_record((buffers_after - buffers_before) as f64),
        verified: false,
    })
}

/// PostgreSQL's CPU seconds so far and the buffer accesses on `processed_messages`, once the
/// engine's sessions are gone (up to 5 s): a session reports its table statistics as it ends.
async fn pg_work(db: &tokio_postgres::Client) -> anyhow::Result<(f64, i64)> {
    super::settle(db, Duration::from_secs(5)).await?;
    let buffers: i64 = db
        .query_one(
            "SELECT coalesce(sum(coalesce(heap_blks_hit, 0) + coalesce(heap_blks_read, 0)
                                 + coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0)), 0)::bigint
             FROM pg_statio_user_tables
             WHERE relid IN (SELECT inhrelid FROM pg_inherits
                             WHERE inhparent = 'public.processed_messages'::regclass)",
            &[],
        )
        .await?
        .get(0);
    let cpu = super::pg_cpu_seconds(db).await.unwrap_or(0.0);
    Ok((cpu, buffers))
}

/// How many pre-filter keys of `consumer` Redis holds (`effectively:{consumer}:*`, by `SCAN`).
async fn keys_held(url: &str, consumer: &str) -> anyhow::Result<u64> {
    let client = redis::Client::open(url)?;
    let mut conn = client.get_multiplexed_async_connection().await?;
    let pattern = format!("effectively:{consumer}:*");
    let mut cursor = 0u64;
    let mut n = 0u64;
    loop {
        let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(&mut conn)
            .await?;
        n += keys.len() as u64;
        if next == 0 {
            return Ok(n);
        }
        cursor = next;
    }
}

/// `part / whole`, to four decimals (0 when `whole` is 0).
fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        return 0.0;
    }
    (part as f64 / whole as f64 * 1e4).round() / 1e4
}

/// `GET /metrics` of the worker, over a plain TCP stream.
fn scrape(addr: SocketAddr) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body)
}
