//! What every request passes before a page sees it, and what every answer carries.
//!
//! - **Token**: when one is configured, every request (the stylesheet too) must carry it, as
//!   `Authorization: Bearer <token>` or as the password of HTTP Basic authentication (any user
//!   name), which is how a browser carries it: it asks once and sends it with every request.
//!   Compared in constant time (only the length can be learned from the timing).
//! - **No cross-site writes**: a request other than GET or HEAD must say it comes from the
//!   console's own pages: `Sec-Fetch-Site: same-origin` (every current browser sends it), or,
//!   without that header, an `Origin` equal to the console's own. A form on another site that
//!   posts to the console (cross-site request forgery) has neither. GET never changes anything.
//! - **Read-only**: without `console.writes = true` every such request is refused.
//! - **Loopback names only, without a token**: a console with no token answers only requests
//!   whose `Host` is a loopback name (`localhost`, `127.0.0.1`, `[::1]`). A web page can point a
//!   name it controls at 127.0.0.1 (DNS rebinding) and read what the console shows as if it were
//!   its own origin; its requests carry that name in `Host`, and are refused.
//! - **Headers**: a Content-Security-Policy that allows no script at all, no framing, forms
//!   posting only to the console, styles only from it; no caching (pages show payloads), no
//!   referrer, no MIME sniffing.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use base64::Engine as _;
use subtle::ConstantTimeEq;

use super::{error_page, Shared};

/// The Content-Security-Policy of every answer: nothing runs, nothing is fetched from
/// elsewhere, the pages cannot be framed, and forms post only here.
pub const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
    form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

const REALM: &str = "Basic realm=\"effectively console\", charset=\"UTF-8\"";

/// Who asked, for the audit row of an action: `console:<peer address>`, and whether the token
/// was shown. Never the token itself.
#[derive(Debug, Clone)]
pub struct Who(pub String);

/// The middleware (see the module docs).
pub async fn guard(
    State(shared): State<Arc<Shared>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    mut req: Request,
    next: Next,
) -> Response {
    let mut answer = match check(&shared, req.method(), req.headers()) {
        Ok(()) => {
            let who = match shared.token {
                Some(_) => format!("console:{} (token)", peer.ip()),
                None => format!("console:{}", peer.ip()),
            };
            req.extensions_mut().insert(Who(who));
            next.run(req).await
        }
        Err(refusal) => refusal.page(),
    };
    let h = answer.headers_mut();
    let mut set = |name: &'static str, value: &'static str| {
        h.insert(name, HeaderValue::from_static(value));
    };
    set("content-security-policy", CSP);
    set("x-content-type-options", "nosniff");
    set("x-frame-options", "DENY");
    set("referrer-policy", "no-referrer");
    set("cross-origin-opener-policy", "same-origin");
    set("cross-origin-resource-policy", "same-origin");
    set("cache-control", "no-store");
    answer
}

/// Why a request was turned away before any page saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    NoToken,
    ForeignHost,
    CrossSite,
    ReadOnly,
}

impl Refusal {
    fn page(self) -> Response {
        match self {
            Refusal::NoToken => {
                let mut r = error_page(
                    StatusCode::UNAUTHORIZED,
                    "Token required",
                    "This console asks for its token: the password of the browser's prompt \
                     (any user name), or `Authorization: Bearer <token>`.",
                );
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(REALM));
                r
            }
            Refusal::ForeignHost => error_page(
                StatusCode::FORBIDDEN,
                "Host not allowed",
                "A console without a token answers only to a loopback name (localhost, \
                 127.0.0.1, [::1]): configure a token to reach it by another name.",
            ),
            Refusal::CrossSite => error_page(
                StatusCode::FORBIDDEN,
                "Cross-site request refused",
                "A change must come from the console's own pages (Sec-Fetch-Site: same-origin, \
                 or an Origin equal to the console's address).",
            ),
            Refusal::ReadOnly => error_page(
                StatusCode::FORBIDDEN,
                "Read-only",
                "This console is read-only: set `writes = true` in the config's [console] \
                 section to redrive, replay, discard, pause, resume or reset offsets.",
            ),
        }
    }
}

fn check(shared: &Shared, method: &Method, headers: &HeaderMap) -> Result<(), Refusal> {
    if let Some(token) = &shared.token {
        if !presented(headers).is_some_and(|t| same(t.as_bytes(), token.expose().as_bytes())) {
            return Err(Refusal::NoToken);
        }
    } else if !loopback_host(headers) {
        return Err(Refusal::ForeignHost);
    }
    if method == Method::GET || method == Method::HEAD {
        return Ok(());
    }
    if !same_origin(headers) {
        return Err(Refusal::CrossSite);
    }
    if !shared.settings.writes {
        return Err(Refusal::ReadOnly);
    }
    Ok(())
}

/// The token a request carries: a Bearer token, or Basic authentication's password.
fn presented(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, rest) = value.split_once(' ')?;
    let rest = rest.trim();
    if scheme.eq_ignore_ascii_case("bearer") {
        return Some(rest.to_string());
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(rest)
            .ok()?;
        let text = String::from_utf8(decoded).ok()?;
        return text
            .split_once(':')
            .map(|(_, password)| password.to_string());
    }
    None
}

/// Constant-time equality (`subtle`): the time does not depend on where the bytes differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && bool::from(a.ct_eq(b))
}

/// Whether the request's `Host` names this machine's loopback (any port).
fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    // "[::1]:9470", "127.0.0.1:9470", "localhost:9470", or any of them without a port.
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(n, _)| n),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Whether a state-changing request comes from the console's own pages.
fn same_origin(headers: &HeaderMap) -> bool {
    let get = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = get("sec-fetch-site") {
        return site == "same-origin";
    }
    match (get("origin"), get("host")) {
        (Some(origin), Some(host)) => {
            origin == format!("http://{host}") || origin == format!("https://{host}")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn tokens_come_as_bearer_or_basic_password() {
        assert_eq!(
            presented(&headers(&[("authorization", "Bearer abc")])).as_deref(),
            Some("abc")
        );
        // "anyone:s3cret"
        assert_eq!(
            presented(&headers(&[("authorization", "Basic YW55b25lOnMzY3JldA==")])).as_deref(),
            Some("s3cret")
        );
        assert_eq!(presented(&headers(&[])), None);
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"abc", b"abcd"));
    }

    #[test]
    fn only_loopback_names_reach_a_console_without_a_token() {
        for ok in [
            "127.0.0.1:9470",
            "localhost:9470",
            "[::1]:9470",
            "LOCALHOST",
            "127.0.0.2",
        ] {
            assert!(loopback_host(&headers(&[("host", ok)])), "{ok}");
        }
        for no in [
            "attacker.example:9470",
            "10.0.0.5:9470",
            "[2001:db8::1]:80",
            "",
        ] {
            assert!(!loopback_host(&headers(&[("host", no)])), "{no}");
        }
        assert!(!loopback_host(&headers(&[])));
    }

    #[test]
    fn only_same_origin_requests_may_change_things() {
        assert!(same_origin(&headers(&[("sec-fetch-site", "same-origin")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "cross-site")])));
        assert!(!same_origin(&headers(&[("sec-fetch-site", "same-site")])));
        // Sec-Fetch-Site wins over a matching Origin.
        assert!(!same_origin(&headers(&[
            ("sec-fetch-site", "cross-site"),
            ("origin", "http://127.0.0.1:9470"),
            ("host", "127.0.0.1:9470")
        ])));
        assert!(same_origin(&headers(&[
            ("origin", "http://127.0.0.1:9470"),
            ("host", "127.0.0.1:9470")
        ])));
        assert!(!same_origin(&headers(&[
            ("origin", "http://evil.example"),
            ("host", "127.0.0.1:9470")
        ])));
        assert!(!same_origin(&headers(&[("host", "127.0.0.1:9470")])));
    }
}
