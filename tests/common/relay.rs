//! The outbox relay as tests/relay.rs drives it: outbox rows written as the payments service
//! would, a config file for a relay, the `effectively relay` process, and the two deliveries
//! of a relay that dies between publishing and marking.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

use super::{database_url, eventually, kafka_brokers, unique, Payment};

/// `[relay]` for one event type, as TOML (the other sections come from `common::config`).
pub fn relay_section(event_type: &str, topic: &str, extra: &str) -> String {
    format!("[relay]\ntopics = {{ \"{event_type}\" = \"{topic}\" }}\npoll_interval = \"50ms\"\n{extra}\n")
}

/// Writes a config that has only `[kafka]`, `[database]` and `relay`.
pub fn relay_config_file(dir: &Path, relay: &str) -> PathBuf {
    let path = dir.join("relay.toml");
    std::fs::write(
        &path,
        format!(
            "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n{relay}",
            kafka_brokers(),
            database_url()
        ),
    )
    .unwrap();
    path
}

pub fn spawn_relay(config: &Path, log: &Path, failpoints: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_effectively"))
        .args(["relay", "--metrics-addr", "off", "--config"])
        .arg(config)
        .env("KAFKA_BROKERS", kafka_brokers())
        .env("DATABASE_URL", database_url())
        .env("FAILPOINTS", failpoints)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .expect("spawn effectively relay")
}

/// Writes `payments` as the payments service would: each one an outbox row of `event_type`,
/// all in one transaction.
pub async fn write_outbox(
    db: &mut tokio_postgres::Client,
    event_type: &str,
    rows: &[(String, Payment)],
) {
    let tx = db.transaction().await.unwrap();
    for (aggregate, p) in rows {
        let payload: serde_json::Value = serde_json::from_slice(&p.json()).unwrap();
        tx.execute(
            "INSERT INTO outbox (id, aggregate_id, event_type, payload) VALUES ($1, $2, $3, $4)",
            &[&p.event_id, aggregate, &event_type, &payload],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
}

pub async fn unpublished(db: &tokio_postgres::Client, event_type: &str) -> i64 {
    db.query_one(
        "SELECT count(*) FROM outbox WHERE event_type = $1 AND published_at IS NULL",
        &[&event_type],
    )
    .await
    .unwrap()
    .get(0)
}

/// `n` payments of a new user, of `first_amount`, `first_amount + 1`, ..., each its own
/// aggregate (its payment id), written to the outbox as `event_type` by [`write_outbox`].
pub async fn outbox_payments(
    db: &mut tokio_postgres::Client,
    event_type: &str,
    n: i64,
    first_amount: i64,
) -> Vec<(String, Payment)> {
    let user = unique("u");
    let payments: Vec<(String, Payment)> = (0..n)
        .map(|i| {
            let p = Payment::new(&user, first_amount + i);
            (p.payment_id.clone(), p)
        })
        .collect();
    write_outbox(db, event_type, &payments).await;
    payments
}

/// A new directory (named after `prefix`) and in it a relay config (by [`relay_config_file`])
/// that publishes `event_type` to `topic`: `(directory, config file)`.
pub fn relay_config_in_new_dir(prefix: &str, event_type: &str, topic: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(unique(prefix));
    std::fs::create_dir_all(&dir).unwrap();
    let config = relay_config_file(&dir, &relay_section(event_type, topic, ""));
    (dir, config)
}

/// Runs a relay (its log `first.log` in `dir`) that publishes the rows and dies before it marks
/// them (the failpoint `relay_after_publish`); its exit status.
pub async fn relay_dies_after_publishing(config: &Path, dir: &Path) -> ExitStatus {
    let mut first = spawn_relay(config, &dir.join("first.log"), "relay_after_publish=return");
    tokio::task::spawn_blocking(move || first.wait().unwrap())
        .await
        .unwrap()
}

/// Runs a relay (its log `second.log` in `dir`) until no row of `event_type` is left
/// unpublished (`what` names that wait), then stops it by SIGTERM; its exit status.
pub async fn relay_until_marked(
    config: &Path,
    dir: &Path,
    db: &tokio_postgres::Client,
    event_type: &str,
    what: &str,
) -> ExitStatus {
    let mut second = spawn_relay(config, &dir.join("second.log"), "");
    eventually(30, what, || async {
        unpublished(db, event_type).await == 0
    })
    .await;
    Command::new("kill")
        .args(["-TERM", &second.id().to_string()])
        .status()
        .unwrap();
    second.wait().unwrap()
}
