//! `[database.tls]` against a real PostgreSQL with `ssl = on`: a server of this test's own
//! (initdb into a temporary folder with the machine's PostgreSQL binaries, as
//! `scripts/stack.sh` finds them), so that the shared stack keeps its plaintext settings. Its
//! pg_hba.conf has `hostssl` lines only: plaintext is refused. Certificates are generated per
//! run: a CA, a server certificate it signs for localhost and 127.0.0.1, and a second CA that
//! signed nothing. At the end the server restarts with `ssl = off`, for `prefer` and `require`.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use effectively::config::{DatabaseConfig, Secret, TlsConfig, TlsMode};
use effectively::store::pool::{self, PoolOptions};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose};

/// `initdb` and `pg_ctl` of the newest installed PostgreSQL, 15 first (as the stack).
fn pg_bin() -> PathBuf {
    let mut dirs = vec![PathBuf::from("/usr/lib/postgresql/15/bin")];
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        dirs.extend(entries.flatten().map(|e| e.path().join("bin")));
    }
    (dirs.into_iter())
        .find(|d| d.join("initdb").is_file())
        .expect("PostgreSQL binaries (initdb) under /usr/lib/postgresql: run scripts/stack.sh up")
}

fn is_root() -> bool {
    let out = Command::new("id").arg("-u").output().expect("id -u");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}

/// PostgreSQL refuses to run as root: as the stack does, run it as `postgres` then.
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"])
            .arg(program)
            .current_dir("/");
        c
    } else {
        Command::new(program)
    }
}

fn run(mut c: Command, what: &str) {
    let out = c.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test's server; stopped and deleted on drop, also when an assertion fails.
struct Server {
    dir: PathBuf,
    port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let mut stop = as_postgres(&pg_bin().join("pg_ctl"));
        stop.arg("-D").arg(self.dir.join("data"));
        stop.args(["-m", "immediate", "-w", "stop"]);
        let _ = stop.output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

struct Pki {
    ca: PathBuf,
    other_ca: PathBuf,
}

fn ca(name: &str) -> (rcgen::Certificate, KeyPair) {
    let key = KeyPair::generate().expect("CA key");
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    (params.self_signed(&key).expect("self-signed CA"), key)
}

/// Writes the certificates into `dir` and starts PostgreSQL with `ssl = on` on a free port.
fn start(dir: &Path) -> (Server, Pki) {
    let (ca_cert, ca_key) = ca("effectively test CA");
    let (other_cert, _) = ca("a CA that signed nothing");
    let server_key = KeyPair::generate().expect("server key");
    let mut params = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()])
        .expect("server params");
    params
        .distinguished_name
        .push(DnType::CommonName, "localhost");
    let server_cert = params
        .signed_by(&server_key, &ca_cert, &ca_key)
        .expect("server certificate");

    std::fs::create_dir_all(dir).expect("test folder");
    let pki = Pki {
        ca: dir.join("ca.pem"),
        other_ca: dir.join("other-ca.pem"),
    };
    std::fs::write(&pki.ca, ca_cert.pem()).unwrap();
    std::fs::write(&pki.other_ca, other_cert.pem()).unwrap();
    let (cert_file, key_file) = (dir.join("server.crt"), dir.join("server.key"));
    std::fs::write(&cert_file, server_cert.pem()).unwrap();
    std::fs::write(&key_file, server_key.serialize_pem()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    if is_root() {
        let mut chown = Command::new("chown");
        chown.arg("-R").arg("postgres:postgres").arg(dir);
        run(chown, "chown the test folder");
    }

    let bin = pg_bin();
    let mut initdb = as_postgres(&bin.join("initdb"));
    initdb.arg("-D").arg(&data);
    initdb.args([
        "-U",
        "postgres",
        "--auth=trust",
        "-E",
        "UTF8",
        "--locale=C.UTF-8",
        "-N",
    ]);
    run(initdb, "initdb");
    std::fs::write(
        data.join("pg_hba.conf"),
        "hostssl all all 127.0.0.1/32 trust\nhostssl all all ::1/128 trust\n",
    )
    .unwrap();

    let port = {
        let l = TcpListener::bind("127.0.0.1:0").expect("a free port");
        l.local_addr().unwrap().port()
    };
    let server = Server {
        dir: dir.to_path_buf(),
        port,
    };
    let mut pg_ctl = as_postgres(&bin.join("pg_ctl"));
    pg_ctl
        .arg("-D")
        .arg(&data)
        .arg("-l")
        .arg(dir.join("server.log"));
    pg_ctl.args(["-w", "-t", "30", "start", "-o"]).arg(format!(
        "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off \
         -c ssl=on -c ssl_cert_file={} -c ssl_key_file={}",
        cert_file.display(),
        key_file.display()
    ));
    let started = pg_ctl.output().expect("pg_ctl start");
    assert!(
        started.status.success(),
        "PostgreSQL with ssl = on did not start: {}",
        std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
    );
    (server, pki)
}

fn database(url: String, mode: TlsMode, ca_file: Option<&Path>) -> DatabaseConfig {
    DatabaseConfig {
        url: Secret::new(url),
        tls: TlsConfig {
            mode: Some(mode),
            ca_file: ca_file.map(Path::to_path_buf),
        },
        connect_timeout: Duration::from_secs(5),
        ..DatabaseConfig::default()
    }
}

/// Whether the session is encrypted, as the server sees it.
async fn encrypted(client: &tokio_postgres::Client) -> bool {
    client
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("pg_stat_ssl")
        .get(0)
}

async fn connect_err(db: &DatabaseConfig) -> String {
    match pool::connect_to(db).await {
        Ok(_) => panic!("{:?} connected, but must not", db.tls),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_modes_against_a_server_with_ssl_on() {
    let dir = std::env::temp_dir().join(format!(
        "effectively-pg-tls-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    ));
    let (server, pki) = start(&dir);
    let port = server.port;
    let url = |host: &str| format!("postgres://postgres@{host}:{port}/postgres");
    // The TCP address stays the server's; the name checked against the certificate is not one
    // it lists (tokio-postgres's `hostaddr`).
    let wrong_name =
        format!("postgres://postgres@db.other.test:{port}/postgres?hostaddr=127.0.0.1");

    // require: encrypted, nothing verified.
    let c = pool::connect_to(&database(url("127.0.0.1"), TlsMode::Require, None))
        .await
        .expect("require connects");
    assert!(encrypted(&c).await, "require must encrypt");

    // prefer (the default) against a server that offers TLS: encrypted.
    let c = pool::connect_to(&database(url("localhost"), TlsMode::Prefer, None))
        .await
        .expect("prefer connects");
    assert!(
        encrypted(&c).await,
        "prefer must use the TLS the server offers"
    );

    // verify-full with the right CA, through the engine's pool (its session tables too).
    for host in ["localhost", "127.0.0.1"] {
        let db = database(url(host), TlsMode::VerifyFull, Some(&pki.ca));
        let p = pool::build_for(
            &db,
            &PoolOptions {
                size: 2,
                connect_timeout: Duration::from_secs(5),
                idle_in_transaction_timeout: Duration::from_secs(60),
                no_parallel_query: false,
            },
        )
        .expect("pool");
        let conn = p
            .get()
            .await
            .unwrap_or_else(|e| panic!("verify-full via {host}: {e}"));
        let n: i64 = conn
            .query_one("SELECT count(*) FROM staged_messages", &[])
            .await
            .expect("a query through the pool")
            .get(0);
        assert_eq!(n, 0);
        assert!(encrypted(&conn).await, "verify-full must encrypt");
    }

    // The same through the URL alone, libpq style (the CLI's --database-url commands).
    let ca_param = pki.ca.display().to_string().replace('/', "%2F");
    let c = pool::connect(&format!(
        "{}?sslmode=verify-full&sslrootcert={ca_param}",
        url("localhost")
    ))
    .await
    .expect("sslmode=verify-full in the URL connects");
    assert!(encrypted(&c).await);

    // A CA that did not sign the server's certificate: refused, and the error says so.
    for mode in [TlsMode::VerifyFull, TlsMode::VerifyCa] {
        let err = connect_err(&database(url("localhost"), mode, Some(&pki.other_ca))).await;
        assert!(
            err.contains("not signed by the CA") && err.contains("other-ca.pem"),
            "{mode}: {err}"
        );
    }

    // A host name the certificate does not list: verify-full refuses, naming the host...
    let err = connect_err(&database(
        wrong_name.clone(),
        TlsMode::VerifyFull,
        Some(&pki.ca),
    ))
    .await;
    assert!(
        err.contains("does not name the host \"db.other.test\""),
        "{err}"
    );
    // ...verify-ca, which checks the chain only, connects.
    let c = pool::connect_to(&database(wrong_name, TlsMode::VerifyCa, Some(&pki.ca)))
        .await
        .expect("verify-ca ignores the host name");
    assert!(encrypted(&c).await);

    // A CA file that is not there fails before any connection, naming the setting.
    let missing = dir.join("missing.pem");
    let err = connect_err(&database(
        url("localhost"),
        TlsMode::VerifyFull,
        Some(&missing),
    ))
    .await;
    assert!(
        err.starts_with("database.tls.ca_file") && err.contains("missing.pem"),
        "{err}"
    );

    // Plaintext to a server whose pg_hba.conf has hostssl lines only.
    let err = connect_err(&database(url("127.0.0.1"), TlsMode::Disable, None)).await;
    assert!(err.contains("accepts only encrypted connections"), "{err}");
    assert!(err.contains("sslmode disable"), "{err}");

    // The same server with ssl = off and plaintext allowed: `prefer` (the default) falls back
    // to plaintext, `require` refuses, saying why.
    std::fs::write(
        dir.join("data").join("pg_hba.conf"),
        "host all all 127.0.0.1/32 trust\n",
    )
    .unwrap();
    let mut pg_ctl = as_postgres(&pg_bin().join("pg_ctl"));
    pg_ctl
        .arg("-D")
        .arg(dir.join("data"))
        .arg("-l")
        .arg(dir.join("server.log"));
    pg_ctl
        .args(["-w", "-t", "30", "-m", "immediate", "restart", "-o"])
        .arg(format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off \
         -c ssl=off"
        ));
    run(pg_ctl, "restart PostgreSQL with ssl = off");
    let c = pool::connect_to(&database(url("127.0.0.1"), TlsMode::Prefer, None))
        .await
        .expect("prefer connects without TLS");
    assert!(!encrypted(&c).await, "ssl = off: plaintext");
    let err = connect_err(&database(url("127.0.0.1"), TlsMode::Require, None)).await;
    assert!(err.contains("the server does not offer TLS"), "{err}");

    drop(server);
    assert!(!dir.exists(), "the test's server folder is removed");
}
