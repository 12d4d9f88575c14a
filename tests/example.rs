//! `examples/loyalty_points.rs`, a library user's handler, run against the real broker and
//! database: each order's points once, a resend a duplicate, the same order under a new event id
//! a business duplicate, a payload that is not an order parked with the reason.

mod common;

#[allow(dead_code)]
#[path = "../examples/loyalty_points.rs"]
mod example;

use uuid::Uuid;

/// Sends `(event id, JSON body)` records to partition 0, in order.
async fn send(topic: &str, records: &[(Uuid, serde_json::Value)]) {
    let records: Vec<(Option<String>, Vec<u8>)> = (records.iter())
        .map(|(id, body)| (Some(id.to_string()), serde_json::to_vec(body).unwrap()))
        .collect();
    common::send_raw(&common::producer(), topic, Some(0), &records).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_handler_applies_each_order_once() {
    let (topic, consumer) = (common::unique("example"), common::unique("example"));
    common::create_topic(&topic, 1).await;
    let (a, b) = (common::unique("order"), common::unique("order"));
    let order = |id: &str, cents: i64| {
        serde_json::json!({"order_id": id, "customer": "c1", "total_cents": cents,
                           "placed_at": chrono::Utc::now().to_rfc3339()})
    };
    let (e1, e2, e3) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    send(
        &topic,
        &[
            (e1, order(&a, 12_345)),
            (e1, order(&a, 12_345)), // a resend: the dedupe key
            (e2, order(&a, 12_345)), // placed again, new event id: the order's key
            (e3, order(&b, 900)),
            // Dated, but not an order: parked by the handler's check.
            (
                Uuid::now_v7(),
                serde_json::json!({"order_id": "x", "placed_at": chrono::Utc::now().to_rfc3339()}),
            ),
        ],
    )
    .await;

    let config = example::config(
        &common::kafka_brokers(),
        &common::database_url(),
        &consumer,
        &topic,
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(example::run(config, async {
        let _ = stopped.await;
    }));
    let db = common::pg().await;
    common::eventually(60, "the example drained its topic", || {
        let (db, consumer, topic) = (&db, &consumer, &topic);
        async move { common::stored_offset(db, consumer, topic, 0).await == Some(5) }
    })
    .await;
    stop.send(()).unwrap();
    worker
        .await
        .unwrap()
        .expect("the example's worker stops cleanly");

    let rows = db
        .query(
            "SELECT order_id, points, event_id FROM loyalty_points WHERE order_id = ANY($1) ORDER BY points",
            &[&vec![a.clone(), b.clone()]],
        )
        .await
        .unwrap();
    let got: Vec<(String, i64, Uuid)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        got,
        vec![(b, 9, e3), (a, 123, e1)],
        "each order's points once, from its first event"
    );
    let keys: i64 = db
        .query_one(
            "SELECT count(*) FROM processed_messages WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        keys, 3,
        "e1, e2 and e3: the second placing passed the dedupe key"
    );
    let dead = common::dead_letters(&db, &consumer).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].reason, "missing_field");
    assert!(
        dead[0].detail.contains("not an OrderPlaced"),
        "{}",
        dead[0].detail
    );
}
