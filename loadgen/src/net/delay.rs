//! Latency on a link, in user space. This machine's kernel (a Firecracker build) has no
//! `sch_netem` and no NFQUEUE, so latency cannot be put on the packets: instead the host's end
//! of a link can take the namespace's connections to a service through a [`Relay`] that holds
//! every chunk a worker sends for the configured delay (± a uniform jitter) before passing it
//! on, in order (only in the latency scenario: [`super::netns::Link::route`] says why). Until
//! a delay is set it passes bytes straight through. Loss and drops stay in the kernel
//! (nftables, [`super::netns`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

/// A delay and its jitter, in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Delay {
    pub ms: u32,
    pub jitter_ms: u32,
}

/// A TCP relay on 127.0.0.1 to one upstream port, delaying what goes upstream.
pub(crate) struct Relay {
    pub port: u16,
    delay: Arc<watch::Sender<Delay>>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    pub(crate) async fn start(upstream: u16) -> anyhow::Result<Relay> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (tx, rx) = watch::channel(Delay::default());
        let upstream: SocketAddr = ([127, 0, 0, 1], upstream).into();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let delay = rx.clone();
                tokio::spawn(async move {
                    if let Ok(server) = TcpStream::connect(upstream).await {
                        pipe(client, server, delay).await;
                    }
                });
            }
        });
        Ok(Relay {
            port,
            delay: Arc::new(tx),
            task,
        })
    }

    /// From now on, every chunk sent upstream waits this long (zero: none).
    pub(crate) fn set(&self, d: Delay) {
        let _ = self.delay.send(d);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Both directions until either side closes: downstream as it comes, upstream through a queue
/// whose chunks leave at their due time (never before the one ahead: the stream keeps its
/// order).
async fn pipe(client: TcpStream, server: TcpStream, delay: watch::Receiver<Delay>) {
    let (mut cr, mut cw) = client.into_split();
    let (mut sr, mut sw) = server.into_split();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read_up = async move {
        let mut rng = fastrand::Rng::new();
        let mut last = Instant::now();
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match cr.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let d = *delay.borrow();
            let jitter = i64::from(d.jitter_ms);
            let ms = (i64::from(d.ms) + rng.i64(-jitter..=jitter)).max(0) as u64;
            let due = (Instant::now() + Duration::from_millis(ms)).max(last);
            last = due;
            if tx.send((due, buf[..n].to_vec())).is_err() {
                return;
            }
        }
    };
    let write_up = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if sw.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = sw.shutdown().await;
    };
    let down = async move {
        let _ = tokio::io::copy(&mut sr, &mut cw).await;
        let _ = cw.shutdown().await;
    };
    // The connection ends when the server's side does, or when the client's side is done and
    // everything it sent has been delivered.
    tokio::select! {
        _ = down => {}
        _ = async { tokio::join!(read_up, write_up) } => {}
    }
}
