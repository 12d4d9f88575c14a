use super::*;

const MINIMAL: &str = "[[consumer]]\nname = \"rewards\"\ntopics = [\"payments\"]\n\
                       handler = { kind = \"cashback\" }\n";
const SEC: Duration = Duration::from_secs(1);
const MS: Duration = Duration::from_millis(1);

/// MINIMAL with `extra` appended inside its consumer.
fn with(extra: &str) -> String {
    format!("{MINIMAL}{extra}\n")
}

fn consumer(text: &str) -> ConsumerConfig {
    let config = Config::from_toml_str(text);
    config.expect(text).consumers.remove(0)
}

fn invalid(text: &str) -> String {
    match Config::from_toml_str(text) {
        Err(ConfigError::Invalid(msg)) => msg,
        other => panic!("expected ConfigError::Invalid, got {other:?}"),
    }
}

fn is_parse_error(text: &str) -> bool {
    matches!(Config::from_toml_str(text), Err(ConfigError::Parse(_)))
}

#[test]
fn example_parses_validates_and_shows_the_defaults() {
    let config = Config::from_toml_str(EXAMPLE).expect("EXAMPLE is valid");
    let minimal = Config::from_toml_str(MINIMAL).expect("MINIMAL is valid");
    assert_eq!(config.database, minimal.database);
    assert_eq!(config.worker, minimal.worker);
    assert_eq!(config.consumers[0], minimal.consumers[0]);
    let audit = &config.consumers[1];
    assert_eq!(audit.strategy, Strategy::PerMessage);
    let HandlerConfig::Sql { statement } = &audit.handler else {
        panic!("audit has an sql handler");
    };
    assert!(statement.contains("payload->>'amount_paise'"));
    let prefilter = audit
        .prefilter
        .as_ref()
        .expect("audit shows [consumer.prefilter]");
    assert_eq!(prefilter.ttl, Ttl::Retention);
    assert_eq!(prefilter.timeout, 50 * MS);
    assert_eq!(prefilter.redis.expose(), "redis://127.0.0.1:6379/0");
    assert!(config.consumers[0].prefilter.is_none(), "off by default");
    let notify = &config.consumers[2];
    assert_eq!(notify.strategy, Strategy::Inbox);
    assert_eq!(notify.inbox, InboxConfig::default());
}

#[test]
fn minimal_config_gets_the_defaults() {
    let config = Config::from_toml_str(MINIMAL).expect("valid");
    let (k, d, w) = (&config.kafka, &config.database.default, &config.worker);
    assert_eq!(k.brokers, "127.0.0.1:9092");
    assert_eq!(k.session_timeout, 45 * SEC);
    assert_eq!(k.max_poll_interval, 300 * SEC);
    assert!(k.options.is_empty());
    let url = "postgres://postgres@127.0.0.1:5432/effectively";
    assert_eq!(d.url.expose(), url);
    assert_eq!(d.pool_size, 16);
    assert_eq!(d.connect_timeout, 5 * SEC);
    assert_eq!(d.idle_in_transaction_timeout, 60 * SEC);
    assert_eq!(d.transaction_deadline, 30 * SEC);
    assert_eq!(w.id, None);
    assert_eq!(w.revoke_deadline, 20 * SEC);
    assert_eq!(w.shutdown_deadline, 30 * SEC);
    assert_eq!(w.metrics_addr, None);
    let c = &config.consumers[0];
    assert_eq!(c.group_id(), "rewards");
    assert_eq!(c.strategy, Strategy::Batch);
    assert_eq!(
        c.handler,
        HandlerConfig::Cashback {
            rate_bp: 200,
            notify: None
        }
    );
    assert_eq!(c.auto_offset_reset, OffsetReset::Earliest);
    assert_eq!(c.on_offset_out_of_range, OutOfRange::Stop);
    assert_eq!(c.batch.max_messages, 1000);
    assert_eq!(c.batch.max_bytes, 4_194_304);
    assert_eq!(c.batch.linger, 5 * MS);
    assert_eq!(c.message_id, MessageIdConfig::header("event_id"));
    assert_eq!(c.event_date, EventDateSource::Auto);
    assert_eq!(c.max_payload_bytes, 1_048_576);
    assert_eq!(c.retry.max_attempts, 5);
    assert_eq!(c.retry.initial_backoff, 100 * MS);
    assert_eq!(c.retry.max_backoff, 10 * SEC);
    assert_eq!(c.retention, 15 * DAY);
    assert_eq!(c.future_tolerance, DAY);
    assert_eq!(c.stall_after, 60 * SEC);
    assert_eq!(c.partitions_ahead, 3);
    let i = &c.inbox;
    assert_eq!((i.processors, i.claim_batch), (4, 100));
    assert_eq!(i.poll_interval, 100 * MS);
    assert_eq!(i.ordering_key, OrderingKey::KafkaKey);
    assert_eq!(
        (i.claim, i.lease, i.done),
        (ClaimMode::Lock, 300 * SEC, DoneRows::Keep)
    );
    let pid = format!("-{}", std::process::id());
    assert!(config.worker_id().ends_with(&pid));
}

#[test]
fn every_enum_spelling() {
    let c = |extra: &str| consumer(&with(extra));
    assert_eq!(c("strategy = \"batch\"").strategy, Strategy::Batch);
    let per_message = c("strategy = \"per-message\"").strategy;
    assert_eq!(per_message, Strategy::PerMessage);
    let latest = c("auto_offset_reset = \"latest\"").auto_offset_reset;
    assert_eq!(latest.as_librdkafka(), "latest");
    let earliest = c("auto_offset_reset = \"earliest\"").auto_offset_reset;
    assert_eq!(earliest.as_librdkafka(), "earliest");
    for policy in [OutOfRange::Stop, OutOfRange::Earliest, OutOfRange::Latest] {
        let line = format!("on_offset_out_of_range = \"{}\"", policy.as_str());
        assert_eq!(c(&line).on_offset_out_of_range, policy);
    }
    assert!(is_parse_error(&with("on_offset_out_of_range = \"none\"")));
    assert!(is_parse_error(&with("on_offset_out_of_range = \"Stop\"")));
    let header = c("message_id = { header = \"id\" }").message_id;
    assert_eq!(header, MessageIdConfig::header("id"));
    let pointer = c("message_id = { json_pointer = \"/id\" }").message_id;
    assert_eq!(pointer.source, MessageIdSource::JsonPointer("/id".into()));
    assert!(!pointer.any_string);
    let uuid7 = c("event_date = \"uuid7\"").event_date;
    assert_eq!(uuid7, EventDateSource::Uuid7);
    let h = |h: &str| consumer(&MINIMAL.replace("{ kind = \"cashback\" }", h)).handler;
    let cashback = h("{ kind = \"cashback\", rate_bp = 150 }");
    assert_eq!(
        cashback,
        HandlerConfig::Cashback {
            rate_bp: 150,
            notify: None
        }
    );
    let statement = "SELECT 1".to_string();
    let sql = h("{ kind = \"sql\", statement = \"SELECT 1\" }");
    assert_eq!(sql, HandlerConfig::Sql { statement });
    let name = "my-handler".to_string();
    assert_eq!(
        h("{ kind = \"custom\", name = \"my-handler\" }"),
        HandlerConfig::Custom { name }
    );
    assert!(is_parse_error(&with("strategy = \"Batch\"")));
    let inbox = |extra: &str| consumer(&with(&format!("strategy = \"inbox\"\n{extra}")));
    assert_eq!(inbox("").strategy, Strategy::Inbox);
    let pointer = inbox("[consumer.inbox]\nordering_key = { json_pointer = \"/user_id\" }");
    let user = OrderingKey::JsonPointer("/user_id".into());
    assert_eq!(pointer.inbox.ordering_key, user);
    let none = inbox("[consumer.inbox]\nordering_key = \"none\"")
        .inbox
        .ordering_key;
    assert_eq!(none, OrderingKey::None);
    let lease = inbox("[consumer.inbox]\nclaim = \"lease\"\ndone = \"delete\"").inbox;
    assert_eq!(
        (lease.claim, lease.done),
        (ClaimMode::Lease, DoneRows::Delete)
    );
    assert!(is_parse_error(&with(
        "[consumer.inbox]\nordering_key = \"key\""
    )));
    let msg = invalid(&with(
        "strategy = \"inbox\"\n[consumer.inbox]\nclaim_batch = 0",
    ));
    assert!(
        msg.contains("inbox.claim_batch must be at least 1"),
        "{msg}"
    );
    let msg = invalid(&with(
        "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 15",
    ));
    assert!(msg.contains("database.pool_size (16)"), "{msg}");
    consumer(&with(
        "strategy = \"inbox\"\n[consumer.inbox]\nprocessors = 14",
    ));
}

#[test]
fn unknown_fields_are_rejected() {
    assert!(is_parse_error(&format!("colour = \"blue\"\n{MINIMAL}")));
    assert!(is_parse_error(
        &MINIMAL.replace("\"cashback\"", "\"cashback\", rate = 1")
    ));
    let err = Config::from_toml_str(&with("topic = \"payments\"")).expect_err("a typo");
    assert!(matches!(err, ConfigError::Parse(_)));
    assert!(err.to_string().contains("line 5"), "{err}");
}

#[test]
fn revoke_deadline_must_be_under_the_session_timeout() {
    let msg = invalid(&format!("[kafka]\nsession_timeout = \"20s\"\n{MINIMAL}"));
    assert!(msg.contains("worker.revoke_deadline (20s)"), "{msg}");
    assert!(msg.contains("kafka.session_timeout (20s)"), "{msg}");
    assert!(msg.contains("group coordinator gives up"), "{msg}");
}

#[test]
fn duplicate_names_and_bad_fields_are_rejected() {
    let msg = invalid(&format!("{MINIMAL}{MINIMAL}"));
    assert!(msg.contains("\"rewards\" is defined twice"), "{msg}");
    let msg = invalid(&with("[consumer.batch]\nmax_messages = 0"));
    assert!(msg.contains("consumer \"rewards\": batch.max_messages must be at least 1"));
    let msg = invalid(&with(
        "strategy = \"per-message\"\n[consumer.batch]\ngroup_partitions = true",
    ));
    assert!(
        msg.contains("group_partitions works with strategy = \"batch\" only"),
        "{msg}"
    );
    let msg = invalid(&with("retention = \"1day\""));
    assert!(
        msg.contains("consumer \"rewards\": retention (1day)"),
        "{msg}"
    );
    let msg = invalid(&MINIMAL.replace("payments", "pay ments"));
    assert!(msg.contains("not a valid Kafka topic name"), "{msg}");
    assert!(invalid("").contains("at least one [[consumer]]"));
}

#[test]
fn env_overrides_apply() {
    let name = format!("effectively-config-{}.toml", std::process::id());
    let path = std::env::temp_dir().join(name);
    std::fs::write(&path, MINIMAL).expect("write a temporary config");
    let load = |vars: &[(&str, &str)]| {
        let lookup = |name: &str| vars.iter().find(|v| v.0 == name).map(|v| v.1.to_string());
        Config::load_with_env(&path, lookup)
    };
    let config = load(&[
        ("KAFKA_BROKERS", "k1:9092,k2:9092"),
        ("DATABASE_URL", "postgres://u:pw@db/x"),
        ("EFFECTIVELY_WORKER_ID", "w7"),
        ("EFFECTIVELY_POOL_SIZE", "4"),
    ]);
    let bad = load(&[("EFFECTIVELY_POOL_SIZE", "many")]);
    let zero = load(&[("EFFECTIVELY_POOL_SIZE", "0")]);
    let _ = std::fs::remove_file(&path);
    let config = config.expect("valid");
    assert_eq!(config.kafka.brokers, "k1:9092,k2:9092");
    assert_eq!(config.database.default.url.expose(), "postgres://u:pw@db/x");
    assert_eq!(config.worker_id(), "w7");
    assert_eq!(config.database.default.pool_size, 4);
    assert!(matches!(bad, Err(ConfigError::Env { name, .. }) if name.ends_with("POOL_SIZE")));
    assert!(matches!(zero, Err(ConfigError::Invalid(_))));
    let missing = Config::load_with_env(&path, |_| None);
    assert!(matches!(missing, Err(ConfigError::Io { .. })));
}

#[test]
fn debug_never_shows_passwords() {
    let text = format!(
        "[database]\nurl = \"postgres://u:pw@h/db\"\n[kafka.options]\n\"sasl.password\" = \
         \"hunter2\"\n\"sasl.oauthbearer.config\" = \"b3arer-v4lue\"\n\"linger.ms\" = \"7\"\n{MINIMAL}"
    );
    let config = Config::from_toml_str(&text).expect("valid");
    let debug = format!("{config:?}");
    assert!(!debug.contains("pw") && !debug.contains("hunter2") && !debug.contains("b3arer-v4lue"));
    assert!(
        debug.contains("postgres://u:***@h/db") && debug.contains("\"7\""),
        "{debug}"
    );
    assert_eq!(
        config.database.default.url.to_string(),
        "postgres://u:***@h/db"
    );
    assert_eq!(config.database.default.url.expose(), "postgres://u:pw@h/db");
    let plain = "postgres://postgres@127.0.0.1:5432/effectively";
    assert_eq!(redact(plain), plain);
    assert_eq!(redact("postgres://u:p/w@h/db"), "postgres://u:***@h/db");
    let query = redact("postgres://u@h/db?password=pw&x=1");
    assert_eq!(query, "postgres://u@h/db?password=***&x=1");
    let key_value = redact("host=h password='a b' user=u");
    assert_eq!(key_value, "host=h password=*** user=u");
}

#[test]
fn event_date_source_spellings() {
    for s in ["auto", "uuid7", "/occurred_at"] {
        let parsed: EventDateSource = s.parse().expect(s);
        assert_eq!(parsed.to_string(), s);
    }
    assert_eq!("auto".parse(), Ok(EventDateSource::Auto));
    assert_eq!("uuid7".parse(), Ok(EventDateSource::Uuid7));
    let pointer = EventDateSource::JsonPointer("/occurred_at".into());
    assert_eq!("/occurred_at".parse(), Ok(pointer));
    let err = Config::from_toml_str(&with("event_date = \"occurred_at\"")).expect_err("no /");
    assert!(
        err.to_string().contains("did you mean \"/occurred_at\"?"),
        "{err}"
    );
}

#[test]
fn version_section_is_read_and_checked() {
    let orders = "[[consumer]]\nname = \"orders\"\ntopics = [\"o\"]\n\
                  handler = { kind = \"order-status\" }\n";
    let msg = invalid(orders);
    assert!(msg.contains("needs [consumer.version]"), "{msg}");
    let text = format!(
        "{orders}[consumer.version]\naggregate = \"/order_id\"\nversion = \"/version\"\n\
         mode = \"delta\"\n"
    );
    let c = consumer(&text);
    let v = c.version.expect("read");
    assert_eq!((v.mode, v.gap_alert_after), (VersionMode::Delta, 300 * SEC));
    assert!(matches!(c.handler, HandlerConfig::OrderStatus { ref status } if status == "/status"));
    let msg = invalid(&text.replace("\"/order_id\"", "\"order_id\""));
    assert!(
        msg.contains("version.aggregate must be a JSON pointer"),
        "{msg}"
    );
    assert!(consumer(MINIMAL).version.is_none());
}

#[test]
fn prefilter_section_is_read_and_checked() {
    let c = consumer(&with(
        "prefilter = { redis = \"redis://:pw@127.0.0.1:6380/2\", ttl = \"2days\" }",
    ));
    let f = c.prefilter.expect("read");
    assert_eq!(f.ttl, Ttl::For(2 * DAY));
    assert_eq!(f.redis.to_string(), "redis://:***@127.0.0.1:6380/2");
    let msg = invalid(&with(
        "retention = \"3days\"\n[consumer.prefilter]\nredis = \"redis://h\"\nttl = \"4days\"",
    ));
    assert!(
        msg.contains(
            "consumer \"rewards\": prefilter.ttl (4days) must not exceed retention (3days)"
        ),
        "{msg}"
    );
    let msg = invalid(&with(
        "strategy = \"inbox\"\nprefilter = { redis = \"redis://h\" }",
    ));
    assert!(
        msg.contains("prefilter does not apply to strategy = \"inbox\""),
        "{msg}"
    );
    let per_message = consumer(&with(
        "strategy = \"per-message\"\nprefilter = { redis = \"redis://h\" }",
    ));
    assert!(per_message.prefilter.is_some());
    let debug = format!(
        "{:?}",
        Config::from_toml_str(&with("prefilter = { redis = \"redis://u:hunter2@h\" }")).unwrap()
    );
    assert!(!debug.contains("hunter2"), "{debug}");
}

#[test]
fn a_registry_payload_needs_its_registry_and_whole_credentials() {
    let c = consumer(&with(
        "payload = { format = \"avro\", registry = \"http://r:8081/apis/ccompat/v7\", key_format = \"protobuf\" }",
    ));
    assert_eq!(c.payload.format, PayloadFormat::Avro);
    assert_eq!(c.payload.key_format, Some(PayloadFormat::Protobuf));
    assert!(c.payload.uses_registry());
    assert_eq!(c.payload.cache_capacity, 1000);
    assert!(!consumer(MINIMAL).payload.uses_registry());

    let e = invalid(&with("payload = { format = \"protobuf\" }"));
    assert!(e.contains("needs payload.registry"), "{e}");
    let e = invalid(&with(
        "payload = { format = \"json\", key_format = \"avro\" }",
    ));
    assert!(e.contains("key_format = \"avro\""), "{e}");
    let e = invalid(&with(
        "payload = { format = \"avro\", registry = \"r:8081\" }",
    ));
    assert!(e.contains("http:// or https://"), "{e}");
    let e = invalid(&with(
        "payload = { format = \"avro\", registry = \"http://r\", username = \"u\" }",
    ));
    assert!(e.contains("username and password"), "{e}");
    let e = invalid(&with(
        "payload = { format = \"avro\", registry = \"http://r\", username = \"u\", password_env = \"P\", token_env = \"T\" }",
    ));
    assert!(e.contains("not both"), "{e}");
    assert!(is_parse_error(&with("payload = { format = \"xml\" }")));
}

#[test]
fn registry_credentials_come_from_a_variable_or_a_file_and_never_print() {
    let dir = std::env::temp_dir().join(format!("eff-reg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    std::fs::write(&file, "s3cret\n").unwrap();
    let c = consumer(&with(&format!(
        "payload = {{ format = \"avro\", registry = \"https://r\", token_file = {:?} }}",
        file.display().to_string()
    )));
    let auth = c.payload.auth().unwrap();
    assert!(matches!(&auth, RegistryAuth::Bearer(t) if t == "s3cret"));
    assert!(!format!("{auth:?}").contains("s3cret"));
    let c = consumer(&with(
        "payload = { format = \"avro\", registry = \"https://r\", username = \"u\", password_env = \"EFFECTIVELY_TEST_UNSET_VAR\" }",
    ));
    assert!(c
        .payload
        .auth()
        .unwrap_err()
        .contains("EFFECTIVELY_TEST_UNSET_VAR"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_text_id_needs_an_event_date_from_the_payload() {
    for id in [
        "message_id = \"key\"",
        "message_id = { template = \"{/payment_id}:{/status}\" }",
        "message_id = { json_pointer = \"/id\", any_string = true }",
    ] {
        for date in ["", "event_date = \"auto\"", "event_date = \"uuid7\""] {
            let msg = invalid(&with(&format!("{id}\n{date}")));
            assert!(
                msg.contains("a text id carries no time"),
                "{id} {date}: {msg}"
            );
            assert!(msg.contains("redelivered after midnight"), "{msg}");
        }
        let ok = consumer(&with(&format!("{id}\nevent_date = \"/occurred_at\"")));
        assert!(ok.message_id.is_text());
    }
    // A UUID source keeps "auto": its UUIDv7 ids date themselves.
    consumer(&with(
        "message_id = { json_pointer = \"/id\" }\nevent_date = \"auto\"",
    ));
}

#[test]
fn max_rate_takes_a_burst_of_half_a_second_by_default() {
    assert_eq!(consumer(MINIMAL).rate_limit(), None);
    let t = consumer(&with("max_rate = 500")).rate_limit().unwrap();
    assert_eq!((t.max_rate, t.burst), (500.0, 250));
    let t = consumer(&with("max_rate = 1")).rate_limit().unwrap();
    assert_eq!(t.burst, 1, "at least one");
    let t = consumer(&with("max_rate = 500\nmax_rate_burst = 7"))
        .rate_limit()
        .unwrap();
    assert_eq!(t.burst, 7);
    assert!(invalid(&with("max_rate = 0")).contains("max_rate must be at least 1"));
    assert!(invalid(&with("max_rate_burst = 5")).contains("max_rate_burst needs max_rate"));
    assert!(invalid(&with("max_rate = 5\nmax_rate_burst = 0")).contains("at least 1"));
}

#[test]
fn static_membership_needs_a_stable_worker_id() {
    let text = format!("[kafka]\nstatic_membership = true\n{MINIMAL}");
    assert!(invalid(&text).contains("needs a stable worker.id"));
    let text = format!("[kafka]\nstatic_membership = true\n[worker]\nid = \"w-0\"\n{MINIMAL}");
    let config = Config::from_toml_str(&text).expect("valid with an id");
    assert!(config.kafka.static_membership);
    assert!(
        !Config::from_toml_str(MINIMAL)
            .unwrap()
            .kafka
            .static_membership
    );
}

#[test]
fn a_secret_file_that_is_not_a_secret_is_refused_not_read_whole() {
    // A device that never ends: read whole, it would take the process's memory.
    let text = format!(
        "[kafka.sasl]\nmechanism = \"PLAIN\"\nusername = \"u\"\npassword_file = \"/dev/zero\"\n{MINIMAL}"
    );
    let e = Config::from_toml_str(&text).unwrap_err().to_string();
    assert!(e.contains("more than 65536 bytes"), "{e}");
    let e = read_small(Path::new("/nonexistent/secret")).unwrap_err();
    assert!(e.contains("No such file"), "{e}");
}

#[test]
fn dedupe_is_the_ledger_unless_a_batch_consumer_keeps_keys_on_its_business_row() {
    assert_eq!(consumer(MINIMAL).dedupe, Dedupe::Ledger);
    assert_eq!(
        consumer(&with("dedupe = \"business-row\"")).dedupe,
        Dedupe::BusinessRow
    );
    assert!(is_parse_error(&with("dedupe = \"row\"")));
    let inbox = invalid(&with("dedupe = \"business-row\"\nstrategy = \"inbox\""));
    assert!(inbox.contains("batch\" only"), "{inbox}");
    let sql = "[[consumer]]\nname = \"audit\"\ntopics = [\"payments\"]\n\
               handler = { kind = \"sql\", statement = \"SELECT 1\" }\ndedupe = \"business-row\"\n";
    assert!(
        invalid(sql).contains("one row a message"),
        "{}",
        invalid(sql)
    );
    let prefilter = invalid(&with(
        "dedupe = \"business-row\"\n[consumer.prefilter]\nredis = \"redis://127.0.0.1:6379\"",
    ));
    assert!(prefilter.contains("ledger's keys"), "{prefilter}");
}
