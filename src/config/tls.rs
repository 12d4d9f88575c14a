//! `[database.tls]`: how the engine's PostgreSQL connections are encrypted and verified. The
//! modes are libpq's `sslmode` values with libpq's meaning, so that what an operator knows from
//! `psql` holds here, and a URL's `?sslmode=verify-full&sslrootcert=/etc/ca.pem` works too.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::Deserialize;

/// libpq's `sslmode`, without `allow` (plaintext first, then TLS: no use to anyone).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum TlsMode {
    /// Plaintext only.
    Disable,
    /// TLS if the server offers it, else plaintext; nothing verified (unless `ca_file` is
    /// set). libpq's and tokio-postgres's default, kept so that a URL that worked before still
    /// works; it defends against a passive listener only.
    #[default]
    Prefer,
    /// TLS or no connection; the certificate is not verified unless `ca_file` is set, in which
    /// case this is `verify-ca` (as libpq does when a root certificate is present).
    Require,
    /// TLS, and the server's certificate chain must lead to `ca_file`; any host name.
    VerifyCa,
    /// `verify-ca`, and the certificate must name the host the URL connects to. The mode for
    /// production.
    VerifyFull,
}

impl TlsMode {
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Disable => "disable",
            TlsMode::Prefer => "prefer",
            TlsMode::Require => "require",
            TlsMode::VerifyCa => "verify-ca",
            TlsMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TlsMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "disable" => TlsMode::Disable,
            "prefer" => TlsMode::Prefer,
            "require" => TlsMode::Require,
            "verify-ca" => TlsMode::VerifyCa,
            "verify-full" => TlsMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode {other:?}: expected disable, prefer, require, verify-ca or \
                     verify-full"
                ))
            }
        })
    }
}

/// `[database.tls]` as written. Both fields may instead come from the URL (`sslmode`,
/// `sslrootcert`); see [`TlsConfig::resolve`].
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// Default: the URL's `sslmode`, else `prefer`.
    pub mode: Option<TlsMode>,
    /// PEM file of the CA (or CAs) that signed the server's certificate.
    pub ca_file: Option<PathBuf>,
}

/// What a connection uses: [`TlsConfig`] merged with the URL's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tls {
    pub mode: TlsMode,
    pub ca_file: Option<PathBuf>,
}

impl TlsConfig {
    /// The settings a connection to `url` uses, and `url` without the `sslmode` and
    /// `sslrootcert` query parameters (tokio-postgres refuses `verify-*` and `sslrootcert`, so
    /// the engine reads them itself), from the `postgres://` form or a key/value string. The
    /// error names the key to fix.
    pub fn resolve(&self, url: &str) -> Result<(String, Tls), String> {
        let (url, url_mode, url_ca) = split_ssl_params(url)?;
        let mode = match (self.mode, url_mode) {
            (Some(c), Some(u)) if c != u => {
                return Err(format!(
                    "database.tls.mode is {c:?} but the database URL says sslmode={u}: set one \
                     of them",
                    c = c.as_str()
                ))
            }
            (c, u) => c.or(u).unwrap_or_default(),
        };
        let ca_file = match (&self.ca_file, url_ca) {
            (Some(c), Some(u)) if *c != u => {
                return Err(format!(
                    "database.tls.ca_file is {} but the database URL says sslrootcert={}: set \
                     one of them",
                    c.display(),
                    u.display()
                ))
            }
            (c, u) => c.clone().or(u),
        };
        match (mode, &ca_file) {
            (TlsMode::VerifyCa | TlsMode::VerifyFull, None) => Err(format!(
                "database.tls.mode = \"{mode}\" needs database.tls.ca_file (or the URL's \
                 sslrootcert): the PEM file of the CA that signed the server's certificate"
            )),
            (TlsMode::Disable, Some(f)) => Err(format!(
                "database.tls.ca_file ({}) is set but the TLS mode is \"disable\": nothing \
                 would be verified",
                f.display()
            )),
            _ => Ok((url, Tls { mode, ca_file })),
        }
    }
}

/// `url` without its `sslmode` and `sslrootcert` (unchanged if they are not understood), for
/// printing it.
pub fn without_tls_params(url: &str) -> String {
    split_ssl_params(url).map_or_else(|_| url.to_string(), |(url, _, _)| url)
}

/// Splits `sslmode` and `sslrootcert` off a `postgres://` URL's query, or off a libpq
/// key/value string (`host=h sslmode=verify-full`; a value quoted with spaces stays whole, as
/// long as it does not itself hold ` sslmode=`).
fn split_ssl_params(url: &str) -> Result<(String, Option<TlsMode>, Option<PathBuf>), String> {
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let (base, params, sep) = match url.split_once('?') {
        Some((base, query)) if is_url => (Some(base), query, '&'),
        None if is_url => return Ok((url.to_string(), None, None)),
        _ => (None, url, ' '),
    };
    let (mut mode, mut ca, mut kept) = (None, None, Vec::new());
    for param in params.split(sep) {
        let value = |v: &str| {
            let v = v.trim_matches('\'');
            if is_url {
                percent_decode(v)
            } else {
                v.to_string()
            }
        };
        match param.split_once('=') {
            Some(("sslmode", v)) => mode = Some(value(v).parse()?),
            Some(("sslrootcert", v)) => ca = Some(PathBuf::from(value(v))),
            _ => kept.push(param),
        }
    }
    let rest = kept.join(&sep.to_string());
    let url = match base {
        Some(base) if rest.is_empty() => base.to_string(),
        Some(base) => format!("{base}?{rest}"),
        None => rest,
    };
    Ok((url, mode, ca))
}

/// `%2F` and the like, as tokio-postgres decodes the other parameters; an invalid escape is
/// kept as written.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let (mut out, mut i) = (Vec::with_capacity(bytes.len()), 0);
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match hex
            .filter(|_| bytes[i] == b'%')
            .map(|h| u8::from_str_radix(h, 16))
        {
            Some(Ok(b)) => {
                out.push(b);
                i += 3;
            }
            _ => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tls(mode: Option<TlsMode>, ca: Option<&str>) -> TlsConfig {
        TlsConfig {
            mode,
            ca_file: ca.map(PathBuf::from),
        }
    }

    #[test]
    fn the_default_is_prefer_like_libpq() {
        let (url, t) = TlsConfig::default().resolve("postgres://u@h/db").unwrap();
        assert_eq!(url, "postgres://u@h/db");
        assert_eq!(t.mode, TlsMode::Prefer);
        assert_eq!(t.ca_file, None);
    }

    #[test]
    fn the_url_parameters_are_read_and_removed() {
        let (url, t) = TlsConfig::default()
            .resolve("postgres://u:pw@h/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&x=1")
            .unwrap();
        assert_eq!(url, "postgres://u:pw@h/db?x=1");
        assert_eq!(t.mode, TlsMode::VerifyFull);
        assert_eq!(t.ca_file, Some(PathBuf::from("/etc/ca.pem")));
        let (url, _) = TlsConfig::default()
            .resolve("postgresql://h/db?sslmode=require")
            .unwrap();
        assert_eq!(url, "postgresql://h/db");
    }

    #[test]
    fn config_and_url_must_agree() {
        let c = tls(Some(TlsMode::VerifyFull), Some("/ca.pem"));
        let err = c.resolve("postgres://h/db?sslmode=require").unwrap_err();
        assert!(err.contains("sslmode=require"), "{err}");
        assert!(c.resolve("postgres://h/db?sslmode=verify-full").is_ok());
        let err = c
            .resolve("postgres://h/db?sslrootcert=/other.pem")
            .unwrap_err();
        assert!(err.contains("sslrootcert=/other.pem"), "{err}");
    }

    #[test]
    fn verification_needs_a_ca_and_disable_refuses_one() {
        for mode in [TlsMode::VerifyCa, TlsMode::VerifyFull] {
            let err = tls(Some(mode), None)
                .resolve("postgres://h/db")
                .unwrap_err();
            assert!(err.contains("needs database.tls.ca_file"), "{err}");
        }
        let err = tls(Some(TlsMode::Disable), Some("/ca.pem"))
            .resolve("postgres://h/db")
            .unwrap_err();
        assert!(err.contains("\"disable\""), "{err}");
        let err = TlsConfig::default()
            .resolve("postgres://h/db?sslmode=verify-ca")
            .unwrap_err();
        assert!(err.contains("needs database.tls.ca_file"), "{err}");
    }

    #[test]
    fn an_unknown_sslmode_is_named() {
        let err = TlsConfig::default()
            .resolve("postgres://h/db?sslmode=allow")
            .unwrap_err();
        assert!(err.contains("\"allow\""), "{err}");
    }

    #[test]
    fn key_value_strings_are_read_too() {
        let kv = "host=h sslmode=verify-full password='a b?c' sslrootcert='/etc/ca.pem'";
        let (url, t) = TlsConfig::default().resolve(kv).unwrap();
        assert_eq!(url, "host=h password='a b?c'");
        assert_eq!(t.mode, TlsMode::VerifyFull);
        assert_eq!(t.ca_file, Some(PathBuf::from("/etc/ca.pem")));
        let (url, t) = TlsConfig::default().resolve("host=h  dbname=x").unwrap();
        assert_eq!(url, "host=h  dbname=x");
        assert_eq!(t.mode, TlsMode::Prefer);
    }
}

#[cfg(test)]
mod config_tests {
    use std::path::PathBuf;

    use crate::config::{Config, ConfigError, TlsMode};

    const CONSUMER: &str = "[[consumer]]\nname = \"r\"\ntopics = [\"p\"]\n\
                            handler = { kind = \"cashback\", rate_bp = 200 }\n";

    fn load(database: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(&format!("[database]\n{database}\n{CONSUMER}"))
    }

    #[test]
    fn the_database_section_reads_tls_inline_or_as_a_table() {
        let inline = load("tls = { mode = \"verify-full\", ca_file = \"/etc/ca.pem\" }").unwrap();
        let table = Config::from_toml_str(&format!(
            "[database.tls]\nmode = \"verify-full\"\nca_file = \"/etc/ca.pem\"\n{CONSUMER}"
        ))
        .unwrap();
        for c in [inline, table] {
            assert_eq!(c.database.default.tls.mode, Some(TlsMode::VerifyFull));
            assert_eq!(
                c.database.default.tls.ca_file,
                Some(PathBuf::from("/etc/ca.pem"))
            );
        }
        assert_eq!(load("").unwrap().database.default.tls.mode, None);
    }

    #[test]
    fn check_config_refuses_what_cannot_connect() {
        let Err(ConfigError::Invalid(msg)) = load("tls = { mode = \"verify-ca\" }") else {
            panic!("verify-ca without a CA file must be refused");
        };
        assert!(msg.contains("needs database.tls.ca_file"), "{msg}");
        let url = "url = \"postgres://u:pw@h/db?sslmode=require\"\ntls = { mode = \"disable\" }";
        let Err(ConfigError::Invalid(msg)) = load(url) else {
            panic!("a URL and a config that disagree must be refused");
        };
        assert!(
            msg.contains("sslmode=require") && !msg.contains("pw"),
            "{msg}"
        );
        assert!(load("tls = { mode = \"allow\" }").is_err());
        assert!(load("tls = { mode = \"require\", cafile = \"x\" }").is_err());
    }
}
