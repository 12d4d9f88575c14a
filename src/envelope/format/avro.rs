//! Avro: a record decoded with its writer's schema (`apache-avro`), then mapped to the JSON a
//! person would write for it, not Avro's own JSON encoding:
//!
//! | Avro | JSON |
//! |---|---|
//! | null, boolean, int, long, float, double, string | the same (a float that is NaN or infinite: `null`) |
//! | union (`["null", "string"]`, any branches) | the branch's value itself, never `{"string": ..}` |
//! | record, map / array | object / array |
//! | enum | its symbol, a string |
//! | bytes, fixed | base64 string (standard alphabet, padded) |
//! | `uuid` | its string form |
//! | `date` | `"YYYY-MM-DD"` |
//! | `time-millis`, `time-micros` | `"HH:MM:SS.fff"`, `"HH:MM:SS.ffffff"` |
//! | `timestamp-millis/micros/nanos` | RFC 3339 in UTC, `Z`, with 3, 6 or 9 fraction digits |
//! | `local-timestamp-*` | the same without `Z` (no time zone) |
//! | `decimal`, `big-decimal` | a string of the exact number (`"12.30"`): a JSON number would round |
//! | `duration` | `{"months": m, "days": d, "millis": ms}` |

use std::collections::HashMap;

use apache_avro::schema::{Name, Schema};
use apache_avro::types::Value as Avro;
use base64::Engine as _;
use chrono::{DateTime, NaiveDate, NaiveTime};
use serde_json::{Map, Number, Value};

use super::SchemaText;

/// How deep a record may nest and still be decoded on the caller's stack.
const SHALLOW: usize = 16;
/// The stack of the thread that decodes deeper records: room for [`super::MAX_DEPTH`] levels
/// in a debug build, with a margin (reserved, not committed, until used).
const DEEP_STACK: usize = 32 << 20;

/// A writer's schema and the named types it (and its references) define.
pub struct AvroSchema {
    schema: Schema,
    /// The referenced schemas, which the decoder resolves `Ref`s against.
    references: Vec<Schema>,
    /// Every named type by full name, to follow a `Ref` while mapping to JSON.
    named: HashMap<Name, Schema>,
}

impl AvroSchema {
    pub fn compile(s: &SchemaText) -> Result<AvroSchema, String> {
        let (schema, references) = if s.references.is_empty() {
            (
                Schema::parse_str(&s.text).map_err(|e| e.to_string())?,
                Vec::new(),
            )
        } else {
            Schema::parse_str_with_list(&s.text, s.references.iter().map(|r| r.text.as_str()))
                .map_err(|e| e.to_string())?
        };
        let mut named = HashMap::new();
        for s in references.iter().chain(std::iter::once(&schema)) {
            collect(s, &mut named);
        }
        Ok(AvroSchema {
            schema,
            references,
            named,
        })
    }

    pub fn decode(&self, body: &[u8]) -> Result<Value, String> {
        // Depth, lengths and counts first: apache-avro recurses and allocates as the bytes say.
        let depth = super::avro_bounds::check(&self.schema, &self.named, body)?;
        if depth <= SHALLOW {
            return self.decode_walked(body);
        }
        // apache-avro's decoder takes about 10 KB of stack a frame and three frames a level in
        // a debug build (less optimised), so a record within the bound but deeper than SHALLOW
        // could still overflow a 2 MiB tokio worker's stack: it gets a thread with room for
        // the bound. Such records are rare; the thread costs tens of microseconds.
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("avro-deep".into())
                .stack_size(DEEP_STACK)
                .spawn_scoped(scope, || self.decode_walked(body))
                .map_err(|e| {
                    format!("Avro: no thread to decode a record {depth} levels deep: {e}")
                })?
                .join()
                .unwrap_or_else(|_| Err("Avro: decoding the record panicked".into()))
        })
    }

    /// [`AvroSchema::decode`] once the bytes are known to stay within the bounds.
    fn decode_walked(&self, mut body: &[u8]) -> Result<Value, String> {
        // Built per record: it borrows the schema (as the older from_avro_datum did inside).
        let reader = apache_avro::reader::datum::GenericDatumReader::builder(&self.schema)
            .writer_schemata(
                self.references
                    .iter()
                    .chain(std::iter::once(&self.schema))
                    .collect(),
            )
            .and_then(|b| b.build());
        let value = reader
            .and_then(|r| r.read_value(&mut body))
            .map_err(|e| format!("Avro: {e}"))?;
        if !body.is_empty() {
            return Err(format!(
                "Avro: {} bytes left over after the record (written with another schema?)",
                body.len()
            ));
        }
        self.json(value, &self.schema)
    }

    /// Maps a decoded value to JSON, walking its schema beside it (a decimal's scale is in the
    /// schema only).
    fn json(&self, value: Avro, schema: &Schema) -> Result<Value, String> {
        let schema = self.resolve(schema)?;
        Ok(match (value, schema) {
            (Avro::Null, _) => Value::Null,
            (Avro::Boolean(b), _) => Value::Bool(b),
            (Avro::Int(n), _) => n.into(),
            (Avro::Long(n), _) => n.into(),
            (Avro::Float(x), _) => float(f64::from(x)),
            (Avro::Double(x), _) => float(x),
            (Avro::String(s), _) => Value::String(s),
            (Avro::Bytes(b), _) | (Avro::Fixed(_, b), _) => base64(&b),
            (Avro::Enum(_, symbol), _) => Value::String(symbol),
            (Avro::Union(i, v), Schema::Union(u)) => {
                let branch = u
                    .variants()
                    .get(i as usize)
                    .ok_or_else(|| format!("Avro: union branch {i} is not in the schema"))?;
                self.json(*v, branch)?
            }
            (Avro::Array(items), Schema::Array(a)) => Value::Array(
                items
                    .into_iter()
                    .map(|v| self.json(v, &a.items))
                    .collect::<Result<_, _>>()?,
            ),
            (Avro::Map(entries), Schema::Map(m)) => {
                // Sorted, so one record always maps to the same JSON text.
                let mut entries: Vec<_> = entries.into_iter().collect();
                entries.sort_by(|a, b| a.0.cmp(&b.0));
                let mut out = Map::new();
                for (k, v) in entries {
                    out.insert(k, self.json(v, &m.types)?);
                }
                Value::Object(out)
            }
            (Avro::Record(fields), Schema::Record(r)) => {
                let mut out = Map::new();
                for (i, (name, v)) in fields.into_iter().enumerate() {
                    let field_schema = r
                        .fields
                        .get(i)
                        .filter(|f| f.name == name)
                        .or_else(|| r.lookup.get(&name).and_then(|&j| r.fields.get(j)))
                        .map(|f| &f.schema)
                        .ok_or_else(|| format!("Avro: field {name:?} is not in the schema"))?;
                    out.insert(name, self.json(v, field_schema)?);
                }
                Value::Object(out)
            }
            (Avro::Decimal(d), Schema::Decimal(s)) => {
                let bytes = Vec::<u8>::try_from(&d).map_err(|e| format!("Avro: decimal: {e}"))?;
                Value::String(decimal(&bytes, s.scale))
            }
            (Avro::BigDecimal(d), _) => Value::String(d.to_string()),
            (Avro::Uuid(u), _) => Value::String(u.to_string()),
            (Avro::Date(days), _) => {
                let date = NaiveDate::from_ymd_opt(1970, 1, 1)
                    .and_then(|e| e.checked_add_signed(chrono::Duration::days(days.into())))
                    .ok_or_else(|| format!("Avro: date {days} days from 1970 is out of range"))?;
                Value::String(date.format("%Y-%m-%d").to_string())
            }
            (Avro::TimeMillis(ms), _) => time(i64::from(ms) * 1_000_000, 3)?,
            (Avro::TimeMicros(us), _) => time(us.saturating_mul(1_000), 6)?,
            (Avro::TimestampMillis(ms), _) => timestamp(ms, 1_000_000, 3, true)?,
            (Avro::TimestampMicros(us), _) => timestamp(us, 1_000, 6, true)?,
            (Avro::TimestampNanos(ns), _) => timestamp(ns, 1, 9, true)?,
            (Avro::LocalTimestampMillis(ms), _) => timestamp(ms, 1_000_000, 3, false)?,
            (Avro::LocalTimestampMicros(us), _) => timestamp(us, 1_000, 6, false)?,
            (Avro::LocalTimestampNanos(ns), _) => timestamp(ns, 1, 9, false)?,
            (Avro::Duration(d), _) => serde_json::json!({
                "months": u32::from(d.months()),
                "days": u32::from(d.days()),
                "millis": u32::from(d.millis()),
            }),
            (v, s) => {
                return Err(format!(
                    "Avro: a {} value where the schema has {s:?}",
                    kind(&v)
                ))
            }
        })
    }

    fn resolve<'a>(&'a self, schema: &'a Schema) -> Result<&'a Schema, String> {
        match schema {
            Schema::Ref { name } => self.named.get(name).ok_or_else(|| {
                format!("Avro: the schema refers to {name:?}, which it does not define")
            }),
            s => Ok(s),
        }
    }
}

/// Every named type inside `schema`, by full name.
fn collect(schema: &Schema, into: &mut HashMap<Name, Schema>) {
    match schema {
        Schema::Record(r) => {
            into.insert(r.name.clone(), schema.clone());
            for f in &r.fields {
                collect(&f.schema, into);
            }
        }
        Schema::Enum(e) => {
            into.insert(e.name.clone(), schema.clone());
        }
        Schema::Fixed(f) => {
            into.insert(f.name.clone(), schema.clone());
        }
        Schema::Array(a) => collect(&a.items, into),
        Schema::Map(m) => collect(&m.types, into),
        Schema::Union(u) => u.variants().iter().for_each(|v| collect(v, into)),
        Schema::Decimal(d) => {
            if let apache_avro::schema::InnerDecimalSchema::Fixed(f) = &d.inner {
                into.insert(f.name.clone(), Schema::Fixed(f.clone()));
            }
        }
        _ => {}
    }
}

fn kind(v: &Avro) -> &'static str {
    match v {
        Avro::Record(_) => "record",
        Avro::Array(_) => "array",
        Avro::Map(_) => "map",
        Avro::Union(..) => "union",
        Avro::Decimal(_) => "decimal",
        _ => "scalar",
    }
}

fn float(x: f64) -> Value {
    Number::from_f64(x).map_or(Value::Null, Value::Number)
}

fn base64(b: &[u8]) -> Value {
    Value::String(base64::engine::general_purpose::STANDARD.encode(b))
}

/// A day's time from nanoseconds after midnight, with `digits` fraction digits.
fn time(nanos: i64, digits: usize) -> Result<Value, String> {
    let secs = u32::try_from(nanos.div_euclid(1_000_000_000)).ok();
    let frac = u32::try_from(nanos.rem_euclid(1_000_000_000)).ok();
    let t = secs
        .zip(frac)
        .and_then(|(s, n)| NaiveTime::from_num_seconds_from_midnight_opt(s, n))
        .ok_or_else(|| format!("Avro: time of day {nanos} ns is out of range"))?;
    let f = format!("{:09}", t.format("%f"));
    Ok(Value::String(format!(
        "{}.{}",
        t.format("%H:%M:%S"),
        &f[..digits]
    )))
}

/// An instant from `n` units of `unit_nanos` since the epoch, RFC 3339 (`utc`) or a local
/// date-time without an offset.
fn timestamp(n: i64, unit_nanos: i64, digits: usize, utc: bool) -> Result<Value, String> {
    let per_sec = 1_000_000_000 / unit_nanos;
    let secs = n.div_euclid(per_sec);
    let nanos = (n.rem_euclid(per_sec) * unit_nanos) as u32;
    let t = DateTime::from_timestamp(secs, nanos)
        .ok_or_else(|| format!("Avro: timestamp {n} is out of range"))?;
    let f = format!("{:09}", t.format("%f"));
    let base = t.format("%Y-%m-%dT%H:%M:%S");
    Ok(Value::String(if utc {
        format!("{base}.{}Z", &f[..digits])
    } else {
        format!("{base}.{}", &f[..digits])
    }))
}

/// The exact decimal text of a big-endian two's-complement unscaled value and its scale.
fn decimal(bytes: &[u8], scale: usize) -> String {
    let negative = bytes.first().is_some_and(|b| b & 0x80 != 0);
    // The magnitude, big-endian: two's complement undone for a negative value.
    let mut mag: Vec<u8> = if negative {
        let mut m: Vec<u8> = bytes.iter().map(|b| !b).collect();
        for b in m.iter_mut().rev() {
            let (v, carry) = b.overflowing_add(1);
            *b = v;
            if !carry {
                break;
            }
        }
        m
    } else {
        bytes.to_vec()
    };
    // Base 256 to base 10 by repeated division.
    let mut digits = Vec::new();
    while mag.iter().any(|&b| b != 0) {
        let mut rem = 0u32;
        for b in mag.iter_mut() {
            let cur = (rem << 8) | u32::from(*b);
            *b = (cur / 10) as u8;
            rem = cur % 10;
        }
        digits.push(b'0' + rem as u8);
    }
    while digits.len() <= scale {
        digits.push(b'0');
    }
    digits.reverse();
    let text = String::from_utf8(digits).expect("ASCII digits");
    let (int, frac) = text.split_at(text.len() - scale);
    let sign = if negative { "-" } else { "" };
    if scale == 0 {
        format!("{sign}{int}")
    } else {
        format!("{sign}{int}.{frac}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use apache_avro::types::Record;

    fn datum(schema: &Schema, r: Record<'_>) -> Vec<u8> {
        apache_avro::writer::datum::GenericDatumWriter::builder(schema)
            .build()
            .unwrap()
            .write_value_to_vec(r)
            .unwrap()
    }

    fn compile(text: &str) -> AvroSchema {
        AvroSchema::compile(&SchemaText {
            kind: super::super::Kind::Avro,
            text: text.into(),
            references: vec![],
        })
        .unwrap()
    }

    #[test]
    fn bytes_that_claim_more_than_they_hold_are_refused_before_decoding() {
        let list = compile(
            r#"{"type": "record", "name": "Node", "fields": [
                {"name": "next", "type": ["null", "Node"]}]}"#,
        );
        // 127 levels decode (on a thread of their own past SHALLOW); 200,000 are refused.
        let mut deep = vec![2u8; 127];
        deep.push(0);
        assert!(list.decode(&deep).is_ok());
        let e = list.decode(&[2u8; 200_000]).unwrap_err();
        assert!(e.contains("deeper than 128 levels"), "{e}");

        // A block of 10 million nulls in 5 bytes; a string of 1 GiB in 5.
        let nulls = compile(r#"{"type": "array", "items": "null"}"#);
        let e = nulls.decode(&[0x80, 0xda, 0xc4, 0x09, 0]).unwrap_err();
        assert!(e.contains("more than 4101 items"), "{e}");
        let string = compile(r#""string""#);
        let e = string.decode(&[0x80, 0x80, 0x80, 0x80, 0x08]).unwrap_err();
        assert!(e.contains("bytes end before the record does"), "{e}");
    }

    #[test]
    fn decimals_are_exact_strings() {
        assert_eq!(decimal(&[0x04, 0xd2], 2), "12.34");
        assert_eq!(decimal(&[0xfb, 0x2e], 2), "-12.34");
        assert_eq!(decimal(&[0x05], 3), "0.005");
        assert_eq!(decimal(&[0x00], 0), "0");
        assert_eq!(decimal(&[0xff], 1), "-0.1");
        // 2^127, more than an i128 holds.
        let mut big = vec![0x00, 0x80];
        big.extend([0u8; 15]);
        assert_eq!(decimal(&big, 0), "170141183460469231731687303715884105728");
    }

    #[test]
    fn times_and_timestamps_read_as_a_person_writes_them() {
        assert_eq!(
            timestamp(1_700_000_000_123_456, 1_000, 6, true).unwrap(),
            Value::String("2023-11-14T22:13:20.123456Z".into())
        );
        assert_eq!(
            timestamp(-1, 1_000_000, 3, false).unwrap(),
            Value::String("1969-12-31T23:59:59.999".into())
        );
        assert_eq!(
            time(3_723_004_000_000, 3).unwrap(),
            Value::String("01:02:03.004".into())
        );
    }

    #[test]
    fn the_demo_payment_maps_to_the_json_demo_s_object() {
        let s = compile(include_str!("../../../loadgen/schemas/payment.avsc"));
        let mut r = Record::new(&s.schema).unwrap();
        let id = uuid::Uuid::now_v7();
        r.put("event_id", Avro::Uuid(id));
        r.put("payment_id", "pay_1");
        r.put("user_id", "u_1");
        r.put("amount_paise", 12_300i64);
        r.put("occurred_at", Avro::TimestampMicros(1_700_000_000_000_001));
        let bytes = datum(&s.schema, r);
        assert_eq!(
            s.decode(&bytes).unwrap(),
            serde_json::json!({
                "event_id": id.to_string(),
                "payment_id": "pay_1",
                "user_id": "u_1",
                "amount_paise": 12300,
                "occurred_at": "2023-11-14T22:13:20.000001Z",
            })
        );
        // Cut short: does not fit; one byte too many: does not fit either.
        assert!(s.decode(&bytes[..bytes.len() - 3]).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(s.decode(&long).unwrap_err().contains("left over"));
    }

    #[test]
    fn unions_enums_maps_and_decimals_map_to_plain_json() {
        let s = compile(
            r#"{"type":"record","name":"T","fields":[
                {"name":"note","type":["null","string"],"default":null},
                {"name":"n","type":["null","long"]},
                {"name":"colour","type":{"type":"enum","name":"C","symbols":["RED","BLUE"]}},
                {"name":"tags","type":{"type":"map","values":"int"}},
                {"name":"price","type":{"type":"bytes","logicalType":"decimal","precision":9,"scale":2}},
                {"name":"day","type":{"type":"int","logicalType":"date"}},
                {"name":"raw","type":"bytes"},
                {"name":"again","type":"C"}
            ]}"#,
        );
        let mut r = Record::new(&s.schema).unwrap();
        r.put("note", Avro::Union(1, Box::new(Avro::String("hi".into()))));
        r.put("n", Avro::Union(0, Box::new(Avro::Null)));
        r.put("colour", Avro::Enum(1, "BLUE".into()));
        r.put(
            "tags",
            Avro::Map(
                [
                    ("b".to_string(), Avro::Int(2)),
                    ("a".to_string(), Avro::Int(1)),
                ]
                .into(),
            ),
        );
        r.put(
            "price",
            Avro::Decimal(apache_avro::Decimal::from(vec![0x30, 0x39])),
        );
        r.put("day", Avro::Date(19_000));
        r.put("raw", Avro::Bytes(vec![1, 2, 3]));
        r.put("again", Avro::Enum(0, "RED".into()));
        let bytes = datum(&s.schema, r);
        assert_eq!(
            s.decode(&bytes).unwrap(),
            serde_json::json!({
                "note": "hi", "n": null, "colour": "BLUE", "tags": {"a": 1, "b": 2},
                "price": "123.45", "day": "2022-01-08", "raw": "AQID", "again": "RED",
            })
        );
    }
}
