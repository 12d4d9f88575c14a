//! `inbox-burst`, the inbox's own scenario: a burst stored by a receiver whose processors lag,
//! then drained by a worker with processors, with the ingest and drain rates in its note.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;

use super::checks::{offsets_equal, verify_effects};
use super::workers::{Env, Proc};
use crate::{produce_stage, Session, Spec};

/// Payments `inbox-burst` produces, as fast as the broker acknowledges them.
pub(super) const BURST: u64 = 100_000;

/// `inbox-burst`: `BURST` payments (and their duplicates and poison) as fast as the broker
/// takes them, into an inbox consumer whose processors lag: a worker with no processors
/// (`processors = 0`) receives everything, so Kafka's offsets must move at insert speed with
/// nothing applied. It stops cleanly (Kafka's committed offsets must then equal PostgreSQL's),
/// and a worker with `processors` processors drains the inbox. Returns what was produced, the
/// live worker, the note with the ingest and drain rates, and whether the burst's own checks
/// held.
pub(super) async fn inbox_burst(
    env: &mut Env<'_>,
    session: &Session,
    spec: &Spec,
    receiver_config: &Path,
    processors: usize,
) -> anyhow::Result<(crate::Produced, Vec<Proc>, String, bool)> {
    let args = env.args;
    let topic = spec.topic.as_str();
    let (db, conn) =
        tokio_postgres::connect(&args.services.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    // 1. The receiver owns every partition before the burst.
    let owner = env.next_id();
    let receiver = env.start_with(receiver_config, None)?;
    let claimed = async {
        loop {
            let n: i64 = db
                .query_one(
                    "SELECT count(*) FROM consumer_offsets
                     WHERE consumer = $1 AND topic = $1 AND owner = $2",
                    &[&topic, &owner],
                )
                .await?
                .get(0);
            if n >= i64::from(spec.partitions) {
                return Ok::<_, anyhow::Error>(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), claimed)
        .await
        .context("the receiver did not claim every partition within 60 s")??;

    // 2. The burst; the receiver stores while it comes.
    let t0 = std::time::Instant::now();
    let produced = produce_stage(session, spec).await?;
    let acked = produced.acked();
    let produce_s = produced.duration_s;
    let ingested = loop {
        match session.watcher.lag(&session.db, topic).await {
            Ok(0) => break true,
            _ if t0.elapsed() > spec.drain_timeout => break false,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let ingest_s = t0.elapsed().as_secs_f64();
    anyhow::ensure!(
        ingested,
        "the receiver did not store the burst within {:?}",
        spec.drain_timeout
    );
    let peak_lag = produced
        .lag
        .lock()
        .unwrap()
        .iter()
        .map(|p| p.lag)
        .max()
        .unwrap_or(0);
    // Server side: rows stored, over the span of their transactions' start times.
    let row = db
        .query_one(
            "SELECT count(*),
                    coalesce(extract(epoch FROM max(received_at) - min(received_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&topic],
        )
        .await?;
    let (rows, store_span): (i64, f64) = (row.get(0), row.get(1));
    let effects_before = verify_effects(&args.services.database_url, topic).await?;
    let open_before = crate::verify::inbox_open(&db, topic).await?;
    // 3. A clean stop commits to Kafka exactly what PostgreSQL stored.
    receiver.stop().await?;
    let equal = offsets_equal(args, topic, spec.partitions).await?;

    // 4. A worker with processors drains the inbox.
    let t1 = std::time::Instant::now();
    let worker = env.start(None)?;
    // A drain that makes no progress for STALL is stalled: the scenario fails, with the
    // claim queries PostgreSQL was running at that moment in the note.
    const STALL: Duration = Duration::from_secs(60);
    let mut stalled: Option<String> = None;
    let (mut least, mut progress_at) = (i64::MAX, std::time::Instant::now());
    let drained = loop {
        match crate::verify::inbox_open(&db, topic).await {
            Ok(0) => break true,
            Ok(n) if n < least => (least, progress_at) = (n, std::time::Instant::now()),
            Ok(n) if progress_at.elapsed() > STALL => {
                stalled = Some(format!(
                    "drain STALLED: {n} rows open and none done for {} s ({}); ",
                    STALL.as_secs(),
                    slow_claims(&db).await?
                ));
                break false;
            }
            _ => {}
        }
        if t1.elapsed() > spec.drain_timeout {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let drain_s = t1.elapsed().as_secs_f64();
    let left = crate::verify::inbox_open(&db, topic).await.unwrap_or(0);
    let row = db
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'DONE'),
                    count(*) FILTER (WHERE status = 'FAILED'),
                    coalesce(extract(epoch FROM max(done_at) - min(done_at)), 0)::float8
             FROM inbox WHERE consumer = $1",
            &[&topic],
        )
        .await?;
    let (done, failed, done_span): (i64, i64, f64) = (row.get(0), row.get(1), row.get(2));
    let rate = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
    let note = format!(
        "ingest (0 processors): {acked} records acked in {produce_s:.1} s ({:.0}/s), all \
         stored {ingest_s:.1} s after producing began: {:.0} records/s ({rows} rows, {:.0} rows/s by \
         received_at), peak lag {peak_lag}; {open_before} rows open and {effects_before} \
         effects; Kafka offset = stored offset after a clean stop: {equal}. drain \
         ({processors} processors): {}{} rows in {:.1} s: {:.0} rows/s ({:.0} \
         rows/s by done_at){}, {failed} FAILED",
        rate(acked as f64, produce_s),
        rate(acked as f64, ingest_s),
        rate(rows as f64, store_span),
        stalled.as_deref().unwrap_or(""),
        open_before - left,
        drain_s,
        rate((open_before - left) as f64, drain_s),
        rate(done as f64, done_span),
        if drained {
            String::new()
        } else {
            format!(" NOT DRAINED ({left} rows open)")
        },
    );
    let ok = drained && stalled.is_none() && equal && effects_before == 0 && open_before == rows;
    Ok((produced, vec![worker], note, ok))
}

/// What a stalled drain's processors are doing: the inbox claims running for more than 10 s.
async fn slow_claims(db: &tokio_postgres::Client) -> anyhow::Result<String> {
    let rows = db
        .query(
            "SELECT extract(epoch FROM now() - query_start)::int, left(query, 40)
             FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
               AND now() - query_start > interval '10 seconds'",
            &[],
        )
        .await?;
    if rows.is_empty() {
        return Ok("no query running for more than 10 s".into());
    }
    let each: Vec<String> = rows
        .iter()
        .map(|r| format!("{} s: {:?}", r.get::<_, i32>(0), r.get::<_, String>(1)))
        .collect();
    Ok(format!("queries running: {}", each.join(", ")))
}
