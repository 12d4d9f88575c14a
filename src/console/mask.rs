//! Masking: the values at the configured JSON pointers (`console.mask`) never reach a page.
//!
//! A payload is masked as a parsed document, never by searching its text: a value can be
//! written many ways in JSON (escapes, spacing), and a text search that missed one would show
//! it. So once anything was masked, every view of the payload (text, pretty JSON, hex) is the
//! masked document re-serialized. The values that were masked are also blanked wherever else a
//! page would quote them (an error text, a header, the key), because a handler's error often
//! repeats the field it choked on. A payload that is not JSON has no fields to find: with
//! masking configured it is withheld rather than shown unmasked.

use serde_json::Value;

/// What a masked value is shown as.
pub const MASKED: &str = "***";

/// Values shorter than this are not blanked in other text: blanking "1" or "ok" everywhere
/// would garble pages while hiding nothing worth hiding.
const MIN_SCRUB_LEN: usize = 4;

/// The configured pointers.
#[derive(Debug, Clone, Default)]
pub struct Mask {
    pointers: Vec<String>,
}

/// A payload after masking.
#[derive(Debug, Clone, PartialEq)]
pub enum Masked {
    /// Nothing configured, or nothing found at any pointer: the bytes as they are.
    Unchanged,
    /// Fields were masked: the document re-serialized (compact), and the values taken out.
    Json {
        bytes: Vec<u8>,
        fields: usize,
        secrets: Vec<String>,
    },
    /// Masking is configured and the payload is not JSON: it cannot be shown safely.
    Withheld,
}

impl Mask {
    pub fn new(pointers: &[String]) -> Mask {
        Mask {
            pointers: pointers.to_vec(),
        }
    }

    pub fn is_active(&self) -> bool {
        !self.pointers.is_empty()
    }

    /// Replaces the value at every pointer with [`MASKED`]; returns how many were replaced and
    /// the text of each scalar taken out (for [`scrub`]).
    pub fn value(&self, doc: &mut Value) -> (usize, Vec<String>) {
        let mut secrets = Vec::new();
        let mut fields = 0;
        for p in &self.pointers {
            if let Some(v) = doc.pointer_mut(p) {
                collect(v, &mut secrets);
                *v = Value::String(MASKED.into());
                fields += 1;
            }
        }
        (fields, secrets)
    }

    /// Masks a payload (see the module docs).
    pub fn bytes(&self, payload: &[u8]) -> Masked {
        if !self.is_active() {
            return Masked::Unchanged;
        }
        let Ok(mut doc) = serde_json::from_slice::<Value>(payload) else {
            return Masked::Withheld;
        };
        let (fields, secrets) = self.value(&mut doc);
        if fields == 0 {
            return Masked::Unchanged;
        }
        Masked::Json {
            bytes: serde_json::to_vec(&doc).expect("a Value serializes"),
            fields,
            secrets,
        }
    }
}

/// The text form of every scalar in `v` (a masked object or array hides all its leaves).
fn collect(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Number(n) => out.push(n.to_string()),
        Value::Array(a) => a.iter().for_each(|x| collect(x, out)),
        Value::Object(o) => o.values().for_each(|x| collect(x, out)),
        Value::Bool(_) | Value::Null => {}
    }
}

/// `text` with every occurrence of a masked value replaced by [`MASKED`].
pub fn scrub(text: &str, secrets: &[String]) -> String {
    let mut out = text.to_string();
    for s in secrets.iter().filter(|s| s.len() >= MIN_SCRUB_LEN) {
        if out.contains(s.as_str()) {
            out = out.replace(s.as_str(), MASKED);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask() -> Mask {
        Mask::new(&["/card/number".into(), "/cvv".into(), "/missing".into()])
    }

    #[test]
    fn fields_at_pointers_are_masked_and_collected() {
        let raw = br#"{"card": {"number": "4111 1111 1111 1111", "exp": "12/29"}, "cvv": 123}"#;
        let Masked::Json {
            bytes,
            fields,
            secrets,
        } = mask().bytes(raw)
        else {
            panic!("masked");
        };
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(fields, 2);
        assert!(!text.contains("4111") && !text.contains("123"), "{text}");
        assert!(text.contains("12/29") && text.contains(MASKED), "{text}");
        assert_eq!(
            secrets,
            vec!["4111 1111 1111 1111".to_string(), "123".into()]
        );
    }

    #[test]
    fn escaped_values_are_masked_too() {
        // "4111" written with a unicode escape: a text search for the value would miss it.
        let raw = br#"{"card": {"number": "\u00341111111"}}"#;
        let Masked::Json { bytes, .. } = mask().bytes(raw) else {
            panic!("masked");
        };
        assert!(!String::from_utf8(bytes).unwrap().contains("1111111"));
    }

    #[test]
    fn not_json_is_withheld_only_when_masking_is_on() {
        assert_eq!(mask().bytes(b"\xff\x00garbage"), Masked::Withheld);
        assert_eq!(Mask::default().bytes(b"\xff\x00garbage"), Masked::Unchanged);
        assert_eq!(mask().bytes(br#"{"other": 1}"#), Masked::Unchanged);
    }

    #[test]
    fn scrub_blanks_quoted_values_but_not_tiny_ones() {
        let secrets = vec!["4111 1111".to_string(), "12".to_string()];
        assert_eq!(
            scrub("card 4111 1111 declined, code 12", &secrets),
            "card *** declined, code 12"
        );
    }
}
