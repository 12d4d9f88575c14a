//! The codecs phase: the batch strategy draining a pre-filled topic written with each
//! compression codec a producer may use (`compression.type` none, zstd, gzip, snappy, lz4), one
//! worker each, side by side: msg/s and the worker's CPU per message. What a codec costs the
//! engine is decompression, per fetched batch, on librdkafka's threads, which the worker's CPU
//! time includes. none and zstd run first and next to each other: the pair the report compares.

use std::path::Path;

use serde::Serialize;

use super::drain::drain_with;
use super::{ratio, BenchArgs};
use crate::session::Compression;

/// The order the codecs run in.
const ORDER: [Compression; 5] = [
    Compression::None,
    Compression::Zstd,
    Compression::Gzip,
    Compression::Snappy,
    Compression::Lz4,
];

#[derive(Debug, Default, Serialize)]
pub(super) struct CodecDrain {
    pub(super) codec: &'static str,
    pub(super) records: u64,
    pub(super) msg_s: f64,
    pub(super) cpu_us_per_msg: f64,
    pub(super) verified: bool,
}

#[derive(Debug, Default, Serialize)]
pub(super) struct Codecs {
    /// Payments of each drain (10% resends on top).
    pub(super) events: u64,
    pub(super) runs: Vec<CodecDrain>,
    /// zstd's msg/s over none's.
    pub(super) zstd_vs_none_msg_s: f64,
    /// zstd's worker CPU per message over none's.
    pub(super) zstd_vs_none_cpu_per_msg: f64,
    pub(super) verified: bool,
}

pub(super) async fn codecs(bin: &Path, args: &BenchArgs, events: u64) -> anyhow::Result<Codecs> {
    let mut out = Codecs {
        events,
        verified: true,
        ..Codecs::default()
    };
    for codec in ORDER {
        let (d, _) = drain_with(bin, args, "batch", events, 0, 1, codec).await?;
        eprintln!(
            "   {:<6} {:>8.0} msg/s, worker CPU {:>6.1} µs/msg{}",
            codec.as_str(),
            d.msg_s,
            d.cpu_us_per_msg,
            if d.verified { "" } else { ", NOT verified" }
        );
        out.verified &= d.verified;
        out.runs.push(CodecDrain {
            codec: codec.as_str(),
            records: d.records,
            msg_s: d.msg_s.round(),
            cpu_us_per_msg: d.cpu_us_per_msg,
            verified: d.verified,
        });
    }
    let of = |c: &str| out.runs.iter().find(|r| r.codec == c);
    if let (Some(none), Some(zstd)) = (of("none"), of("zstd")) {
        out.zstd_vs_none_msg_s = ratio(zstd.msg_s, none.msg_s);
        out.zstd_vs_none_cpu_per_msg = ratio(zstd.cpu_us_per_msg, none.cpu_us_per_msg);
    }
    eprintln!(
        "   zstd against none: {:.2} of the msg/s, {:.2} of the worker CPU per message",
        out.zstd_vs_none_msg_s, out.zstd_vs_none_cpu_per_msg
    );
    Ok(out)
}
