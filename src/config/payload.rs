//! `[consumer.payload]`: how a consumer's record values (and, when asked, keys) are encoded.
//!
//! `json` (the default) reads the bytes as they are. `avro`, `protobuf` and `json-schema` read
//! the Confluent wire format (magic byte 0, the 4-byte schema id, Protobuf's message indexes)
//! with the writer's schema fetched by id from a Confluent-compatible Schema Registry
//! (`registry`), and turn the record into the JSON object every handler already reads (see
//! `crate::envelope::format`).
//!
//! Credentials never go in the file: a password or bearer token comes from an environment
//! variable (`*_env`) or a file (`*_file`), like `[kafka.sasl]`'s password.

use super::*;

/// How a record's value or key is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PayloadFormat {
    /// JSON as it is on the wire (no registry).
    #[default]
    Json,
    /// Avro in the Confluent wire format.
    Avro,
    /// Protobuf in the Confluent wire format (with its message-index list).
    Protobuf,
    /// JSON validated against a JSON Schema, in the Confluent wire format.
    JsonSchema,
}

impl PayloadFormat {
    pub fn as_str(&self) -> &'static str {
        match self {
            PayloadFormat::Json => "json",
            PayloadFormat::Avro => "avro",
            PayloadFormat::Protobuf => "protobuf",
            PayloadFormat::JsonSchema => "json-schema",
        }
    }

    /// Whether records of this format carry a schema id to look up.
    pub fn uses_registry(&self) -> bool {
        !matches!(self, PayloadFormat::Json)
    }
}

/// `[consumer.payload]` (or `payload = { format = "avro", registry = "..." }`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PayloadConfig {
    #[serde(default)]
    pub format: PayloadFormat,
    /// Decode the record key too (its JSON text is then what handlers see as the key);
    /// `None`: the key stays the bytes it is.
    #[serde(default)]
    pub key_format: Option<PayloadFormat>,
    /// The registry's Confluent-compatible base URL, for example Apicurio's
    /// `http://registry:8080/apis/ccompat/v7` or Confluent's `http://registry:8081`.
    #[serde(default)]
    pub registry: Option<String>,
    /// HTTP Basic authentication: the user, with `password_env` or `password_file`.
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub password_env: Option<String>,
    #[serde(default)]
    pub password_file: Option<PathBuf>,
    /// A bearer token instead of Basic authentication.
    #[serde(default)]
    pub token_env: Option<String>,
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// A PEM file of the CA that signed the registry's certificate (an `https://` registry
    /// whose CA the system roots lack).
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// How many schemas one process keeps (ids are immutable, so an entry never goes stale;
    /// the bound only caps memory against a stream of distinct ids). Default 1,000.
    #[serde(default = "default_cache_capacity")]
    pub cache_capacity: usize,
    /// How long one registry request may take before it counts as the registry not answering.
    /// Default 10 s.
    #[serde(default = "default_registry_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// `json-schema`: check each record against its schema (default true); off, the schema id
    /// is still looked up, so an id the registry does not know is parked.
    #[serde(default = "default_true")]
    pub validate: bool,
}

fn default_cache_capacity() -> usize {
    1_000
}
fn default_registry_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_true() -> bool {
    true
}

impl Default for PayloadConfig {
    fn default() -> Self {
        PayloadConfig {
            format: PayloadFormat::Json,
            key_format: None,
            registry: None,
            username: None,
            password_env: None,
            password_file: None,
            token_env: None,
            token_file: None,
            ca_file: None,
            cache_capacity: default_cache_capacity(),
            timeout: default_registry_timeout(),
            validate: true,
        }
    }
}

/// How the engine authenticates to the registry, read when the decoder is built. `Debug`
/// never shows the secret.
pub enum RegistryAuth {
    None,
    Basic { username: String, password: String },
    Bearer(String),
}

impl fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RegistryAuth::None => f.write_str("None"),
            RegistryAuth::Basic { username, .. } => write!(f, "Basic({username}, ***)"),
            RegistryAuth::Bearer(_) => f.write_str("Bearer(***)"),
        }
    }
}

impl PayloadConfig {
    /// Whether any part of a record goes through the registry.
    pub fn uses_registry(&self) -> bool {
        self.format.uses_registry() || self.key_format.is_some_and(|k| k.uses_registry())
    }

    /// Reads the credentials from their variables or files.
    pub fn auth(&self) -> Result<RegistryAuth, String> {
        let token = read_secret("payload.token", &self.token_env, &self.token_file)?;
        let password = read_secret("payload.password", &self.password_env, &self.password_file)?;
        match (&self.username, password, token) {
            (None, None, None) => Ok(RegistryAuth::None),
            (None, None, Some(t)) => Ok(RegistryAuth::Bearer(t)),
            (Some(u), Some(p), None) => Ok(RegistryAuth::Basic {
                username: u.clone(),
                password: p,
            }),
            (Some(_), None, None) => {
                Err("payload.username needs password_env or password_file".into())
            }
            (None, Some(_), _) => Err("payload.password_* needs payload.username".into()),
            (Some(_), _, Some(_)) => Err(
                "payload: use either username with a password (Basic) or a token (Bearer), not both"
                    .into(),
            ),
        }
    }

    /// The section's problems, without the `consumer "name": ` prefix.
    pub(super) fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        match &self.registry {
            None if self.uses_registry() => p.push(format!(
                "payload.format = \"{}\"{} reads the Confluent wire format and needs \
                 payload.registry, the Schema Registry's URL",
                self.format.as_str(),
                match self.key_format {
                    Some(k) if k.uses_registry() =>
                        format!(" (or key_format = \"{}\")", k.as_str()),
                    _ => String::new(),
                }
            )),
            Some(url) if !(url.starts_with("http://") || url.starts_with("https://")) => p.push(
                format!("payload.registry {url:?} must be an http:// or https:// URL"),
            ),
            _ => {}
        }
        if self.password_env.is_some() && self.password_file.is_some() {
            p.push("payload: password_env and password_file exclude each other".into());
        }
        if self.token_env.is_some() && self.token_file.is_some() {
            p.push("payload: token_env and token_file exclude each other".into());
        }
        let has_password = self.password_env.is_some() || self.password_file.is_some();
        let has_token = self.token_env.is_some() || self.token_file.is_some();
        if has_token && (self.username.is_some() || has_password) {
            p.push("payload: use either username with a password (Basic) or a token (Bearer), not both".into());
        }
        if self.username.is_some() != has_password && !has_token {
            p.push("payload: username and password_env/password_file go together".into());
        }
        if self.cache_capacity < 1 {
            p.push("payload.cache_capacity must be at least 1".into());
        }
        if self.timeout.is_zero() {
            p.push("payload.timeout must be more than 0".into());
        }
        p
    }
}
