//! `/healthz` and `/readyz` against the real Kafka and PostgreSQL: workers started in-process,
//! each with its own endpoint on a port of its own (`127.0.0.1:0`), its own topic and consumer.
//!
//! - Ready only once the group's assignment went through the rebalance callback, alive
//!   meanwhile (the claim that assignment waits for is held behind a row lock).
//! - Ready with no partition: the second member of a group on a one-partition topic.
//! - Not ready while a revocation drains (a handler that holds its batch until released).
//! - Not ready while PostgreSQL is unreachable (the worker's database is a TCP proxy the test
//!   closes and opens again), alive meanwhile, ready again once it answers.
//! - Not alive when a loop ended (a relay whose task is aborted), ready while it ran.
//!
//! Heartbeats going stale are unit-tested in `src/health.rs` with tokio's paused clock.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{eventually, Payment};
use effectively::config::Config;
use effectively::envelope::{Envelope, Rejection};
use effectively::handler::cashback::Cashback;
use effectively::handler::{Applied, BatchContext, Handler, HandlerError, Registry};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// `GET http://addr/path`: the status and the body.
async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let r = reqwest::get(format!("http://{addr}{path}"))
        .await
        .unwrap_or_else(|e| panic!("GET {path} on {addr}: {e}"));
    let status = r.status().as_u16();
    (status, r.text().await.expect("a text body"))
}

/// `common::config` with the monitoring endpoint on a free port.
fn config(consumer: &str, topic: &str, handler: &str, extra: &str) -> Config {
    let mut c = common::config(consumer, topic, handler, extra);
    c.worker.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    c
}

/// Waits until `path` answers `status` with a body containing `needle`.
async fn until(addr: SocketAddr, path: &str, status: u16, needle: &str, secs: u64) {
    let what = format!("{path} on {addr}: {status} with {needle:?}");
    eventually(secs, &what, || async move {
        let (s, body) = get(addr, path).await;
        s == status && body.contains(needle)
    })
    .await;
}

#[tokio::test]
async fn ready_once_the_group_assigned_alive_while_the_assignment_waits() {
    let topic = common::unique("health-join");
    let consumer = common::unique("health-join");
    common::create_topic(&topic, 1).await;
    // The assignment's claim waits behind this lock on the partition's offsets row.
    let mut db = common::pg().await;
    effectively::store::offsets::claim(&db, &consumer, &topic, 0, "test")
        .await
        .unwrap();
    let tx = db.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM consumer_offsets WHERE consumer = $1 AND topic = $2 AND partition = 0 \
         FOR UPDATE",
        &[&consumer, &topic],
    )
    .await
    .unwrap();

    let worker = common::start(config(&consumer, &topic, r#"{ kind = "cashback" }"#, "")).await;
    let addr = worker.endpoint().expect("the endpoint started");
    let (status, body) = get(addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("not in its group"), "{body}");

    // Well past the join (a second or two): the callback is still waiting for the claim, so
    // the consumer is not ready; its loops beat on throughout, so it is alive.
    for _ in 0..6 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (status, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("not in its group"), "{body}");
        let (status, body) = get(addr, "/healthz").await;
        assert_eq!(status, 200, "alive while the assignment waits: {body}");
    }
    let (status, metrics) = get(addr, "/metrics").await;
    assert_eq!(status, 200);
    assert!(
        metrics.contains("effectively_"),
        "the metrics beside: {metrics}"
    );

    tx.commit().await.unwrap();
    until(addr, "/readyz", 200, "ready", 30).await;

    // It does its job: a payment sent now is credited.
    common::send_payments(
        &common::producer(),
        &topic,
        Some(0),
        &[Payment::new(&common::unique("u"), 10_000)],
    )
    .await;
    eventually(30, "the payment credited", || {
        let (db, c) = (&db, &consumer);
        async move { common::ledger(db, c).await.credits == 1 }
    })
    .await;

    let health = worker.health();
    worker.stop().await.unwrap();
    let r = health.readiness();
    assert!(!r.ok && r.text.contains("stopping"), "{}", r.text);
    assert!(health.liveness().ok, "{}", health.liveness().text);
}

#[tokio::test]
async fn a_member_the_group_gives_no_partition_is_ready() {
    let topic = common::unique("health-idle");
    let consumer = common::unique("health-idle");
    common::create_topic(&topic, 1).await;
    let cfg = config(&consumer, &topic, r#"{ kind = "cashback" }"#, "");
    let a = common::start(cfg.clone()).await;
    until(a.endpoint().unwrap(), "/readyz", 200, "ready", 30).await;
    // A stored offset, so that whichever member holds the partition knows where it is.
    let db = common::pg().await;
    common::send_payments(
        &common::producer(),
        &topic,
        Some(0),
        &[Payment::new(&common::unique("u"), 10_000)],
    )
    .await;
    eventually(30, "the payment credited", || {
        let (db, c) = (&db, &consumer);
        async move { common::ledger(db, c).await.credits == 1 }
    })
    .await;
    let b = common::start(cfg).await;
    let b_addr = b.endpoint().unwrap();
    until(b_addr, "/readyz", 200, "ready", 30).await;
    // One partition, two members: one of them holds nothing, and both are ready.
    let held = |w: &effectively::worker::Worker| {
        w.stats(&consumer)
            .map(|s| s.committed_offsets().len())
            .unwrap_or(0)
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(held(&a) + held(&b), 1, "the one partition is held once");
    assert_eq!(get(a.endpoint().unwrap(), "/readyz").await.0, 200);
    assert_eq!(get(b_addr, "/readyz").await.0, 200);
    b.stop().await.unwrap();
    a.stop().await.unwrap();
}

/// Cashback, except that `apply` waits until the gate opens, counting the calls that entered.
struct Gated {
    inner: Cashback,
    open: watch::Receiver<bool>,
    entered: AtomicU64,
}

#[async_trait::async_trait]
impl Handler for Gated {
    fn check(&self, msg: &Envelope) -> Result<(), Rejection> {
        self.inner.check(msg)
    }

    async fn apply(
        &self,
        tx: &deadpool_postgres::Transaction<'_>,
        ctx: &BatchContext<'_>,
        fresh: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.clone();
        let _ = open.wait_for(|o| *o).await;
        self.inner.apply(tx, ctx, fresh).await
    }
}

#[tokio::test]
async fn not_ready_while_a_revocation_drains() {
    let topic = common::unique("health-drain");
    let consumer = common::unique("health-drain");
    common::create_topic(&topic, 2).await;
    let (gate, open) = watch::channel(false);
    let gated = Arc::new(Gated {
        inner: Cashback::new(200),
        open,
        entered: AtomicU64::new(0),
    });
    let handler = r#"{ kind = "custom", name = "gated" }"#;
    // One transaction per batch (commit groups would put both partitions' batches in one
    // handler call): the revocation waits for the batch of the partition it takes.
    let extra = "batch = { group_partitions = false }";
    let mut cfg = config(&consumer, &topic, handler, extra);
    // A drain longer than the test's polling needs to see it, still below the session timeout.
    cfg.worker.revoke_deadline = Duration::from_secs(8);
    let a = common::start_with(
        cfg.clone(),
        Registry::new().with("gated", gated.clone() as Arc<dyn Handler>),
    )
    .await;
    let addr = a.endpoint().unwrap();
    until(addr, "/readyz", 200, "ready", 30).await;

    // One payment on each partition: both batches wait inside the handler.
    let user = common::unique("u");
    let producer = common::producer();
    for p in 0..2 {
        common::send_payments(&producer, &topic, Some(p), &[Payment::new(&user, 1_000)]).await;
    }
    eventually(30, "both batches inside the handler", || {
        let gated = gated.clone();
        async move { gated.entered.load(Ordering::SeqCst) >= 2 }
    })
    .await;
    assert_eq!(get(addr, "/readyz").await.0, 200, "busy is still ready");

    // A second member: the group takes one partition from the first, whose revocation waits
    // for that partition's batch.
    let (_, b_open) = watch::channel(true);
    let b_handler = Arc::new(Gated {
        inner: Cashback::new(200),
        open: b_open,
        entered: AtomicU64::new(0),
    });
    let b = common::start_with(
        config(&consumer, &topic, handler, extra),
        Registry::new().with("gated", b_handler as Arc<dyn Handler>),
    )
    .await;
    until(addr, "/readyz", 503, "draining revoked partitions", 30).await;
    let (status, body) = get(addr, "/healthz").await;
    assert_eq!(status, 200, "alive while draining: {body}");

    // Released: the drain ends, both members are ready, and both payments are credited once.
    gate.send(true).unwrap();
    until(addr, "/readyz", 200, "ready", 30).await;
    until(b.endpoint().unwrap(), "/readyz", 200, "ready", 30).await;
    let db = common::pg().await;
    eventually(30, "both payments credited", || {
        let (db, c) = (&db, &consumer);
        async move { common::ledger(db, c).await.credits == 2 }
    })
    .await;
    b.stop().await.unwrap();
    a.stop().await.unwrap();
}

/// A TCP proxy to PostgreSQL that the test closes (every connection cut, nothing listening)
/// and opens again on the same port.
struct Proxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    cut: CancellationToken,
}

impl Proxy {
    async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let cut = CancellationToken::new();
        tokio::spawn(Self::serve(listener, upstream, cut.clone()));
        Proxy {
            addr,
            upstream,
            cut,
        }
    }

    async fn serve(listener: TcpListener, upstream: SocketAddr, cut: CancellationToken) {
        loop {
            let (mut client, _) = tokio::select! {
                _ = cut.cancelled() => return,
                a = listener.accept() => match a {
                    Ok(a) => a,
                    Err(_) => continue,
                },
            };
            let cut = cut.clone();
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                tokio::select! {
                    _ = cut.cancelled() => {}
                    _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                }
            });
        }
    }

    fn close(&mut self) {
        self.cut.cancel();
    }

    async fn open(&mut self) {
        self.cut = CancellationToken::new();
        let listener = TcpListener::bind(self.addr).await.unwrap();
        tokio::spawn(Self::serve(listener, self.upstream, self.cut.clone()));
    }
}

#[tokio::test]
async fn not_ready_while_postgres_is_unreachable_alive_meanwhile() {
    let url = common::database_url();
    let pg: tokio_postgres::Config = url.parse().unwrap();
    let host = match &pg.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("a TCP database host, not {other:?}"),
    };
    let port = pg.get_ports().first().copied().unwrap_or(5432);
    let upstream = tokio::net::lookup_host((host.as_str(), port))
        .await
        .unwrap()
        .next()
        .unwrap();
    let mut proxy = Proxy::start(upstream).await;
    let user = pg.get_user().unwrap_or("postgres");
    let auth = match pg.get_password() {
        Some(p) => format!("{user}:{}", String::from_utf8_lossy(p)),
        None => user.to_string(),
    };
    let dbname = pg.get_dbname().unwrap_or("effectively");
    let proxied_url = format!("postgres://{auth}@{}/{dbname}", proxy.addr);

    let topic = common::unique("health-pg");
    let consumer = common::unique("health-pg");
    common::create_topic(&topic, 1).await;
    let mut cfg = config(&consumer, &topic, r#"{ kind = "cashback" }"#, "");
    cfg.database.default.url = effectively::config::Secret::new(proxied_url);
    let worker = common::start(cfg).await;
    let addr = worker.endpoint().unwrap();
    until(addr, "/readyz", 200, "ready", 30).await;

    proxy.close();
    until(addr, "/readyz", 503, "database: unavailable", 20).await;
    // A database outage is not the process's fault: alive throughout, no restart.
    for _ in 0..4 {
        let (status, body) = get(addr, "/healthz").await;
        assert_eq!(status, 200, "alive while PostgreSQL is away: {body}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    proxy.open().await;
    until(addr, "/readyz", 200, "ready", 30).await;
    worker.stop().await.unwrap();
}

#[tokio::test]
async fn a_relay_is_ready_with_postgres_and_not_alive_once_its_loop_ended() {
    let relay_topic = common::unique("health-relay");
    let config = Config::from_toml_str(&format!(
        "[kafka]\nbrokers = \"{}\"\n[database]\nurl = \"{}\"\n\
         [relay]\ntopics = {{ \"{}\" = \"{relay_topic}\" }}\npoll_interval = \"50ms\"\n",
        common::kafka_brokers(),
        common::database_url(),
        common::unique("HealthEvent"),
    ))
    .unwrap();
    let relay = effectively::relay::Relay::new(&config).unwrap();
    let health = relay.health();
    let addr = effectively::endpoint::serve("127.0.0.1:0".parse().unwrap(), health).unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.run(stop.clone()));
    until(addr, "/readyz", 200, "ready", 20).await;
    until(addr, "/healthz", 200, "ok", 5).await;

    // Killed, not stopped: the loop is dead, and says which.
    task.abort();
    let _ = task.await;
    let (status, body) = get(addr, "/healthz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("relay: ended"), "{body}");
    stop.cancel();
}
