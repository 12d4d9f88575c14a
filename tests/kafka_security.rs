//! TLS and SASL to Kafka, against the stack's own broker: its TLS listener and its SASL-over-TLS
//! listener (SCRAM-SHA-256, SCRAM-SHA-512 and PLAIN), with the CA and the SCRAM user that
//! `scripts/stack.sh up` makes (`KAFKA_TLS_BROKERS`, `KAFKA_SASL_BROKERS`, `KAFKA_CA_FILE`,
//! `KAFKA_SASL_PASSWORD_FILE` in `.stack/env`). A worker configured with `[kafka.tls]` and
//! `[kafka.sasl]` consumes and applies; a wrong password, a CA that did not sign the broker's
//! certificate, or plaintext against a TLS port fail with librdkafka's reason.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{eventually, ledger, Payment};
use effectively::config::{KafkaConfig, KafkaSasl, KafkaTls, SaslMechanism};
use effectively::source::probe;

struct Stack {
    tls_brokers: String,
    sasl_brokers: String,
    ca_file: PathBuf,
    password_file: PathBuf,
}

fn stack() -> Stack {
    let get = |name: &str| {
        let v = common::setting(name, "");
        assert!(
            !v.is_empty(),
            "{name} is not set: run `scripts/stack.sh up` (it starts the TLS and SASL listeners)"
        );
        v
    };
    Stack {
        tls_brokers: get("KAFKA_TLS_BROKERS"),
        sasl_brokers: get("KAFKA_SASL_BROKERS"),
        ca_file: get("KAFKA_CA_FILE").into(),
        password_file: get("KAFKA_SASL_PASSWORD_FILE").into(),
    }
}

fn tls(ca_file: &std::path::Path) -> KafkaTls {
    KafkaTls {
        ca_file: Some(ca_file.to_path_buf()),
        cert_file: None,
        key_file: None,
        verify_hostname: true,
    }
}

fn sasl(mechanism: SaslMechanism, username: &str, password_file: PathBuf) -> KafkaSasl {
    KafkaSasl {
        mechanism,
        username: username.into(),
        password_env: None,
        password_file: Some(password_file),
    }
}

fn kafka(brokers: &str, tls: Option<KafkaTls>, sasl: Option<KafkaSasl>) -> KafkaConfig {
    KafkaConfig {
        brokers: brokers.into(),
        tls,
        sasl,
        ..KafkaConfig::default()
    }
}

/// A CA of its own, which signed nothing the broker has.
fn other_ca(dir: &std::path::Path) -> PathBuf {
    let ca = dir.join("other-ca.pem");
    let ok = std::process::Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        ])
        .args(["-subj", "/CN=not the stack's CA", "-keyout"])
        .arg(dir.join("other-ca.key"))
        .arg("-out")
        .arg(&ca)
        .output()
        .expect("running openssl")
        .status
        .success();
    assert!(ok, "openssl made the other CA");
    ca
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_consume_over_tls_and_over_sasl_scram_and_plain() {
    let s = stack();
    let db = common::pg().await;
    let producer = common::producer();
    let over_sasl = |mechanism| {
        let login = sasl(mechanism, "effectively", s.password_file.clone());
        kafka(&s.sasl_brokers, Some(tls(&s.ca_file)), Some(login))
    };
    let setups = [
        ("tls", kafka(&s.tls_brokers, Some(tls(&s.ca_file)), None)),
        ("scram-sha-512", over_sasl(SaslMechanism::ScramSha512)),
        ("scram-sha-256", over_sasl(SaslMechanism::ScramSha256)),
        ("plain", over_sasl(SaslMechanism::Plain)),
    ];
    for (name, k) in setups {
        let topic = common::unique(&format!("secure-{name}"));
        let consumer = common::unique(&format!("secure-{name}"));
        common::create_topic(&topic, 1).await;
        let mut cfg = common::config(&consumer, &topic, r#"{ kind = "cashback" }"#, "");
        cfg.kafka.brokers = k.brokers.clone();
        cfg.kafka.tls = k.tls.clone();
        cfg.kafka.sasl = k.sasl.clone();
        cfg.validate().expect("a valid config");
        assert_eq!(probe(&k, Duration::from_secs(10)), Ok(1), "{name}");
        let worker = common::start(cfg).await;
        let user = common::unique("u");
        let payments: Vec<Payment> = (0..3).map(|i| Payment::new(&user, 1_000 + i)).collect();
        common::send_payments(&producer, &topic, Some(0), &payments).await;
        eventually(40, &format!("{name}: three payments credited"), || {
            let (db, c) = (&db, &consumer);
            async move { ledger(db, c).await.credits == 3 }
        })
        .await;
        worker.stop().await.unwrap();
    }
}

#[tokio::test]
async fn a_wrong_password_a_wrong_ca_or_plaintext_to_tls_fail_with_the_reason() {
    let s = stack();
    let dir = std::env::temp_dir().join(common::unique("kafka-security"));
    std::fs::create_dir_all(&dir).unwrap();
    let wrong_pw = dir.join("wrong-password");
    std::fs::write(&wrong_pw, "not-the-password\n").unwrap();
    let t = Duration::from_secs(8);

    let bad_auth = kafka(
        &s.sasl_brokers,
        Some(tls(&s.ca_file)),
        Some(sasl(SaslMechanism::ScramSha512, "effectively", wrong_pw)),
    );
    let err = probe(&bad_auth, t).unwrap_err();
    assert!(err.contains("Authentication failed"), "{err}");
    assert!(!err.contains("not-the-password"), "{err}");

    let bad_ca = kafka(&s.tls_brokers, Some(tls(&other_ca(&dir))), None);
    let err = probe(&bad_ca, t).unwrap_err();
    assert!(err.contains("certificate verify failed"), "{err}");

    let plaintext = kafka(&s.tls_brokers, None, None);
    assert!(probe(&plaintext, t).is_err(), "plaintext to a TLS port");

    // The right settings, for contrast: the same calls succeed.
    assert_eq!(
        probe(&kafka(&s.tls_brokers, Some(tls(&s.ca_file)), None), t),
        Ok(1)
    );
}

/// Runs `effectively` with `args` and returns what it printed (stdout and stderr).
fn output_of(config: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_effectively"))
        .args(args)
        .arg("--config")
        .arg(config)
        // The file's brokers and URL, not the plaintext ones of the environment.
        .env_remove("KAFKA_BROKERS")
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "debug")
        .output()
        .expect("running effectively");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

/// Every output of a run, at debug level, holds neither the SASL password nor the database
/// password: `--help`, `check-config --connect`, a worker's log while it consumes over SASL, and
/// its metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_output_of_a_run_shows_a_password() {
    let s = stack();
    let sasl_password = std::fs::read_to_string(&s.password_file).unwrap();
    let sasl_password = sasl_password.trim();
    let db_password = "pg-pw-never-printed-4f1c";
    let topic = common::unique("secure-secrets");
    common::create_topic(&topic, 1).await;
    let dir = std::env::temp_dir().join(common::unique("secrets"));
    std::fs::create_dir_all(&dir).unwrap();
    // The stack's PostgreSQL trusts loopback: the password is accepted and ignored.
    let db_url =
        common::database_url().replacen("postgres@", &format!("postgres:{db_password}@"), 1);
    assert!(
        db_url.contains(db_password),
        "the URL carries a password: {db_url}"
    );
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let config = dir.join("effectively.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[kafka]
brokers = "{brokers}"
session_timeout = "10s"
[kafka.tls]
ca_file = "{ca}"
[kafka.sasl]
mechanism = "SCRAM-SHA-512"
username = "effectively"
password_file = "{pw}"
[database]
url = "{db_url}"
[worker]
revoke_deadline = "5s"
metrics_addr = "127.0.0.1:{port}"
[[consumer]]
name = "{topic}"
topics = ["{topic}"]
handler = {{ kind = "cashback" }}
"#,
            brokers = s.sasl_brokers,
            ca = s.ca_file.display(),
            pw = s.password_file.display(),
        ),
    )
    .unwrap();

    let mut outputs = Vec::new();
    let (ok, check) = output_of(&config, &["check-config", "--connect"]);
    assert!(ok, "check-config --connect: {check}");
    assert!(check.contains("kafka security: sasl_ssl"), "{check}");
    assert!(check.contains("connect kafka: ok"), "{check}");
    assert!(check.contains("connect database: ok"), "{check}");
    outputs.push(("check-config --connect", check));
    for help in [
        &["--help"][..],
        &["run", "--help"],
        &["check-config", "--help"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_effectively"))
            .args(help)
            .env("DATABASE_URL", &db_url)
            .output()
            .unwrap();
        outputs.push(("--help", String::from_utf8_lossy(&out.stdout).to_string()));
    }

    let mut worker = std::process::Command::new(env!("CARGO_BIN_EXE_effectively"))
        .arg("run")
        .arg("--config")
        .arg(&config)
        .env_remove("KAFKA_BROKERS")
        .env_remove("DATABASE_URL")
        .env("RUST_LOG", "debug")
        // A file, not a pipe: a debug log would fill a pipe nobody reads until the end.
        .stdout(std::fs::File::create(dir.join("worker.out")).unwrap())
        .stderr(std::fs::File::create(dir.join("worker.err")).unwrap())
        .spawn()
        .unwrap();
    let db = common::pg().await;
    let user = common::unique("u");
    let payments: Vec<Payment> = (0..2).map(|i| Payment::new(&user, 2_000 + i)).collect();
    common::send_payments(&common::producer(), &topic, Some(0), &payments).await;
    eventually(40, "the worker credits over SASL", || {
        let db = &db;
        let c = &topic;
        async move { ledger(db, c).await.credits == 2 }
    })
    .await;
    let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("effectively_records_received_total"));
    outputs.push(("metrics", metrics));
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &worker.id().to_string()])
        .status();
    let status = worker.wait().unwrap();
    let log = std::fs::read_to_string(dir.join("worker.out")).unwrap()
        + &std::fs::read_to_string(dir.join("worker.err")).unwrap();
    assert!(status.success(), "the worker stopped cleanly: {log}");
    assert!(log.contains("DEBUG"), "the log is at debug level");
    outputs.push(("worker log", log));

    for (what, text) in &outputs {
        assert!(
            !text.contains(sasl_password),
            "{what} shows the SASL password"
        );
        assert!(
            !text.contains(db_password),
            "{what} shows the database password"
        );
    }
}
