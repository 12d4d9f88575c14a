//! `[tracing]`: OpenTelemetry traces of the batch transactions, the inbox rounds, the relay's
//! publishes and the sender's calls, exported with OTLP over HTTP (`crate::telemetry`). Off by
//! default: then nothing reads a `traceparent` header and no span is made.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::ConfigError;

/// `[tracing]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    /// Traces at all; overridden by `EFFECTIVELY_TRACING` (`true` or `false`).
    pub enabled: bool,
    /// The collector's OTLP/HTTP base URL; the exporter posts protobuf to `{endpoint}/v1/traces`.
    /// Overridden by `OTEL_EXPORTER_OTLP_ENDPOINT`, the variable every OpenTelemetry SDK reads.
    pub otlp_endpoint: String,
    /// The share of new traces kept, 0.0 to 1.0 (`ParentBased(TraceIdRatioBased)`): a span
    /// whose parent came in a `traceparent` header follows the parent's decision, so the ratio
    /// applies only where a trace starts here. Overridden by `OTEL_TRACES_SAMPLER_ARG`.
    pub sampling_ratio: Ratio,
    /// `service.name` of the spans; the relay and the sender add `-relay` and `-sender`.
    /// Overridden by `OTEL_SERVICE_NAME`.
    pub service_name: String,
    /// The longest one export (a POST of up to 512 spans) may take.
    #[serde(with = "humantime_serde")]
    pub export_timeout: Duration,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            enabled: false,
            otlp_endpoint: "http://127.0.0.1:4318".into(), // OTLP/HTTP's default port
            // OpenTelemetry's own default sampler (parentbased_always_on): a span is one
            // transaction, not one message, so keeping all of them is cheap (docs/PERFORMANCE.md).
            sampling_ratio: Ratio(1.0),
            service_name: "effectively".into(),
            export_timeout: Duration::from_secs(10), // OTEL_EXPORTER_OTLP_TIMEOUT's default
        }
    }
}

/// A share from 0.0 to 1.0. Compared by value, so a [`TracingConfig`] can sit in a
/// `PartialEq + Eq` config (a ratio is never NaN once [`TracingConfig::problems`] passed it).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct Ratio(pub f64);

impl Eq for Ratio {}

impl fmt::Display for Ratio {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl TracingConfig {
    /// Applies the environment overrides (`var` gives a variable's non-empty value).
    pub fn apply_env(&mut self, var: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        let env = |name: &str, reason: String| ConfigError::Env {
            name: name.into(),
            reason,
        };
        if let Some(v) = var("EFFECTIVELY_TRACING") {
            self.enabled = parse_bool(&v)
                .ok_or_else(|| env("EFFECTIVELY_TRACING", format!("{v:?} is not true or false")))?;
        }
        if let Some(v) = var("OTEL_EXPORTER_OTLP_ENDPOINT") {
            self.otlp_endpoint = v.trim().to_string();
        }
        if let Some(v) = var("OTEL_TRACES_SAMPLER_ARG") {
            let r = v.trim().parse::<f64>().map_err(|e| {
                env(
                    "OTEL_TRACES_SAMPLER_ARG",
                    format!("{v:?} is not a ratio: {e}"),
                )
            })?;
            self.sampling_ratio = Ratio(r);
        }
        if let Some(v) = var("OTEL_SERVICE_NAME") {
            self.service_name = v.trim().to_string();
        }
        Ok(())
    }

    /// What is wrong with it, if anything (one line each). Checked when off too, so a typo
    /// shows before the day tracing is turned on.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let r = self.sampling_ratio.0;
        if !(0.0..=1.0).contains(&r) {
            p.push(format!(
                "tracing.sampling_ratio ({r}) must be from 0.0 to 1.0"
            ));
        }
        if let Err(why) = check_endpoint(&self.otlp_endpoint) {
            p.push(format!(
                "tracing.otlp_endpoint {:?} {why}",
                self.otlp_endpoint
            ));
        }
        if self.service_name.trim().is_empty() {
            p.push("tracing.service_name must not be empty".into());
        }
        if self.export_timeout.is_zero() {
            p.push("tracing.export_timeout must be more than 0s".into());
        }
        p
    }

    /// Where the exporter posts: the base URL with OTLP's traces path.
    pub fn traces_url(&self) -> String {
        format!("{}/v1/traces", self.otlp_endpoint.trim_end_matches('/'))
    }
}

fn parse_bool(v: &str) -> Option<bool> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Some(true),
        "false" | "0" | "no" | "off" => Some(false),
        _ => None,
    }
}

/// An `http(s)://host[:port][/path]` URL without user info, query or fragment.
fn check_endpoint(url: &str) -> Result<(), &'static str> {
    let rest = (url.strip_prefix("http://"))
        .or_else(|| url.strip_prefix("https://"))
        .ok_or("must be an http:// or https:// URL (OTLP over HTTP)")?;
    let authority = rest.split('/').next().unwrap_or_default();
    if authority.is_empty() {
        return Err("has no host");
    }
    if authority.contains('@') || rest.contains(['?', '#']) || url.contains(char::is_whitespace) {
        return Err("must have no user, query, fragment or spaces");
    }
    if let Some((_, port)) = authority
        .rsplit_once(':')
        .filter(|_| !authority.ends_with(']'))
    {
        port.parse::<u16>()
            .map_err(|_| "has a port that is not a number")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> TracingConfig {
        toml::from_str(text).expect(text)
    }

    #[test]
    fn off_by_default_with_the_otlp_defaults() {
        let c = TracingConfig::default();
        assert!(!c.enabled);
        assert_eq!(c.traces_url(), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(c.sampling_ratio, Ratio(1.0));
        assert!(c.problems().is_empty());
        assert_eq!(parse(""), c);
    }

    #[test]
    fn a_section_parses_and_checks() {
        let c = parse(
            "enabled = true\notlp_endpoint = \"https://otel.example:4318/\"\n\
             sampling_ratio = 0.1\nservice_name = \"rewards\"\nexport_timeout = \"3s\"\n",
        );
        assert!(c.enabled);
        assert_eq!(c.traces_url(), "https://otel.example:4318/v1/traces");
        assert_eq!(c.sampling_ratio, Ratio(0.1));
        assert_eq!(c.export_timeout, Duration::from_secs(3));
        assert!(c.problems().is_empty(), "{:?}", c.problems());
        assert_eq!(parse("sampling_ratio = 1").sampling_ratio, Ratio(1.0));
        assert!(toml::from_str::<TracingConfig>("sample = 1").is_err());
    }

    #[test]
    fn bad_values_are_named() {
        let bad = |text: &str| parse(text).problems().join("; ");
        assert!(bad("sampling_ratio = 1.5").contains("sampling_ratio (1.5)"));
        assert!(bad("sampling_ratio = -0.1").contains("from 0.0 to 1.0"));
        assert!(bad("sampling_ratio = nan").contains("sampling_ratio"));
        assert!(bad("otlp_endpoint = \"127.0.0.1:4317\"").contains("http:// or https://"));
        assert!(bad("otlp_endpoint = \"http://\"").contains("no host"));
        assert!(bad("otlp_endpoint = \"http://h:x\"").contains("port"));
        assert!(bad("otlp_endpoint = \"http://u:pw@h\"").contains("no user"));
        assert!(bad("service_name = \" \"").contains("service_name"));
        assert!(bad("otlp_endpoint = \"http://[::1]:4318\"").is_empty());
    }

    #[test]
    fn the_example_configs_commented_section_parses_uncommented() {
        let text: String = (crate::config::EXAMPLE.lines())
            .skip_while(|l| *l != "# [tracing]")
            .skip(1)
            .map_while(|l| l.strip_prefix("# "))
            .map(|l| format!("{l}\n"))
            .collect();
        let c = parse(&text);
        assert!(c.enabled, "{text}");
        assert_eq!(c.otlp_endpoint, "http://127.0.0.1:4318");
        assert_eq!(
            TracingConfig {
                enabled: false,
                ..c
            },
            TracingConfig::default(),
            "the example shows the defaults"
        );
    }

    #[test]
    fn env_overrides() {
        let mut c = TracingConfig::default();
        let vars = [
            ("EFFECTIVELY_TRACING", "true"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://jaeger:4318"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_SERVICE_NAME", "rewards"),
        ];
        let lookup = |n: &str| vars.iter().find(|v| v.0 == n).map(|v| v.1.to_string());
        c.apply_env(lookup).unwrap();
        assert!(c.enabled);
        assert_eq!(c.otlp_endpoint, "http://jaeger:4318");
        assert_eq!(c.sampling_ratio, Ratio(0.25));
        assert_eq!(c.service_name, "rewards");
        let err = c
            .apply_env(|n| (n == "EFFECTIVELY_TRACING").then(|| "maybe".to_string()))
            .unwrap_err();
        assert!(matches!(err, ConfigError::Env { name, .. } if name == "EFFECTIVELY_TRACING"));
        let err = c
            .apply_env(|n| (n == "OTEL_TRACES_SAMPLER_ARG").then(|| "ten".to_string()))
            .unwrap_err();
        assert!(matches!(err, ConfigError::Env { name, .. } if name == "OTEL_TRACES_SAMPLER_ARG"));
    }
}
