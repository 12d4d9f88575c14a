//! The console on big tables (docs/PERFORMANCE.md, "Console on big tables"): fills 1,000,000
//! dead letters and 1,000,000 FAILED inbox rows under a consumer of its own, times every page
//! `CONSOLE_BENCH_N` times (default 100) against a console in-process, prints p50 and p99 per
//! page as a Markdown table, and removes the rows again. Ignored by default (it writes about
//! 600 MB and takes a few minutes):
//!
//! ```sh
//! cargo test --release --features effectively/failpoints --test console_bench -- --ignored --nocapture
//! ```
//!
//! `CONSOLE_BENCH_ROWS` changes the row count of each table. `DATABASE_URL` may name a database
//! of its own (migrated with `effectively migrate`), as docs/PERFORMANCE.md's run did.

mod common;

use std::time::{Duration, Instant};

use common::*;
use effectively::config::Config;

const FILL_DEAD_LETTERS: &str = "\
INSERT INTO dead_letters (consumer, topic, partition, \"offset\", message_id, reason, detail,
                          key, header_names, header_values, payload, kafka_ts, attempts,
                          first_seen, last_seen)
SELECT $1, $2, (g % 6)::int, g, gen_random_uuid(),
       (ARRAY['missing_event_id', 'undecodable_payload', 'missing_field', 'handler_error'])[1 + g % 4],
       'generated row ' || g, convert_to('k-' || (g % 1000), 'UTF8'), '{event_id}',
       ARRAY[convert_to(gen_random_uuid()::text, 'UTF8')],
       convert_to('{\"n\": ' || g || ', \"card\": {\"number\": \"CARD-4111-SECRET\"}}', 'UTF8'),
       now() - ($3::bigint - g) * interval '1 ms', 1,
       now() - ($3::bigint - g) * interval '1 ms', now() - ($3::bigint - g) * interval '1 ms'
FROM generate_series(1, $3::bigint) g";

const FILL_INBOX: &str = "\
INSERT INTO inbox (consumer, message_id, event_date, seq, ordering_key, status, attempts,
                   last_error, topic, partition, \"offset\", kafka_ts, key, payload, received_at)
SELECT $1, gen_random_uuid(), current_date, nextval('inbox_seq'), 'k:' || (g % 1000), 'FAILED', 5,
       'generated failure ' || g, $2, (g % 6)::int, g, now(), convert_to('k-' || (g % 1000), 'UTF8'),
       convert_to('{\"n\": ' || g || '}', 'UTF8'), now() - ($3::bigint - g) * interval '1 ms'
FROM generate_series(1, $3::bigint) g";

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fills 2,000,000 rows: run by hand for docs/PERFORMANCE.md"]
async fn every_page_under_200_ms_on_big_tables() {
    let rows: i64 = std::env::var("CONSOLE_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000_000);
    let n: usize = std::env::var("CONSOLE_BENCH_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let consumer = unique("console-bench");
    let topic = format!("{consumer}-topic");
    let db = pg().await;
    effectively::store::partitions::create(&db, chrono::Utc::now().date_naive())
        .await
        .unwrap();
    let t = Instant::now();
    db.execute(FILL_DEAD_LETTERS, &[&consumer, &topic, &rows])
        .await
        .unwrap();
    db.execute(FILL_INBOX, &[&consumer, &topic, &rows])
        .await
        .unwrap();
    // As autovacuum would after a million inserts: the visibility map lets the capped counts
    // read their partial indexes without visiting the heap.
    for table in ["dead_letters", "inbox"] {
        db.batch_execute(&format!("VACUUM ANALYZE {table}"))
            .await
            .unwrap();
    }
    eprintln!(
        "filled {rows} dead letters and {rows} FAILED inbox rows in {:.0} s",
        t.elapsed().as_secs_f64()
    );

    let result = std::panic::AssertUnwindSafe(measure(&consumer, &topic, n));
    let outcome = futures::FutureExt::catch_unwind(result).await;
    // Removed whatever happened, so the shared database is as it was.
    db.execute("DELETE FROM dead_letters WHERE consumer = $1", &[&consumer])
        .await
        .unwrap();
    db.execute("DELETE FROM inbox WHERE consumer = $1", &[&consumer])
        .await
        .unwrap();
    for table in ["dead_letters", "inbox"] {
        db.batch_execute(&format!("VACUUM ANALYZE {table}"))
            .await
            .unwrap();
    }
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn measure(consumer: &str, topic: &str, n: usize) {
    let db = pg().await;
    let text = format!(
        r#"
[kafka]
brokers = "{brokers}"
[database]
url = "{db}"
[[consumer]]
name = "{consumer}"
topics = ["{topic}"]
strategy = "inbox"
handler = {{ kind = "cashback" }}
[console]
addr = "127.0.0.1:0"
mask = ["/card/number"]
"#,
        brokers = kafka_brokers(),
        db = database_url(),
    );
    let config = Config::from_toml_str(&text).expect("config");
    let bound = effectively::console::bind(&config, None).await.unwrap();
    let addr = bound.addr;
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(bound.run(async move {
        let _ = stopped.await;
    }));
    let q = |sql: &str| {
        let db = &db;
        let sql = sql.to_string();
        async move { db.query_one(&sql, &[&consumer]).await.unwrap() }
    };
    let deep_id: i64 = q("SELECT min(id) + 40 FROM dead_letters WHERE consumer = $1")
        .await
        .get(0);
    let deep_seq: i64 = q("SELECT min(seq) + 40 FROM inbox WHERE consumer = $1")
        .await
        .get(0);
    let mid_id: i64 =
        q("SELECT min(id) + (max(id) - min(id)) / 2 FROM dead_letters WHERE consumer = $1")
            .await
            .get(0);
    let message: uuid::Uuid = q("SELECT message_id FROM inbox WHERE consumer = $1 LIMIT 1")
        .await
        .get(0);
    let pages = [
        ("overview", "/".to_string()),
        ("parked, no filter", "/parked".to_string()),
        ("parked, consumer", format!("/parked?consumer={consumer}")),
        (
            "parked, consumer + reason",
            format!("/parked?consumer={consumer}&reason=missing_field"),
        ),
        (
            "parked, consumer + partition + time window",
            format!("/parked?consumer={consumer}&partition=3&since=20m&until=10m"),
        ),
        (
            "parked, last page (keyset)",
            format!("/parked?consumer={consumer}&dl_before={deep_id}&ib_before={deep_seq}"),
        ),
        ("dead letter page", format!("/parked/dead-letters/{mid_id}")),
        (
            "inbox row page",
            format!("/parked/inbox/{consumer}/{message}"),
        ),
        (
            "inbox, FAILED",
            format!("/inbox?consumer={consumer}&status=FAILED"),
        ),
        (
            "inbox, FAILED, last page (keyset)",
            format!("/inbox?consumer={consumer}&status=FAILED&after_seq={deep_seq}"),
        ),
        ("outbox", "/outbox".to_string()),
        ("notifications", "/notifications".to_string()),
        ("audit", "/audit".to_string()),
    ];
    let client = reqwest::Client::new();
    println!("\n| page | p50 ms | p99 ms | max ms |\n|---|---:|---:|---:|");
    let mut worst = Duration::ZERO;
    for (name, path) in &pages {
        let url = format!("http://{addr}{path}");
        let mut times = Vec::with_capacity(n);
        for i in 0..n + 3 {
            let t = Instant::now();
            let r = client.get(&url).send().await.unwrap();
            let status = r.status();
            let body = r.text().await.unwrap();
            let took = t.elapsed();
            assert!(status.is_success(), "{path}: {status}: {body}");
            assert!(!body.contains("CARD-4111-SECRET"), "{path}: masked");
            if i >= 3 {
                times.push(took);
            }
        }
        times.sort();
        let p99 = percentile(&times, 0.99);
        worst = worst.max(p99);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} |",
            ms(percentile(&times, 0.5)),
            ms(p99),
            ms(*times.last().unwrap())
        );
    }
    assert!(
        worst < Duration::from_millis(200),
        "a page's p99 is {worst:?}, over 200 ms"
    );
}
