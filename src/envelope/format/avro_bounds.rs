//! What an Avro record's bytes may make the decoder do, checked before `apache-avro` decodes
//! them: a skip-only walk of the bytes along the writer's schema, which allocates nothing.
//!
//! `apache-avro` follows the bytes wherever the schema lets them go. With a recursive schema
//! (a linked list, a tree: legal Avro) a record two bytes a level deep can nest as deep as
//! its bytes allow, and the decoder (and the mapping to JSON after it) recurses once a level:
//! 100,000 levels in a 200 KB record overflow the partition task's stack and abort the whole
//! worker, which restarts, reads the same record, and aborts again, so the record is never
//! parked. And a length or a block count claiming more than the record holds makes it
//! allocate first and find out later (up to its 512 MiB limit a value; a block of a million
//! `null`s costs 6 bytes). The walk refuses both, with a reason, before anything is allocated:
//! - nesting (records, arrays and maps within each other, as the JSON it becomes nests)
//!   deeper than [`super::MAX_DEPTH`], the bound JSON payloads have too;
//! - a record that ends early, a negative length, a union branch the schema lacks;
//! - more array items and map entries than the record has bytes, plus [`SPARE_ITEMS`] (only
//!   items of zero bytes, such as `null`s, can be more numerous than bytes).

use std::collections::HashMap;

use apache_avro::schema::{InnerDecimalSchema, Name, Schema, UuidSchema};

use super::MAX_DEPTH;

/// Items a record may hold beyond one per byte.
pub const SPARE_ITEMS: usize = 4096;

/// Walks `body` along `schema`: `Ok` with the deepest level the record reaches, `Err` with why
/// it is refused, for the operator.
pub fn check(schema: &Schema, named: &HashMap<Name, Schema>, body: &[u8]) -> Result<usize, String> {
    let mut walk = Walk {
        named,
        rest: body,
        items: 0,
        max_items: body.len().saturating_add(SPARE_ITEMS),
        deepest: 0,
    };
    walk.value(schema, 0).map_err(|e| format!("Avro: {e}"))?;
    Ok(walk.deepest)
}

struct Walk<'a> {
    named: &'a HashMap<Name, Schema>,
    rest: &'a [u8],
    items: usize,
    max_items: usize,
    deepest: usize,
}

impl Walk<'_> {
    fn value(&mut self, schema: &Schema, depth: usize) -> Result<(), String> {
        self.deepest = self.deepest.max(depth);
        if depth > MAX_DEPTH {
            return Err(format!(
                "the record nests deeper than {MAX_DEPTH} levels (records, arrays and maps within \
                 each other), the most the engine decodes"
            ));
        }
        match schema {
            Schema::Null => Ok(()),
            Schema::Boolean => self.skip(1),
            Schema::Int
            | Schema::Long
            | Schema::Enum(_)
            | Schema::Date
            | Schema::TimeMillis
            | Schema::TimeMicros
            | Schema::TimestampMillis
            | Schema::TimestampMicros
            | Schema::TimestampNanos
            | Schema::LocalTimestampMillis
            | Schema::LocalTimestampMicros
            | Schema::LocalTimestampNanos => self.long().map(drop),
            Schema::Float => self.skip(4),
            Schema::Double => self.skip(8),
            Schema::Bytes
            | Schema::String
            | Schema::BigDecimal
            | Schema::Uuid(UuidSchema::String | UuidSchema::Bytes) => self.bytes(),
            Schema::Uuid(UuidSchema::Fixed(f)) | Schema::Fixed(f) | Schema::Duration(f) => {
                self.skip(f.size)
            }
            Schema::Decimal(d) => match &d.inner {
                InnerDecimalSchema::Bytes => self.bytes(),
                InnerDecimalSchema::Fixed(f) => self.skip(f.size),
            },
            Schema::Array(a) => self.blocks(|w| w.value(&a.items, depth + 1)),
            Schema::Map(m) => self.blocks(|w| {
                w.bytes()?;
                w.value(&m.types, depth + 1)
            }),
            Schema::Union(u) => {
                let i = self.long()?;
                let branch = usize::try_from(i)
                    .ok()
                    .and_then(|i| u.variants().get(i))
                    .ok_or_else(|| {
                        format!(
                            "union branch {i}, but the schema's union has {}",
                            u.variants().len()
                        )
                    })?;
                // A union is its branch's value: no level of its own.
                self.value(branch, depth)
            }
            Schema::Record(r) => r
                .fields
                .iter()
                .try_for_each(|f| self.value(&f.schema, depth + 1)),
            Schema::Ref { name } => {
                let named = self.named.get(name).ok_or_else(|| {
                    format!("the schema refers to {name:?}, which it does not define")
                })?;
                self.value(named, depth)
            }
        }
    }

    /// An array's or map's blocks: a count (negative: followed by the block's size in bytes),
    /// that many items, until a count of 0.
    fn blocks(
        &mut self,
        mut item: impl FnMut(&mut Self) -> Result<(), String>,
    ) -> Result<(), String> {
        loop {
            let count = self.long()?;
            if count == 0 {
                return Ok(());
            }
            if count < 0 {
                self.long()?;
            }
            for _ in 0..count.unsigned_abs() {
                self.items += 1;
                if self.items > self.max_items {
                    return Err(format!(
                        "the record's arrays and maps claim more than {} items, more than its \
                         {} bytes can hold",
                        self.max_items,
                        self.max_items - SPARE_ITEMS
                    ));
                }
                item(self)?;
            }
        }
    }

    /// A zigzag varint (Avro's int and long).
    fn long(&mut self) -> Result<i64, String> {
        let mut value: u64 = 0;
        for shift in (0..70).step_by(7) {
            let (&b, rest) = self.rest.split_first().ok_or_else(ended)?;
            self.rest = rest;
            if shift == 63 && b > 1 {
                break;
            }
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(((value >> 1) as i64) ^ -((value & 1) as i64));
            }
        }
        Err("a number is longer than a long's 10 bytes".into())
    }

    /// A length, then that many bytes.
    fn bytes(&mut self) -> Result<(), String> {
        let len = self.long()?;
        let len = usize::try_from(len).map_err(|_| format!("a negative length ({len})"))?;
        self.skip(len)
    }

    fn skip(&mut self, n: usize) -> Result<(), String> {
        if self.rest.len() < n {
            return Err(format!(
                "a value of {n} bytes where {} are left: {}",
                self.rest.len(),
                ended()
            ));
        }
        self.rest = &self.rest[n..];
        Ok(())
    }
}

fn ended() -> String {
    "the bytes end before the record does (cut short, or written with another schema?)".into()
}
