//! Versioned writes against the real PostgreSQL: the planner's verdicts on versions read from
//! and moved in `aggregate_versions`, and two transactions racing for a new aggregate.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use effectively::store::versions;
use effectively::version::{plan, Stamp, Verdict, VersionMode};

fn stamps(list: &[(&str, i64)]) -> Vec<Stamp> {
    list.iter()
        .map(|(a, v)| Stamp {
            aggregate: a.to_string(),
            version: *v,
        })
        .collect()
}

/// One batch: read the versions, plan, move them, commit. Returns the verdicts.
async fn batch(
    db: &mut deadpool_postgres::Object,
    consumer: &str,
    mode: VersionMode,
    events: &[(&str, i64)],
) -> Vec<Verdict> {
    let events = stamps(events);
    let tx = db.transaction().await.unwrap();
    let aggregates: Vec<&str> = events.iter().map(|e| e.aggregate.as_str()).collect();
    let stored = versions::read(&tx, consumer, &aggregates).await.unwrap();
    let p = plan(mode, &stored, &events);
    versions::advance(&tx, consumer, &stored, &p.advanced)
        .await
        .unwrap()
        .unwrap();
    tx.commit().await.unwrap();
    p.verdicts
}

async fn stored(db: &deadpool_postgres::Object, consumer: &str) -> HashMap<String, i64> {
    db.query(
        "SELECT aggregate, version FROM aggregate_versions WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

#[tokio::test]
async fn a_redelivered_older_state_changes_nothing() {
    let mut db = common::pool(2).get().await.unwrap();
    let consumer = common::unique("versions-full");
    // PAID (v7), then REFUNDED (v8), then PAID redelivered.
    use Verdict::*;
    let full = VersionMode::FullState;
    assert_eq!(
        batch(&mut db, &consumer, full, &[("o1", 7)]).await,
        [Apply { round: 0 }]
    );
    assert_eq!(
        batch(&mut db, &consumer, full, &[("o1", 8)]).await,
        [Apply { round: 0 }]
    );
    assert_eq!(batch(&mut db, &consumer, full, &[("o1", 7)]).await, [Stale]);
    assert_eq!(
        batch(&mut db, &consumer, full, &[("o1", 8)]).await,
        [Duplicate]
    );
    assert_eq!(stored(&db, &consumer).await["o1"], 8);
}

#[tokio::test]
async fn deltas_across_batches_move_one_version_at_a_time() {
    let mut db = common::pool(2).get().await.unwrap();
    let consumer = common::unique("versions-delta");
    use Verdict::*;
    let delta = VersionMode::Delta;
    assert_eq!(
        batch(&mut db, &consumer, delta, &[("a", 1), ("a", 2), ("b", 2)]).await,
        [Apply { round: 0 }, Apply { round: 1 }, Gap]
    );
    assert_eq!(
        batch(&mut db, &consumer, delta, &[("a", 4), ("b", 1), ("a", 2)]).await,
        [Gap, Apply { round: 0 }, Duplicate]
    );
    assert_eq!(
        stored(&db, &consumer).await,
        HashMap::from([("a".into(), 2), ("b".into(), 1)])
    );
}

#[tokio::test]
async fn two_transactions_racing_for_a_new_aggregate_cannot_both_move_it() {
    let pool = common::pool(2);
    let mut first = pool.get().await.unwrap();
    let mut second = pool.get().await.unwrap();
    let consumer = common::unique("versions-race");
    let t1 = first.transaction().await.unwrap();
    let t2 = second.transaction().await.unwrap();
    // Both read before either stores: no row to lock, each plans version 1.
    let s1 = versions::read(&t1, &consumer, &["x"]).await.unwrap();
    let s2 = versions::read(&t2, &consumer, &["x"]).await.unwrap();
    assert!(s1.is_empty() && s2.is_empty());
    let to = HashMap::from([("x".to_string(), 1)]);
    versions::advance(&t1, &consumer, &s1, &to)
        .await
        .unwrap()
        .unwrap();
    // t2's insert waits for t1's row; once t1 commits, t2 finds the version moved.
    let started = Instant::now();
    let commit_later = async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        t1.commit().await.unwrap();
    };
    let (moved, ()) = tokio::join!(versions::advance(&t2, &consumer, &s2, &to), commit_later);
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "t2 waited for t1"
    );
    assert_eq!(moved.unwrap().unwrap_err().aggregate, "x");
    t2.rollback().await.unwrap();
    assert_eq!(stored(&second, &consumer).await["x"], 1);
}

// ---------------------------------------------------------------------------------------------
// Through Kafka: the engine with `[consumer.version]`.
// ---------------------------------------------------------------------------------------------

use common::*;

/// A record for `send_raw`: its event id header, and its payload.
type Record = (Option<String>, Vec<u8>);

/// A versioned event: `{"order_id": .., "version": .., "status": ..}` under a new event id.
fn order(order_id: &str, version: i64, status: &str) -> Record {
    let payload = serde_json::json!({"order_id": order_id, "version": version, "status": status});
    (
        Some(uuid::Uuid::now_v7().to_string()),
        serde_json::to_vec(&payload).unwrap(),
    )
}

fn versioned(mode: &str, extra: &str) -> String {
    format!(
        "{extra}\n[consumer.version]\naggregate = \"/order_id\"\nversion = \"/version\"\n\
         mode = \"{mode}\"\ngap_alert_after = \"1s\"\n"
    )
}

const INBOX: &str = "strategy = \"inbox\"\n[consumer.inbox]\npoll_interval = \"50ms\"";

/// Waits until `consumer` stored `offset` for partition 0 of `topic` and, under the inbox
/// strategy, has no open inbox row left.
async fn drained(db: &tokio_postgres::Client, consumer: &str, topic: &str, offset: i64) {
    eventually(
        60,
        &format!("{consumer} at offset {offset}, inbox drained"),
        || async {
            let open: i64 = db
                .query_one(
                    "SELECT count(*) FROM inbox WHERE consumer = $1
                 AND status IN ('PENDING', 'IN_PROGRESS')",
                    &[&consumer],
                )
                .await
                .unwrap()
                .get(0);
            stored_offset(db, consumer, topic, 0).await == Some(offset) && open == 0
        },
    )
    .await;
}

/// (status, version) of an order in `order_status_view`.
async fn view(db: &tokio_postgres::Client, order_id: &str) -> Option<(String, i64)> {
    db.query_opt(
        "SELECT status, version FROM order_status_view WHERE order_id = $1",
        &[&order_id],
    )
    .await
    .unwrap()
    .map(|r| (r.get(0), r.get(1)))
}

async fn history(db: &tokio_postgres::Client, order_id: &str) -> Vec<(Option<i64>, i64)> {
    db.query(
        "SELECT from_version, to_version FROM order_status_history WHERE order_id = $1 ORDER BY id",
        &[&order_id],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

/// REFUNDED (v8) applied, then PAID (v7) redelivered under a new event id: stays REFUNDED.
async fn refunded_stays_refunded(strategy: &str) {
    let (topic, consumer) = (unique("v-refund"), unique("v-refund"));
    let o = unique("order");
    create_topic(&topic, 1).await;
    let cfg = config(
        &consumer,
        &topic,
        "{ kind = \"order-status\" }",
        &versioned("full-state", strategy),
    );
    let worker = start(cfg).await;
    let db = pg().await;
    let p = producer();
    let first = [order(&o, 1, "PLACED"), order(&o, 8, "REFUNDED")];
    send_raw(&p, &topic, Some(0), &first).await;
    drained(&db, &consumer, &topic, 2).await;
    assert_eq!(view(&db, &o).await, Some(("REFUNDED".into(), 8)));
    send_raw(&p, &topic, Some(0), &[order(&o, 7, "PAID")]).await;
    drained(&db, &consumer, &topic, 3).await;
    worker.stop().await.unwrap();
    assert_eq!(view(&db, &o).await, Some(("REFUNDED".into(), 8)));
    // PLACED and REFUNDED may share a batch (then only v8 is written): either way, no move
    // ever goes back, and PAID never lands.
    let h = history(&db, &o).await;
    assert!(
        h == vec![(None, 1), (Some(1), 8)] || h == vec![(None, 8)],
        "history {h:?}"
    );
}

#[tokio::test]
async fn a_redelivered_paid_after_refunded_changes_nothing_batch() {
    refunded_stays_refunded("").await;
}

#[tokio::test]
async fn a_redelivered_paid_after_refunded_changes_nothing_per_message() {
    refunded_stays_refunded("strategy = \"per-message\"").await;
}

#[tokio::test]
async fn a_redelivered_paid_after_refunded_changes_nothing_inbox() {
    refunded_stays_refunded(INBOX).await;
}

/// The log the test's SQL handler writes: what it was given, in the order it was given.
const LOG: &str = "CREATE TABLE IF NOT EXISTS version_log (
    id bigserial PRIMARY KEY, consumer text NOT NULL, aggregate text NOT NULL,
    version bigint NOT NULL, stored_version bigint)";

const LOG_HANDLER: &str = r#"{ kind = "sql", statement = """
    INSERT INTO version_log (consumer, aggregate, version, stored_version)
    SELECT $1, aggregate, version, stored_version FROM fresh_messages ORDER BY aggregate""" }"#;

/// `(version, stored_version)` the handler was given for `aggregate`, in order.
async fn logged(
    db: &tokio_postgres::Client,
    consumer: &str,
    aggregate: &str,
) -> Vec<(i64, Option<i64>)> {
    db.query(
        "SELECT version, stored_version FROM version_log
         WHERE consumer = $1 AND aggregate = $2 ORDER BY id",
        &[&consumer, &aggregate],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1)))
    .collect()
}

async fn held_versions(db: &tokio_postgres::Client, consumer: &str) -> Vec<i64> {
    db.query(
        "SELECT version FROM inbox WHERE consumer = $1 AND status = 'HELD' ORDER BY version",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// A one-partition topic and a delta consumer on it (`strategy`: TOML for its table) whose
/// handler logs what it is given: (topic, consumer, a client, the running worker).
async fn logging_delta_consumer(
    prefix: &str,
    strategy: &str,
) -> (
    String,
    String,
    tokio_postgres::Client,
    effectively::worker::Worker,
) {
    let (topic, consumer) = (unique(prefix), unique(prefix));
    create_topic(&topic, 1).await;
    let db = pg().await;
    create_once(&db, LOG).await;
    let cfg = config(
        &consumer,
        &topic,
        LOG_HANDLER,
        &versioned("delta", strategy),
    );
    (topic, consumer, db, start(cfg).await)
}

/// Deltas 1, 2, 4 then 3: the handler sees 1, 2, then 3 and 4 once 3 arrives; 4 waits HELD.
async fn deltas_apply_in_order(strategy: &str) {
    let (topic, consumer, db, worker) = logging_delta_consumer("v-delta", strategy).await;
    let a = unique("agg");
    let p = producer();
    let early = [order(&a, 1, "x"), order(&a, 2, "x"), order(&a, 4, "x")];
    send_raw(&p, &topic, Some(0), &early).await;
    drained(&db, &consumer, &topic, 3).await;
    assert_eq!(
        logged(&db, &consumer, &a).await,
        vec![(1, None), (2, Some(1))]
    );
    assert_eq!(held_versions(&db, &consumer).await, vec![4]);
    let gaps = versions::gaps(&db, &consumer, 10).await.unwrap();
    assert_eq!(
        (gaps.len(), gaps[0].stored, gaps[0].held.clone()),
        (1, Some(2), vec![4])
    );

    send_raw(&p, &topic, Some(0), &[order(&a, 3, "x")]).await;
    drained(&db, &consumer, &topic, 4).await;
    eventually(30, "the held 4 applied", || async {
        held_versions(&db, &consumer).await.is_empty()
    })
    .await;
    worker.stop().await.unwrap();
    assert_eq!(
        logged(&db, &consumer, &a).await,
        vec![(1, None), (2, Some(1)), (3, Some(2)), (4, Some(3))]
    );
}

#[tokio::test]
async fn deltas_1_2_4_3_apply_as_1_2_3_4_batch() {
    deltas_apply_in_order("").await;
}

#[tokio::test]
async fn deltas_1_2_4_3_apply_as_1_2_3_4_inbox() {
    deltas_apply_in_order(INBOX).await;
}

#[tokio::test]
async fn a_gap_never_filled_raises_the_alert_and_holds_what_follows() {
    let (topic, consumer, db, worker) = logging_delta_consumer("v-gap", "").await;
    let a = unique("agg");
    let p = producer();
    let events = [
        order(&a, 1, "x"),
        order(&a, 3, "x"),
        order(&a, 4, "x"),
        order(&a, 6, "x"),
    ];
    send_raw(&p, &topic, Some(0), &events).await;
    drained(&db, &consumer, &topic, 4).await;
    // Nothing past the gap: 2 never came.
    assert_eq!(logged(&db, &consumer, &a).await, vec![(1, None)]);
    assert_eq!(held_versions(&db, &consumer).await, vec![3, 4, 6]);
    let (held, overdue) = versions::held_and_overdue(&db, &consumer, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(held, 3);
    assert_eq!(overdue, 0, "not overdue yet");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (_, overdue) = versions::held_and_overdue(&db, &consumer, Duration::from_secs(1))
        .await
        .unwrap();
    assert_eq!(overdue, 1, "one aggregate's gap is past gap_alert_after");
    worker.stop().await.unwrap();
    assert_eq!(logged(&db, &consumer, &a).await, vec![(1, None)]);
}

#[tokio::test]
async fn a_thousand_aggregates_interleaved_across_partitions_apply_in_order() {
    let (topic, consumer) = (unique("v-many"), unique("v-many"));
    let prefix = unique("m");
    create_topic(&topic, 4).await;
    let db = pg().await;
    create_once(&db, LOG).await;
    let (aggregates, depth) = (1000, 3);
    let mut events: Vec<(i32, Record)> = Vec::new();
    for n in 0..aggregates {
        for v in 1..=depth {
            let partition = fastrand::i32(0..4);
            events.push((partition, order(&format!("{prefix}-{n}"), v, "x")));
        }
    }
    fastrand::shuffle(&mut events);
    let mut by_partition: HashMap<i32, Vec<Record>> = HashMap::new();
    for (p, e) in events {
        by_partition.entry(p).or_default().push(e);
    }
    let p = producer();
    for (partition, records) in &by_partition {
        send_raw(&p, &topic, Some(*partition), records).await;
    }
    let extra = versioned("delta", "[consumer.batch]\nmax_messages = 200");
    let worker = start(config(&consumer, &topic, LOG_HANDLER, &extra)).await;
    eventually(120, "every aggregate at its last version", || async {
        let done: i64 = db
            .query_one(
                "SELECT count(*) FROM aggregate_versions WHERE consumer = $1 AND version = $2",
                &[&consumer, &depth],
            )
            .await
            .unwrap()
            .get(0);
        done == aggregates as i64
    })
    .await;
    worker.stop().await.unwrap();
    // Per aggregate, the handler saw 1, 2, 3 in that order, each once, each from the one before.
    let rows = db
        .query(
            "SELECT aggregate, array_agg(version ORDER BY id), array_agg(coalesce(stored_version, 0) ORDER BY id)
             FROM version_log WHERE consumer = $1 GROUP BY aggregate",
            &[&consumer],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), aggregates);
    for r in rows {
        let (a, seen, from): (String, Vec<i64>, Vec<i64>) = (r.get(0), r.get(1), r.get(2));
        assert_eq!(seen, vec![1, 2, 3], "aggregate {a}");
        assert_eq!(from, vec![0, 1, 2], "aggregate {a}");
    }
    assert!(held_versions(&db, &consumer).await.is_empty());
}

/// The history rows and the view of the orders named `prefix-*`.
async fn snapshot(db: &tokio_postgres::Client, prefix: &str) -> (i64, String) {
    let like = format!("{prefix}-%");
    let r = db
        .query_one(
            "SELECT (SELECT count(*) FROM order_status_history WHERE order_id LIKE $1),
                    (SELECT string_agg(order_id || status || version, ',' ORDER BY order_id)
                     FROM order_status_view WHERE order_id LIKE $1)",
            &[&like],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

#[tokio::test]
async fn a_compacted_topic_replayed_from_the_start_changes_nothing() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::ClientConfig;
    let (topic, consumer) = (unique("v-compact"), unique("v-compact"));
    let prefix = unique("c");
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers())
        .create()
        .unwrap();
    let t = NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set("cleanup.policy", "compact");
    for r in admin
        .create_topics(&[t], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let statuses = ["PLACED", "PAID", "SHIPPED", "DELIVERED"];
    let mut events = Vec::new();
    for v in 1..=4i64 {
        for n in 0..50 {
            events.push(order(&format!("{prefix}-{n}"), v, statuses[v as usize - 1]));
        }
    }
    // A compacted topic needs keys: the order id.
    let p = producer();
    for (id, payload) in &events {
        let doc: serde_json::Value = serde_json::from_slice(payload).unwrap();
        let key = doc["order_id"].as_str().unwrap().to_string();
        let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
            key: "event_id",
            value: id.as_deref(),
        });
        let rec = rdkafka::producer::FutureRecord::to(&topic)
            .key(&key)
            .payload(payload)
            .partition(0)
            .headers(headers);
        p.send(rec, Duration::from_secs(30)).await.unwrap();
    }
    let db = pg().await;
    let cfg = || {
        config(
            &consumer,
            &topic,
            "{ kind = \"order-status\" }",
            &versioned("full-state", ""),
        )
    };
    let worker = start(cfg()).await;
    drained(&db, &consumer, &topic, 200).await;
    worker.stop().await.unwrap();
    let before = snapshot(&db, &prefix).await;
    assert!(before.1.contains("DELIVERED4"), "{before:?}");
    // Years later: the dedupe keys are long gone (retention), and the topic is read again from
    // its first offset. Only the versions stand between the replay and the view.
    db.execute(
        "DELETE FROM processed_messages WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap();
    db.execute(
        "DELETE FROM consumer_offsets WHERE consumer = $1",
        &[&consumer],
    )
    .await
    .unwrap();
    let worker = start(cfg()).await;
    drained(&db, &consumer, &topic, 200).await;
    worker.stop().await.unwrap();
    assert_eq!(snapshot(&db, &prefix).await, before);
}
