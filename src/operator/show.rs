//! How a parked record reads to an operator: its payload as UTF-8 text, pretty JSON or a hex
//! dump, and the text `effectively dead-letters show` and `inbox show` print. Pure functions,
//! shared with the console.

use std::fmt::Write;

use crate::store::parked::{DeadLetter, InboxRow, Message};

/// The readings of some bytes an operator may want.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Views {
    /// The bytes as text, when they are valid UTF-8.
    pub utf8: Option<String>,
    /// Indented JSON, when the bytes are a JSON document.
    pub json: Option<String>,
    /// A hex dump: offset, 16 bytes in hex, the printable ASCII.
    pub hex: String,
}

impl Views {
    pub fn of(bytes: &[u8]) -> Views {
        let utf8 = std::str::from_utf8(bytes).ok().map(str::to_string);
        let json = serde_json::from_slice::<serde_json::Value>(bytes)
            .ok()
            .and_then(|v| serde_json::to_string_pretty(&v).ok());
        Views {
            utf8,
            json,
            hex: hex_dump(bytes),
        }
    }
}

/// `xxd`-style: `00000010  7b 22 69 64 ...  {"id...`.
pub fn hex_dump(bytes: &[u8]) -> String {
    let mut out = String::new();
    for (i, line) in bytes.chunks(16).enumerate() {
        let _ = write!(out, "{:08x}  ", i * 16);
        for j in 0..16 {
            match line.get(j) {
                Some(b) => {
                    let _ = write!(out, "{b:02x} ");
                }
                None => out.push_str("   "),
            }
            if j == 7 {
                out.push(' ');
            }
        }
        out.push(' ');
        out.extend(line.iter().map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        }));
        out.push('\n');
    }
    out
}

/// Which reading `show` prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum As {
    /// Pretty JSON if it is JSON, else the text if it is UTF-8, else hex.
    Auto,
    Utf8,
    Json,
    Hex,
}

/// The payload as `how` says, or why it cannot be read that way.
pub fn payload(bytes: &[u8], how: As) -> String {
    let v = Views::of(bytes);
    match how {
        As::Auto => v.json.or(v.utf8).unwrap_or(v.hex),
        As::Utf8 => v
            .utf8
            .unwrap_or_else(|| format!("(not UTF-8; hex:)\n{}", v.hex)),
        As::Json => v.json.unwrap_or_else(|| "(not a JSON document)".into()),
        As::Hex => v.hex,
    }
}

/// A header or key value as text: UTF-8 when it is, else hex.
pub fn short(bytes: Option<&[u8]>) -> String {
    match bytes {
        None => "(null)".into(),
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) => format!("{s:?}"),
            Err(_) => format!(
                "0x{}",
                b.iter().map(|x| format!("{x:02x}")).collect::<String>()
            ),
        },
    }
}

fn message(out: &mut String, m: &Message, how: As) {
    let _ = writeln!(out, "key:         {}", short(m.key.as_deref()));
    match m.kafka_ts {
        Some(t) => {
            let _ = writeln!(out, "kafka_ts:    {}", t.to_rfc3339());
        }
        None => out.push_str("kafka_ts:    (none)\n"),
    }
    if m.headers.is_empty() {
        out.push_str("headers:     (none)\n");
    } else {
        out.push_str("headers:\n");
        for (name, value) in &m.headers {
            let _ = writeln!(out, "  {name}: {}", short(value.as_deref()));
        }
    }
    match &m.payload {
        None => out.push_str("payload:     (null: a tombstone)\n"),
        Some(p) => {
            let _ = writeln!(out, "payload ({} bytes):", p.len());
            out.push_str(&payload(p, how));
            if !out.ends_with('\n') {
                out.push('\n');
            }
        }
    }
}

/// What `effectively dead-letters show ID` prints.
pub fn dead_letter(d: &DeadLetter, how: As) -> String {
    let s = &d.summary;
    let mut out = String::new();
    let _ = writeln!(out, "dead letter {}", s.id);
    let _ = writeln!(out, "consumer:    {}", s.consumer);
    let _ = writeln!(out, "record:      {}/{}@{}", s.topic, s.partition, s.offset);
    let id = s.message_id.map_or("(none)".into(), |u| u.to_string());
    let _ = writeln!(out, "message_id:  {id}");
    if let Some(key) = &s.message_key {
        let _ = writeln!(out, "made from:   {key:?}");
    }
    let _ = writeln!(out, "reason:      {}", s.reason);
    let _ = writeln!(out, "detail:      {}", s.detail);
    let _ = writeln!(out, "attempts:    {}", s.attempts);
    let _ = writeln!(
        out,
        "parked:      first {}, last {}",
        s.first_seen.to_rfc3339(),
        s.last_seen.to_rfc3339()
    );
    match &d.resolution {
        None => out.push_str("status:      parked\n"),
        Some(r) => {
            let _ = write!(
                out,
                "status:      {} {} by {} (action {})",
                r.what,
                r.at.to_rfc3339(),
                r.by,
                r.action
            );
            if let Some(to) = &r.redriven_to {
                let _ = write!(out, ", copy at {to}");
            }
            out.push('\n');
        }
    }
    message(&mut out, &d.message, how);
    out
}

/// What `effectively inbox show CONSUMER MESSAGE_ID` prints.
pub fn inbox_row(r: &InboxRow, how: As) -> String {
    let s = &r.summary;
    let mut out = String::new();
    let _ = writeln!(out, "inbox row {} of {}", s.message_id, s.consumer);
    let _ = writeln!(out, "status:      {}", r.status);
    let _ = writeln!(out, "record:      {}/{}@{}", s.topic, s.partition, s.offset);
    let _ = writeln!(out, "event_date:  {}", s.event_date);
    let _ = writeln!(out, "ordering:    key {:?}, seq {}", s.ordering_key, s.seq);
    let _ = writeln!(out, "attempts:    {}", s.attempts);
    let _ = writeln!(
        out,
        "last_error:  {}",
        s.last_error.as_deref().unwrap_or("(none)")
    );
    let _ = writeln!(out, "received:    {}", s.received_at.to_rfc3339());
    let _ = writeln!(out, "next try:    {}", r.next_attempt_at.to_rfc3339());
    message(&mut out, &r.message, how);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_payload_reads_as_json_text_and_hex() {
        let v = Views::of(br#"{"a":1}"#);
        assert_eq!(v.utf8.as_deref(), Some(r#"{"a":1}"#));
        assert_eq!(v.json.as_deref(), Some("{\n  \"a\": 1\n}"));
        assert!(v.hex.starts_with("00000000  7b 22 61 22"), "{}", v.hex);
        assert!(v.hex.trim_end().ends_with(r#"{"a":1}"#), "{}", v.hex);
    }

    #[test]
    fn bytes_that_are_not_text_fall_back_to_hex() {
        let bytes = [0xff, 0x00, 0x41];
        assert_eq!(payload(&bytes, As::Auto), hex_dump(&bytes));
        assert!(payload(&bytes, As::Utf8).starts_with("(not UTF-8"));
        assert_eq!(payload(&bytes, As::Json), "(not a JSON document)");
        assert_eq!(short(Some(&bytes)), "0xff0041");
        assert_eq!(short(Some(b"k-1")), "\"k-1\"");
    }

    #[test]
    fn a_long_dump_numbers_its_lines() {
        let bytes: Vec<u8> = (0u8..40).collect();
        let dump = hex_dump(&bytes);
        assert_eq!(dump.lines().count(), 3);
        assert!(dump.lines().nth(2).unwrap().starts_with("00000020  20 21"));
    }
}
