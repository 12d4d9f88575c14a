//! Decoding's unit tests: ids, event dates, the window and every rejection.

use super::*;
use EventDateSource as D;
use Reason as R;

const DAY: u64 = 86_400;
/// 2023-11-14T22:13:20Z.
const SECS: u64 = 1_700_000_000;

fn v7() -> Uuid {
    Uuid::new_v7(uuid::Timestamp::from_unix(uuid::NoContext, SECS, 0))
}

fn date(s: &str) -> NaiveDate {
    NaiveDate::parse_from_str(s, "%Y-%m-%d").unwrap()
}

fn by_header(date_src: D, needs_json: bool) -> Decoder {
    let id = MessageIdConfig::header("event_id");
    Decoder::new(&id, &date_src, 1024, needs_json)
}

fn by_pointer() -> Decoder {
    Decoder::new(
        &MessageIdConfig {
            source: MessageIdSource::JsonPointer("/id".into()),
            any_string: false,
        },
        &D::Auto,
        1024,
        false,
    )
}

fn raw<'a>(headers: &'a [(&'a str, Option<&'a [u8]>)], body: Option<&'a [u8]>) -> RawRecord<'a> {
    let (partition, offset, timestamp_ms) = (3, 42, Some(1_700_000_000_000));
    let key = Some(&b"k1"[..]);
    RawRecord {
        partition,
        offset,
        timestamp_ms,
        key,
        payload: body,
        headers,
    }
}

/// Decodes `body` with an `event_id` header holding `id` (no header when None).
fn decode(d: &Decoder, id: Option<&str>, body: &[u8]) -> Result<Envelope, Rejection> {
    let headers = id.map(|id| [("event_id", Some(id.as_bytes()))]);
    d.decode(&raw(headers.as_ref().map_or(&[], |h| &h[..]), Some(body)))
}

fn why(d: &Decoder, id: Option<&str>, body: &[u8]) -> Reason {
    decode(d, id, body).unwrap_err().reason
}

#[test]
fn header_id_ok() {
    let (id, other) = (v7(), Uuid::new_v4().to_string());
    let text = format!("  {}\n", id.simple());
    let headers = [
        ("event_id", Some(other.as_bytes())),
        ("trace", Some(&b"x"[..])),
        ("event_id", Some(text.as_bytes())),
    ];
    let d = by_header(D::Uuid7, false);
    let env = d.decode(&raw(&headers, Some(b"opaque"))).unwrap();
    assert_eq!(env.message_id, id, "last header wins, whitespace trimmed");
    assert_eq!(env.event_date, date("2023-11-14"));
    assert_eq!(env.kafka_ts.unwrap().timestamp_millis(), 1_700_000_000_000);
    assert!(env.json.is_none(), "nothing needed the body");
    assert_eq!(env.size, 2 + 6 + (8 + 36) + (5 + 1) + (8 + text.len()));
    assert_eq!(
        (env.partition, env.offset, &env.payload[..]),
        (3, 42, &b"opaque"[..])
    );
    let mut negative = raw(&headers, Some(b"x"));
    negative.timestamp_ms = Some(-1);
    assert_eq!(d.decode(&negative).unwrap().kafka_ts, None);
}

#[test]
fn header_missing_or_invalid() {
    let d = by_header(D::Auto, false);
    assert_eq!(why(&d, None, b"x"), R::MissingEventId);
    let null = [("event_id", None)];
    assert_eq!(
        d.decode(&raw(&null, Some(b"x"))).unwrap_err().reason,
        R::MissingEventId
    );
    let r = decode(&d, Some(&"z".repeat(200)), b"x").unwrap_err();
    assert_eq!((r.reason, r.message_id), (R::InvalidEventId, None));
    assert!(r.detail.contains("event_id") && r.detail.contains(&"z".repeat(64)));
    assert!(!r.detail.contains(&"z".repeat(65)), "{}", r.detail);
    assert_eq!(
        why(&d, Some(&Uuid::nil().to_string()), b"x"),
        R::InvalidEventId
    );
    assert_eq!(
        why(&d, Some(&v7().urn().to_string()), b"x"),
        R::InvalidEventId
    );
}

#[test]
fn pointer_id() {
    let (d, id) = (by_pointer(), v7());
    let env = decode(&d, None, format!(r#"{{"id":"{id}"}}"#).as_bytes()).unwrap();
    assert_eq!(env.message_id, id);
    assert!(env.json.is_some());
    assert_eq!(why(&d, None, br#"{"x":1}"#), R::MissingEventId);
    assert_eq!(why(&d, None, br#"{"id":17}"#), R::InvalidEventId);
    assert_eq!(why(&d, None, br#"{"id":"x"}"#), R::InvalidEventId);
    assert_eq!(why(&d, None, b"[1]"), R::UndecodablePayload);
}

#[test]
fn undecodable_json() {
    let r = decode(&by_pointer(), None, b"{\"id\": ").unwrap_err();
    assert_eq!(r.reason, R::UndecodablePayload);
    assert!(
        r.detail.starts_with("payload is not valid JSON"),
        "{}",
        r.detail
    );
    let id = v7().to_string();
    assert_eq!(
        why(&by_header(D::Uuid7, true), Some(&id), b"text"),
        R::UndecodablePayload
    );
    let auto = by_header(D::Auto, false);
    assert_eq!(why(&auto, Some(&id), b" {broken"), R::UndecodablePayload);
}

#[test]
fn oversized_and_empty() {
    let (d, id) = (by_header(D::Uuid7, false), v7());
    let (text, big) = (id.to_string(), vec![b'a'; 1025]);
    let r = decode(&d, Some(&text), &big).unwrap_err();
    assert_eq!((r.reason, r.message_id), (R::OversizedPayload, Some(id)));
    assert_eq!(r.detail, "payload of 1025 bytes exceeds the limit of 1024");
    assert!(decode(&d, Some(&text), &big[..1024]).is_ok());
    assert_eq!(why(&d, Some(&text), b""), R::EmptyPayload);
    let headers = [("event_id", Some(text.as_bytes()))];
    let r = d.decode(&raw(&headers, None)).unwrap_err();
    assert_eq!(
        (r.reason, r.message_id, r.skip),
        (R::Tombstone, Some(id), false)
    );
    assert!(r.detail.contains("on_tombstone"), "{}", r.detail);
}

#[test]
fn tombstones_park_or_skip() {
    let id = v7().to_string();
    let headers = [("event_id", Some(id.as_bytes()))];
    let skip = by_header(D::Uuid7, false).with_tombstones(OnTombstone::Skip);
    let r = skip.decode(&raw(&headers, None)).unwrap_err();
    assert_eq!((r.reason, r.skip), (R::Tombstone, true));
    // A tombstone without an id is skipped too: nothing of it is applied or kept.
    assert!(skip.decode(&raw(&[], None)).unwrap_err().skip);
    // Zero bytes are an empty payload, parked under either setting.
    let r = skip.decode(&raw(&headers, Some(b""))).unwrap_err();
    assert_eq!((r.reason, r.skip), (R::EmptyPayload, false));
}

fn text_ids(source: MessageIdSource, any_string: bool, date_src: D) -> Decoder {
    Decoder::new(
        &MessageIdConfig { source, any_string },
        &date_src,
        1024,
        false,
    )
}

#[test]
fn text_ids_become_name_based_uuids() {
    let d = text_ids(
        MessageIdSource::JsonPointer("/id".into()),
        true,
        D::JsonPointer("/created".into()),
    );
    let body = |id: &str| format!(r#"{{"id":{id},"created":"2026-12-07T10:00:00Z"}}"#);
    let stripe = decode(&d, None, body(r#""evt_1NxYz""#).as_bytes()).unwrap();
    assert_eq!(
        stripe.message_id,
        Uuid::new_v5(&KEY_NAMESPACE, b"evt_1NxYz")
    );
    assert_eq!(stripe.message_id.get_version_num(), 5);
    assert_eq!(stripe.message_key.as_deref(), Some("evt_1NxYz"));
    assert_eq!(stripe.event_date, date("2026-12-07"));
    // The same text is the same key, whatever copy carries it.
    let again = decode(&d, None, body(r#"" evt_1NxYz ""#).as_bytes()).unwrap();
    assert_eq!(again.message_id, stripe.message_id);
    // A UUID stays that UUID, so ledgers from before keep their keys.
    let id = v7();
    let uuid = decode(&d, None, body(&format!("\"{id}\"")).as_bytes()).unwrap();
    assert_eq!((uuid.message_id, uuid.message_key), (id, None));
    // Numbers are text ids too; empty, null and the nil UUID are not.
    let n = decode(&d, None, body("42").as_bytes()).unwrap();
    assert_eq!(n.message_id, Uuid::new_v5(&KEY_NAMESPACE, b"42"));
    assert_eq!(why(&d, None, body(r#""  ""#).as_bytes()), R::MissingEventId);
    assert_eq!(why(&d, None, body("null").as_bytes()), R::MissingEventId);
    let nil = format!("\"{}\"", Uuid::nil());
    assert_eq!(why(&d, None, body(&nil).as_bytes()), R::InvalidEventId);
    assert_eq!(why(&d, None, body("{}").as_bytes()), R::InvalidEventId);
    // Without any_string, text that is not a UUID is parked, with the way out in the detail.
    let strict = text_ids(MessageIdSource::JsonPointer("/id".into()), false, D::Auto);
    let r = decode(&strict, None, body(r#""evt_1""#).as_bytes()).unwrap_err();
    assert_eq!(r.reason, R::InvalidEventId);
    assert!(r.detail.contains("any_string = true"), "{}", r.detail);
}

#[test]
fn a_text_id_without_a_date_is_parked_with_its_text() {
    let d = text_ids(MessageIdSource::Header("event_id".into()), true, D::Auto);
    let r = why(&d, Some("whk_delivery_7"), b"{}");
    assert_eq!(r, R::NoEventDate);
    let r = decode(&d, Some("whk_delivery_7"), b"{}").unwrap_err();
    assert_eq!(r.message_key.as_deref(), Some("whk_delivery_7"));
    assert_eq!(
        r.message_id,
        Some(Uuid::new_v5(&KEY_NAMESPACE, b"whk_delivery_7"))
    );
    // An oversized record is parked with the header's text too.
    let r = decode(&d, Some("whk_delivery_7"), &[b'a'; 2000]).unwrap_err();
    assert_eq!(
        (r.reason, r.message_key.as_deref()),
        (R::OversizedPayload, Some("whk_delivery_7"))
    );
}

#[test]
fn the_record_key_and_templates() {
    let when = r#""at":"2026-12-07T10:00:00Z""#;
    let key = text_ids(MessageIdSource::Key, true, D::JsonPointer("/at".into()));
    let env = decode(&key, None, format!("{{{when}}}").as_bytes()).unwrap();
    assert_eq!(
        env.message_key.as_deref(),
        Some("k1"),
        "raw() carries key k1"
    );
    let mut no_key = raw(&[], Some(b"{}"));
    no_key.key = None;
    assert_eq!(key.decode(&no_key).unwrap_err().reason, R::MissingEventId);

    let template: crate::config::Template = "{/payment_id}:{/status}".parse().unwrap();
    let d = text_ids(
        MessageIdSource::Template(template),
        true,
        D::JsonPointer("/at".into()),
    );
    let tap = |event_id: &str, status: &str| {
        format!(r#"{{"event_id":"{event_id}","payment_id":"pay_42","status":"{status}",{when}}}"#)
    };
    let first = decode(&d, None, tap("e1", "CAPTURED").as_bytes()).unwrap();
    let double_tap = decode(&d, None, tap("e2", "CAPTURED").as_bytes()).unwrap();
    assert_eq!(first.message_key.as_deref(), Some("pay_42:CAPTURED"));
    assert_eq!(
        first.message_id, double_tap.message_id,
        "fresh event id, same business key"
    );
    let refund = decode(&d, None, tap("e3", "REFUNDED").as_bytes()).unwrap();
    assert_ne!(refund.message_id, first.message_id);
    // A missing or empty part is bad input, never a shorter key.
    let missing = format!(r#"{{"payment_id":"pay_42",{when}}}"#);
    let r = decode(&d, None, missing.as_bytes()).unwrap_err();
    assert_eq!(r.reason, R::MissingEventId);
    assert!(
        r.detail.contains("{/payment_id}:{/status}") && r.detail.contains("/status"),
        "{}",
        r.detail
    );
    let empty = tap("e4", "");
    let r = decode(&d, None, empty.as_bytes()).unwrap_err();
    assert_eq!(r.reason, R::MissingEventId);
    assert!(r.detail.contains("{/status} is empty"), "{}", r.detail);

    let mixed: crate::config::Template = "{header:source}/{key}".parse().unwrap();
    let d = text_ids(
        MessageIdSource::Template(mixed),
        true,
        D::JsonPointer("/at".into()),
    );
    let headers = [("source", Some(&b"billing"[..]))];
    let env = d
        .decode(&raw(&headers, Some(format!("{{{when}}}").as_bytes())))
        .unwrap();
    assert_eq!(env.message_key.as_deref(), Some("billing/k1"));
    let r = d
        .decode(&raw(&[], Some(format!("{{{when}}}").as_bytes())))
        .unwrap_err();
    assert!(r.detail.contains("no header \"source\""), "{}", r.detail);
}

#[test]
fn auto_date_sources() {
    let (d, id) = (by_header(D::Auto, false), v7().to_string());
    let body = br#" {"occurred_at":"2024-03-01T23:30:00-02:00"}"#;
    let env = decode(&d, Some(&id), body).unwrap();
    assert_eq!(
        env.event_date,
        date("2024-03-02"),
        "occurred_at wins, in UTC"
    );
    for body in [&br#"{"a":1}"#[..], b"\x00bin", br#"{"occurred_at":null}"#] {
        let env = decode(&d, Some(&id), body).unwrap();
        assert_eq!(
            env.event_date,
            date("2023-11-14"),
            "falls back to the UUIDv7"
        );
    }
    let v4 = Uuid::new_v4();
    let r = decode(&d, Some(&v4.to_string()), br#"{"a":1}"#).unwrap_err();
    assert_eq!((r.reason, r.message_id), (R::NoEventDate, Some(v4)));
    let (strict, dated) = (
        by_header(D::Uuid7, false),
        br#"{"occurred_at":"2024-03-01T00:00:00Z"}"#,
    );
    assert_eq!(why(&strict, Some(&v4.to_string()), dated), R::NoEventDate);
    for bad in [
        &br#"{"occurred_at":"yesterday"}"#[..],
        br#"{"occurred_at":17}"#,
    ] {
        assert_eq!(why(&d, Some(&id), bad), R::InvalidEventDate);
    }
}

#[test]
fn pointer_date_accepts_plain_date() {
    let d = by_header(D::JsonPointer("/meta/day".into()), false);
    let id = Uuid::new_v4().to_string();
    let env = decode(&d, Some(&id), br#"{"meta":{"day":"2024-02-29"}}"#).unwrap();
    assert_eq!(env.event_date, date("2024-02-29"));
    let bad = br#"{"meta":{"day":"2024-02-30"}}"#;
    assert_eq!(why(&d, Some(&id), bad), R::InvalidEventDate);
    assert_eq!(why(&d, Some(&id), b"{}"), R::NoEventDate);
}

#[test]
fn check_window_boundaries() {
    let today = date("2024-06-30");
    let check = |day, ret, tol| check_window(date(day), today, ret, tol).map_err(|r| r.reason);
    let ret = Duration::from_secs(30 * DAY + 3600); // rounds down to 30 days
    let tol = Duration::from_secs(3600); // rounds up to 1 day
    assert_eq!(check("2024-05-31", ret, tol), Ok(()));
    assert_eq!(check("2024-05-30", ret, tol), Err(R::OlderThanRetention));
    assert_eq!(check("2024-07-01", ret, tol), Ok(()));
    assert_eq!(check("2024-07-02", ret, tol), Err(R::FutureEventDate));
    // Zero tolerance allows today at most; a sub-day retention still keeps yesterday.
    let zero = Duration::ZERO;
    assert_eq!(check("2024-06-30", zero, zero), Ok(()));
    assert_eq!(check("2024-06-29", zero, zero), Ok(()));
    assert_eq!(check("2024-06-28", zero, zero), Err(R::OlderThanRetention));
    assert_eq!(check("2024-07-01", zero, zero), Err(R::FutureEventDate));
}

#[test]
fn redelivery_gives_same_key() {
    let (d, id) = (by_header(D::Auto, false), v7().to_string());
    let headers = [("event_id", Some(id.as_bytes()))];
    for body in [&br#"{"occurred_at":"2024-01-01T10:00:00Z"}"#[..], b"opaque"] {
        let first = d.decode(&raw(&headers, Some(body))).unwrap();
        let mut again = raw(&headers, Some(body));
        (again.offset, again.timestamp_ms) = (9_000, Some(1_900_000_000_000));
        let second = d.decode(&again).unwrap();
        let key = |e: &Envelope| (e.message_id, e.event_date);
        assert_eq!(key(&first), key(&second));
        assert_ne!(first.kafka_ts, second.kafka_ts);
    }
}

#[test]
fn reasons_are_stable_and_distinct() {
    let codes: std::collections::HashSet<_> = R::ALL.iter().map(R::as_str).collect();
    assert_eq!(codes.len(), R::ALL.len());
    assert_eq!(R::RetriesExhausted.as_str(), "retries_exhausted");
    assert_eq!(R::NotWireFormat.as_str(), "not_wire_format");
    assert_eq!(R::UnknownSchema.as_str(), "unknown_schema");
    assert_eq!(R::SchemaMismatch.as_str(), "schema_mismatch");
    let r = Rejection::new(R::MissingField, "no amount");
    assert_eq!(r.to_string(), "missing_field: no amount");
    assert_eq!(uuid7_date(&Uuid::new_v4()), None);
}

fn cloudevents(needs_json: bool) -> Decoder {
    by_header(D::Auto, needs_json).with_envelope(crate::config::EnvelopeKind::CloudEvents)
}

#[test]
fn cloudevents_binary_and_structured_are_one_event() {
    let d = cloudevents(true);
    let data = br#"{"payment_id":"pay_42","amount_paise":1000}"#;
    let binary = [
        ("ce_specversion", Some(&b"1.0"[..])),
        ("ce_id", Some(&b"evt_1"[..])),
        ("ce_source", Some(&b"/billing"[..])),
        ("ce_type", Some(&b"payment.succeeded"[..])),
        ("ce_time", Some(&b"2026-12-07T10:00:00+05:30"[..])),
        ("ce_traceid", Some(&b"abc"[..])),
        ("content-type", Some(&b"application/json"[..])),
    ];
    let b = d.decode(&raw(&binary, Some(data))).unwrap();
    assert_eq!(&b.payload[..], data);
    assert_eq!(b.json.as_ref().unwrap()["amount_paise"], 1000);
    assert_eq!(b.event_date, date("2026-12-07"));
    assert_eq!(b.message_key.as_deref(), Some(r#"["/billing","evt_1"]"#));
    let attrs = b.cloudevent.as_ref().unwrap();
    assert_eq!(
        (attrs["type"].as_str(), attrs["traceid"].as_str()),
        (Some("payment.succeeded"), Some("abc"))
    );
    assert_eq!(attrs["datacontenttype"], "application/json");

    let body =
        br#"{"specversion":"1.0","id":"evt_1","source":"/billing","type":"payment.succeeded",
        "time":"2026-12-07T04:30:00Z","datacontenttype":"application/json",
        "data":{"payment_id":"pay_42","amount_paise":1000}}"#;
    let structured = [(
        "content-type",
        Some(&b"application/cloudevents+json; charset=utf-8"[..]),
    )];
    let s = d.decode(&raw(&structured, Some(body))).unwrap();
    assert_eq!(
        s.message_id, b.message_id,
        "one source and id: one key, whatever the mode"
    );
    assert_eq!(s.json, b.json);
    assert!(s.cloudevent.as_ref().unwrap().get("data").is_none());

    // The same id from another source is another event.
    let other = body.to_vec();
    let other = String::from_utf8(other)
        .unwrap()
        .replace("/billing", "/refunds");
    let o = d.decode(&raw(&structured, Some(other.as_bytes()))).unwrap();
    assert_ne!(o.message_id, b.message_id);

    // data_base64 is the data's bytes.
    let b64 =
        br#"{"specversion":"1.0","id":"2","source":"s","type":"t","time":"2026-12-07T00:00:00Z",
        "data_base64":"eyJhIjoxfQ=="}"#;
    let e = d.decode(&raw(&structured, Some(b64))).unwrap();
    assert_eq!(&e.payload[..], br#"{"a":1}"#);
}

#[test]
fn cloudevents_bad_input_is_parked_with_its_reason() {
    let d = cloudevents(true);
    let structured = [("content-type", Some(&b"application/cloudevents+json"[..]))];
    let event = |fields: &str| format!(r#"{{"specversion":"1.0","type":"t",{fields}}}"#);
    let cases = [
        (
            event(r#""id":"1","source":"s","data":{}"#),
            R::NoEventDate,
            "time",
        ),
        (
            event(r#""source":"s","time":"2026-12-07T00:00:00Z","data":{}"#),
            R::MissingEventId,
            "no id",
        ),
        (
            event(r#""id":"1","source":"","time":"2026-12-07T00:00:00Z","data":{}"#),
            R::MissingEventId,
            "source is empty",
        ),
        (
            event(r#""id":"1","source":"s","time":"yesterday","data":{}"#),
            R::InvalidEventDate,
            "time",
        ),
        (
            event(r#""id":"1","source":"s","time":"2026-12-07T00:00:00Z""#),
            R::EmptyPayload,
            "no data",
        ),
        (
            event(r#""id":"1","source":"s","time":"2026-12-07T00:00:00Z","data":[1]"#),
            R::UndecodablePayload,
            "data",
        ),
        ("[1,2]".into(), R::UndecodablePayload, "JSON object"),
    ];
    for (body, reason, says) in cases {
        let r = d
            .decode(&raw(&structured, Some(body.as_bytes())))
            .unwrap_err();
        assert_eq!(r.reason, reason, "{body}: {}", r.detail);
        assert!(r.detail.contains(says), "{body}: {}", r.detail);
    }
    // Once source and id are read, a parked event carries its key.
    let r = d
        .decode(&raw(&structured, Some(cases_missing_time().as_bytes())))
        .unwrap_err();
    assert_eq!(r.message_key.as_deref(), Some(r#"["s","1"]"#));
    let batch = [(
        "content-type",
        Some(&b"application/cloudevents-batch+json"[..]),
    )];
    let r = d.decode(&raw(&batch, Some(b"[]"))).unwrap_err();
    assert!(r.detail.contains("batched"), "{}", r.detail);
    // A plain record on a CloudEvents consumer.
    let r = d.decode(&raw(&[], Some(b"{}"))).unwrap_err();
    assert_eq!(r.reason, R::MissingEventId);
    assert!(r.detail.contains("not a CloudEvent"), "{}", r.detail);
}

fn cases_missing_time() -> String {
    r#"{"specversion":"1.0","type":"t","id":"1","source":"s","data":{}}"#.into()
}
