//! Scenarios where a service fails under the workers: `postgres-crash` and `broker-crash`
//! (crashed and restarted with `scripts/stack.sh`) and `postgres-unreachable` (connections cut
//! and refused by a proxy).

use std::sync::Arc;

use super::workers::{Env, Proc};
use crate::harness::pause;
use crate::harness::stack::stack;

/// `postgres-crash`: PostgreSQL crashed and restarted twice.
pub(super) async fn postgres_crash(
    env: &mut Env<'_>,
    rng: &mut fastrand::Rng,
    live: &mut Vec<Proc>,
) -> anyhow::Result<()> {
    live.push(env.start(None)?);
    for _ in 0..2 {
        pause(rng.u64(2000..4000)).await;
        stack("pg-crash").await?;
        pause(3000).await;
        stack("up").await?;
    }
    Ok(())
}

/// `postgres-unreachable`: the workers' connections through `proxy` cut, and new ones refused,
/// for 8 s.
pub(super) async fn postgres_unreachable(
    env: &mut Env<'_>,
    rng: &mut fastrand::Rng,
    proxy: &Option<Proxy>,
    live: &mut Vec<Proc>,
    note: &mut String,
) -> anyhow::Result<()> {
    live.push(env.start(None)?);
    let proxy = proxy.as_ref().expect("started above");
    pause(rng.u64(2000..4000)).await;
    // Longer than the pool's connect timeout (5 s): established connections
    // are cut and new ones refused, then it comes back.
    proxy.cut(true);
    pause(8000).await;
    proxy.cut(false);
    *note = "connections cut and refused for 8 s".into();
    Ok(())
}

/// `broker-crash`: the Kafka broker crashed and restarted.
pub(super) async fn broker_crash(
    env: &mut Env<'_>,
    rng: &mut fastrand::Rng,
    live: &mut Vec<Proc>,
) -> anyhow::Result<()> {
    live.push(env.start(None)?);
    pause(rng.u64(2000..4000)).await;
    stack("kafka-crash").await?;
    pause(2000).await;
    stack("up").await?;
    Ok(())
}

/// A TCP proxy in front of PostgreSQL that can cut every connection and refuse new ones.
pub(super) struct Proxy {
    pub(super) url: String,
    cut: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Proxy {
    pub(super) async fn start(database_url: &str) -> anyhow::Result<Proxy> {
        let cfg: tokio_postgres::Config = database_url.parse()?;
        let port = cfg.get_ports().first().copied().unwrap_or(5432);
        let upstream = format!("127.0.0.1:{port}");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let local = listener.local_addr()?;
        let url = database_url.replacen(&format!(":{port}/"), &format!(":{}/", local.port()), 1);
        anyhow::ensure!(
            url != database_url,
            "cannot point {database_url:?} at the proxy"
        );
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if *rx.borrow() {
                    drop(client); // refused: closed at once
                    continue;
                }
                let upstream = upstream.clone();
                let mut cut = rx.clone();
                tokio::spawn(async move {
                    let Ok(server) = tokio::net::TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let (mut c, mut s) = (client, server);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut c, &mut s) => {}
                        // Dropping both ends cuts the connection.
                        _ = cut.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        Ok(Proxy {
            url,
            cut: Arc::new(tx),
        })
    }

    fn cut(&self, on: bool) {
        let _ = self.cut.send(on);
    }
}
