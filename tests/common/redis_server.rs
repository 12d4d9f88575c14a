//! A real `redis-server` owned by a test, so that the test can kill, stop, flush and restart
//! it. The binary comes from the stack script's install step (`scripts/stack.sh
//! redis-install`: Debian's redis-server, installed with apt-get when missing).

use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The `redis-server` binary, installed on first use.
fn binary() -> &'static str {
    static BIN: OnceLock<String> = OnceLock::new();
    BIN.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/stack.sh");
        let out = Command::new("bash")
            .args([script, "redis-install"])
            .stderr(Stdio::inherit())
            .output()
            .expect("run scripts/stack.sh redis-install");
        assert!(
            out.status.success(),
            "scripts/stack.sh redis-install failed"
        );
        let text = String::from_utf8(out.stdout).unwrap();
        text.lines()
            .last()
            .expect("the binary's path")
            .trim()
            .to_string()
    })
}

/// One `redis-server` on a free loopback port, no persistence; killed when dropped.
pub struct Redis {
    port: u16,
    dir: std::path::PathBuf,
    child: Option<Child>,
}

impl Redis {
    pub fn start() -> Redis {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
            l.local_addr().unwrap().port()
        };
        let dir = std::env::temp_dir().join(format!("effectively-redis-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let mut r = Redis {
            port,
            dir,
            child: None,
        };
        r.restart();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port, empty.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "already running");
        let child = Command::new(binary())
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let until = Instant::now() + Duration::from_secs(10);
        while self.connection().is_err() {
            assert!(
                Instant::now() < until,
                "redis-server did not answer in 10 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`): a server that accepts connections and never
    /// answers.
    pub fn pause(&self, stop: bool) {
        let pid = self.child.as_ref().expect("running").id();
        let sig = if stop { "-STOP" } else { "-CONT" };
        let ok = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }

    fn connection(&self) -> redis::RedisResult<redis::Connection> {
        let client = redis::Client::open(self.url())?;
        let conn = client.get_connection_with_timeout(Duration::from_secs(1))?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(conn)
    }

    /// Runs one command; panics if Redis does not answer.
    pub fn cmd<T: redis::FromRedisValue>(&self, args: &[&str]) -> T {
        let mut conn = self
            .connection()
            .expect("connect to the test's redis-server");
        let mut c = redis::cmd(args[0]);
        for a in &args[1..] {
            c.arg(*a);
        }
        c.query(&mut conn)
            .unwrap_or_else(|e| panic!("redis {args:?}: {e}"))
    }

    /// A field of `INFO`, as a number.
    pub fn info(&self, field: &str) -> u64 {
        let text: String = self.cmd(&["INFO"]);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in INFO"))
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // Never leave a stopped server behind: SIGCONT first, then kill.
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
