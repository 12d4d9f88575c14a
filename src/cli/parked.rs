//! `effectively dead-letters | inbox | notifications`: find parked rows, read them, and send
//! them back (redrive, replay, retry) or give them up (discard), one id or every row matching
//! a filter. Every change goes through [`crate::operator`], which audits it.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use clap::{Args, Subcommand};
use uuid::Uuid;

use crate::config::{Config, DatabaseConfig, Strategy, DEFAULT_DATABASE};
use crate::inbox::admin;
use crate::operator::show::{self, As};
use crate::operator::{self, Actor, DeadLetters, Done, InboxRows, Notifications};
use crate::store::{self, parked::Filter};

/// The config file (its `[database]` and `[kafka]` sections), and which of its databases.
#[derive(Debug, Args)]
pub struct ConfigArg {
    #[arg(long, short, default_value = "effectively.toml")]
    pub config: PathBuf,
    /// The database to work on: a `[database.NAME]` of the config (default: `[database]`).
    /// Not needed with `--consumer`: a consumer's rows are in its own database.
    #[arg(long)]
    pub database: Option<String>,
}

/// A loaded config and the database a command works on.
pub(super) struct Loaded {
    pub config: Config,
    pub db: DatabaseConfig,
}

impl ConfigArg {
    /// Loads the config and picks the database: `consumer`'s, when it is one of the config's;
    /// else `--database`; else `[database]`.
    pub(super) fn load(&self, consumer: Option<&str>) -> anyhow::Result<Loaded> {
        let config = Config::load(&self.config)?;
        let name = pick_database(&config, consumer, self.database.as_deref())?;
        let db = config
            .database
            .get(Some(&name))
            .map_err(anyhow::Error::msg)?
            .clone();
        Ok(Loaded { config, db })
    }

    /// [`ConfigArg::load`] for a row named by its id alone: ids are numbered in each database,
    /// so a config of several databases needs `--database` (the same id is another consumer's
    /// row in another database).
    pub(super) fn load_by_id(&self) -> anyhow::Result<Loaded> {
        let loaded = self.load(None)?;
        if self.database.is_none() && !loaded.config.database.named.is_empty() {
            anyhow::bail!(
                "ids are numbered in each database, and this config names {}: say which with \
                 --database (`dead-letters list --consumer NAME` lists a consumer's ids from \
                 its own database)",
                loaded
                    .config
                    .database
                    .names()
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        Ok(loaded)
    }
}

/// The database of `consumer` when the config has it (a `--database` that names another is
/// refused: the consumer's rows are not there), else `database`, else the default. A consumer
/// the config no longer has (its dead letters outlive it) is looked for in `database`.
pub(super) fn pick_database(
    config: &Config,
    consumer: Option<&str>,
    database: Option<&str>,
) -> anyhow::Result<String> {
    let of_consumer = consumer
        .and_then(|name| config.consumers.iter().find(|c| c.name == name))
        .map(|c| c.database_name());
    let name = match (of_consumer, database) {
        (Some(c), Some(d)) if c != d => anyhow::bail!(
            "consumer {:?} is on database {c:?}, not {d:?}: leave --database out",
            consumer.unwrap_or_default()
        ),
        (Some(c), _) => c,
        (None, Some(d)) => d,
        (None, None) => DEFAULT_DATABASE,
    };
    config
        .database
        .get(Some(name))
        .map_err(anyhow::Error::msg)?;
    Ok(name.to_string())
}

/// Which parked rows (every flag narrows).
#[derive(Debug, Args, Clone, Default)]
pub struct FilterArgs {
    /// The consumer (its `name` in the config).
    #[arg(long)]
    pub consumer: Option<String>,
    /// The reason code (`missing_event_id`, `handler_error`, ...; FAILED inbox rows show
    /// `inbox_failed`).
    #[arg(long)]
    pub reason: Option<String>,
    /// The topic the record came from.
    #[arg(long)]
    pub topic: Option<String>,
    /// Its partition.
    #[arg(long)]
    pub partition: Option<i32>,
    /// Parked since this RFC 3339 time, or this long ago ("2h", "3days").
    #[arg(long)]
    pub since: Option<String>,
    /// Parked before this RFC 3339 time, or this long ago.
    #[arg(long)]
    pub until: Option<String>,
}

impl FilterArgs {
    fn is_empty(&self) -> bool {
        self.consumer.is_none()
            && self.reason.is_none()
            && self.topic.is_none()
            && self.partition.is_none()
            && self.since.is_none()
            && self.until.is_none()
    }

    fn filter(&self) -> anyhow::Result<Filter> {
        let now = chrono::Utc::now();
        let time = |s: &Option<String>| -> anyhow::Result<_> {
            s.as_deref()
                .map(|s| admin::parse_since(s, now).map_err(anyhow::Error::msg))
                .transpose()
        };
        Ok(Filter {
            consumer: self.consumer.clone(),
            reason: self.reason.clone(),
            topic: self.topic.clone(),
            partition: self.partition,
            since: time(&self.since)?,
            until: time(&self.until)?,
        })
    }
}

/// What a change asks before it acts.
#[derive(Debug, Args, Clone, Default)]
pub struct ChangeArgs {
    /// Print how many rows would change, and change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Do not ask for confirmation when more than one row would change.
    #[arg(long, short)]
    pub yes: bool,
    /// Why (kept in the audit row).
    #[arg(long)]
    pub note: Option<String>,
    /// With no id and no filter flag: every parked row (refused without it).
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, Subcommand)]
pub enum DeadLetterAction {
    /// Parked dead letters, newest first (`--before ID` for the next page).
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        filter: FilterArgs,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        before: Option<i64>,
    },
    /// One dead letter: coordinates, reason, detail, headers, payload.
    Show {
        #[command(flatten)]
        config: ConfigArg,
        id: i64,
        /// How to print the payload.
        #[arg(long = "as", value_enum, default_value_t = As::Auto)]
        how: As,
    },
    /// Produce parked records back to their topics (same key, headers and bytes, with the
    /// idempotent producer): the normal exactly-once path applies each once, or parks it again.
    Redrive {
        #[command(flatten)]
        config: ConfigArg,
        /// One dead letter; without it, every parked one matching the filter.
        id: Option<i64>,
        #[command(flatten)]
        filter: FilterArgs,
        #[command(flatten)]
        change: ChangeArgs,
        /// Add or replace a header on every copy: `NAME=VALUE` (repeatable).
        #[arg(long = "header", value_parser = header)]
        headers: Vec<(String, String)>,
    },
    /// Give parked records up: they stay in the table, marked discarded, never applied.
    Discard {
        #[command(flatten)]
        config: ConfigArg,
        id: Option<i64>,
        #[command(flatten)]
        filter: FilterArgs,
        #[command(flatten)]
        change: ChangeArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum NotificationAction {
    /// FAILED notifications, newest first.
    List {
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        channel: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: i64,
    },
    /// Put FAILED notifications back to PENDING (same idempotency key): senders call again.
    Retry {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        which: NotificationArgs,
        #[command(flatten)]
        change: ChangeArgs,
    },
    /// Give FAILED notifications up: status DISCARDED, never sent.
    Discard {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        which: NotificationArgs,
        #[command(flatten)]
        change: ChangeArgs,
    },
}

/// One notification (`--event-id` and `--channel`) or the FAILED ones of a channel / since.
#[derive(Debug, Args, Clone)]
pub struct NotificationArgs {
    #[arg(long, requires = "channel")]
    pub event_id: Option<Uuid>,
    #[arg(long)]
    pub channel: Option<String>,
    /// Created since this RFC 3339 time, or this long ago.
    #[arg(long)]
    pub since: Option<String>,
}

fn header(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((n, v)) if !n.is_empty() => Ok((n.to_string(), v.to_string())),
        _ => Err(format!("--header {s:?}: expected NAME=VALUE")),
    }
}

/// A pool of one or two connections to `db` for a command's few statements.
pub(super) fn pool(db: &DatabaseConfig) -> anyhow::Result<deadpool_postgres::Pool> {
    let opts = store::pool::PoolOptions {
        size: 2,
        ..store::pool::PoolOptions::of(db)
    };
    Ok(store::pool::build_for(db, &opts)?)
}

/// Asks to type `n` when more than one row would change, unless `--yes`. Refuses on a closed
/// standard input: a script must say `--yes`.
fn confirm(what: &str, n: u64, change: &ChangeArgs) -> anyhow::Result<bool> {
    confirm_typed(what, n, change.yes)
}

/// [`confirm`] for commands with their own `--yes`.
pub(super) fn confirm_typed(what: &str, n: u64, yes: bool) -> anyhow::Result<bool> {
    if n <= 1 || yes {
        return Ok(true);
    }
    print!("{what}: {n} rows. Type {n} to go on: ");
    std::io::stdout().flush()?;
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line)? == 0 {
        anyhow::bail!("not confirmed (no input); pass --yes to go on without asking");
    }
    Ok(line.trim() == n.to_string())
}

/// Whether to go on: `--dry-run` prints how many `what` would change and stops; otherwise
/// [`confirm`], refusing when not confirmed.
fn proceed(verb: &str, n: u64, what: &str, change: &ChangeArgs) -> anyhow::Result<bool> {
    if change.dry_run {
        println!("would {verb} {n} {what}");
        return Ok(false);
    }
    if !confirm(verb, n, change)? {
        anyhow::bail!("not confirmed: nothing changed");
    }
    Ok(true)
}

/// The outcome line every change prints.
fn report(verb: &str, done: &Done) {
    println!(
        "{verb} {} row(s) (audit action {})",
        done.count, done.action
    );
}

fn selection<T>(
    id: Option<T>,
    filter: &FilterArgs,
    change: &ChangeArgs,
) -> anyhow::Result<Option<T>> {
    if id.is_some() && !filter.is_empty() {
        anyhow::bail!("give an id or filter flags, not both");
    }
    if id.is_none() && filter.is_empty() && !change.all {
        anyhow::bail!("no id and no filter: say --all to take every parked row");
    }
    Ok(id)
}

pub async fn dead_letters(action: DeadLetterAction) -> anyhow::Result<()> {
    match action {
        DeadLetterAction::List {
            config,
            filter,
            limit,
            before,
        } => {
            let target = config.load(filter.consumer.as_deref())?;
            let client = store::pool::connect_to(&target.db).await?;
            let f = filter.filter()?;
            let n = store::parked::count_dead_letters(&client, &f, 10_000).await?;
            let rows = store::parked::dead_letters(&client, &f, before, limit).await?;
            println!("{n} parked dead letter(s) match");
            println!(
                "{:>10}  {:<20} {:<28} {:<22} {:<24} detail",
                "id", "consumer", "record", "reason", "last parked"
            );
            for r in &rows {
                println!(
                    "{:>10}  {:<20} {:<28} {:<22} {:<24} {}",
                    r.id,
                    r.consumer,
                    format!("{}/{}@{}", r.topic, r.partition, r.offset),
                    r.reason,
                    r.last_seen.format("%Y-%m-%d %H:%M:%S"),
                    r.detail
                );
            }
            if rows.len() as i64 == limit {
                if let Some(last) = rows.last() {
                    println!("next page: --before {}", last.id);
                }
            }
            Ok(())
        }
        DeadLetterAction::Show { config, id, how } => {
            let target = config.load_by_id()?;
            let client = store::pool::connect_to(&target.db).await?;
            match store::parked::dead_letter(&client, id).await? {
                Some(d) => print!("{}", show::dead_letter(&d, how)),
                None => anyhow::bail!("no dead letter {id}"),
            }
            Ok(())
        }
        DeadLetterAction::Redrive {
            config,
            id,
            filter,
            change,
            headers,
        } => dead_letter_change(&config, id, &filter, &change, Some(&headers)).await,
        DeadLetterAction::Discard {
            config,
            id,
            filter,
            change,
        } => dead_letter_change(&config, id, &filter, &change, None).await,
    }
}

/// Redrive (with `headers` to add to every copy) or, without headers, discard.
async fn dead_letter_change(
    config: &ConfigArg,
    id: Option<i64>,
    filter: &FilterArgs,
    change: &ChangeArgs,
    redrive: Option<&[(String, String)]>,
) -> anyhow::Result<()> {
    let Loaded { config, db, .. } = match id {
        Some(_) => config.load_by_id()?,
        None => config.load(filter.consumer.as_deref())?,
    };
    let sel = match selection(id, filter, change)? {
        Some(id) => DeadLetters::Id(id),
        None => DeadLetters::Matching(filter.filter()?),
    };
    let verb = if redrive.is_some() {
        "redrive"
    } else {
        "discard"
    };
    let pool = pool(&db)?;
    let n = operator::count_dead_letters(&pool, &sel).await?;
    if !proceed(verb, n, "dead letter(s)", change)? {
        return Ok(());
    }
    let note = change.note.as_deref();
    match redrive {
        Some(headers) => {
            let mut r = operator::Redriver::new(&config.kafka)?;
            for (name, value) in headers {
                r = r.header(name, value);
            }
            let done = operator::redrive(&pool, &r, &sel, &Actor::cli(), note).await?;
            report("redrove", &done);
        }
        None => {
            let done = operator::discard_dead_letters(&pool, &sel, &Actor::cli(), note).await?;
            report("discarded", &done);
        }
    }
    Ok(())
}

/// `inbox list`: FAILED rows matching the filter, newest first.
pub async fn inbox_list(
    db: &DatabaseConfig,
    filter: &FilterArgs,
    limit: i64,
    before: Option<i64>,
) -> anyhow::Result<()> {
    let client = store::pool::connect_to(db).await?;
    let f = filter.filter()?;
    let n = store::parked::count_failed_inbox(&client, &f, 10_000).await?;
    let rows = store::parked::failed_inbox(&client, &f, before, limit).await?;
    println!("{n} FAILED inbox row(s) match");
    println!(
        "{:>10}  {:<20} {:<36} {:<28} {:>8}  last error",
        "seq", "consumer", "message_id", "record", "attempts"
    );
    for r in &rows {
        println!(
            "{:>10}  {:<20} {:<36} {:<28} {:>8}  {}",
            r.seq,
            r.consumer,
            r.message_id,
            format!("{}/{}@{}", r.topic, r.partition, r.offset),
            r.attempts,
            r.last_error.as_deref().unwrap_or("")
        );
    }
    if rows.len() as i64 == limit {
        if let Some(last) = rows.last() {
            println!("next page: --before {}", last.seq);
        }
    }
    Ok(())
}

/// `inbox show CONSUMER MESSAGE_ID`.
pub async fn inbox_show(
    db: &DatabaseConfig,
    consumer: &str,
    message_id: Uuid,
    how: As,
) -> anyhow::Result<()> {
    let client = store::pool::connect_to(db).await?;
    match store::parked::inbox_row(&client, consumer, message_id).await? {
        Some(r) => print!("{}", show::inbox_row(&r, how)),
        None => anyhow::bail!("no inbox row {message_id} of {consumer:?}"),
    }
    Ok(())
}

/// `inbox replay --failed` and `inbox discard`: FAILED rows, one (`--id`) or by filter.
pub async fn inbox_change(
    db: &DatabaseConfig,
    id: Option<Uuid>,
    filter: &FilterArgs,
    change: &ChangeArgs,
    discard: bool,
) -> anyhow::Result<()> {
    let sel = match id {
        Some(message_id) => InboxRows::Id {
            consumer: filter
                .consumer
                .clone()
                .ok_or_else(|| anyhow::anyhow!("--id needs --consumer"))?,
            message_id,
        },
        None => {
            selection(None::<Uuid>, filter, change)?;
            InboxRows::Matching(filter.filter()?)
        }
    };
    let verb = if discard { "discard" } else { "replay" };
    let pool = pool(db)?;
    let n = operator::count_inbox(&pool, &sel).await?;
    if !proceed(verb, n, "FAILED inbox row(s)", change)? {
        return Ok(());
    }
    let note = change.note.as_deref();
    let done = if discard {
        operator::discard_inbox(&pool, &sel, &Actor::cli(), note).await?
    } else {
        operator::replay_inbox(&pool, &sel, &Actor::cli(), note).await?
    };
    if discard {
        report("discarded", &done);
    } else {
        println!(
            "{} row(s) back to PENDING (audit action {})",
            done.count, done.action
        );
    }
    Ok(())
}

/// `inbox replay` without `--failed`: FAILED and DONE rows of one consumer.
pub async fn inbox_replay_done(
    config: &Config,
    db: &DatabaseConfig,
    consumer: &str,
    filter: store::inbox::ReplayFilter,
    change: &ChangeArgs,
) -> anyhow::Result<()> {
    match config.consumers.iter().find(|c| c.name == consumer) {
        None => anyhow::bail!("this config has no consumer named {consumer:?}"),
        Some(c) if c.strategy != Strategy::Inbox => {
            anyhow::bail!("consumer {consumer:?} does not have strategy = \"inbox\"")
        }
        Some(_) => {}
    }
    if change.dry_run {
        let client = store::pool::connect_to(db).await?;
        let n = store::inbox::replay_count(&client, consumer, &filter).await?;
        println!("would replay {n} inbox row(s) of {consumer:?}");
        return Ok(());
    }
    if !change.yes && !filter.failed_only {
        // The count is not taken first here (a DONE table is big): ask once, by name.
        print!(
            "replay FAILED and DONE rows of {consumer:?} (DONE rows apply their effect again)? \
             Type {consumer} to go on: "
        );
        std::io::stdout().flush()?;
        let mut line = String::new();
        if std::io::stdin().lock().read_line(&mut line)? == 0 || line.trim() != consumer {
            anyhow::bail!("not confirmed: nothing replayed (pass --yes to go on without asking)");
        }
    }
    let pool = pool(db)?;
    let done = operator::replay_inbox_done(
        &pool,
        consumer,
        &filter,
        &Actor::cli(),
        change.note.as_deref(),
    )
    .await?;
    println!(
        "{} row(s) of {consumer:?} back to PENDING (audit action {})",
        done.count, done.action
    );
    Ok(())
}

pub async fn notifications(action: NotificationAction) -> anyhow::Result<()> {
    match action {
        NotificationAction::List {
            config,
            channel,
            limit,
        } => {
            let target = config.load(None)?;
            let client = store::pool::connect_to(&target.db).await?;
            let rows = client
                .query(
                    "SELECT event_id, channel, attempts, created_at, coalesce(last_error, '')
                     FROM notifications WHERE status = 'FAILED'
                       AND ($1::text IS NULL OR channel = $1)
                     ORDER BY created_at DESC LIMIT $2",
                    &[&channel, &limit],
                )
                .await?;
            println!(
                "{:<36} {:<12} {:>8} {:<20} last error",
                "event_id", "channel", "attempts", "created"
            );
            for r in &rows {
                let created: chrono::DateTime<chrono::Utc> = r.get(3);
                println!(
                    "{:<36} {:<12} {:>8} {:<20} {}",
                    r.get::<_, Uuid>(0),
                    r.get::<_, String>(1),
                    r.get::<_, i32>(2),
                    created.format("%Y-%m-%d %H:%M:%S"),
                    r.get::<_, String>(4)
                );
            }
            Ok(())
        }
        NotificationAction::Retry {
            config,
            which,
            change,
        } => notification_change(&config, &which, &change, false).await,
        NotificationAction::Discard {
            config,
            which,
            change,
        } => notification_change(&config, &which, &change, true).await,
    }
}

async fn notification_change(
    config: &ConfigArg,
    which: &NotificationArgs,
    change: &ChangeArgs,
    discard: bool,
) -> anyhow::Result<()> {
    let Loaded { db, .. } = config.load(None)?;
    let sel = match (which.event_id, &which.channel) {
        (Some(event_id), Some(channel)) => Notifications::Id {
            event_id,
            channel: channel.clone(),
        },
        _ => {
            if which.channel.is_none() && which.since.is_none() && !change.all {
                anyhow::bail!("no id and no filter: say --all to take every FAILED notification");
            }
            let since = which
                .since
                .as_deref()
                .map(|s| admin::parse_since(s, chrono::Utc::now()).map_err(anyhow::Error::msg))
                .transpose()?;
            Notifications::Matching {
                channel: which.channel.clone(),
                since,
            }
        }
    };
    let verb = if discard { "discard" } else { "retry" };
    let pool = pool(&db)?;
    let n = operator::count_notifications(&pool, &sel).await?;
    if !proceed(verb, n, "FAILED notification(s)", change)? {
        return Ok(());
    }
    let note = change.note.as_deref();
    let done = if discard {
        operator::discard_notifications(&pool, &sel, &Actor::cli(), note).await?
    } else {
        operator::retry_notifications(&pool, &sel, &Actor::cli(), note).await?
    };
    report(if discard { "discarded" } else { "retried" }, &done);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{pick_database, ConfigArg};
    use crate::config::Config;

    const TWO: &str = "[database.ledger]\nurl = \"postgres://h2/x\"\n\
                       [[consumer]]\nname = \"payments\"\ntopics = [\"p\"]\n\
                       handler = { kind = \"cashback\" }\n\
                       [[consumer]]\nname = \"orders\"\ntopics = [\"o\"]\n\
                       handler = { kind = \"cashback\" }\ndatabase = \"ledger\"\n";

    #[test]
    fn a_command_works_on_the_consumers_database() {
        let c = Config::from_toml_str(TWO).unwrap();
        assert_eq!(pick_database(&c, Some("orders"), None).unwrap(), "ledger");
        assert_eq!(
            pick_database(&c, Some("payments"), None).unwrap(),
            "default"
        );
        assert_eq!(pick_database(&c, None, None).unwrap(), "default");
        assert_eq!(pick_database(&c, None, Some("ledger")).unwrap(), "ledger");
        // --database agreeing with the consumer is fine; contradicting it is refused.
        assert_eq!(
            pick_database(&c, Some("orders"), Some("ledger")).unwrap(),
            "ledger"
        );
        let e = pick_database(&c, Some("orders"), Some("default")).unwrap_err();
        assert!(e.to_string().contains("is on database \"ledger\""), "{e}");
        // A consumer the config no longer has (its dead letters outlive it): --database.
        assert_eq!(
            pick_database(&c, Some("gone"), Some("ledger")).unwrap(),
            "ledger"
        );
        let e = pick_database(&c, None, Some("nope")).unwrap_err();
        assert!(e.to_string().contains("no database \"nope\""), "{e}");
    }

    #[test]
    fn an_id_alone_needs_its_database_when_there_are_several() {
        let path = std::env::temp_dir().join(format!("effectively-id-{}.toml", std::process::id()));
        std::fs::write(&path, TWO).expect("write a temporary config");
        let arg = |database: Option<&str>| ConfigArg {
            config: path.clone(),
            database: database.map(String::from),
        };
        let e = arg(None)
            .load_by_id()
            .err()
            .expect("refused without --database");
        assert!(e.to_string().contains("--database"), "{e}");
        let loaded = arg(Some("ledger"))
            .load_by_id()
            .expect("--database names it");
        assert_eq!(loaded.db.url.expose(), "postgres://h2/x");
        std::fs::remove_file(&path).ok();
    }
}
