//! JSON Schema: the body after the header is JSON already; it is parsed, and (unless the
//! consumer turns `validate` off) checked against the writer's schema with the `jsonschema`
//! crate, formats included (`date-time`, `uuid`, ...), so a record that does not fit its
//! schema is parked rather than applied. A `$ref` to another registered schema resolves to the
//! reference of that name; the validator never fetches anything from the network.

use std::collections::HashMap;

use jsonschema::{Retrieve, Uri, Validator};
use serde_json::Value;

use super::SchemaText;

pub struct JsonSchema {
    validator: Option<Validator>,
}

/// The schema's references, by the name its `$ref`s use.
struct References(HashMap<String, Value>);

impl Retrieve for References {
    fn retrieve(
        &self,
        uri: &Uri<String>,
    ) -> Result<Value, Box<dyn std::error::Error + Send + Sync>> {
        let wanted = uri.as_str();
        self.0
            .iter()
            .find(|(name, _)| wanted == name.as_str() || wanted.ends_with(&format!("/{name}")))
            .map(|(_, v)| v.clone())
            .ok_or_else(|| format!("{wanted} is not among the schema's references").into())
    }
}

impl JsonSchema {
    pub fn compile(s: &SchemaText, validate: bool) -> Result<JsonSchema, String> {
        let schema: Value = serde_json::from_str(&s.text)
            .map_err(|e| format!("the JSON Schema is not JSON: {e}"))?;
        if !validate {
            return Ok(JsonSchema { validator: None });
        }
        let references = s
            .references
            .iter()
            .map(|r| {
                serde_json::from_str(&r.text)
                    .map(|v| (r.name.clone(), v))
                    .map_err(|e| format!("the JSON Schema's reference {} is not JSON: {e}", r.name))
            })
            .collect::<Result<HashMap<_, _>, _>>()?;
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .with_retriever(References(references))
            .build(&schema)
            .map_err(|e| format!("the JSON Schema does not compile: {e}"))?;
        Ok(JsonSchema {
            validator: Some(validator),
        })
    }

    pub fn decode(&self, body: &[u8]) -> Result<Value, String> {
        let value: Value = serde_json::from_slice(body)
            .map_err(|e| format!("JSON Schema: {}", super::json_error("the value", &e)))?;
        if let Some(v) = &self.validator {
            if let Some(e) = v.iter_errors(&value).next() {
                let at = e.instance_path().to_string();
                return Err(format!(
                    "JSON Schema: does not fit its schema at {:?}: {e}",
                    if at.is_empty() { "/" } else { &at }
                ));
            }
        }
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Kind, Reference};
    use super::*;

    fn compile(text: &str, references: Vec<Reference>) -> JsonSchema {
        JsonSchema::compile(
            &SchemaText {
                kind: Kind::Json,
                text: text.into(),
                references,
            },
            true,
        )
        .unwrap()
    }

    #[test]
    fn the_demo_payment_fits_and_a_bad_one_does_not() {
        let s = compile(
            include_str!("../../../loadgen/schemas/payment.schema.json"),
            vec![],
        );
        let good = serde_json::json!({
            "event_id": "0190a5c2-7e1f-7c3a-8b1e-0123456789ab",
            "payment_id": "pay_1", "user_id": "u_1", "amount_paise": 100,
            "occurred_at": "2026-12-06T10:00:00Z",
        });
        assert_eq!(s.decode(good.to_string().as_bytes()).unwrap(), good);
        let mut bad = good.clone();
        bad["amount_paise"] = "100".into();
        let e = s.decode(bad.to_string().as_bytes()).unwrap_err();
        assert!(e.contains("/amount_paise"), "{e}");
        let mut bad = good.clone();
        bad["occurred_at"] = "yesterday".into();
        assert!(s.decode(bad.to_string().as_bytes()).is_err());
        assert!(s
            .decode(b"not json")
            .unwrap_err()
            .contains("not valid JSON"));
    }

    #[test]
    fn a_ref_resolves_to_a_reference() {
        let s = compile(
            r#"{"type":"object","properties":{"money":{"$ref":"money.json"}},"required":["money"]}"#,
            vec![Reference {
                name: "money.json".into(),
                text: r#"{"type":"object","required":["currency"]}"#.into(),
            }],
        );
        assert!(s.decode(br#"{"money":{"currency":"INR"}}"#).is_ok());
        assert!(s.decode(br#"{"money":{}}"#).is_err());
    }
}
