//! The operator's way back, through the command line, against the real Kafka and PostgreSQL:
//! redrive (a fixed message applied once, an applied one changes nothing, a crash between the
//! produce and the mark doubles nothing, poison parked again), discard, FAILED inbox rows
//! replayed and discarded, FAILED notifications retried and discarded, and the audit row of
//! every action.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{eventually, ledger, Fault, Payment};

/// A config file for the CLI: the consumer's name and topic; the stack's addresses come from
/// the environment.
fn config_file(consumer: &str, topic: &str, extra: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(consumer);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("effectively.toml");
    std::fs::write(
        &path,
        format!(
            "[[consumer]]\nname = \"{consumer}\"\ntopics = [\"{topic}\"]\n\
             handler = {{ kind = \"cashback\" }}\n{extra}\n"
        ),
    )
    .unwrap();
    path
}

/// Runs `effectively ARGS -c CONFIG` with stdin closed; `failpoints` sets FAILPOINTS.
fn cli(config: &Path, args: &[&str], failpoints: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_effectively"));
    c.args(args)
        .arg("--config")
        .arg(config)
        .env("KAFKA_BROKERS", common::kafka_brokers())
        .env("DATABASE_URL", common::database_url())
        .env("USER", "tester")
        .stdin(Stdio::null());
    if let Some(f) = failpoints {
        c.env("FAILPOINTS", f);
    }
    c.output().unwrap()
}

/// Runs the CLI and returns its standard output; fails the test if it failed.
fn ok(config: &Path, args: &[&str]) -> String {
    let out = cli(config, args, None);
    assert!(out.status.success(), "{args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// A payment padded to about `bytes` bytes of JSON.
fn padded(p: &Payment, bytes: usize) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_slice(&p.json()).unwrap();
    v["pad"] = serde_json::Value::String("x".repeat(bytes));
    serde_json::to_vec(&v).unwrap()
}

/// `(resolution, resolved_by, redriven_to)` of a dead letter.
async fn resolution(
    db: &tokio_postgres::Client,
    id: i64,
) -> (Option<String>, Option<String>, Option<String>) {
    let r = db
        .query_one(
            "SELECT resolution, resolved_by, redriven_to FROM dead_letters WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

/// `(id, reason, offset)` of every dead letter of `consumer`, by offset.
async fn parked(db: &tokio_postgres::Client, consumer: &str) -> Vec<(i64, String, i64)> {
    db.query(
        "SELECT id, reason, \"offset\" FROM dead_letters WHERE consumer = $1 ORDER BY \"offset\"",
        &[&consumer],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// `(verb, count, note)` of the audit rows whose filter names `consumer` or one of `ids`.
async fn audit(
    db: &tokio_postgres::Client,
    consumer: &str,
    ids: &[i64],
) -> Vec<(String, i64, Option<String>, String)> {
    let ids: Vec<String> = ids.iter().map(i64::to_string).collect();
    db.query(
        "SELECT verb, count, note, actor FROM operator_actions
         WHERE filter->>'consumer' = $1 OR filter->>'id' = ANY($2) ORDER BY id",
        &[&consumer, &ids],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_applies_a_fixed_message_once_and_a_crash_half_way_doubles_nothing() {
    let topic = common::unique("redrive");
    let consumer = common::unique("rewards");
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    let user = common::unique("u");
    let small = Payment::new(&user, 10_000);
    let big = Payment::new(&user, 50_000);
    let records = vec![
        (Some(small.event_id.to_string()), small.json()),
        (Some(big.event_id.to_string()), padded(&big, 600)),
        (None, b"\xff not a payment".to_vec()),
    ];
    common::send_raw(&common::producer(), &topic, Some(0), &records).await;

    // A payload limit too small for the big payment: it is parked as oversized.
    let worker = common::start_cashback(&consumer, &topic, "max_payload_bytes = 400").await;
    eventually(60, "all three records read", || async {
        common::stored_offset(&db, &consumer, &topic, 0).await == Some(3)
    })
    .await;
    worker.stop().await.unwrap();
    let dl = parked(&db, &consumer).await;
    assert_eq!(dl.len(), 2, "{dl:?}");
    let (big_id, poison_id) = (dl[0].0, dl[1].0);
    assert_eq!(dl[0].1, "oversized_payload");
    assert_eq!(ledger(&db, &consumer).await.credits, 1);

    let cfg = config_file(&consumer, &topic, "");
    // What an operator reads first.
    let list = ok(&cfg, &["dead-letters", "list", "--consumer", &consumer]);
    assert!(list.starts_with("2 parked dead letter(s) match"), "{list}");
    assert!(list.contains("oversized_payload"), "{list}");
    let shown = ok(&cfg, &["dead-letters", "show", &big_id.to_string()]);
    assert!(
        shown.contains(&format!("record:      {topic}/0@1")),
        "{shown}"
    );
    assert!(
        shown.contains(&format!("\"payment_id\": \"{}\"", big.payment_id)),
        "{shown}"
    );
    assert!(shown.contains("event_id: \""), "{shown}");
    let hex = ok(
        &cfg,
        &[
            "dead-letters",
            "show",
            &poison_id.to_string(),
            "--as",
            "hex",
        ],
    );
    assert!(hex.contains("00000000  ff 20 6e 6f"), "{hex}");

    // Without a filter or --all: refused. More than one row without --yes on a closed stdin:
    // refused. --dry-run: only the count.
    let out = cli(&cfg, &["dead-letters", "redrive"], None);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--all"),
        "{out:?}"
    );
    let out = cli(
        &cfg,
        &["dead-letters", "redrive", "--consumer", &consumer],
        None,
    );
    assert!(!out.status.success(), "{out:?}");
    let dry = ok(
        &cfg,
        &[
            "dead-letters",
            "redrive",
            "--consumer",
            &consumer,
            "--dry-run",
        ],
    );
    assert_eq!(dry.trim(), "would redrive 2 dead letter(s)");
    assert_eq!(resolution(&db, big_id).await.0, None);

    // The fix: the limit is lifted. A worker with the default limit runs from here on.
    let worker = common::start_cashback(&consumer, &topic, "").await;

    // A redrive that dies after the broker took the copy and before the mark: the row stays
    // parked, no audit row; the copy is applied once.
    let out = cli(
        &cfg,
        &["dead-letters", "redrive", &big_id.to_string()],
        Some("redrive_before_mark=return"),
    );
    assert!(!out.status.success(), "the failpoint aborts: {out:?}");
    assert_eq!(resolution(&db, big_id).await.0, None, "still parked");
    assert!(audit(&db, &consumer, &[big_id]).await.is_empty());
    eventually(60, "the crashed redrive's copy applied", || async {
        ledger(&db, &consumer).await.credits == 2
    })
    .await;

    // Redriven again: the second copy is a duplicate of an applied message, nothing changes.
    let out = ok(
        &cfg,
        &[
            "dead-letters",
            "redrive",
            "--consumer",
            &consumer,
            "--reason",
            "oversized_payload",
            "--note",
            "limit raised",
        ],
    );
    assert!(out.starts_with("redrove 1 row(s)"), "{out}");
    let (what, by, to) = resolution(&db, big_id).await;
    assert_eq!(
        (what.as_deref(), by.as_deref()),
        (Some("redriven"), Some("cli:tester"))
    );
    // Offsets 0-2 the originals, 3 the crashed redrive's copy, 4 this one's.
    assert_eq!(to.as_deref(), Some(format!("{topic}/0@4").as_str()));
    eventually(60, "the second copy read", || async {
        common::stored_offset(&db, &consumer, &topic, 0).await == Some(5)
    })
    .await;
    let l = ledger(&db, &consumer).await;
    assert_eq!(
        (l.credits, l.distinct_payments, l.dedupe_keys),
        (2, 2, 2),
        "{l:?}"
    );
    assert_eq!(
        common::wallet_total(&db, std::slice::from_ref(&user)).await,
        (10_000 + 50_000) * 2 / 100
    );
    assert!(common::doubly_credited(&db, &consumer).await.is_empty());

    // Twice is harmless: the row is no longer parked.
    let again = ok(&cfg, &["dead-letters", "redrive", &big_id.to_string()]);
    assert!(again.starts_with("redrove 0 row(s)"), "{again}");

    // The poison cannot be applied: redriven, it is parked again at its new offset, with the
    // redrive's headers, and the old row says where the copy went.
    ok(&cfg, &["dead-letters", "redrive", &poison_id.to_string()]);
    eventually(60, "the poison parked again", || async {
        parked(&db, &consumer).await.len() == 3
    })
    .await;
    let dl = parked(&db, &consumer).await;
    let (new_id, reason, offset) = dl[2].clone();
    assert_eq!((reason.as_str(), offset), (dl[1].1.as_str(), 5));
    assert_eq!(
        resolution(&db, poison_id).await.2.as_deref(),
        Some(format!("{topic}/0@5").as_str())
    );
    let shown = ok(&cfg, &["dead-letters", "show", &new_id.to_string()]);
    assert!(shown.contains("effectively-redrive: \""), "{shown}");
    assert!(
        shown.contains(&format!("effectively-redriven-from: \"{topic}/0@2\"")),
        "{shown}"
    );

    // Given up: it stays, marked, with the operator's note in the audit.
    let out = ok(
        &cfg,
        &[
            "dead-letters",
            "discard",
            &new_id.to_string(),
            "--note",
            "garbage",
        ],
    );
    assert!(out.starts_with("discarded 1 row(s)"), "{out}");
    assert_eq!(
        resolution(&db, new_id).await.0.as_deref(),
        Some("discarded")
    );
    let list = ok(&cfg, &["dead-letters", "list", "--consumer", &consumer]);
    assert!(list.starts_with("0 parked dead letter(s) match"), "{list}");

    let a = audit(&db, &consumer, &[big_id, poison_id, new_id]).await;
    let verbs: Vec<(&str, i64, Option<&str>)> = a
        .iter()
        .map(|(v, n, note, _)| (v.as_str(), *n, note.as_deref()))
        .collect();
    assert_eq!(
        verbs,
        [
            ("redrive", 1, Some("limit raised")),
            ("redrive", 0, None),
            ("redrive", 1, None),
            ("discard", 1, Some("garbage")),
        ]
    );
    assert!(a.iter().all(|r| r.3 == "cli:tester"), "{a:?}");
    worker.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_inbox_rows_are_replayed_once_or_discarded_with_an_audit_row() {
    let topic = common::unique("inbox-replay");
    let consumer = common::unique("notify");
    common::create_topic(&topic, 1).await;
    let db = common::pg().await;
    let user = common::unique("u");
    let refused: Vec<Payment> = (0..3).map(|_| Payment::new(&user, 13_000)).collect();
    let fine = Payment::new(&user, 20_000);
    let mut all = refused.clone();
    all.push(fine.clone());
    common::send_payments(&common::producer(), &topic, Some(0), &all).await;

    // A handler that refuses 130.00 payments: they end FAILED (a permanent error).
    let inbox = "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 1";
    let (_faulty, worker) = common::start_faulty(
        &consumer,
        &topic,
        Fault::RejectAmount(13_000),
        "faulty",
        inbox,
    )
    .await;
    let failed = || async {
        db.query_one(
            "SELECT count(*) FROM inbox WHERE consumer = $1 AND status = 'FAILED'",
            &[&consumer],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    eventually(60, "three rows FAILED", || async { failed().await == 3 }).await;
    worker.stop().await.unwrap();
    assert_eq!(ledger(&db, &consumer).await.credits, 1);

    let cfg = config_file(&consumer, &topic, inbox);
    let list = ok(&cfg, &["inbox", "list", "--consumer", &consumer]);
    assert!(list.starts_with("3 FAILED inbox row(s) match"), "{list}");
    assert!(list.contains("injected: amount 13000 is refused"), "{list}");
    let id = refused[0].event_id.to_string();
    let shown = ok(&cfg, &["inbox", "show", &consumer, &id]);
    assert!(shown.contains("status:      FAILED"), "{shown}");
    assert!(shown.contains(&refused[0].payment_id), "{shown}");

    // One given up, by id; the other two replayed by filter once the handler is fixed.
    let out = ok(
        &cfg,
        &[
            "inbox",
            "discard",
            "--consumer",
            &consumer,
            "--id",
            &id,
            "--note",
            "refunded",
        ],
    );
    assert!(out.starts_with("discarded 1 row(s)"), "{out}");
    let dry = ok(
        &cfg,
        &[
            "inbox",
            "replay",
            "--failed",
            "--consumer",
            &consumer,
            "--dry-run",
        ],
    );
    assert_eq!(dry.trim(), "would replay 2 FAILED inbox row(s)");
    let worker = common::start_cashback(&consumer, &topic, inbox).await;
    let out = ok(
        &cfg,
        &[
            "inbox",
            "replay",
            "--failed",
            "--consumer",
            &consumer,
            "--yes",
        ],
    );
    assert!(out.starts_with("2 row(s) back to PENDING"), "{out}");
    eventually(60, "the replayed rows applied", || async {
        ledger(&db, &consumer).await.credits == 3
    })
    .await;
    // Replayed again: nothing is FAILED any more, nothing changes.
    let out = ok(
        &cfg,
        &[
            "inbox",
            "replay",
            "--failed",
            "--consumer",
            &consumer,
            "--yes",
        ],
    );
    assert!(out.starts_with("0 row(s)"), "{out}");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    worker.stop().await.unwrap();
    let l = ledger(&db, &consumer).await;
    assert_eq!((l.credits, l.distinct_payments), (3, 3), "{l:?}");
    let statuses: Vec<(String, i64)> = db
        .query(
            "SELECT status, count(*) FROM inbox WHERE consumer = $1 GROUP BY 1 ORDER BY 1",
            &[&consumer],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        statuses,
        [("DISCARDED".to_string(), 1), ("DONE".to_string(), 3)]
    );
    let a: Vec<(String, i64, Option<String>)> = audit(&db, &consumer, &[])
        .await
        .into_iter()
        .map(|(v, n, note, _)| (v, n, note))
        .collect();
    assert_eq!(
        a,
        [
            ("discard".into(), 1, Some("refunded".into())),
            ("replay".into(), 2, None),
            ("replay".into(), 0, None),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_notifications_are_retried_with_their_key_or_discarded() {
    let db = common::pg().await;
    let channel = common::unique("sms");
    let ids: Vec<uuid::Uuid> = (0..3).map(|_| uuid::Uuid::now_v7()).collect();
    for (i, id) in ids.iter().enumerate() {
        db.execute(
            "INSERT INTO notifications (event_id, channel, status, payload, key_generation,
                                        attempts, last_error)
             VALUES ($1, $2, 'FAILED', '{}', $3, 5, 'provider said no')",
            &[id, &channel, &(i as i32)],
        )
        .await
        .unwrap();
    }
    let cfg = config_file(&common::unique("sender"), "unused", "");
    let list = ok(&cfg, &["notifications", "list", "--channel", &channel]);
    assert_eq!(list.lines().count(), 4, "{list}");
    let one = ids[0].to_string();
    let out = ok(
        &cfg,
        &[
            "notifications",
            "discard",
            "--event-id",
            &one,
            "--channel",
            &channel,
        ],
    );
    assert!(out.starts_with("discarded 1 row(s)"), "{out}");
    let out = ok(
        &cfg,
        &[
            "notifications",
            "retry",
            "--channel",
            &channel,
            "--yes",
            "--note",
            "provider fixed",
        ],
    );
    assert!(out.starts_with("retried 2 row(s)"), "{out}");
    let rows: Vec<(uuid::Uuid, String, i32, i32)> = db
        .query(
            "SELECT event_id, status, attempts, key_generation FROM notifications
             WHERE channel = $1 ORDER BY event_id",
            &[&channel],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        rows,
        [
            (ids[0], "DISCARDED".to_string(), 5, 0),
            (ids[1], "PENDING".to_string(), 0, 1),
            (ids[2], "PENDING".to_string(), 0, 2),
        ],
        "a retry keeps the idempotency key's generation"
    );
    let a: Vec<(String, i64)> = db
        .query(
            "SELECT verb, count FROM operator_actions
             WHERE target = 'notifications' AND filter->>'channel' = $1 ORDER BY id",
            &[&channel],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(a, [("discard".into(), 1), ("retry".into(), 2)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_rows_page_by_keyset_filter_and_count_with_a_cap() {
    use effectively::store::parked::{self, Filter};
    let db = common::pg().await;
    let consumer = common::unique("pages");
    // 25 dead letters over two reasons and two partitions, one of them resolved already.
    for i in 0..25i64 {
        let reason = if i % 5 == 0 {
            "missing_event_id"
        } else {
            "undecodable_payload"
        };
        db.execute(
            "INSERT INTO dead_letters (consumer, topic, partition, \"offset\", reason, detail, payload)
             VALUES ($1, 'payments', $2, $3, $4, 'test', 'x')",
            &[&consumer, &((i % 2) as i32), &i, &reason],
        )
        .await
        .unwrap();
    }
    db.execute(
        "UPDATE dead_letters SET resolution = 'discarded', resolved_at = now(),
                resolved_by = 'test', resolved_action = gen_random_uuid()
         WHERE consumer = $1 AND \"offset\" = 24",
        &[&consumer],
    )
    .await
    .unwrap();
    let all = Filter {
        consumer: Some(consumer.clone()),
        ..Filter::default()
    };
    // Keyset pages of 10, newest first, cover the 24 parked rows once each.
    let mut seen = Vec::new();
    let mut before = None;
    loop {
        let page = parked::dead_letters(&db, &all, before, 10).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.windows(2).all(|w| w[0].id > w[1].id), "newest first");
        before = page.last().map(|r| r.id);
        seen.extend(page.iter().map(|r| r.offset));
    }
    seen.sort();
    assert_eq!(seen, (0..24).collect::<Vec<i64>>());
    let capped = |f: Filter, cap| {
        let db = &db;
        async move { parked::count_dead_letters(db, &f, cap).await.unwrap() }
    };
    let c = capped(all.clone(), 10).await;
    assert_eq!(
        (c.count, c.more, c.to_string()),
        (10, true, "10+".to_string())
    );
    let c = capped(all.clone(), 1_000).await;
    assert_eq!((c.count, c.more), (24, false));
    let by_reason = Filter {
        reason: Some("missing_event_id".into()),
        partition: Some(0),
        ..all.clone()
    };
    // Offsets 0, 10, 20 (5 and 15 are on partition 1).
    let rows = parked::dead_letters(&db, &by_reason, None, 50)
        .await
        .unwrap();
    let offsets: Vec<i64> = rows.iter().map(|r| r.offset).collect();
    assert_eq!(offsets, [20, 10, 0]);
    let later = Filter {
        since: Some(chrono::Utc::now() + chrono::Duration::hours(1)),
        ..all.clone()
    };
    assert_eq!(capped(later, 100).await.count, 0);
    // A reason of dead letters leaves FAILED inbox rows out.
    assert!(!by_reason.takes_inbox());
    assert_eq!(
        parked::count_failed_inbox(&db, &by_reason, 100)
            .await
            .unwrap()
            .count,
        0
    );
    let one = parked::dead_letter(&db, rows[0].id).await.unwrap().unwrap();
    assert_eq!(one.message.payload.as_deref(), Some(&b"x"[..]));
    assert!(one.resolution.is_none());
}
