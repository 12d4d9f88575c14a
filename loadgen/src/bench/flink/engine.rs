//! The engine on the peer's effect: the batch strategy draining the topic Flink's drains read,
//! with an SQL handler whose statement is the peer's upsert into a table of the peer's shape
//! (in the engine's database, as the engine's effect must be: one transaction holds it, its
//! dedupe keys and its offsets). `batch_vs_flink_xa` sets the cashback effect (four writes a
//! payment: the key, the credit, the wallet, the outbox row) against Flink's one upsert; this run
//! sets one write against one write, measured the same way: rows' commit times from the same
//! clock, from the first row written to the last commit.

use std::time::{Duration, Instant};

use anyhow::ensure;

use super::commits::CommitClock;
use super::{committed_rows, Ctx, DrainRun, Topic, MORE_COLUMNS, STALL};
use crate::bench::db::Db;
use crate::bench::peer::{check_table, create_table};
use crate::bench::worker::Worker;

/// The peer's upsert (peers/flink-xa, `FlinkXaPeer.UPSERT`) over the batch's fresh messages,
/// `{t}` the table. In key order, as the SQL handler's docs ask (two partitions' batches lock
/// rows in one order). A redelivered record is not in `fresh_messages`, so `applied` counts each
/// event once, as the check expects of an exactly-once sink.
const STATEMENT: &str = "INSERT INTO {t} (event_id, payment_id, user_id, amount_paise, \
occurred_at, kafka_ts) SELECT message_id, payload->>'payment_id', payload->>'user_id', \
(payload->>'amount_paise')::int8, (payload->>'occurred_at')::timestamptz, kafka_ts \
FROM fresh_messages ORDER BY message_id ON CONFLICT (event_id) DO UPDATE SET \
payment_id = EXCLUDED.payment_id, user_id = EXCLUDED.user_id, \
amount_paise = EXCLUDED.amount_paise, occurred_at = EXCLUDED.occurred_at, \
kafka_ts = EXCLUDED.kafka_ts, applied = {t}.applied + 1";

/// The handler's statement as the report shows it (`{t}` for the run's table).
pub(super) fn statement() -> &'static str {
    STATEMENT
}

/// One worker of the engine (`bin`), batch strategy with its defaults, draining `topic` into a
/// fresh table of the peer's shape. `checkpoint_interval_ms` is 0: the engine commits each batch.
pub(super) async fn drain(
    ctx: &Ctx<'_>,
    bin: &std::path::Path,
    topic: &Topic,
) -> anyhow::Result<DrainRun> {
    let name = format!("{}-engine", topic.name);
    let table = name.replace('-', "_");
    let (db, conn) =
        tokio_postgres::connect(&ctx.args.services.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    create_table(&db, &table, MORE_COLUMNS).await?;
    let toml = format!(
        "[worker]\nid = \"{name}\"\n[[consumer]]\nname = \"{name}\"\ntopics = [\"{}\"]\n\
         strategy = \"batch\"\n[consumer.handler]\nkind = \"sql\"\nstatement = '''{}'''\n",
        topic.name,
        STATEMENT.replace("{t}", &table)
    );
    let clock = CommitClock::start(&ctx.args.services.database_url).await?;
    let pg = Db::connect(ctx.args).await?;
    let mark = pg.mark().await?;
    let clock_cpu = clock.cpu_s();
    let mut worker = Worker::start_config(bin, ctx.args, &toml, &name).await?;
    let waited = until_stored(&db, &mut worker, &name, topic).await;
    let (rss_mb, cpu_s) = worker.usage();
    // Stopped first: the cost's mark waits for the engine's sessions to end.
    worker.stop().await?;
    let cost = pg.cost_since(&mark).await?;
    let clock_cpu = clock.cpu_s() - clock_cpu;
    let commits = clock.stop();
    waited?;
    let check = check_table(&db, &table, &topic.expected, Some(&topic.copies)).await?;
    let rows = committed_rows(&db, &table, &commits).await?;
    db.batch_execute(&format!("DROP TABLE {table}")).await?;
    Ok(DrainRun::measured(
        topic,
        &rows,
        (rss_mb, cpu_s),
        &cost,
        clock_cpu,
        check,
    ))
}

/// Until the consumer's stored offsets reach the topic's ends (each partition's last batch
/// committed with them: its rows are in the table); failing if the worker exits or the offsets
/// stand still for [`STALL`]. Six rows a poll, not a count of the growing table.
async fn until_stored(
    db: &tokio_postgres::Client,
    worker: &mut Worker,
    consumer: &str,
    topic: &Topic,
) -> anyhow::Result<()> {
    let want: i64 = topic.highs.iter().sum();
    let (mut last, mut moved) = (-1_i64, Instant::now());
    loop {
        let stored: i64 = (db
            .query_one(
                "SELECT coalesce(sum(next_offset), 0)::int8 FROM consumer_offsets \
                 WHERE consumer = $1 AND topic = $2",
                &[&consumer, &topic.name],
            )
            .await?)
            .get(0);
        if stored >= want {
            return Ok(());
        }
        if stored != last {
            (last, moved) = (stored, Instant::now());
        }
        if let Some(why) = worker.exited(&format!("{consumer}.log")) {
            anyhow::bail!("the engine's drain of {}: {why}", topic.name);
        }
        ensure!(
            moved.elapsed() < STALL,
            "the engine's drain of {} stalled at offset {stored} of {want} (see {consumer}.log)",
            topic.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
