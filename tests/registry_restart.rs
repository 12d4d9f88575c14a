//! The Schema Registry stopped mid-run and started again, for real (`scripts/stack.sh
//! registry-down`, then `registry-up`: the stack's Apicurio process, its storage in
//! PostgreSQL): a record whose schema id the worker has not seen waits, nothing is parked,
//! nothing lost, the unavailable gauge says so, and the partition resumes once the registry
//! answers. Its own test binary with one test, because it stops the registry every other
//! registry test uses (cargo runs test binaries one after another).

mod common;

use std::process::Command;
use std::time::Duration;

use common::schema_registry::{self as sr, PAYMENT_AVSC};
use common::{eventually, ledger, Payment};

fn stack(action: &str) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/stack.sh");
    let status = Command::new(script)
        .arg(action)
        .status()
        .expect("scripts/stack.sh runs");
    assert!(status.success(), "scripts/stack.sh {action} failed");
}

/// The unavailable gauge of `consumer` as the process's Prometheus recorder renders it.
fn waiting(consumer: &str) -> bool {
    let text = effectively::metrics::recorder().expect("recorder").render();
    text.lines().any(|l| {
        l.starts_with("effectively_schema_registry_unavailable{")
            && l.contains(&format!("consumer=\"{consumer}\""))
            && l.ends_with(" 1")
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registry_that_stops_mid_run_holds_the_partition_and_parks_nothing() {
    let url = sr::url().await;
    effectively::metrics::recorder().expect("recorder");
    let topic = common::unique("reg-restart");
    let consumer = common::unique("reg");
    common::create_topic(&topic, 1).await;
    let subject = format!("{topic}-value");
    let v1 = sr::register(&url, &subject, "AVRO", PAYMENT_AVSC).await;
    let mut v2: serde_json::Value = serde_json::from_str(PAYMENT_AVSC).unwrap();
    v2["fields"].as_array_mut().unwrap().push(serde_json::json!(
        {"name": "channel", "type": "string", "default": "web"}
    ));
    let v2_text = v2.to_string();
    let v2_id = sr::register(&url, &subject, "AVRO", &v2_text).await;
    let s1 = apache_avro::Schema::parse_str(PAYMENT_AVSC).unwrap();
    let s2 = apache_avro::Schema::parse_str(&v2_text).unwrap();
    let user = common::unique("u");
    let first: Vec<Payment> = (0..20).map(|i| Payment::new(&user, 1_000 + i)).collect();
    let second: Vec<Payment> = (0..20).map(|i| Payment::new(&user, 5_000 + i)).collect();
    let producer = common::producer();
    let rec = |p: &Payment, v2: bool| {
        let bytes = if v2 {
            sr::avro(
                v2_id,
                &s2,
                p,
                &[("channel", apache_avro::types::Value::String("app".into()))],
            )
        } else {
            sr::avro(v1, &s1, p, &[])
        };
        (Some(p.event_id.to_string()), bytes)
    };
    let v1_records: Vec<_> = first.iter().map(|p| rec(p, false)).collect();
    common::send_raw(&producer, &topic, Some(0), &v1_records).await;

    let extra =
        format!("payload = {{ format = \"avro\", registry = \"{url}\", timeout = \"2s\" }}");
    let worker = common::start_cashback(&consumer, &topic, &extra).await;
    let db = common::pg().await;
    eventually(60, "the v1 payments credited", || async {
        ledger(&db, &consumer).await.credits == 20
    })
    .await;

    // The registry goes away; then v2 records (an id this process never looked up), and v1
    // ones behind them.
    stack("registry-down");
    let mut more: Vec<_> = second[..10].iter().map(|p| rec(p, true)).collect();
    more.extend(second[10..].iter().map(|p| rec(p, false)));
    common::send_raw(&producer, &topic, Some(0), &more).await;
    eventually(30, "the partition waits for the registry", || async {
        waiting(&consumer)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(
        l.credits, 20,
        "nothing behind the unknown id is applied: {l:?}"
    );
    assert_eq!(
        l.parked, 0,
        "nothing parked while the registry is down: {l:?}"
    );

    stack("registry-up");
    eventually(
        90,
        "every payment credited once the registry answers",
        || async { ledger(&db, &consumer).await.credits == 40 },
    )
    .await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(l.credits, 40, "{l:?}");
    assert_eq!(l.parked, 0, "{l:?}");
    let expected: i64 = first
        .iter()
        .chain(&second)
        .map(|p| p.amount_paise * 2 / 100)
        .sum();
    assert_eq!(l.cashback_paise, expected);
    eventually(10, "the gauge back at 0", || async { !waiting(&consumer) }).await;
    worker.stop().await.unwrap();
}
