//! `effectively inbox`: the inbox strategy's status, its FAILED rows (list, show), replay and
//! discard.

use clap::Subcommand;

use super::parked;
use crate::config::{Config, Strategy};
use crate::store;

#[derive(Debug, Subcommand)]
pub enum InboxAction {
    /// Per inbox or versioned consumer: PENDING rows (and how many are due now), IN_PROGRESS,
    /// FAILED, HELD (events waiting for a missing version) and the oldest PENDING row's age;
    /// then, per versioned consumer, its held gaps per aggregate, oldest first.
    Status {
        #[command(flatten)]
        config: parked::ConfigArg,
    },
    /// FAILED rows matching the filter, newest first (`--before SEQ` for the next page).
    List {
        #[command(flatten)]
        config: parked::ConfigArg,
        #[command(flatten)]
        filter: parked::FilterArgs,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        before: Option<i64>,
    },
    /// One inbox row, whatever its status: coordinates, attempts, last error, headers, payload.
    Show {
        #[command(flatten)]
        config: parked::ConfigArg,
        consumer: String,
        message_id: uuid::Uuid,
        #[arg(long = "as", value_enum, default_value_t = crate::operator::show::As::Auto)]
        how: crate::operator::show::As,
    },
    /// Put rows back to PENDING (attempts reset) so the processors apply them again. With
    /// --failed, FAILED rows only, one (`--id` with `--consumer`) or every one matching the
    /// filter: never applied before, so applied once. Without --failed, DONE rows of
    /// `--consumer` are replayed too: safe only for an effect that keeps its own business key
    /// (the cashback handler's UNIQUE payment_id), or it applies twice.
    Replay {
        #[command(flatten)]
        config: parked::ConfigArg,
        /// Only FAILED rows.
        #[arg(long)]
        failed: bool,
        /// One row, by message id (with --consumer).
        #[arg(long)]
        id: Option<uuid::Uuid>,
        /// Only rows of this ordering key (the Kafka key, or the configured payload field).
        #[arg(long)]
        key: Option<String>,
        #[command(flatten)]
        filter: parked::FilterArgs,
        #[command(flatten)]
        change: parked::ChangeArgs,
    },
    /// Give FAILED rows up: status DISCARDED, bytes kept, never applied (one with `--id` and
    /// `--consumer`, or every one matching the filter).
    Discard {
        #[command(flatten)]
        config: parked::ConfigArg,
        #[arg(long)]
        id: Option<uuid::Uuid>,
        #[command(flatten)]
        filter: parked::FilterArgs,
        #[command(flatten)]
        change: parked::ChangeArgs,
    },
}

pub async fn run(action: InboxAction) -> anyhow::Result<()> {
    use crate::inbox::admin;
    match action {
        InboxAction::Status { config: arg } => {
            let config = Config::load(&arg.config)?;
            if let Some(d) = &arg.database {
                config.database.get(Some(d)).map_err(anyhow::Error::msg)?;
            }
            // Inbox consumers, and versioned ones (their gaps wait in the inbox).
            let inbox = |c: &&crate::config::ConsumerConfig| {
                c.strategy == Strategy::Inbox || c.version.is_some()
            };
            if !config.consumers.iter().any(|c| inbox(&c)) {
                anyhow::bail!(
                    "no consumer of this config has strategy = \"inbox\" or [consumer.version]"
                );
            }
            // Each database holds its own consumers' rows: one status table per database.
            for name in config.database.names() {
                if arg.database.as_deref().is_some_and(|only| only != name) {
                    continue;
                }
                let on: Vec<&crate::config::ConsumerConfig> = (config.consumers.iter())
                    .filter(|c| c.database_name() == name)
                    .filter(inbox)
                    .collect();
                if on.is_empty() {
                    continue;
                }
                if !config.database.named.is_empty() {
                    println!("database {name}:");
                }
                let db = config
                    .database
                    .get(Some(name))
                    .map_err(anyhow::Error::msg)?;
                let client = store::pool::connect_to(db).await?;
                let names: Vec<String> = on.iter().map(|c| c.name.clone()).collect();
                let rows = store::inbox::status(&client, &names).await?;
                print!("{}", admin::render_status(&rows));
                for c in on.iter().filter(|c| c.version.is_some()) {
                    let gaps = store::versions::gaps(&client, &c.name, 20).await?;
                    let all = store::versions::gap_count(&client, &c.name).await?;
                    print!("\n{}", admin::render_gaps(&c.name, &gaps, all));
                }
            }
            Ok(())
        }
        InboxAction::List {
            config,
            filter,
            limit,
            before,
        } => {
            let target = config.load(filter.consumer.as_deref())?;
            parked::inbox_list(&target.db, &filter, limit, before).await
        }
        InboxAction::Show {
            config,
            consumer,
            message_id,
            how,
        } => {
            let target = config.load(Some(&consumer))?;
            parked::inbox_show(&target.db, &consumer, message_id, how).await
        }
        InboxAction::Discard {
            config,
            id,
            filter,
            change,
        } => {
            let target = config.load(filter.consumer.as_deref())?;
            parked::inbox_change(&target.db, id, &filter, &change, true).await
        }
        InboxAction::Replay {
            config,
            failed,
            id,
            key,
            filter,
            change,
        } => {
            let target = config.load(filter.consumer.as_deref())?;
            if failed && key.is_none() {
                return parked::inbox_change(&target.db, id, &filter, &change, false).await;
            }
            // DONE rows too, or one ordering key: one consumer's rows, one statement.
            let Some(consumer) = filter.consumer.as_deref() else {
                anyhow::bail!("replaying DONE rows or one --key needs --consumer");
            };
            if id.is_some()
                || filter.reason.is_some()
                || filter.topic.is_some()
                || filter.partition.is_some()
                || filter.until.is_some()
            {
                anyhow::bail!(
                    "--id, --reason, --topic, --partition and --until select FAILED rows: add --failed"
                );
            }
            let since = match &filter.since {
                Some(s) => {
                    Some(admin::parse_since(s, chrono::Utc::now()).map_err(anyhow::Error::msg)?)
                }
                None => None,
            };
            let replay = store::inbox::ReplayFilter {
                failed_only: failed,
                since,
                key: key.as_deref().map(admin::stored_key),
            };
            parked::inbox_replay_done(&target.config, &target.db, consumer, replay, &change).await
        }
    }
}
