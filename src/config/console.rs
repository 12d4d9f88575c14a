//! `[console]`: the web console (`effectively console`), which shows what waits (lag, parked
//! messages, the inbox, the outbox, notifications) and, when allowed, redrives, replays and
//! discards. It may share a file with the workers' `[[consumer]]`s, whose names it lists.
//!
//! The defaults are the safe ones: loopback only, no token needed there, read-only. A console
//! reachable from other machines must have a token; the check is at load, so `check-config`
//! refuses such a file before anyone starts it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::Secret;

/// `[console]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsoleConfig {
    /// Where it listens. Loopback by default; any other address needs a token.
    pub addr: SocketAddr,
    /// The variable that holds the access token (read when the console starts, never printed).
    pub token_env: Option<String>,
    /// A file that holds the access token (its first line), e.g. a mounted secret.
    pub token_file: Option<PathBuf>,
    /// Whether the actions (redrive, replay, discard, retry) are offered. Off: every POST is
    /// refused, whoever asks.
    pub writes: bool,
    /// JSON pointers into payloads (`"/card/number"`) whose values are shown as `***` on every
    /// page: the message page's text, JSON and hex views, the outbox's and notifications'
    /// payloads, and any error text that quotes the value.
    pub mask: Vec<String>,
    /// How often a page reloads itself (each page has a link to pause it); 0 turns it off.
    #[serde(with = "humantime_serde")]
    pub refresh: Duration,
    /// Rows per page of a list.
    pub page_size: usize,
    /// The database this console shows and acts on: a `[database.NAME]`; `None` is
    /// `[database]`. Its pages list the consumers on that database only (their ledgers,
    /// offsets, inbox and dead letters are there), beside that database's outbox,
    /// notifications and audit log; run one console per database (`effectively console
    /// --database NAME --addr ...`).
    pub database: Option<String>,
}

/// The console's default port: beside the workers' metrics (9464), the relay's (9474) and the
/// sender's (9484).
pub const DEFAULT_CONSOLE_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9470);

impl Default for ConsoleConfig {
    fn default() -> Self {
        ConsoleConfig {
            addr: DEFAULT_CONSOLE_ADDR,
            token_env: None,
            token_file: None,
            writes: false,
            mask: Vec::new(),
            refresh: Duration::from_secs(5),
            page_size: 50,
            database: None,
        }
    }
}

impl ConsoleConfig {
    /// What is wrong with it, if anything (one line each).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if let Err(e) = check_addr(self.addr, self.has_token()) {
            p.push(e);
        }
        if self.token_env.is_some() && self.token_file.is_some() {
            p.push("console: set token_env or token_file, not both".into());
        }
        for m in &self.mask {
            if !m.starts_with('/') {
                p.push(format!(
                    "console.mask {m:?} is not a JSON pointer (it must start with '/', e.g. \"/card/number\")"
                ));
            }
        }
        if !(1..=1000).contains(&self.page_size) {
            p.push("console.page_size must be between 1 and 1000".into());
        }
        p
    }

    /// Whether a token is configured (not whether it can be read: see [`ConsoleConfig::token`]).
    pub fn has_token(&self) -> bool {
        self.token_env.is_some() || self.token_file.is_some()
    }

    /// Reads the token from its variable or file. Read when the console starts rather than at
    /// load, so a worker that shares the file needs no access to the console's secret.
    pub fn token(&self) -> Result<Option<Secret>, String> {
        let value = match (&self.token_env, &self.token_file) {
            (Some(var), _) => std::env::var(var).map_err(|_| {
                format!("console.token_env: the variable {var} is not set (or not UTF-8)")
            })?,
            (None, Some(file)) => super::read_small(file)
                .map_err(|e| format!("console.token_file {}: {e}", file.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .to_string(),
            (None, None) => return Ok(None),
        };
        let value = value.trim();
        if value.len() < 16 {
            return Err(
                "the console token must be at least 16 characters (e.g. `openssl rand -hex 32`)"
                    .into(),
            );
        }
        Ok(Some(Secret::new(value)))
    }
}

/// Refuses a non-loopback address without a token: the console shows payloads and, with
/// `writes`, changes the database. Also used for `--addr`, which bypasses the file.
pub fn check_addr(addr: SocketAddr, has_token: bool) -> Result<(), String> {
    if addr.ip().is_loopback() || has_token {
        return Ok(());
    }
    Err(format!(
        "console.addr {addr} is not a loopback address: set console.token_env or \
         console.token_file (the console then asks every request for the token), or bind \
         127.0.0.1 and reach it through an SSH tunnel"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_loopback_read_only_and_valid() {
        let c = ConsoleConfig::default();
        assert!(c.addr.ip().is_loopback() && !c.writes);
        assert!(c.problems().is_empty());
        assert_eq!(c.token(), Ok(None));
    }

    #[test]
    fn a_public_address_needs_a_token() {
        let c: ConsoleConfig = toml::from_str("addr = \"0.0.0.0:9470\"").unwrap();
        let p = c.problems();
        assert!(p[0].contains("not a loopback address"), "{p:?}");
        let c: ConsoleConfig =
            toml::from_str("addr = \"0.0.0.0:9470\"\ntoken_env = \"CONSOLE_TOKEN\"").unwrap();
        assert!(c.problems().is_empty());
    }

    #[test]
    fn masks_are_pointers_and_tokens_are_long() {
        let c: ConsoleConfig = toml::from_str("mask = [\"card.number\"]").unwrap();
        assert!(c.problems()[0].contains("JSON pointer"));
        let dir = std::env::temp_dir().join(format!("console-token-{}", std::process::id()));
        std::fs::write(&dir, "short\n").unwrap();
        let c = ConsoleConfig {
            token_file: Some(dir.clone()),
            ..Default::default()
        };
        assert!(c.token().unwrap_err().contains("16 characters"));
        std::fs::write(&dir, "0123456789abcdef0123\nignored\n").unwrap();
        assert_eq!(c.token().unwrap().unwrap().expose(), "0123456789abcdef0123");
        let _ = std::fs::remove_file(dir);
    }
}
