//! The notification sender (`effectively send -c FILE`): delivers the intents handlers record in
//! `notifications` (an SMS per cashback credit) to providers outside the database.
//!
//! A provider call cannot join a transaction, so exactly once needs the provider's help: every
//! call carries an idempotency key derived from the event (`sms:<event id>`), and a provider
//! that honours keys the way Stripe's API does performs the effect once per key and answers a
//! repeated call from its record. A notification goes PENDING -> SENDING (claimed, committed,
//! then the call) -> SENT with the provider's id. What each answer means:
//!
//! - **2xx**: sent (or a replay of the first answer: the same id); SENT.
//! - **no answer** (timeout, connection lost): unknown; the same key again after a backoff.
//! - **409**: a call with this key is still in flight at the provider; again later.
//! - **5xx**: the provider saved a failure under the key and will replay it. With `lookup`, the
//!   sender asks whether anything was sent under it: yes, SENT with that id; no, the key is
//!   spent and the next attempt uses the next key (`sms:<event id>#1`). Without `lookup` the
//!   same key is tried until `retry.max_attempts`, then FAILED.
//! - **400 idempotency error** (the key was used with other parameters: the payload changed,
//!   a bug) and other 4xx: FAILED at once.
//!
//! A sender that dies between the call and recording its outcome leaves the row SENDING; after
//! `sending_timeout` another sender takes it over as **interrupted**: with `lookup` it asks the
//! provider (and records SENT without a second call if it went out); otherwise the channel's
//! `on_interrupted` decides: `resend` (same key: once with a key-honouring provider) or `skip`
//! (at most once). Past `retry.max_attempts` a notification is FAILED, and alerted on.

use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use crate::config::{
    ChannelConfig, Config, DatabaseConfig, OnInterrupted, SenderConfig, DEFAULT_DATABASE,
};
use crate::health::Health;
use crate::metrics::NotificationOutcome as Outcome;
use crate::store::notifications::{self, Claimed, Finish};
use crate::store::{pool, StoreError};

/// Why the sender could not start, or a round failed.
#[derive(Debug, thiserror::Error)]
pub enum SenderError {
    #[error("this config has no [sender] section")]
    NotConfigured,
    #[error("http client: {0}")]
    Http(#[from] reqwest::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::TelemetryError),
}

impl From<deadpool_postgres::PoolError> for SenderError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        SenderError::Store(e.into())
    }
}

/// One sender: a connection pool and an HTTP client.
pub struct Sender {
    config: SenderConfig,
    channels: Vec<String>,
    pool: Pool,
    http: reqwest::Client,
    /// For the readiness probe, on a connection of its own: the name and settings of the
    /// database whose notifications this sender works.
    database: (String, DatabaseConfig),
    health: std::sync::Arc<Health>,
}

impl Sender {
    pub fn new(config: &Config) -> Result<Sender, SenderError> {
        let sender = config.sender.clone().ok_or(SenderError::NotConfigured)?;
        crate::telemetry::install(&config.tracing, crate::telemetry::Component::Sender)?;
        let name = sender.database.as_deref().unwrap_or(DEFAULT_DATABASE);
        let db = (config.database.get(Some(name))).map_err(pool::PoolError::Unknown)?;
        let opts = pool::PoolOptions {
            size: 4,
            ..pool::PoolOptions::of(db)
        };
        Ok(Sender {
            channels: sender.channels.keys().cloned().collect(),
            http: reqwest::Client::builder()
                .timeout(sender.request_timeout)
                .build()?,
            pool: pool::build_for(db, &opts)?,
            database: (name.to_string(), db.clone()),
            config: sender,
            health: Health::new(),
        })
    }

    /// The sender's liveness and readiness (PostgreSQL reachable), for `/healthz` and `/readyz`.
    pub fn health(&self) -> std::sync::Arc<Health> {
        std::sync::Arc::clone(&self.health)
    }

    /// The longest gap between two rounds' starts when nothing is wrong: the longest wait (the
    /// poll interval or the longest backoff), a delivery (a lookup and a call, each bounded by
    /// `request_timeout`) and a silent database's statements.
    fn period(&self) -> Duration {
        self.config.poll_interval.max(self.config.retry.max_backoff)
            + self.config.request_timeout * 2
            + pool::SILENT_SERVER_TIMEOUT
    }

    /// One round: claim up to `batch` notifications, deliver them concurrently, record each
    /// outcome. Returns the outcomes.
    pub async fn round(&self) -> Result<Vec<Outcome>, SenderError> {
        let client = self.pool.get().await?;
        let claimed = notifications::claim(
            &**client,
            &self.channels,
            self.config.batch as i64,
            self.config.sending_timeout,
        )
        .await?;
        drop(client);
        let outcomes = futures::future::join_all(claimed.iter().map(|n| self.one(n))).await;
        outcomes.into_iter().collect()
    }

    /// `request` with the notification's trace context: through a span of this call when the
    /// row's context is sampled (and tracing is on), else as the row holds it.
    fn traced(
        &self,
        mut request: reqwest::RequestBuilder,
        n: &Claimed,
    ) -> (reqwest::RequestBuilder, Option<crate::telemetry::Publish>) {
        use crate::telemetry::{self, context};
        let span = (n.traceparent.as_deref())
            .filter(|_| telemetry::enabled())
            .and_then(|tp| context::from_columns(Some(tp), n.tracestate.as_deref()))
            .and_then(|cx| {
                let id = n.event_id.to_string();
                let attrs = [
                    ("effectively.channel", n.channel.as_str()),
                    ("effectively.notification_id", id.as_str()),
                ];
                telemetry::Publish::http("POST", &cx, &attrs)
            });
        let carrier = match &span {
            Some(s) => Some(s.carrier()),
            None => (n.traceparent.clone()).map(|tp| (tp, n.tracestate.clone())),
        };
        if let Some((parent, state)) = carrier {
            request = request.header(context::TRACEPARENT, parent);
            if let Some(state) = state {
                request = request.header(context::TRACESTATE, state);
            }
        }
        (request, span)
    }

    /// Delivers one claimed notification and records the outcome.
    async fn one(&self, n: &Claimed) -> Result<Outcome, SenderError> {
        let channel = &self.config.channels[&n.channel];
        let (outcome, mut finish) = self.deliver(channel, n).await;
        let mut outcome = outcome;
        if let Finish::Retry {
            error,
            counts: true,
            ..
        } = &finish
        {
            if n.attempts as u32 >= self.config.retry.max_attempts {
                finish = Finish::Failed {
                    error: format!("{error} (after {} attempt(s))", n.attempts),
                };
                outcome = Outcome::Failed;
            }
        }
        let client = self.pool.get().await?;
        let ours = notifications::finish(&**client, n, &finish).await?;
        if !ours {
            tracing::warn!(channel = n.channel, event_id = %n.event_id,
                "notification: another sender took this one over (sending_timeout passed); \
                 its outcome stands");
            return Ok(outcome);
        }
        crate::metrics::notification(&n.channel, outcome);
        match &finish {
            Finish::Failed { error } => tracing::warn!(channel = n.channel,
                event_id = %n.event_id, error, "notification FAILED"),
            Finish::Retry { error, .. } => tracing::info!(channel = n.channel,
                event_id = %n.event_id, attempt = n.attempts, error, "notification: retrying later"),
            _ => {}
        }
        Ok(outcome)
    }

    /// The provider's side of one notification (module docs).
    async fn deliver(&self, channel: &ChannelConfig, n: &Claimed) -> (Outcome, Finish) {
        let key = n.idempotency_key();
        let retry_as = |error: String, new_key: bool, counts: bool| {
            let delay = crate::strategy::backoff(&self.config.retry, n.attempts as u32);
            (
                Outcome::Retried,
                Finish::Retry {
                    delay_ms: delay.as_millis() as i64,
                    error,
                    new_key,
                    counts,
                },
            )
        };
        let retry = |error: String, new_key: bool| retry_as(error, new_key, true);
        if n.interrupted {
            if channel.lookup {
                match self.lookup(channel, &key).await {
                    Ok(Some(provider_id)) => {
                        return (Outcome::Reconciled, Finish::Sent { provider_id })
                    }
                    Ok(None) => {} // It never went out: send it.
                    Err(e) => return retry(format!("interrupted send, lookup failed: {e}"), false),
                }
            } else if channel.on_interrupted == OnInterrupted::Skip {
                return (
                    Outcome::Skipped,
                    Finish::Skipped {
                        reason: "the previous send was interrupted and the provider cannot be \
                                 asked (on_interrupted = skip)"
                            .into(),
                    },
                );
            }
        }
        let (mut request, span) = self.traced(
            self.http.post(&channel.url).header("Idempotency-Key", &key),
            n,
        );
        request = request.json(&n.payload);
        let answer = request.send().await;
        if let Some(mut s) = span {
            match &answer {
                Ok(a) => {
                    let code = a.status().as_u16();
                    s.attribute("http.response.status_code", code.into());
                    s.end((code >= 400).then_some(a.status().as_str()));
                }
                Err(e) => s.end(Some(&e.to_string())),
            }
        }
        // Chaos: the provider acted, the outcome is not recorded.
        fail::fail_point!("sender_after_call", |_| std::process::abort());
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                return retry(
                    format!("no answer ({e}); the same key again, the provider dedupes"),
                    false,
                )
            }
        };
        let status = answer.status();
        let replayed = answer.headers().contains_key("idempotent-replayed");
        let body: serde_json::Value = answer.json().await.unwrap_or(serde_json::Value::Null);
        if status.is_success() {
            return match body.get("id").and_then(|v| v.as_str()) {
                Some(id) => (
                    if replayed {
                        Outcome::Replayed
                    } else {
                        Outcome::Sent
                    },
                    Finish::Sent {
                        provider_id: id.to_string(),
                    },
                ),
                None => retry(format!("{status} without an id: {body}"), false),
            };
        }
        let what = body
            .pointer("/error/message")
            .and_then(|m| m.as_str())
            .unwrap_or("")
            .to_string();
        match status.as_u16() {
            // Not the key's failure: the provider is still at work on it.
            409 => retry_as(
                format!("409: still in flight at the provider ({what})"),
                false,
                false,
            ),
            429 => retry(format!("429: rate limited ({what})"), false),
            s if s >= 500 => {
                if !channel.lookup {
                    return retry(format!("{status}: {what}"), false);
                }
                match self.lookup(channel, &key).await {
                    Ok(Some(provider_id)) => (Outcome::Reconciled, Finish::Sent { provider_id }),
                    // The failure is saved under the key and nothing went out: a new key.
                    Ok(None) => retry(
                        format!("{status} and nothing sent under {key}: next attempt under a new key ({what})"),
                        true,
                    ),
                    Err(e) => retry(format!("{status}, then the lookup failed: {e}"), false),
                }
            }
            _ => (
                Outcome::Failed,
                Finish::Failed {
                    error: format!("{status}: {what}"),
                },
            ),
        }
    }

    /// Asks the provider what it delivered under `key`: its id, or `None`.
    async fn lookup(&self, channel: &ChannelConfig, key: &str) -> Result<Option<String>, String> {
        let answer = self
            .http
            .get(&channel.url)
            .query(&[("idempotency_key", key)])
            .send()
            .await
            .map_err(|e| e.to_string())?;
        match answer.status().as_u16() {
            404 => Ok(None),
            s if (200..300).contains(&s) => {
                let body: serde_json::Value = answer.json().await.map_err(|e| e.to_string())?;
                body.get("id")
                    .and_then(|v| v.as_str())
                    .map(|id| Some(id.to_string()))
                    .ok_or_else(|| format!("lookup answered without an id: {body}"))
            }
            s => Err(format!("lookup answered {s}")),
        }
    }

    /// Rounds until `stop`; a full round is followed by another at once. Samples the gauges
    /// every 15 s.
    pub async fn run(self, stop: CancellationToken) {
        for c in &self.channels {
            crate::metrics::notification_channel(c);
        }
        let mut sampled: Option<std::time::Instant> = None;
        let mut failures = 0u32;
        let beat = self.health.register("sender", self.period());
        let _probe = crate::health::spawn_database_watch(
            &self.database.0,
            self.database.1.clone(),
            self.health(),
            &stop,
        );
        loop {
            beat.beat();
            if sampled.is_none_or(|t| t.elapsed() >= Duration::from_secs(15)) {
                sampled = Some(std::time::Instant::now());
                self.sample().await;
            }
            let wait = tokio::select! {
                _ = stop.cancelled() => break,
                r = self.round() => match r {
                    Ok(done) => {
                        failures = 0;
                        if done.len() >= self.config.batch {
                            continue;
                        }
                        self.config.poll_interval
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(attempt = failures, error = %e,
                            "notification sender: round failed; retrying");
                        crate::strategy::backoff(&self.config.retry, failures)
                    }
                },
            };
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = tokio::time::sleep(wait) => {}
            }
        }
        // Ends on purpose: not a dead loop for `/healthz`.
        self.health.stopping();
        crate::telemetry::flush().await;
    }

    async fn sample(&self) {
        let status = match self.pool.get().await {
            Ok(c) => notifications::status(&**c, &self.channels).await,
            Err(e) => Err(e.into()),
        };
        match status {
            Ok(rows) => {
                for (channel, pending, sending, failed, oldest) in rows {
                    crate::metrics::notifications_status(
                        &channel, pending, sending, failed, oldest,
                    );
                }
            }
            Err(e) => tracing::debug!(error = %e, "notification sender: sampling failed"),
        }
    }
}
