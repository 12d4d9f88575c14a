//! The notification sender against a real HTTP provider stub (Stripe-like idempotency keys) and
//! the real PostgreSQL: one provider-side effect per notification whatever fails in between.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use effectively::sender::Sender;
use provider_stub::{Fault, ProviderStub};
use tokio_util::sync::CancellationToken;

/// A config with only `[database]` and a `[sender]` for one channel at `stub`.
fn sender_toml(channel: &str, stub: &ProviderStub, extra: &str, channel_extra: &str) -> String {
    format!(
        "[database]\nurl = \"{db}\"\n[sender]\npoll_interval = \"50ms\"\n{extra}\n\
         [sender.retry]\nmax_attempts = 6\ninitial_backoff = \"50ms\"\nmax_backoff = \"200ms\"\n\
         [sender.channels.{channel}]\nurl = \"{url}/v1/messages\"\n{channel_extra}\n",
        db = database_url(),
        url = stub.url(),
    )
}

/// One notification on `channel`; returns its event id.
async fn notify(db: &tokio_postgres::Client, channel: &str) -> uuid::Uuid {
    let id = uuid::Uuid::now_v7();
    let payload = serde_json::json!({"to": "u_17", "text": "Cashback of 2400 paise credited"});
    db.execute(
        "INSERT INTO notifications (event_id, channel, payload) VALUES ($1, $2, $3)",
        &[&id, &channel, &payload],
    )
    .await
    .unwrap();
    id
}

/// (status, provider_id, key_generation) of a notification.
async fn row(
    db: &tokio_postgres::Client,
    id: uuid::Uuid,
    channel: &str,
) -> (String, Option<String>, i32) {
    let r = db
        .query_one(
            "SELECT status, provider_id, key_generation FROM notifications
             WHERE event_id = $1 AND channel = $2",
            &[&id, &channel],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

async fn until_status(db: &tokio_postgres::Client, id: uuid::Uuid, channel: &str, want: &str) {
    eventually(30, &format!("notification {want}"), || async {
        row(db, id, channel).await.0 == want
    })
    .await;
}

/// Runs an in-process sender for `toml` until `check` holds.
async fn with_sender<F, Fut>(toml: &str, what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let config = effectively::config::Config::from_toml_str(toml).unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(Sender::new(&config).unwrap().run(stop.clone()));
    eventually(30, what, check).await;
    stop.cancel();
    task.await.unwrap();
}

/// The sender process dies after the provider sent the SMS and before it recorded SENT. The next
/// sender finds the row interrupted; `lookup` lets it ask the provider instead of sending again.
async fn a_sender_killed_after_the_call(lookup: bool) {
    let stub = ProviderStub::start("127.0.0.1:0").await.unwrap();
    let channel = unique("sms");
    let db = pg().await;
    let id = notify(&db, &channel).await;
    let key = format!("{channel}:{id}");
    let channel_extra = if lookup { "lookup = true" } else { "" };
    let toml = sender_toml(
        &channel,
        &stub,
        "request_timeout = \"500ms\"\nsending_timeout = \"1s\"",
        channel_extra,
    );
    let dir = std::env::temp_dir().join(unique("sender-kill"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("sender.toml");
    std::fs::write(&path, &toml).unwrap();
    let mut victim = Command::new(env!("CARGO_BIN_EXE_effectively"))
        .args(["send", "--metrics-addr", "off", "--config"])
        .arg(&path)
        .env("DATABASE_URL", database_url())
        .env("FAILPOINTS", "sender_after_call=return")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("victim.log")).unwrap())
        .spawn()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || victim.wait().unwrap())
        .await
        .unwrap();
    assert!(!status.success(), "the failpoint aborts the sender");
    assert_eq!(stub.effects_for(&key), 1, "the provider sent it");
    assert_eq!(
        row(&db, id, &channel).await.0,
        "SENDING",
        "nothing recorded"
    );

    with_sender(&toml, "the interrupted notification SENT", || async {
        row(&db, id, &channel).await.0 == "SENT"
    })
    .await;
    assert_eq!(stub.effects_for(&key), 1, "one SMS");
    let posts = stub.requests();
    if lookup {
        assert_eq!(posts, 1, "reconciled by lookup: no second call");
    } else {
        assert_eq!(posts, 2, "resent under the same key");
        assert_eq!(stub.replays(), 1, "and answered from the provider's record");
    }
    let (_, provider_id, _) = row(&db, id, &channel).await;
    assert_eq!(provider_id.as_deref(), Some(stub.messages()[0].id.as_str()));
}

#[tokio::test]
async fn a_sender_killed_after_the_call_is_reconciled_by_lookup() {
    a_sender_killed_after_the_call(true).await;
}

#[tokio::test]
async fn a_sender_killed_after_the_call_resends_under_the_same_key() {
    a_sender_killed_after_the_call(false).await;
}

#[tokio::test]
async fn a_500_before_sending_then_success_sends_once_under_a_new_key() {
    let stub = ProviderStub::start("127.0.0.1:0").await.unwrap();
    stub.inject(Fault::FailBefore);
    let channel = unique("sms");
    let db = pg().await;
    let id = notify(&db, &channel).await;
    let toml = sender_toml(&channel, &stub, "", "lookup = true");
    with_sender(&toml, "SENT after the 500", || async {
        row(&db, id, &channel).await.0 == "SENT"
    })
    .await;
    // The 500 is saved under the first key, which sent nothing; the second key sent it.
    assert_eq!(stub.effects_for(&format!("{channel}:{id}")), 0);
    assert_eq!(stub.effects_for(&format!("{channel}:{id}#1")), 1);
    assert_eq!(stub.messages().len(), 1, "one SMS");
    assert_eq!(row(&db, id, &channel).await.2, 1, "one key spent");
}

#[tokio::test]
async fn a_500_after_sending_is_reconciled_not_resent() {
    let stub = ProviderStub::start("127.0.0.1:0").await.unwrap();
    stub.inject(Fault::FailAfter);
    let channel = unique("sms");
    let db = pg().await;
    let id = notify(&db, &channel).await;
    let toml = sender_toml(&channel, &stub, "", "lookup = true");
    with_sender(&toml, "SENT by reconciliation", || async {
        row(&db, id, &channel).await.0 == "SENT"
    })
    .await;
    assert_eq!(stub.messages().len(), 1, "one SMS");
    assert_eq!(stub.requests(), 1, "no second call");
    let (_, provider_id, generation) = row(&db, id, &channel).await;
    assert_eq!(provider_id.as_deref(), Some(stub.messages()[0].id.as_str()));
    assert_eq!(generation, 0);
}

#[tokio::test]
async fn a_call_still_in_flight_gets_409_and_is_retried_later() {
    let stub = ProviderStub::start("127.0.0.1:0").await.unwrap();
    // The provider holds the first call for 1.5 s; the sender gives up on it after 300 ms and
    // tries again under the same key while it is still in flight.
    stub.inject(Fault::Delay(Duration::from_millis(1500)));
    let channel = unique("sms");
    let db = pg().await;
    let id = notify(&db, &channel).await;
    let toml = sender_toml(
        &channel,
        &stub,
        "request_timeout = \"300ms\"\nsending_timeout = \"10s\"",
        "",
    );
    with_sender(&toml, "SENT once the first call finished", || async {
        row(&db, id, &channel).await.0 == "SENT"
    })
    .await;
    assert!(stub.conflicts() >= 1, "a 409 while in flight");
    assert_eq!(stub.messages().len(), 1, "one SMS");
    assert_eq!(stub.effects_for(&format!("{channel}:{id}")), 1);
}

#[tokio::test]
async fn a_key_reused_with_other_parameters_fails_the_notification() {
    let stub = ProviderStub::start("127.0.0.1:0").await.unwrap();
    let channel = unique("sms");
    let db = pg().await;
    let id = notify(&db, &channel).await;
    // Something else used the key first, with another body.
    reqwest::Client::new()
        .post(format!("{}/v1/messages", stub.url()))
        .header("Idempotency-Key", format!("{channel}:{id}"))
        .json(&serde_json::json!({"to": "u_99", "text": "something else"}))
        .send()
        .await
        .unwrap();
    let toml = sender_toml(&channel, &stub, "", "lookup = true");
    with_sender(&toml, "FAILED on the mismatch", || async {
        row(&db, id, &channel).await.0 == "FAILED"
    })
    .await;
    assert_eq!(stub.mismatches(), 1);
    assert_eq!(stub.messages().len(), 1, "only the other body's SMS");
    let error: String = db
        .query_one(
            "SELECT last_error FROM notifications WHERE event_id = $1 AND channel = $2",
            &[&id, &channel],
        )
        .await
        .unwrap()
        .get(0);
    assert!(error.starts_with("400"), "{error}");
    until_status(&db, id, &channel, "FAILED").await;
}
