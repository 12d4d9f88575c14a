//! `effectively inbox`: the inbox strategy's status, its FAILED rows (list, show), replay and
//! discard.

use std::path::PathBuf;

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
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
    },
    /// FAILED rows matching the filter, newest first (`--before SEQ` for the next page).
    List {
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
        #[command(flatten)]
        filter: parked::FilterArgs,
        #[arg(long, default_value_t = 50)]
        limit: i64,
        #[arg(long)]
        before: Option<i64>,
    },
    /// One inbox row, whatever its status: coordinates, attempts, last error, headers, payload.
    Show {
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
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
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
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
        #[arg(long, short, default_value = "effectively.toml")]
        config: PathBuf,
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
        InboxAction::Status { config } => {
            let config = Config::load(&config)?;
            // Inbox consumers, and versioned ones (their gaps wait in the inbox).
            let names: Vec<String> = (config.consumers.iter())
                .filter(|c| c.strategy == Strategy::Inbox || c.version.is_some())
                .map(|c| c.name.clone())
                .collect();
            if names.is_empty() {
                anyhow::bail!(
                    "no consumer of this config has strategy = \"inbox\" or [consumer.version]"
                );
            }
            let client = store::pool::connect_to(&config.database).await?;
            let rows = store::inbox::status(&client, &names).await?;
            print!("{}", admin::render_status(&rows));
            for c in config.consumers.iter().filter(|c| c.version.is_some()) {
                let gaps = store::versions::gaps(&client, &c.name, 20).await?;
                let all = store::versions::gap_count(&client, &c.name).await?;
                print!("\n{}", admin::render_gaps(&c.name, &gaps, all));
            }
            Ok(())
        }
        InboxAction::List {
            config,
            filter,
            limit,
            before,
        } => parked::inbox_list(&Config::load(&config)?, &filter, limit, before).await,
        InboxAction::Show {
            config,
            consumer,
            message_id,
            how,
        } => parked::inbox_show(&Config::load(&config)?, &consumer, message_id, how).await,
        InboxAction::Discard {
            config,
            id,
            filter,
            change,
        } => parked::inbox_change(&Config::load(&config)?, id, &filter, &change, true).await,
        InboxAction::Replay {
            config,
            failed,
            id,
            key,
            filter,
            change,
        } => {
            let config = Config::load(&config)?;
            if failed && key.is_none() {
                return parked::inbox_change(&config, id, &filter, &change, false).await;
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
            parked::inbox_replay_done(&config, consumer, replay, &change).await
        }
    }
}
