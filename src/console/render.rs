//! How bytes, counts and times read on a page: a payload as UTF-8 text, pretty JSON and a hex
//! dump (as `show` prints it), counts that may be capped, ages. Plain functions over values, so
//! the templates stay free of logic and these are tested without a server.

use chrono::{DateTime, Utc};

use super::mask::{scrub, Mask, Masked};
use crate::operator::show::hex_dump;

/// The hex view stops here: a 1 MiB payload would make a 4 MiB page.
pub const HEX_LIMIT: usize = 16 * 1024;

/// A payload's three views, masked.
#[derive(Debug, Clone, Default)]
pub struct Payload {
    /// Bytes stored (before masking).
    pub size: usize,
    pub present: bool,
    /// The bytes as UTF-8, when they are.
    pub text: Option<String>,
    /// Pretty-printed, when they parse as JSON.
    pub json: Option<String>,
    pub hex: String,
    /// The hex view was cut at [`HEX_LIMIT`].
    pub hex_cut: bool,
    /// Says what masking did, if anything.
    pub note: Option<String>,
    /// Why nothing is shown, when masking could not be applied.
    pub withheld: Option<String>,
}

/// `bytes` (None: a record with no payload) in its three views, masked; also the masked
/// values, to be blanked in the rest of the page ([`scrub`]).
pub fn payload(bytes: Option<&[u8]>, mask: &Mask) -> (Payload, Vec<String>) {
    let Some(raw) = bytes else {
        return (Payload::default(), Vec::new());
    };
    let mut p = Payload {
        size: raw.len(),
        present: true,
        ..Payload::default()
    };
    let (shown, secrets): (std::borrow::Cow<'_, [u8]>, Vec<String>) = match mask.bytes(raw) {
        Masked::Unchanged => (raw.into(), Vec::new()),
        Masked::Json {
            bytes,
            fields,
            secrets,
        } => {
            p.note = Some(format!(
                "{fields} field(s) masked (console.mask); the text and hex views show the \
                 masked document re-serialized, not the stored bytes"
            ));
            (bytes.into(), secrets)
        }
        Masked::Withheld => {
            p.withheld = Some(
                "not shown: masking is configured (console.mask) and this payload is not JSON, \
                 so its fields cannot be found"
                    .into(),
            );
            return (p, Vec::new());
        }
    };
    p.text = std::str::from_utf8(&shown).ok().map(str::to_string);
    p.json = serde_json::from_slice::<serde_json::Value>(&shown)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok());
    p.hex_cut = shown.len() > HEX_LIMIT;
    // The same dump `effectively dead-letters show` prints.
    p.hex = hex_dump(&shown[..shown.len().min(HEX_LIMIT)]);
    (p, secrets)
}

/// A key or a header value: its UTF-8 text, or `0x…` hex when it is not text; scrubbed.
pub fn bytes_text(b: Option<&[u8]>, secrets: &[String]) -> String {
    match b {
        None => "(null)".into(),
        Some(b) => match std::str::from_utf8(b) {
            Ok(s) if !s.chars().any(char::is_control) => scrub(s, secrets),
            _ => {
                let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
                format!("0x{}", scrub(&hex, secrets))
            }
        },
    }
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        out.insert(0, '-');
    }
    out
}

/// A count that stopped at its cap: `10,000+`.
pub fn capped(count: i64, more: bool) -> String {
    if more {
        format!("{}+", thousands(count))
    } else {
        thousands(count)
    }
}

/// Seconds as `3m 5s` (whole seconds; under one: `0s`).
pub fn age_s(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    humantime_serde::re::humantime::format_duration(std::time::Duration::from_secs(s)).to_string()
}

/// How long ago `t` was, from `now`.
pub fn ago(t: DateTime<Utc>, now: DateTime<Utc>) -> String {
    age_s((now - t).num_milliseconds() as f64 / 1000.0)
}

/// A timestamp as the pages show it: UTC, to the millisecond.
pub fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3fZ").to_string()
}

/// An optional timestamp; `-` for none.
pub fn time_opt(t: Option<DateTime<Utc>>) -> String {
    t.map_or_else(|| "-".into(), time)
}

/// The first line of `s`, cut to `max` characters, for a table cell.
pub fn short(s: &str, max: usize) -> String {
    let line = s.lines().next().unwrap_or_default();
    if line.chars().count() <= max && line.len() == s.len() {
        return line.to_string();
    }
    let cut: String = line.chars().take(max).collect();
    format!("{cut}…")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_views() {
        let (p, _) = payload(Some(br#"{"a":1}"#), &Mask::default());
        assert_eq!(p.text.as_deref(), Some(r#"{"a":1}"#));
        assert_eq!(p.json.as_deref(), Some("{\n  \"a\": 1\n}"));
        assert!(p.hex.starts_with("00000000  7b 22 61 22"), "{}", p.hex);
        assert!(p.hex.ends_with("{\"a\":1}\n"), "{}", p.hex);
        let (p, _) = payload(Some(b"\xff\xfe"), &Mask::default());
        assert!(p.text.is_none() && p.json.is_none() && p.present);
        let (p, _) = payload(None, &Mask::default());
        assert!(!p.present);
    }

    #[test]
    fn masked_payloads_show_the_masked_document_only() {
        let mask = Mask::new(&["/pan".into()]);
        let (p, secrets) = payload(Some(br#"{"pan":"4111111111111111","x":2}"#), &mask);
        for view in [
            p.text.as_deref().unwrap(),
            p.json.as_deref().unwrap(),
            &p.hex,
        ] {
            assert!(!view.contains("4111111111111111"), "{view}");
        }
        assert!(p.note.is_some());
        assert_eq!(secrets, vec!["4111111111111111".to_string()]);
        let (p, _) = payload(Some(b"not json 4111111111111111"), &mask);
        assert!(p.withheld.is_some() && p.text.is_none() && p.hex.is_empty());
    }

    #[test]
    fn numbers_and_text() {
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(-1000), "-1,000");
        assert_eq!(capped(10_000, true), "10,000+");
        assert_eq!(age_s(75.4), "1m 15s");
        assert_eq!(short("abc\ndef", 10), "abc…");
        assert_eq!(short("abcdef", 3), "abc…");
        assert_eq!(bytes_text(Some(b"k-1"), &[]), "k-1");
        assert_eq!(bytes_text(Some(b"\x00\x01"), &[]), "0x0001");
    }
}
