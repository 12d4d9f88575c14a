//! `[kafka.tls]` and `[kafka.sasl]`: how the engine authenticates to the brokers and encrypts
//! the connection, as typed fields that map to librdkafka's properties:
//!
//! | fields | `security.protocol` |
//! |---|---|
//! | neither | `plaintext` |
//! | `[kafka.tls]` | `ssl` |
//! | `[kafka.sasl]` | `sasl_plaintext` |
//! | both | `sasl_ssl` |
//!
//! The password is never in the file: `password_env` names an environment variable, or
//! `password_file` a file (its content, one trailing newline dropped). It is read when the
//! config is checked (a missing one fails at start) and each time a client is built, and it is
//! redacted wherever the config is printed.

use std::fmt;
use std::path::PathBuf;

use serde::Deserialize;

use super::read_secret;

/// `[kafka.tls]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaTls {
    /// The CA certificates (PEM) the brokers' certificates must chain to; `None`: the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// A client certificate (PEM), for brokers that require one (`ssl.client.auth=required`).
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM, unencrypted).
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// Check that the broker's certificate names the host connected to (librdkafka's
    /// `ssl.endpoint.identification.algorithm = https`). Default true.
    #[serde(default = "yes")]
    pub verify_hostname: bool,
}

fn yes() -> bool {
    true
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum SaslMechanism {
    #[serde(rename = "PLAIN")]
    Plain,
    #[serde(rename = "SCRAM-SHA-256")]
    ScramSha256,
    #[serde(rename = "SCRAM-SHA-512")]
    ScramSha512,
}

impl SaslMechanism {
    pub fn as_librdkafka(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
}

/// `[kafka.sasl]`. `Debug` shows where the password comes from, never the password.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaSasl {
    pub mechanism: SaslMechanism,
    pub username: String,
    /// The environment variable holding the password.
    #[serde(default)]
    pub password_env: Option<String>,
    /// The file holding the password.
    #[serde(default)]
    pub password_file: Option<PathBuf>,
}

/// A password, redacted in `Debug` and `Display`.
pub struct Password(String);

impl Password {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Password {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

impl KafkaSasl {
    /// Reads the password from its variable or file.
    pub fn password(&self) -> Result<Password, String> {
        match (&self.password_env, &self.password_file) {
            (Some(_), None) | (None, Some(_)) => {
                let p = read_secret(
                    "kafka.sasl.password",
                    &self.password_env,
                    &self.password_file,
                )?;
                Ok(Password(p.expect("one source is set")))
            }
            _ => Err(
                "kafka.sasl needs exactly one of password_env and password_file (the \
                      password itself never goes in the file)"
                    .into(),
            ),
        }
    }
}

/// The protocol both sections amount to, as librdkafka spells it.
pub fn protocol(tls: Option<&KafkaTls>, sasl: Option<&KafkaSasl>) -> &'static str {
    match (tls.is_some(), sasl.is_some()) {
        (false, false) => "plaintext",
        (true, false) => "ssl",
        (false, true) => "sasl_plaintext",
        (true, true) => "sasl_ssl",
    }
}

/// librdkafka's properties for both sections (`security.protocol` always). The password, when
/// there is one, is the last pair's value.
pub fn properties(
    tls: Option<&KafkaTls>,
    sasl: Option<&KafkaSasl>,
) -> Result<Vec<(&'static str, String)>, String> {
    let mut out = vec![("security.protocol", protocol(tls, sasl).to_string())];
    if let Some(t) = tls {
        let file = |p: &PathBuf, field: &str| -> Result<String, String> {
            if !p.is_file() {
                return Err(format!("kafka.tls.{field} {}: no such file", p.display()));
            }
            Ok(p.display().to_string())
        };
        if let Some(ca) = &t.ca_file {
            out.push(("ssl.ca.location", file(ca, "ca_file")?));
        }
        match (&t.cert_file, &t.key_file) {
            (Some(c), Some(k)) => {
                out.push(("ssl.certificate.location", file(c, "cert_file")?));
                out.push(("ssl.key.location", file(k, "key_file")?));
            }
            (None, None) => {}
            _ => return Err("kafka.tls: cert_file and key_file go together".into()),
        }
        let check = if t.verify_hostname { "https" } else { "none" };
        out.push(("ssl.endpoint.identification.algorithm", check.into()));
    }
    if let Some(s) = sasl {
        out.push(("sasl.mechanisms", s.mechanism.as_librdkafka().into()));
        out.push(("sasl.username", s.username.clone()));
        out.push(("sasl.password", s.password()?.0));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sasl(toml_text: &str) -> KafkaSasl {
        toml::from_str(toml_text).unwrap()
    }

    #[test]
    fn the_sections_pick_the_protocol() {
        let tls: KafkaTls = toml::from_str("").unwrap();
        assert!(tls.verify_hostname);
        let s = sasl("mechanism = \"SCRAM-SHA-512\"\nusername = \"u\"\npassword_env = \"X\"");
        assert_eq!(protocol(None, None), "plaintext");
        assert_eq!(protocol(Some(&tls), None), "ssl");
        assert_eq!(protocol(None, Some(&s)), "sasl_plaintext");
        assert_eq!(protocol(Some(&tls), Some(&s)), "sasl_ssl");
    }

    #[test]
    fn the_password_comes_from_a_file_and_is_never_printed() {
        let dir = std::env::temp_dir().join(format!("kafka-sasl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("password");
        std::fs::write(&file, "s3cret-pw\n").unwrap();
        let s = sasl(&format!(
            "mechanism = \"PLAIN\"\nusername = \"u\"\npassword_file = {:?}",
            file.display().to_string()
        ));
        let p = s.password().unwrap();
        assert_eq!(p.expose(), "s3cret-pw");
        assert_eq!(format!("{p:?}"), "***");
        assert!(!format!("{s:?}").contains("s3cret-pw"));
        let props = properties(None, Some(&s)).unwrap();
        assert_eq!(
            props.last().unwrap(),
            &("sasl.password", "s3cret-pw".into())
        );
    }

    #[test]
    fn missing_or_double_passwords_and_files_are_refused() {
        let none = sasl("mechanism = \"PLAIN\"\nusername = \"u\"");
        assert!(none.password().unwrap_err().contains("exactly one"));
        let unset = sasl(
            "mechanism = \"PLAIN\"\nusername = \"u\"\npassword_env = \"EFFECTIVELY_TEST_UNSET_PW\"",
        );
        assert!(unset
            .password()
            .unwrap_err()
            .contains("EFFECTIVELY_TEST_UNSET_PW"));
        let tls: KafkaTls = toml::from_str("ca_file = \"/nonexistent/ca.pem\"").unwrap();
        assert!(properties(Some(&tls), None)
            .unwrap_err()
            .contains("ca_file"));
        let half: KafkaTls = toml::from_str("cert_file = \"/etc/hostname\"").unwrap();
        assert!(properties(Some(&half), None)
            .unwrap_err()
            .contains("together"));
        assert!(toml::from_str::<KafkaSasl>("mechanism = \"GSSAPI\"\nusername = \"u\"").is_err());
    }
}
