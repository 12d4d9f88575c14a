//! `message_id`: where a record's dedupe key comes from, and what text it may be.
//!
//! The ledger's key is a UUID (16 bytes, `processed_messages.message_id`). A source reads text:
//! a header, a JSON string at a pointer, the record key, or a template of them
//! (`"{/payment_id}:{/status}"`, the seed's business key). Text that is a UUID stays that UUID,
//! so ledgers written before text ids keep their keys; other text becomes a name-based UUID
//! (v5) in [`crate::envelope::KEY_NAMESPACE`] when the consumer accepts text ids (a key, a
//! template, or `any_string = true`). Without that, text that is not a UUID is parked as
//! `invalid_event_id`, as it always was: a producer bug that sends `"undefined"` for every id
//! must not turn into one key that swallows every later event.

use super::*;

/// `message_id` of a `[[consumer]]`.
///
/// TOML: `{ header = "event_id" }` (the default), `{ json_pointer = "/id" }`, either with
/// `any_string = true`; `"key"` (the record key's text); `{ template = "{/payment_id}:{/status}" }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MessageIdConfig {
    pub source: MessageIdSource,
    /// Text that is not a UUID becomes a v5 UUID instead of being parked. Always true for a key
    /// or a template.
    pub any_string: bool,
}

impl MessageIdConfig {
    /// A UUID from the last header of this name.
    pub fn header(name: &str) -> MessageIdConfig {
        MessageIdConfig {
            source: MessageIdSource::Header(name.into()),
            any_string: false,
        }
    }

    /// Whether ids may be any text, so that they carry no time a UUIDv7 would.
    pub fn is_text(&self) -> bool {
        self.any_string
            || matches!(
                self.source,
                MessageIdSource::Key | MessageIdSource::Template(_)
            )
    }
}

impl Default for MessageIdConfig {
    fn default() -> Self {
        MessageIdConfig::header("event_id")
    }
}

/// Where the text of a record's message id is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageIdSource {
    /// The last header of this name (Kafka allows repeats; the last was added last).
    Header(String),
    /// A JSON string (or, for text ids, a number) at this pointer in the payload.
    JsonPointer(String),
    /// The record key, as UTF-8 text (as JSON text when `key_format` decodes it).
    Key,
    /// Pieces of the record put together.
    Template(Template),
}

/// A template such as `"{/payment_id}:{/status}"`: literal text, and placeholders for a JSON
/// pointer (`{/field}`), a header (`{header:NAME}`) or the record key (`{key}`). `{{` and `}}`
/// are literal braces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Template {
    /// As written, for messages and `check-config`.
    pub text: String,
    pub parts: Vec<Part>,
}

/// One piece of a [`Template`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    Literal(String),
    Pointer(String),
    Header(String),
    Key,
}

impl FromStr for Template {
    type Err = String;

    fn from_str(text: &str) -> Result<Template, String> {
        let mut parts = Vec::new();
        let mut literal = String::new();
        let mut chars = text.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                '{' if chars.peek() == Some(&'{') => {
                    chars.next();
                    literal.push('{');
                }
                '}' if chars.peek() == Some(&'}') => {
                    chars.next();
                    literal.push('}');
                }
                '}' => {
                    return Err(format!(
                        "message_id.template {text:?} has a '}}' that closes nothing (write '}}}}' for a literal brace)"
                    ))
                }
                '{' => {
                    let mut inner = String::new();
                    loop {
                        match chars.next() {
                            Some('}') => break,
                            Some('{') | None => {
                                return Err(format!(
                                    "message_id.template {text:?} has a '{{' that is not closed \
                                     (write '{{{{' for a literal brace)"
                                ))
                            }
                            Some(c) => inner.push(c),
                        }
                    }
                    if !literal.is_empty() {
                        parts.push(Part::Literal(std::mem::take(&mut literal)));
                    }
                    parts.push(placeholder(text, &inner)?);
                }
                c => literal.push(c),
            }
        }
        if !literal.is_empty() {
            parts.push(Part::Literal(literal));
        }
        if !parts.iter().any(|p| !matches!(p, Part::Literal(_))) {
            return Err(format!(
                "message_id.template {text:?} has no placeholder: every record would get the same \
                 key (use {{/pointer}}, {{header:NAME}} or {{key}})"
            ));
        }
        Ok(Template {
            text: text.to_string(),
            parts,
        })
    }
}

fn placeholder(text: &str, inner: &str) -> Result<Part, String> {
    if inner == "key" {
        return Ok(Part::Key);
    }
    if inner.starts_with('/') {
        return Ok(Part::Pointer(inner.to_string()));
    }
    if let Some(name) = inner.strip_prefix("header:") {
        if name.is_empty() {
            return Err(format!(
                "message_id.template {text:?}: {{header:}} names no header"
            ));
        }
        return Ok(Part::Header(name.to_string()));
    }
    Err(format!(
        "message_id.template {text:?}: {{{inner}}} is not a placeholder (use {{/pointer}}, \
         {{header:NAME}} or {{key}})"
    ))
}

/// The table form, every field optional so that the checks can say what is wrong.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Table {
    header: Option<String>,
    json_pointer: Option<String>,
    template: Option<String>,
    any_string: Option<bool>,
}

impl TryFrom<Table> for MessageIdConfig {
    type Error = String;

    fn try_from(t: Table) -> Result<MessageIdConfig, String> {
        let source = match (t.header, t.json_pointer, t.template) {
            (Some(h), None, None) => MessageIdSource::Header(h),
            (None, Some(p), None) => MessageIdSource::JsonPointer(p),
            (None, None, Some(text)) => MessageIdSource::Template(text.parse()?),
            (None, None, None) => {
                return Err("message_id needs one of header, json_pointer or template \
                            (or message_id = \"key\")"
                    .into())
            }
            _ => {
                return Err(
                    "message_id takes one of header, json_pointer or template, not several \
                     (a template puts several together: \"{header:id}:{/status}\")"
                        .into(),
                )
            }
        };
        let text = matches!(source, MessageIdSource::Template(_));
        match t.any_string {
            Some(false) if text => Err("message_id.any_string = false does not apply to a \
                                        template: a template's key is always text"
                .into()),
            any => Ok(MessageIdConfig {
                source,
                any_string: text || any.unwrap_or(false),
            }),
        }
    }
}

impl<'de> Deserialize<'de> for MessageIdConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = MessageIdConfig;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "\"key\", or a table with header, json_pointer or template \
                     (and any_string)",
                )
            }

            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Self::Value, E> {
                match s {
                    "key" => Ok(MessageIdConfig {
                        source: MessageIdSource::Key,
                        any_string: true,
                    }),
                    other => Err(E::custom(format!(
                        "message_id = {other:?}: the only word is \"key\" (the record key); \
                         otherwise a table: {{ header = \"event_id\" }}, {{ json_pointer = \"/id\" }} \
                         or {{ template = \"{{/payment_id}}:{{/status}}\" }}"
                    ))),
                }
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<Self::Value, A::Error> {
                let table = Table::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                MessageIdConfig::try_from(table).map_err(serde::de::Error::custom)
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl fmt::Display for MessageIdConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let any = if self.any_string
            && !matches!(
                self.source,
                MessageIdSource::Key | MessageIdSource::Template(_)
            ) {
            ", any_string = true"
        } else {
            ""
        };
        match &self.source {
            MessageIdSource::Header(h) => write!(f, "{{ header = {h:?}{any} }}"),
            MessageIdSource::JsonPointer(p) => write!(f, "{{ json_pointer = {p:?}{any} }}"),
            MessageIdSource::Key => f.write_str("\"key\""),
            MessageIdSource::Template(t) => write!(f, "{{ template = {:?} }}", t.text),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Deserialize)]
    struct Doc {
        message_id: MessageIdConfig,
    }

    fn parse(toml_text: &str) -> Result<MessageIdConfig, String> {
        toml::from_str::<Doc>(toml_text)
            .map(|d| d.message_id)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_forms() {
        assert_eq!(
            parse("message_id = { header = \"id\" }"),
            Ok(MessageIdConfig::header("id"))
        );
        let any = parse("message_id = { json_pointer = \"/id\", any_string = true }").unwrap();
        assert_eq!(any.source, MessageIdSource::JsonPointer("/id".into()));
        assert!(any.any_string && any.is_text());
        let key = parse("message_id = \"key\"").unwrap();
        assert_eq!(key.source, MessageIdSource::Key);
        assert!(key.is_text());
        assert!(!MessageIdConfig::default().is_text());
    }

    #[test]
    fn a_template_parses_into_parts() {
        let t: Template = "{/payment_id}:{/status}".parse().unwrap();
        assert_eq!(
            t.parts,
            vec![
                Part::Pointer("/payment_id".into()),
                Part::Literal(":".into()),
                Part::Pointer("/status".into()),
            ]
        );
        let t: Template = "{{{header:source}}}-{key}".parse().unwrap();
        assert_eq!(
            t.parts,
            vec![
                Part::Literal("{".into()),
                Part::Header("source".into()),
                Part::Literal("}-".into()),
                Part::Key,
            ]
        );
        let parsed = parse("message_id = { template = \"{/a}|{/b}\" }").unwrap();
        assert!(parsed.any_string);
        assert_eq!(parsed.to_string(), "{ template = \"{/a}|{/b}\" }");
    }

    #[test]
    fn bad_templates_say_what_is_wrong() {
        for (text, says) in [
            ("payments", "no placeholder"),
            ("{/a", "not closed"),
            ("{/a}}", "closes nothing"),
            ("{amount}", "not a placeholder"),
            ("{header:}", "names no header"),
        ] {
            let e = text.parse::<Template>().unwrap_err();
            assert!(e.contains(says), "{text}: {e}");
        }
        for (doc, says) in [
            ("message_id = \"event_id\"", "the only word is \"key\""),
            (
                "message_id = { header = \"a\", json_pointer = \"/b\" }",
                "not several",
            ),
            ("message_id = {}", "needs one of"),
            (
                "message_id = { template = \"{/a}\", any_string = false }",
                "always text",
            ),
            (
                "message_id = { header = \"a\", uuid = true }",
                "unknown field",
            ),
        ] {
            let e = parse(doc).unwrap_err();
            assert!(e.contains(says), "{doc}: {e}");
        }
    }
}
