//! A worker's own network: a namespace joined to the host by a veth pair, and the faults the
//! scenarios put on that link (nftables for loss and silent drops, a relay for latency). Nothing
//! leaves the machine: the addresses are the test's own, and the services stay on the host's
//! loopback.
//!
//! The workers are told the stack's loopback addresses (127.0.0.1), as every other test does,
//! and Kafka advertises its listener there. Inside a namespace 127.0.0.1 is the namespace's
//! own, so its nftables send the services' ports across the veth (DNAT to the host's end, then
//! masquerade), and the host's take them back to its loopback (DNAT to 127.0.0.1 on the way
//! in, SNAT to 127.0.0.1 at input, which PostgreSQL's `pg_hba.conf` trusts). `route_localnet`
//! lets loopback addresses cross the veth; it is set on the namespace and on the host's end of
//! the veth only.
//!
//! A fault names what it acts on ([`To`]: the ports of PostgreSQL, of Kafka, or both); only
//! those ports are touched, the other service's traffic crosses the same link undisturbed.
//! Drops and loss are nftables rules inside the namespace, on the packets themselves: what the
//! namespace sends to a port (output) and what it receives from it (input); loss draws each
//! packet with `numgen random`. Latency is added by the link's [`Relay`]s (one per service
//! port, which the host's end sends the namespace's connections through when
//! [`Link::route`] says so): this kernel has no `sch_netem` ([`super::delay`] says why).

use std::process::Stdio;

use anyhow::Context;

use super::delay::{Delay, Relay};

/// The services' ports a fault acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum To {
    Postgres,
    Kafka,
    Both,
}

/// A fault on a link, until [`Link::heal`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fault {
    /// What is sent to `to` delayed `ms` ± `jitter_ms` (uniform), on the way there only:
    /// every round trip to it grows by about `ms`.
    Latency { to: To, ms: u32, jitter_ms: u32 },
    /// This percentage of the packets to and from `to` lost, each way (so a round trip is
    /// lost about twice as often).
    Loss { to: To, percent: f64 },
    /// Every packet to and from `to` dropped silently (nothing refused, no reset): established
    /// connections hang, new ones time out.
    Cut { to: To },
    /// Only the answers from `to` dropped: what is sent arrives (a COMMIT commits), the worker
    /// never hears back.
    Deaf { to: To },
}

/// The stack's ports, as the workers dial them on 127.0.0.1.
#[derive(Debug, Clone)]
pub(crate) struct Ports {
    pub postgres: u16,
    pub kafka: Vec<u16>,
}

impl Ports {
    /// From the stack's `KAFKA_BROKERS` and `DATABASE_URL`: every broker must be on
    /// 127.0.0.1 (the namespaces reach the host's loopback, nothing else).
    pub(crate) fn of(brokers: &str, database_url: &str) -> anyhow::Result<Ports> {
        let mut kafka = Vec::new();
        for b in brokers.split(',') {
            let (host, port) = b
                .trim()
                .rsplit_once(':')
                .with_context(|| format!("broker {b:?} has no port"))?;
            anyhow::ensure!(
                host == "127.0.0.1" || host == "localhost",
                "chaos-net reaches the stack on 127.0.0.1 only, not broker {b:?}"
            );
            kafka.push(port.parse()?);
        }
        let pg: tokio_postgres::Config = database_url.parse()?;
        Ok(Ports {
            postgres: pg.get_ports().first().copied().unwrap_or(5432),
            kafka,
        })
    }

    fn of_fault(&self, to: To) -> Vec<u16> {
        match to {
            To::Postgres => vec![self.postgres],
            To::Kafka => self.kafka.clone(),
            To::Both => [vec![self.postgres], self.kafka.clone()].concat(),
        }
    }

    fn all(&self) -> Vec<u16> {
        self.of_fault(To::Both)
    }
}

/// `{ 5432, 9092 }`: an nftables set of ports.
fn set(ports: &[u16]) -> String {
    let list: Vec<String> = ports.iter().map(u16::to_string).collect();
    format!("{{ {} }}", list.join(", "))
}

/// Namespace `effnet<n>`, joined to the host by a veth pair (`effnet<n>h` on the host,
/// `effnet<n>n` inside), 10.213.<n>.1 and .2 on a /30.
pub(crate) struct Link {
    pub ns: String,
    host_if: String,
    ns_if: String,
    host_ip: String,
    ns_ip: String,
    ports: Ports,
    /// The relay of each service port: (the port, its relay).
    relays: Vec<(u16, Relay)>,
}

impl Link {
    /// Makes namespace `n` (1 to 250), after removing whatever a crashed run left of it.
    pub(crate) async fn create(n: u8, ports: &Ports) -> anyhow::Result<Link> {
        anyhow::ensure!(
            (1..=250).contains(&n),
            "namespace number {n} out of 1..=250"
        );
        let mut relays = Vec::new();
        for p in ports.all() {
            relays.push((p, Relay::start(p).await?));
        }
        let link = Link {
            ns: format!("effnet{n}"),
            host_if: format!("effnet{n}h"),
            ns_if: format!("effnet{n}n"),
            host_ip: format!("10.213.{n}.1"),
            ns_ip: format!("10.213.{n}.2"),
            ports: ports.clone(),
            relays,
        };
        link.remove().await;
        link.build().await.with_context(|| {
            format!(
                "making network namespace {} (chaos-net needs root, iproute2 and nftables)",
                link.ns
            )
        })?;
        Ok(link)
    }

    async fn build(&self) -> anyhow::Result<()> {
        let (ns, h, n) = (&self.ns, &self.host_if, &self.ns_if);
        run("ip", &["netns", "add", ns]).await?;
        run("ip", &["link", "add", h, "type", "veth", "peer", "name", n]).await?;
        run("ip", &["link", "set", n, "netns", ns]).await?;
        run(
            "ip",
            &["addr", "add", &format!("{}/30", self.host_ip), "dev", h],
        )
        .await?;
        run("ip", &["link", "set", h, "up"]).await?;
        self.in_ns(
            "ip",
            &["addr", "add", &format!("{}/30", self.ns_ip), "dev", n],
        )
        .await?;
        self.in_ns("ip", &["link", "set", n, "up"]).await?;
        self.in_ns("ip", &["link", "set", "lo", "up"]).await?;
        self.in_ns("ip", &["route", "add", "default", "via", &self.host_ip])
            .await?;
        self.in_ns("sysctl", &["-qw", "net.ipv4.conf.all.route_localnet=1"])
            .await?;
        run(
            "sysctl",
            &["-qw", &format!("net.ipv4.conf.{h}.route_localnet=1")],
        )
        .await?;
        let ports = set(&self.ports.all());
        let inside = format!(
            "table ip effnet {{\n\
             chain out {{\n type nat hook output priority -100\n \
             ip daddr 127.0.0.1 tcp dport {ports} dnat to {host}\n}}\n\
             chain post {{\n type nat hook postrouting priority 100\n oifname \"{n}\" masquerade\n}}\n}}\n",
            host = self.host_ip
        );
        self.nft_in_ns(&inside).await?;
        self.route(false).await
    }

    /// The host's end: the namespace's connections to the services' ports go to the services
    /// themselves, or (`relayed`) each to its port's [`Relay`] (latency). Set before a
    /// scenario's workers start: connections made before keep their way. Only the latency
    /// scenario goes through the relays: a relay outlives a worker's dead connection (it
    /// holds the server's end open until the worker's FIN comes through), which would hide
    /// from PostgreSQL a client that is gone.
    pub(crate) async fn route(&self, relayed: bool) -> anyhow::Result<()> {
        let _ = quiet("nft", &["delete", "table", "ip", &self.ns]).await;
        let ports = set(&self.ports.all());
        let to = if relayed {
            let map: Vec<String> = (self.relays.iter())
                .map(|(p, r)| format!("{p} : {}", r.port))
                .collect();
            format!("127.0.0.1 : tcp dport map {{ {} }}", map.join(", "))
        } else {
            "127.0.0.1".to_string()
        };
        let outside = format!(
            "table ip {ns} {{\n\
             chain pre {{\n type nat hook prerouting priority -100\n \
             iifname \"{h}\" ip daddr {host} tcp dport {ports} dnat to {to}\n}}\n\
             chain in {{\n type nat hook input priority 100\n \
             ip saddr {ns_ip} ip daddr 127.0.0.1 snat to 127.0.0.1\n}}\n}}\n",
            ns = self.ns,
            h = self.host_if,
            host = self.host_ip,
            ns_ip = self.ns_ip,
        );
        nft(None, &outside).await
    }

    /// Removes the namespace, its veth pair (deleting one end deletes both) and the host's
    /// table; what is already gone is no error.
    async fn remove(&self) {
        let _ = quiet("ip", &["link", "del", &self.host_if]).await;
        let _ = quiet("ip", &["netns", "del", &self.ns]).await;
        let _ = quiet("nft", &["delete", "table", "ip", &self.ns]).await;
    }

    /// `ip netns exec <ns> <program>`: `program` run inside the namespace (`ip` execs it, so
    /// the child's pid is the program's own).
    pub(crate) fn command(&self, program: &std::path::Path) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("ip");
        cmd.args(["netns", "exec", &self.ns]).arg(program);
        cmd
    }

    /// Puts `fault` on the link, after lifting any other.
    pub(crate) async fn apply(&self, fault: Fault) -> anyhow::Result<()> {
        self.heal().await?;
        match fault {
            Fault::Latency { to, ms, jitter_ms } => {
                let ports = self.ports.of_fault(to);
                for (_, r) in self.relays.iter().filter(|(p, _)| ports.contains(p)) {
                    r.set(Delay { ms, jitter_ms });
                }
                Ok(())
            }
            Fault::Loss { to, percent } => {
                // Per mille, drawn per packet.
                let drop = format!("numgen random mod 1000 < {} drop", (percent * 10.0).round());
                self.drop(to, &drop, &drop).await
            }
            Fault::Cut { to } => self.drop(to, "drop", "drop").await,
            Fault::Deaf { to } => self.drop(to, "accept", "drop").await,
        }
    }

    /// Lifts every fault: the link as it was made.
    pub(crate) async fn heal(&self) -> anyhow::Result<()> {
        for (_, r) in &self.relays {
            r.set(Delay::default());
        }
        let _ = quiet_in(
            &self.ns,
            "nft",
            &["delete", "table", "inet", "effnet_fault"],
        )
        .await;
        Ok(())
    }

    /// A rule inside the namespace on what it sends to `to` (`out`: its verdict, such as
    /// `drop`) and on what it receives from `to` (`back`).
    async fn drop(&self, to: To, out: &str, back: &str) -> anyhow::Result<()> {
        let ports = set(&self.ports.of_fault(to));
        let rules = format!(
            "table inet effnet_fault {{\n\
             chain out {{\n type filter hook output priority 0\n tcp dport {ports} {out}\n}}\n\
             chain in {{\n type filter hook input priority 0\n tcp sport {ports} {back}\n}}\n}}\n"
        );
        self.nft_in_ns(&rules).await
    }

    async fn in_ns(&self, program: &str, args: &[&str]) -> anyhow::Result<()> {
        let mut all = vec!["netns", "exec", &self.ns, program];
        all.extend_from_slice(args);
        run("ip", &all).await
    }

    async fn nft_in_ns(&self, rules: &str) -> anyhow::Result<()> {
        nft(Some(&self.ns), rules).await
    }

    /// Removes everything [`Link::create`] made.
    pub(crate) async fn destroy(self) {
        self.remove().await;
    }
}

/// `nft -f -` with `rules` on its stdin, in namespace `ns` if any.
async fn nft(ns: Option<&str>, rules: &str) -> anyhow::Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = tokio::process::Command::new("ip");
            c.args(["netns", "exec", ns, "nft", "-f", "-"]);
            c
        }
        None => {
            let mut c = tokio::process::Command::new("nft");
            c.args(["-f", "-"]);
            c
        }
    };
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting nft (Debian's nftables)")?;
    let mut stdin = child.stdin.take().context("nft's stdin")?;
    stdin.write_all(rules.as_bytes()).await?;
    drop(stdin);
    let out = child.wait_with_output().await?;
    anyhow::ensure!(
        out.status.success(),
        "nft refused these rules: {}\n{rules}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// Runs `program args`; its stderr in the error if it fails.
async fn run(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .await
        .with_context(|| format!("starting {program}"))?;
    anyhow::ensure!(
        out.status.success(),
        "{program} {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// [`run`] where failing is expected (removing what may not exist).
async fn quiet(program: &str, args: &[&str]) -> anyhow::Result<()> {
    let status = tokio::process::Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await?;
    anyhow::ensure!(status.success(), "{program} failed");
    Ok(())
}

async fn quiet_in(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<()> {
    let mut all = vec!["netns", "exec", ns, program];
    all.extend_from_slice(args);
    quiet("ip", &all).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_come_from_the_stacks_addresses() {
        let p = Ports::of(
            "127.0.0.1:9092,localhost:9096",
            "postgres://postgres@127.0.0.1:5433/effectively",
        )
        .unwrap();
        assert_eq!(p.postgres, 5433);
        assert_eq!(p.kafka, vec![9092, 9096]);
        assert_eq!(p.of_fault(To::Postgres), vec![5433]);
        assert_eq!(p.of_fault(To::Both), vec![5433, 9092, 9096]);
        assert_eq!(set(&p.all()), "{ 5433, 9092, 9096 }");
        assert!(Ports::of("10.0.0.5:9092", "postgres://x@127.0.0.1/e").is_err());
    }
}
