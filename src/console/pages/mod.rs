//! One file per page: each gathers its rows through `store`, turns them into display strings
//! (`render`), and fills its template. The templates hold no logic beyond loops and ifs.

pub mod audit;
pub mod consumer;
pub mod inbox;
pub mod message;
pub mod notifications;
pub mod outbox;
pub mod overview;
pub mod parked;

/// A query parameter as forms send it: an empty field is no filter.
pub(crate) fn given(v: &Option<String>) -> Option<&str> {
    v.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// `?a=1&b=2` from pairs, each value URL-encoded, empty ones left out.
pub(crate) fn query(pairs: &[(&str, Option<String>)]) -> String {
    let parts: Vec<String> = (pairs.iter())
        .filter_map(|(k, v)| {
            let v = v.as_deref().filter(|v| !v.is_empty())?;
            Some(format!("{k}={}", encode(v)))
        })
        .collect();
    match parts.is_empty() {
        true => String::new(),
        false => format!("?{}", parts.join("&")),
    }
}

/// What stays as it is in a URL component: RFC 3986's unreserved characters.
const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encodes everything but unreserved characters (RFC 3986).
pub(crate) fn encode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, UNRESERVED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_drop_empty_values_and_encode_the_rest() {
        assert_eq!(
            query(&[
                ("consumer", Some("a b".into())),
                ("reason", None),
                ("x", Some(String::new()))
            ]),
            "?consumer=a%20b"
        );
        assert_eq!(query(&[]), "");
        assert_eq!(given(&Some("  ".into())), None);
    }
}
