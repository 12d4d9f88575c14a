//! What the bench's JVM peers (Kafka Connect's JDBC sink, `connect/`; Flink's XA sink, `flink/`)
//! share: a database of their own next to the engine's, the JDBC address of it, the topic's ends
//! and a consumer group's committed offsets against them, and the check of a peer's table
//! against what loadgen produced.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::{bail, Context};
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use uuid::Uuid;

use super::worker::PARTITIONS;

/// The columns both peers' tables share: the payment's fields as loadgen writes them, keyed by
/// event id, and `loaded_at` (`clock_timestamp()` when the row was first written, like the
/// engine's `credited_at`). `{t}` is the table; `{more}` is more columns (or nothing).
pub(super) const CREATE_TABLE: &str =
    "CREATE TABLE {t} (event_id uuid PRIMARY KEY, payment_id text NOT NULL, \
     user_id text NOT NULL, amount_paise bigint NOT NULL, occurred_at timestamptz NOT NULL, \
     loaded_at timestamptz NOT NULL DEFAULT clock_timestamp(){more})";

/// `DROP TABLE IF EXISTS` and [`CREATE_TABLE`] with `more` columns (each starting with `, `).
pub(super) async fn create_table(
    db: &tokio_postgres::Client,
    table: &str,
    more: &str,
) -> anyhow::Result<()> {
    let create = CREATE_TABLE.replace("{t}", table).replace("{more}", more);
    db.batch_execute(&format!("DROP TABLE IF EXISTS {table}; {create}"))
        .await
        .with_context(|| format!("creating the peer's table {table}"))
}

/// A client of the database `name` (created if missing) and its config, from `DATABASE_URL`.
pub(super) async fn database(
    url: &str,
    name: &str,
) -> anyhow::Result<(tokio_postgres::Client, tokio_postgres::Config)> {
    let mut cfg: tokio_postgres::Config = url.parse().context("parsing DATABASE_URL")?;
    let (db, conn) = cfg.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    match db.batch_execute(&format!("CREATE DATABASE {name}")).await {
        Ok(()) => {}
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_DATABASE) => {}
        Err(e) => return Err(e).with_context(|| format!("creating the database {name}")),
    }
    cfg.dbname(name);
    let (db, conn) = cfg.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok((db, cfg))
}

/// Where a JVM peer's JDBC driver connects: the server of `DATABASE_URL`, one of its databases.
pub(super) struct Jdbc {
    pub(super) url: String,
    pub(super) user: String,
    /// Written into the peer's config or arguments only, never printed.
    pub(super) password: String,
}

impl Jdbc {
    pub(super) fn new(pg: &tokio_postgres::Config, database: &str) -> anyhow::Result<Jdbc> {
        let host = match pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            _ => bail!("the JVM peers' JDBC driver needs a TCP host in DATABASE_URL"),
        };
        let port = pg.get_ports().first().copied().unwrap_or(5432);
        Ok(Jdbc {
            url: format!("jdbc:postgresql://{host}:{port}/{database}"),
            user: pg.get_user().unwrap_or("postgres").to_string(),
            password: String::from_utf8_lossy(pg.get_password().unwrap_or_default()).into_owned(),
        })
    }
}

/// The topic's high watermarks, by partition.
pub(super) fn highs(brokers: &str, topic: &str) -> anyhow::Result<Vec<i64>> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    (0..PARTITIONS)
        .map(|p| Ok(c.fetch_watermarks(topic, p, Duration::from_secs(10))?.1))
        .collect()
}

/// A client that only reads the committed offsets of the consumer group `group`; it never
/// joins the group.
pub(super) fn group_reader(brokers: &str, group: &str) -> anyhow::Result<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .create()?)
}

/// Records between the group's committed offsets and the topic's ends.
pub(super) fn lag(group: &BaseConsumer, topic: &str, highs: &[i64]) -> anyhow::Result<i64> {
    let mut tpl = TopicPartitionList::new();
    for p in 0..PARTITIONS {
        tpl.add_partition(topic, p);
    }
    let committed = group.committed_offsets(tpl, Duration::from_secs(5))?;
    Ok((0..PARTITIONS)
        .map(|p| {
            let at = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => 0,
            };
            (highs[p as usize] - at).max(0)
        })
        .sum())
}

pub(super) async fn delete_topics(brokers: &str, topics: &[&str]) {
    let admin: Result<AdminClient<DefaultClientContext>, _> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create();
    if let Ok(admin) = admin {
        let _ = admin.delete_topics(topics, &AdminOptions::new()).await;
    }
}

/// A peer's table against what loadgen produced, event by event.
#[derive(Debug, Default, Clone, Serialize)]
pub(super) struct TableCheck {
    pub(super) rows: u64,
    /// Events produced whose row is missing, or (a table that counts them) whose records were
    /// applied fewer times than they were sent.
    pub(super) lost: u64,
    /// Events whose records were applied more times than they were sent (a table that counts).
    pub(super) doubled: u64,
    /// Rows of events never produced.
    pub(super) unexpected: u64,
    /// Rows whose amount is not the one produced.
    pub(super) wrong_amount: u64,
    /// The counts and the first few events of each kind, in words.
    pub(super) problems: Vec<String>,
    pub(super) verified: bool,
}

/// What differs between `table` and the payments: `expected` holds each event's amount, and
/// `copies`, for a table with an `applied` column (how many of the event's records were
/// applied), how many records of each event the broker acknowledged.
pub(super) async fn check_table(
    db: &tokio_postgres::Client,
    table: &str,
    expected: &HashMap<Uuid, i64>,
    copies: Option<&HashMap<Uuid, u32>>,
) -> anyhow::Result<TableCheck> {
    let applied = if copies.is_some() { "applied" } else { "1" };
    let rows = db
        .query(
            &format!("SELECT event_id, amount_paise, {applied}::int4 FROM {table}"),
            &[],
        )
        .await
        .with_context(|| format!("reading the peer's table {table}"))?;
    let mut c = TableCheck {
        rows: rows.len() as u64,
        ..TableCheck::default()
    };
    let mut seen = HashMap::with_capacity(rows.len());
    // The first few of each kind, in words: a broken table may be wrong in every row.
    let mut examples = Vec::new();
    let mut example = |text: String| {
        if examples.len() < 9 {
            examples.push(text);
        }
    };
    let mut sum = 0i64;
    for r in &rows {
        let (id, amount, times): (Uuid, i64, i32) = (r.get(0), r.get(1), r.get(2));
        sum += amount;
        seen.insert(id, times);
        match expected.get(&id) {
            Some(&a) if a == amount => {}
            Some(&a) => {
                c.wrong_amount += 1;
                example(format!("{id}: amount {amount}, produced {a}"));
            }
            None => {
                c.unexpected += 1;
                example(format!("{id}: not produced"));
            }
        }
    }
    for id in expected.keys() {
        let sent = copies.map_or(1, |c| c.get(id).copied().unwrap_or(1)) as i32;
        match seen.get(id) {
            None => {
                c.lost += 1;
                example(format!("{id}: no row"));
            }
            Some(&n) if n < sent => {
                c.lost += 1;
                example(format!("{id}: {n} of its {sent} records applied"));
            }
            Some(&n) if n > sent => {
                c.doubled += 1;
                example(format!("{id}: applied {n} times, {sent} records sent"));
            }
            Some(_) => {}
        }
    }
    let want: i64 = expected.values().sum();
    c.verified =
        c.lost == 0 && c.doubled == 0 && c.unexpected == 0 && c.wrong_amount == 0 && sum == want;
    if !c.verified {
        c.problems.push(format!(
            "{} rows (amounts {sum}) against {} payments produced (amounts {want}): {} lost, {} \
             doubled, {} unexpected, {} with a wrong amount",
            c.rows,
            expected.len(),
            c.lost,
            c.doubled,
            c.unexpected,
            c.wrong_amount
        ));
    }
    c.problems.extend(examples);
    Ok(c)
}
