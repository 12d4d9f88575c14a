//! W3C Trace Context (`traceparent`, `tracestate`) as a Kafka record, an inbox row or an outbox
//! row carries it: read strictly, written in version 00.
//!
//! A value that is not a valid `traceparent` is ignored, as the W3C recommendation says a
//! receiver must: the message is processed exactly as one without a context, never parked. A
//! `tracestate` that does not parse is dropped and its `traceparent` kept.

use std::str::FromStr;

use bytes::Bytes;
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// The header (and column) names.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// A `traceparent` is 55 bytes in version 00; the W3C's limit for a `tracestate` is 32 entries,
/// a few hundred bytes in practice. Anything far larger is not a trace context.
const MAX_TRACESTATE: usize = 8 * 1024;

/// The remote span context in `traceparent` (and `tracestate`), if `traceparent` is valid.
pub fn parse(traceparent: &[u8], tracestate: Option<&[u8]>) -> Option<SpanContext> {
    let tp = std::str::from_utf8(traceparent)
        .ok()?
        .trim_matches([' ', '\t']);
    let b = tp.as_bytes();
    // version "-" trace-id "-" parent-id "-" flags: 2 + 1 + 32 + 1 + 16 + 1 + 2.
    if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
        return None;
    }
    let version = &tp[..2];
    if !lower_hex(version) || version == "ff" {
        return None;
    }
    // Version 00 is exactly 55 bytes; a later version may append fields after a '-'.
    if (version == "00" && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
        return None;
    }
    let (trace, span, flags) = (&tp[3..35], &tp[36..52], &tp[53..55]);
    if !(lower_hex(trace) && lower_hex(span) && lower_hex(flags)) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = tracestate
        .filter(|s| s.len() <= MAX_TRACESTATE)
        .and_then(|s| std::str::from_utf8(s).ok())
        .and_then(|s| TraceState::from_str(s.trim()).ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace_id,
        span_id,
        // Only the sampled bit is defined; the others are not passed on.
        TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8()),
        true,
        state,
    ))
}

fn lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
}

/// The context in a Kafka record's headers: exactly one `traceparent` (two are as invalid as a
/// malformed one) and its `tracestate`, if any.
pub fn from_headers(headers: &[(String, Option<Bytes>)]) -> Option<SpanContext> {
    let mut parent = None;
    let mut state = None;
    for (k, v) in headers {
        if k.eq_ignore_ascii_case(TRACEPARENT) {
            if parent.is_some() {
                return None;
            }
            parent = Some(v.as_deref()?);
        } else if k.eq_ignore_ascii_case(TRACESTATE) && state.is_none() {
            state = v.as_deref();
        }
    }
    parse(parent?, state)
}

/// The context as a row keeps it (`traceparent`, `tracestate` text columns).
pub fn from_columns(traceparent: Option<&str>, tracestate: Option<&str>) -> Option<SpanContext> {
    parse(traceparent?.as_bytes(), tracestate.map(str::as_bytes))
}

/// `traceparent` and, when not empty, `tracestate`, to write into a header or a row.
pub fn format(cx: &SpanContext) -> (String, Option<String>) {
    let parent = format!(
        "00-{}-{}-{:02x}",
        cx.trace_id(),
        cx.span_id(),
        cx.trace_flags().to_u8()
    );
    let state = cx.trace_state().header();
    (parent, (!state.is_empty()).then_some(state))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn headers(list: &[(&str, &str)]) -> Vec<(String, Option<Bytes>)> {
        (list.iter())
            .map(|(k, v)| (k.to_string(), Some(Bytes::copy_from_slice(v.as_bytes()))))
            .collect()
    }

    #[test]
    fn a_valid_traceparent_and_tracestate_parse_and_format_back() {
        let cx = parse(
            GOOD.as_bytes(),
            Some(b"congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"),
        )
        .expect("valid");
        assert_eq!(
            cx.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(cx.span_id(), SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(cx.is_sampled() && cx.is_remote());
        let (tp, ts) = format(&cx);
        assert_eq!(tp, GOOD);
        assert_eq!(
            ts.as_deref(),
            Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")
        );
        let unsampled = parse(GOOD.replace("-01", "-00").as_bytes(), None).unwrap();
        assert!(!unsampled.is_sampled());
        assert_eq!(format(&unsampled).1, None);
        // Unknown flags are not passed on; surrounding spaces are allowed.
        let odd = parse(format!(" {} ", GOOD.replace("-01", "-ff")).as_bytes(), None).unwrap();
        assert_eq!(format(&odd).0, GOOD);
    }

    #[test]
    fn a_later_version_may_carry_more_fields() {
        let v1 = format!("{}-what-comes-next", GOOD.replacen("00", "01", 1));
        assert!(parse(v1.as_bytes(), None).is_some());
        let v1_glued = format!("{}x", GOOD.replacen("00", "01", 1));
        assert!(parse(v1_glued.as_bytes(), None).is_none());
    }

    #[test]
    fn anything_malformed_is_ignored() {
        let bad = [
            "",
            "00",
            "garbage",
            &GOOD[..54],
            &format!("{GOOD}-"),           // v00 with more
            &GOOD.replacen("00", "ff", 1), // forbidden version
            &GOOD.to_uppercase(),          // upper-case hex
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01", // zero trace id
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // zero span id
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01", // not hex
            "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01", // wrong separators
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-+1",
        ];
        for b in bad {
            assert!(parse(b.as_bytes(), None).is_none(), "{b:?} must be ignored");
        }
        assert!(parse(&[0xff, 0xfe, 0x00], None).is_none(), "not UTF-8");
        // A broken tracestate is dropped, the traceparent kept.
        let cx = parse(GOOD.as_bytes(), Some(b"=,,not a state=\xff")).unwrap();
        assert_eq!(cx.trace_state().header(), "");
        let huge = vec![b'a'; MAX_TRACESTATE + 1];
        assert_eq!(
            parse(GOOD.as_bytes(), Some(&huge))
                .unwrap()
                .trace_state()
                .header(),
            ""
        );
    }

    #[test]
    fn headers_give_exactly_one_traceparent() {
        let h = headers(&[
            ("event_id", "x"),
            ("traceparent", GOOD),
            ("tracestate", "a=b"),
        ]);
        let cx = from_headers(&h).unwrap();
        assert_eq!(cx.trace_state().header(), "a=b");
        assert!(from_headers(&headers(&[("TraceParent", GOOD)])).is_some());
        assert!(from_headers(&headers(&[("traceparent", GOOD), ("traceparent", GOOD)])).is_none());
        assert!(from_headers(&headers(&[("tracestate", "a=b")])).is_none());
        assert!(from_headers(&[("traceparent".to_string(), None)]).is_none());
        assert!(from_headers(&[]).is_none());
        assert!(from_columns(Some(GOOD), None).is_some());
        assert!(from_columns(None, Some("a=b")).is_none());
    }
}
