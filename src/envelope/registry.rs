//! The Schema Registry client: a writer's schema by id from a Confluent-compatible registry
//! (Confluent's own, Apicurio's `/apis/ccompat/v7`, Redpanda's, Karapace), compiled once and
//! kept for the process's life.
//!
//! A registry never changes what an id means, so a compiled schema never goes stale: the cache
//! is bounded (an arbitrary entry leaves when it is full) only against a stream of distinct
//! ids. One request per id: partition tasks that meet a new id together wait for the first
//! one's answer. What each answer means for the record:
//! - the schema: decode with it;
//! - 404 (the id, or a schema it references, is not there): bad input, the record is parked;
//!   remembered for [`UNKNOWN_FOR`], so a burst of such records costs one request;
//! - a schema that does not compile: bad input, parked, remembered like a schema;
//! - no answer, a 5xx, 429, or an authentication error: the registry is unavailable. The
//!   caller retries with backoff and never parks (a good record must not become a dead letter
//!   because the registry was down).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::format::{Compiled, Kind, Reference, SchemaText};
use crate::config::{PayloadConfig, RegistryAuth};

/// How long a 404 is believed before the registry is asked again (a schema registered just
/// after its first record was produced).
pub const UNKNOWN_FOR: Duration = Duration::from_secs(30);

/// How deep references may nest (a cycle would otherwise never end).
const MAX_DEPTH: usize = 16;

/// What became of a schema id.
#[derive(Debug, Clone)]
pub enum Lookup {
    Found(Arc<Compiled>),
    /// Bad input: the registry does not have it (404), or its schema cannot be used.
    Refused(String),
}

/// The registry could not answer now: retry, never park.
#[derive(Debug, Clone, thiserror::Error)]
#[error("schema registry {url} unavailable: {reason}")]
pub struct Unavailable {
    pub url: String,
    pub reason: String,
}

enum Entry {
    Found(Arc<Compiled>),
    Invalid(String),
    Unknown { reason: String, at: Instant },
}

pub struct Registry {
    base: String,
    http: reqwest::Client,
    auth: RegistryAuth,
    validate: bool,
    capacity: usize,
    cache: Mutex<HashMap<u32, Entry>>,
    /// One lock per id being fetched, so concurrent tasks make one request.
    fetching: Mutex<HashMap<u32, Arc<tokio::sync::Mutex<()>>>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("base", &self.base)
            .finish()
    }
}

#[derive(Deserialize)]
struct SchemaJson {
    schema: String,
    #[serde(default, rename = "schemaType")]
    schema_type: Option<String>,
    #[serde(default)]
    references: Vec<ReferenceJson>,
}

#[derive(Deserialize)]
struct ReferenceJson {
    name: String,
    subject: String,
    version: i64,
}

/// A failed request: the registry lacks it, or could not answer.
enum Failure {
    NotFound(String),
    Unavailable(String),
}

impl Registry {
    /// The process's client for this registry and these settings: consumers reading one
    /// registry share its cache, so each id is fetched once per process.
    pub fn shared(config: &PayloadConfig) -> Result<Arc<Registry>, String> {
        static ALL: OnceLock<Mutex<HashMap<String, Arc<Registry>>>> = OnceLock::new();
        let url = config
            .registry
            .as_deref()
            .ok_or("payload.registry is not set")?;
        let key = format!(
            "{url}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}",
            config.username,
            config.timeout,
            config.password_env,
            config.password_file,
            config.ca_file,
            config.validate,
            config.cache_capacity,
            config.token_env,
            config.token_file,
        );
        let mut all = ALL
            .get_or_init(Default::default)
            .lock()
            .expect("registry map");
        if let Some(r) = all.get(&key) {
            return Ok(Arc::clone(r));
        }
        let r = Arc::new(Registry::new(config)?);
        all.insert(key, Arc::clone(&r));
        Ok(r)
    }

    pub fn new(config: &PayloadConfig) -> Result<Registry, String> {
        let url = config
            .registry
            .as_deref()
            .ok_or("payload.registry is not set")?;
        let mut http = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(5)));
        if let Some(ca) = &config.ca_file {
            let pem =
                std::fs::read(ca).map_err(|e| format!("payload.ca_file {}: {e}", ca.display()))?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .map_err(|e| format!("payload.ca_file {}: {e}", ca.display()))?;
            http = http.add_root_certificate(cert);
        }
        Ok(Registry {
            base: url.trim_end_matches('/').to_string(),
            http: http
                .build()
                .map_err(|e| format!("the registry's HTTP client: {e}"))?,
            auth: config.auth()?,
            validate: config.validate,
            capacity: config.cache_capacity.max(1),
            cache: Mutex::new(HashMap::new()),
            fetching: Mutex::new(HashMap::new()),
        })
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// The id's schema if it is known already (found, refused, or a 404 still believed);
    /// `None`: ask [`Registry::fetch`].
    pub fn cached(&self, id: u32) -> Option<Lookup> {
        let cache = self.cache.lock().expect("registry cache");
        match cache.get(&id)? {
            Entry::Found(c) => Some(Lookup::Found(Arc::clone(c))),
            Entry::Invalid(reason) => Some(Lookup::Refused(reason.clone())),
            Entry::Unknown { reason, at } if at.elapsed() < UNKNOWN_FOR => {
                Some(Lookup::Refused(reason.clone()))
            }
            Entry::Unknown { .. } => None,
        }
    }

    /// Fetches and compiles the id's schema (once per process, whoever asks), and caches the
    /// verdict.
    pub async fn fetch(&self, id: u32) -> Result<Lookup, Unavailable> {
        let lock = {
            let mut f = self.fetching.lock().expect("registry fetches");
            Arc::clone(f.entry(id).or_default())
        };
        let _one = lock.lock().await;
        if let Some(l) = self.cached(id) {
            return Ok(l);
        }
        let entry = match self.schema_text(id).await {
            Ok(text) => match Compiled::compile(&text, self.validate) {
                Ok(c) => Entry::Found(Arc::new(c)),
                Err(e) => Entry::Invalid(format!("schema id {id} ({}): {e}", text.kind.as_str())),
            },
            Err(Failure::NotFound(what)) => Entry::Unknown {
                reason: format!(
                    "schema id {id} is not in the registry {}: {what}",
                    self.base
                ),
                at: Instant::now(),
            },
            Err(Failure::Unavailable(reason)) => {
                self.fetching.lock().expect("registry fetches").remove(&id);
                return Err(Unavailable {
                    url: self.base.clone(),
                    reason,
                });
            }
        };
        let lookup = match &entry {
            Entry::Found(c) => Lookup::Found(Arc::clone(c)),
            Entry::Invalid(r) | Entry::Unknown { reason: r, .. } => Lookup::Refused(r.clone()),
        };
        let mut cache = self.cache.lock().expect("registry cache");
        if cache.len() >= self.capacity && !cache.contains_key(&id) {
            if let Some(&evict) = cache.keys().next() {
                cache.remove(&evict);
            }
        }
        cache.insert(id, entry);
        drop(cache);
        self.fetching.lock().expect("registry fetches").remove(&id);
        Ok(lookup)
    }

    /// The schema of `id` and everything it references, dependencies first.
    async fn schema_text(&self, id: u32) -> Result<SchemaText, Failure> {
        let root: SchemaJson = self.get(&format!("/schemas/ids/{id}")).await?;
        let kind = Kind::from_registry(root.schema_type.as_deref()).map_err(|e| {
            // An unknown schemaType is this record's problem, like an unknown id.
            Failure::NotFound(e)
        })?;
        let mut references = Vec::new();
        let mut seen = Vec::new();
        self.references(&root.references, 0, &mut references, &mut seen)
            .await?;
        Ok(SchemaText {
            kind,
            text: root.schema,
            references,
        })
    }

    /// Resolves references depth first, so a schema's dependencies come before it.
    async fn references(
        &self,
        refs: &[ReferenceJson],
        depth: usize,
        out: &mut Vec<Reference>,
        seen: &mut Vec<(String, i64)>,
    ) -> Result<(), Failure> {
        if depth > MAX_DEPTH {
            return Err(Failure::NotFound(format!(
                "references nest deeper than {MAX_DEPTH} (a cycle?)"
            )));
        }
        for r in refs {
            let key = (r.subject.clone(), r.version);
            if seen.contains(&key) {
                continue;
            }
            seen.push(key);
            let path = format!("/subjects/{}/versions/{}", urlencode(&r.subject), r.version);
            let s: SchemaJson = self.get(&path).await?;
            Box::pin(self.references(&s.references, depth + 1, out, seen)).await?;
            out.push(Reference {
                name: r.name.clone(),
                text: s.schema,
            });
        }
        Ok(())
    }

    async fn get<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, Failure> {
        let url = format!("{}{path}", self.base);
        let mut req = self.http.get(&url).header(
            "Accept",
            "application/vnd.schemaregistry.v1+json, application/json",
        );
        req = match &self.auth {
            RegistryAuth::None => req,
            RegistryAuth::Basic { username, password } => req.basic_auth(username, Some(password)),
            RegistryAuth::Bearer(token) => req.bearer_auth(token),
        };
        let resp = req
            .send()
            .await
            .map_err(|e| Failure::Unavailable(format!("GET {path}: {e}")))?;
        let status = resp.status();
        if status == reqwest::StatusCode::NOT_FOUND {
            let body = resp.text().await.unwrap_or_default();
            return Err(Failure::NotFound(format!(
                "GET {path} answered 404 {}",
                body.chars().take(200).collect::<String>()
            )));
        }
        if !status.is_success() {
            // 5xx and 429 are the registry's trouble; 401/403 a credential to fix; any other
            // 4xx a registry that is not the one configured. None of them is the record's fault.
            return Err(Failure::Unavailable(format!(
                "GET {path} answered {status}"
            )));
        }
        resp.json::<T>()
            .await
            .map_err(|e| Failure::Unavailable(format!("GET {path}: unreadable answer: {e}")))
    }
}

/// What stays as it is in a URL component: RFC 3986's unreserved characters.
const UNRESERVED: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'_')
    .remove(b'.')
    .remove(b'~');

/// Percent-encodes a subject name for a URL path (subjects may hold `/`, `:` and spaces).
fn urlencode(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, UNRESERVED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects_are_escaped_in_paths() {
        assert_eq!(urlencode("payments-value"), "payments-value");
        assert_eq!(urlencode("a/b c:d"), "a%2Fb%20c%3Ad");
    }

    #[tokio::test]
    async fn a_registry_that_does_not_answer_is_unavailable_not_a_verdict() {
        let config = PayloadConfig {
            format: crate::config::PayloadFormat::Avro,
            // A port nothing listens on (the discard port, closed on these machines).
            registry: Some("http://127.0.0.1:9/apis/ccompat/v7".into()),
            timeout: Duration::from_secs(2),
            ..PayloadConfig::default()
        };
        let r = Registry::new(&config).unwrap();
        let e = r.fetch(7).await.unwrap_err();
        assert!(e.reason.contains("/schemas/ids/7"), "{e}");
        assert!(r.cached(7).is_none(), "unavailability must not be cached");
    }
}
