//! The console's query strings and form bodies under generated input, through axum's own
//! extractors and each page's or form's checks (`effectively::console::fuzzing`).
//!
//! Shared by the libFuzzer targets (`console_query`, `console_form`) and `tests/fuzz.rs`.
//! Properties: parsing never panics; a refusal always says why; and a confirmation's hidden
//! fields, posted to the second step as a browser would, are accepted there and mean the same
//! thing (the reset's target resolved in the first step is the one the second step applies).

use arbitrary::{Arbitrary, Unstructured};
use effectively::console::fuzzing::{self, GET_PATHS, POST_PATHS};
use http::Uri;

/// A query string or form body: raw text, or `name=value` pairs of the fields the console
/// reads, with values chosen to be awkward.
#[derive(Debug, Arbitrary)]
pub enum Fields {
    Raw(Vec<u8>),
    Pairs(Vec<(Name, Value)>),
}

#[derive(Debug, Arbitrary)]
pub enum Name {
    Verb,
    Id,
    MessageId,
    EventId,
    Channel,
    Consumer,
    Reason,
    Topic,
    Partition,
    Since,
    Until,
    Typed,
    Note,
    Kind,
    Value,
    To,
    ShiftBy,
    Action,
    Before,
    Status,
    After,
    AfterSeq,
    AfterVersion,
    AfterCreated,
    AfterEvent,
    DlBefore,
    DlAt,
    Published,
    Other(String),
}

#[derive(Debug, Arbitrary)]
pub enum Value {
    Int(i64),
    Uuid([u8; 16]),
    Duration(u64, Unit),
    Rfc3339(i64, i32),
    FormTime(i32, u8, u8),
    Word(Word),
    Text(String),
    /// Percent-encoded bytes, which need not be UTF-8.
    Bytes(Vec<u8>),
}

#[derive(Debug, Arbitrary)]
pub enum Unit {
    S,
    H,
    Days,
    Years,
}

#[derive(Debug, Arbitrary)]
pub enum Word {
    Redrive,
    DiscardDeadLetters,
    Replay,
    DiscardInbox,
    RetryNotifications,
    DiscardNotifications,
    Earliest,
    Latest,
    Time,
    Offset,
    Shift,
    Failed,
    Pending,
    True,
}

#[derive(Debug, Arbitrary)]
pub struct Query {
    page: u8,
    fields: Fields,
}

#[derive(Debug, Arbitrary)]
pub struct Form {
    form: u8,
    fields: Fields,
}

pub fn run_query(data: &[u8]) {
    if let Ok(q) = Query::arbitrary_take_rest(Unstructured::new(data)) {
        check_query(&q);
    }
}

pub fn run_form(data: &[u8]) {
    if let Ok(f) = Form::arbitrary_take_rest(Unstructured::new(data)) {
        check_form(&f);
    }
}

pub fn check_query(q: &Query) {
    let path = GET_PATHS[usize::from(q.page) % GET_PATHS.len()];
    let query = String::from_utf8_lossy(&q.fields.encoded()).into_owned();
    // A target hyper would refuse before any handler ran is not the console's to parse.
    let Ok(uri) = format!("{path}?{query}").parse::<Uri>() else {
        return;
    };
    if let Err(e) = fuzzing::get(&uri) {
        assert!(!e.trim().is_empty(), "{uri}: refused without a reason");
    }
}

pub fn check_form(f: &Form) {
    let path = POST_PATHS[usize::from(f.form) % POST_PATHS.len()];
    let body = f.fields.encoded();
    let parsed = match fuzzing::post(path, &body) {
        Err(e) => {
            assert!(!e.trim().is_empty(), "{path}: refused without a reason");
            return;
        }
        Ok(p) => p,
    };
    let Some(next) = fuzzing::second_step(path) else {
        return;
    };
    // The confirmation page's hidden inputs, as a browser posts them.
    let carried: Vec<u8> = (parsed.hidden.iter())
        .map(|(k, v)| format!("{k}={}", encode(v.as_bytes())))
        .collect::<Vec<_>>()
        .join("&")
        .into_bytes();
    match fuzzing::post(next, &carried) {
        Ok(again) => {
            assert_eq!(again.hidden, parsed.hidden, "{next} carries other fields");
            if path == "/consumer/reset/confirm" {
                assert_eq!(
                    again.meaning, parsed.meaning,
                    "{next} resets to another target than {path} planned"
                );
            }
        }
        Err(e) => panic!(
            "{path} accepted {:?} but {next} refuses what its confirmation carries ({:?}): {e}",
            String::from_utf8_lossy(&body),
            String::from_utf8_lossy(&carried)
        ),
    }
}

impl Fields {
    fn encoded(&self) -> Vec<u8> {
        match self {
            Fields::Raw(b) => b.clone(),
            Fields::Pairs(pairs) => (pairs.iter())
                .map(|(n, v)| format!("{}={}", encode(n.text().as_bytes()), v.encoded()))
                .collect::<Vec<_>>()
                .join("&")
                .into_bytes(),
        }
    }
}

impl Name {
    fn text(&self) -> String {
        match self {
            Name::Verb => "verb",
            Name::Id => "id",
            Name::MessageId => "message_id",
            Name::EventId => "event_id",
            Name::Channel => "channel",
            Name::Consumer => "consumer",
            Name::Reason => "reason",
            Name::Topic => "topic",
            Name::Partition => "partition",
            Name::Since => "since",
            Name::Until => "until",
            Name::Typed => "typed",
            Name::Note => "note",
            Name::Kind => "kind",
            Name::Value => "value",
            Name::To => "to",
            Name::ShiftBy => "shift_by",
            Name::Action => "action",
            Name::Before => "before",
            Name::Status => "status",
            Name::After => "after",
            Name::AfterSeq => "after_seq",
            Name::AfterVersion => "after_version",
            Name::AfterCreated => "after_created",
            Name::AfterEvent => "after_event",
            Name::DlBefore => "dl_before",
            Name::DlAt => "dl_at",
            Name::Published => "published",
            Name::Other(s) => return s.clone(),
        }
        .into()
    }
}

impl Value {
    /// The value as it appears in the body: percent-encoded.
    fn encoded(&self) -> String {
        let text = match self {
            Value::Int(n) => n.to_string(),
            Value::Uuid(b) => uuid::Uuid::from_bytes(*b).to_string(),
            Value::Duration(n, u) => format!(
                "{n}{}",
                match u {
                    Unit::S => "s",
                    Unit::H => "h",
                    Unit::Days => "days",
                    Unit::Years => "years",
                }
            ),
            Value::Rfc3339(secs, offset_minutes) => {
                let t =
                    chrono::DateTime::from_timestamp(secs % 400_000_000_000, 0).unwrap_or_default();
                chrono::FixedOffset::east_opt((offset_minutes % 1440) * 60)
                    .map_or_else(|| t.to_rfc3339(), |o| t.with_timezone(&o).to_rfc3339())
            }
            Value::FormTime(y, m, d) => format!("{y:04}-{m:02}-{d:02}T23:00"),
            Value::Word(w) => match w {
                Word::Redrive => "redrive",
                Word::DiscardDeadLetters => "discard-dead-letters",
                Word::Replay => "replay",
                Word::DiscardInbox => "discard-inbox",
                Word::RetryNotifications => "retry-notifications",
                Word::DiscardNotifications => "discard-notifications",
                Word::Earliest => "earliest",
                Word::Latest => "latest",
                Word::Time => "time",
                Word::Offset => "offset",
                Word::Shift => "shift",
                Word::Failed => "FAILED",
                Word::Pending => "pending",
                Word::True => "true",
            }
            .into(),
            Value::Text(s) => s.clone(),
            Value::Bytes(b) => return encode(b),
        };
        encode(text.as_bytes())
    }
}

/// `application/x-www-form-urlencoded`'s percent-encoding of every byte but the unreserved.
fn encode(b: &[u8]) -> String {
    b.iter()
        .map(|&c| match c {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                char::from(c).to_string()
            }
            c => format!("%{c:02X}"),
        })
        .collect()
}

/// Hand-made queries and forms: every page and form with the values that broke or nearly
/// broke them (times and durations at the calendar's edges, numbers past i64, bytes that are
/// not UTF-8).
pub fn query_seeds() -> Vec<Query> {
    let pairs = |page: u8, p: Vec<(Name, Value)>| Query {
        page,
        fields: Fields::Pairs(p),
    };
    let mut out = vec![
        pairs(0, vec![(Name::Since, Value::Duration(2, Unit::H))]),
        pairs(
            0,
            vec![(Name::Since, Value::Duration(1_000_000, Unit::Years))],
        ),
        pairs(0, vec![(Name::Until, Value::FormTime(99_999, 12, 31))]),
        pairs(
            0,
            vec![(Name::Partition, Value::Text("99999999999".into()))],
        ),
        pairs(0, vec![(Name::DlAt, Value::Rfc3339(i64::MAX, 0))]),
        pairs(1, vec![(Name::Action, Value::Uuid([9; 16]))]),
        pairs(1, vec![(Name::Before, Value::Text("1e3".into()))]),
        pairs(3, vec![(Name::Status, Value::Word(Word::Pending))]),
        pairs(3, vec![(Name::AfterSeq, Value::Bytes(vec![0xff]))]),
        pairs(
            5,
            vec![(Name::AfterCreated, Value::Text("2026-13-01".into()))],
        ),
    ];
    for page in 0..6 {
        out.push(Query {
            page,
            fields: Fields::Raw(b"a=%ff&&=&%zz=1&b".to_vec()),
        });
    }
    out
}

pub fn form_seeds() -> Vec<Form> {
    let pairs = |form: u8, p: Vec<(Name, Value)>| Form {
        form,
        fields: Fields::Pairs(p),
    };
    vec![
        pairs(
            0,
            vec![
                (Name::Verb, Value::Word(Word::Redrive)),
                (Name::Since, Value::Duration(3, Unit::Days)),
                (Name::Partition, Value::Int(2)),
            ],
        ),
        pairs(
            0,
            vec![
                (Name::Verb, Value::Word(Word::RetryNotifications)),
                (Name::Since, Value::Duration(u64::MAX, Unit::S)),
            ],
        ),
        pairs(
            0,
            vec![
                (Name::Verb, Value::Word(Word::Replay)),
                (Name::MessageId, Value::Uuid([1; 16])),
            ],
        ),
        pairs(2, vec![(Name::Partition, Value::Int(-1))]),
        pairs(
            4,
            vec![
                (Name::Kind, Value::Word(Word::Time)),
                (Name::Value, Value::Duration(1_000_000, Unit::Years)),
            ],
        ),
        pairs(
            4,
            vec![
                (Name::Kind, Value::Word(Word::Time)),
                (Name::Value, Value::FormTime(-1, 1, 1)),
            ],
        ),
        pairs(
            4,
            vec![
                (Name::Kind, Value::Word(Word::Time)),
                (Name::Value, Value::FormTime(10_000, 1, 1)),
            ],
        ),
        pairs(4, vec![(Name::To, Value::Rfc3339(-62_167_219_200, -60))]),
        pairs(
            4,
            vec![
                (Name::Kind, Value::Word(Word::Shift)),
                (Name::Value, Value::Int(i64::MIN)),
            ],
        ),
        pairs(
            4,
            vec![
                (Name::Kind, Value::Word(Word::Offset)),
                (Name::Value, Value::Text("+5".into())),
            ],
        ),
        Form {
            form: 0,
            fields: Fields::Raw(vec![0xff, b'=', b'&']),
        },
    ]
}
