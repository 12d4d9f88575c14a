//! The config loader under generated text: arbitrary text, and the example config
//! (`effectively example-config`) with lines changed, removed, repeated or uncommented and
//! values swapped for awkward ones (negative, huge, empty, the wrong type, durations that
//! overflow), which reach the checks after TOML far more often than random text does.
//!
//! Shared by the libFuzzer target (`fuzz/fuzz_targets/config_load.rs`) and `tests/fuzz.rs`.
//! Properties: loading never panics; a refusal always says why; a config that loads checks
//! clean again (its checks are a function of the config).

use arbitrary::{Arbitrary, Unstructured};
use effectively::config::{Config, EXAMPLE};

#[derive(Debug, Arbitrary)]
pub enum Input {
    Text(String),
    Example(Vec<Edit>),
}

/// One change to the example's lines (`line` is taken modulo their number).
#[derive(Debug, Arbitrary)]
pub enum Edit {
    /// The value after `=` becomes another.
    Value {
        line: u16,
        value: Value,
    },
    Remove {
        line: u16,
    },
    Repeat {
        line: u16,
    },
    /// A commented `# key = value` line becomes a setting.
    Uncomment {
        line: u16,
    },
    /// A line of its own, after `line`.
    Insert {
        line: u16,
        text: String,
    },
    /// A setting the consumer section may hold, appended at the end (the last table is the
    /// example's `[[consumer]]` or one of its subtables).
    Append {
        key: Key,
        value: Value,
    },
}

/// Values that break typed fields in different ways.
#[derive(Debug, Arbitrary)]
pub enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Duration(u64, Unit),
    Empty,
    Array(Vec<Value>),
    Table(Vec<(Key, Value)>),
}

#[derive(Debug, Arbitrary)]
pub enum Unit {
    Ns,
    Ms,
    S,
    Days,
    Years,
}

/// Keys the config knows, and others.
#[derive(Debug, Arbitrary)]
pub enum Key {
    Name,
    Topics,
    MessageId,
    EventDate,
    Retention,
    FutureTolerance,
    MaxPayloadBytes,
    MaxRate,
    BatchSize,
    Strategy,
    Handler,
    Template,
    JsonPointer,
    Header,
    Format,
    Registry,
    Other(String),
}

pub fn run(data: &[u8]) {
    let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    check(&input);
}

pub fn check(input: &Input) {
    let text = match input {
        Input::Text(t) => t.clone(),
        Input::Example(edits) => edited(edits),
    };
    match Config::from_toml_str(&text) {
        Err(e) => assert!(
            !e.to_string().trim().is_empty(),
            "a refusal without a reason for {text:?}"
        ),
        Ok(config) => {
            if let Err(e) = config.validate() {
                panic!("a config that loaded fails its own checks: {e}\n{text}");
            }
        }
    }
}

/// The example with the edits applied in order.
pub fn edited(edits: &[Edit]) -> String {
    let mut lines: Vec<String> = EXAMPLE.lines().map(str::to_string).collect();
    for edit in edits {
        let at = |line: &u16, lines: &Vec<String>| usize::from(*line) % lines.len().max(1);
        match edit {
            Edit::Value { line, value } => {
                let i = at(line, &lines);
                if let Some((key, _)) = lines[i].split_once('=') {
                    lines[i] = format!("{key}= {}", value.toml());
                }
            }
            Edit::Remove { line } if !lines.is_empty() => {
                let i = at(line, &lines);
                lines.remove(i);
            }
            Edit::Remove { .. } => {}
            Edit::Repeat { line } if !lines.is_empty() => {
                let i = at(line, &lines);
                lines.insert(i, lines[i].clone());
            }
            Edit::Repeat { .. } => {}
            Edit::Uncomment { line } if !lines.is_empty() => {
                let i = at(line, &lines);
                if let Some(rest) = lines[i].strip_prefix("# ") {
                    lines[i] = rest.to_string();
                }
            }
            Edit::Uncomment { .. } => {}
            Edit::Insert { line, text } => {
                let i = at(line, &lines).min(lines.len());
                lines.insert(i, text.clone());
            }
            Edit::Append { key, value } => {
                lines.push(format!("{} = {}", key.toml(), value.toml()));
            }
        }
    }
    lines.join("\n")
}

impl Value {
    fn toml(&self) -> String {
        match self {
            Value::Int(n) => n.to_string(),
            Value::Float(x) if x.is_finite() => format!("{x:?}"),
            Value::Float(x) if x.is_nan() => "nan".into(),
            Value::Float(x) => if *x > 0.0 { "inf" } else { "-inf" }.into(),
            Value::Bool(b) => b.to_string(),
            Value::Str(s) => quoted(s),
            Value::Duration(n, unit) => {
                let unit = match unit {
                    Unit::Ns => "ns",
                    Unit::Ms => "ms",
                    Unit::S => "s",
                    Unit::Days => "days",
                    Unit::Years => "years",
                };
                format!("\"{n}{unit}\"")
            }
            Value::Empty => "\"\"".into(),
            Value::Array(items) => format!(
                "[{}]",
                items.iter().map(Value::toml).collect::<Vec<_>>().join(", ")
            ),
            Value::Table(fields) => format!(
                "{{ {} }}",
                fields
                    .iter()
                    .map(|(k, v)| format!("{} = {}", k.toml(), v.toml()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }
}

impl Key {
    fn toml(&self) -> String {
        match self {
            Key::Name => "name".into(),
            Key::Topics => "topics".into(),
            Key::MessageId => "message_id".into(),
            Key::EventDate => "event_date".into(),
            Key::Retention => "retention".into(),
            Key::FutureTolerance => "future_tolerance".into(),
            Key::MaxPayloadBytes => "max_payload_bytes".into(),
            Key::MaxRate => "max_rate".into(),
            Key::BatchSize => "batch_size".into(),
            Key::Strategy => "strategy".into(),
            Key::Handler => "handler".into(),
            Key::Template => "template".into(),
            Key::JsonPointer => "json_pointer".into(),
            Key::Header => "header".into(),
            Key::Format => "format".into(),
            Key::Registry => "registry".into(),
            Key::Other(s) => quoted(s),
        }
    }
}

/// A TOML basic string holding `s` (TOML has no escape for some control characters' raw
/// form, so every non-printable one is written as `\uXXXX`).
fn quoted(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Hand-made configs: the example itself, and edits that reach the checks after TOML.
pub fn seeds() -> Vec<Input> {
    let append = |key, value| Input::Example(vec![Edit::Append { key, value }]);
    vec![
        Input::Example(vec![]),
        Input::Text(String::new()),
        // A secret's file that never ends.
        Input::Text(
            "[kafka.sasl]\nmechanism = \"PLAIN\"\nusername = \"u\"\npassword_file = \"/dev/zero\"\n\
             [[consumer]]\nname = \"c\"\ntopics = [\"t\"]\nhandler = { kind = \"cashback\" }\n"
                .into(),
        ),
        Input::Text("[[consumer]]\nname = \"\u{ff}\"".into()),
        Input::Text("[kafka]\nsession_timeout = \"18446744073709551615years\"\n".into()),
        append(Key::Retention, Value::Duration(u64::MAX, Unit::Years)),
        append(Key::FutureTolerance, Value::Duration(u64::MAX, Unit::Ns)),
        append(Key::MaxPayloadBytes, Value::Int(-1)),
        append(Key::MaxPayloadBytes, Value::Int(0)),
        append(Key::BatchSize, Value::Int(i64::MAX)),
        append(Key::MaxRate, Value::Float(f64::NAN)),
        append(Key::MaxRate, Value::Float(f64::INFINITY)),
        append(Key::MaxRate, Value::Int(0)),
        append(Key::Topics, Value::Array(vec![])),
        append(Key::Name, Value::Empty),
        append(
            Key::MessageId,
            Value::Table(vec![(Key::Template, Value::Str("{".into()))]),
        ),
        append(
            Key::MessageId,
            Value::Table(vec![(Key::JsonPointer, Value::Str("no-slash".into()))]),
        ),
        append(
            Key::EventDate,
            Value::Table(vec![(Key::JsonPointer, Value::Empty)]),
        ),
        Input::Example((0..60).map(|line| Edit::Uncomment { line }).collect()),
        Input::Example((0..200).map(|line| Edit::Repeat { line }).collect()),
    ]
}
