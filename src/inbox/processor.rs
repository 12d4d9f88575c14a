//! Inbox processors: claim due rows, apply their effect with the consumer's handler, and mark
//! them DONE, all in one transaction (`claim = "lock"`), or claim by lease first and apply in a
//! second transaction that holds only rows still leased to it (`claim = "lease"`).
//!
//! A round, for the claimed rows (at most one per ordering key, oldest first):
//! 1. rebuild each message from its stored bytes; a payload the handler cannot read, or one its
//!    check refuses, is FAILED at once (permanent: no retry can fix it, a fixed handler can
//!    replay it);
//! 2. per topic (the handler's [`BatchContext`], spanning partitions), under a savepoint: stage the
//!    messages for SQL handlers and call the handler with them as its fresh messages;
//! 3. a group that fails is rolled back to its savepoint and its messages are applied one by
//!    one, each under its own savepoint, so the failing ones are found and the rest applied;
//! 4. mark the applied rows DONE (or delete them), schedule the failed ones (`attempts + 1`,
//!    exponential backoff with jitter, the error text) or park them as FAILED past
//!    `retry.max_attempts`; commit.
//!
//! A database error (connection lost, deadlock) loses the round: nothing of it commits, and the
//! rows are claimable again (their locks died with the transaction, or their lease expires).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use deadpool_postgres::{Pool, Transaction};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::config::{ClaimMode, ConsumerConfig, DoneRows};
use crate::envelope::Envelope;
use crate::handler::{Applied, BatchContext, Handler, HandlerError};
use crate::inbox::limit::Limit;
use crate::inbox::members::Members;
use crate::stats::Stats;
use crate::store::inbox::{self as table, Claimed, Failure};
use crate::store::{copy, ErrorClass, StoreError};
use crate::strategy::backoff;

/// Why a processor stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProcessorError {
    /// The handler cannot work at all (its SQL or the schema is wrong): the worker stops.
    #[error("consumer {consumer:?}: inbox processor: {reason}")]
    Fatal { consumer: String, reason: String },
}

/// Everything the processors of one consumer share.
pub struct Processors {
    pub consumer: Arc<str>,
    pub config: Arc<ConsumerConfig>,
    pub pool: Pool,
    pub handler: Arc<dyn Handler>,
    /// Notified by this process's receiver after it stored rows.
    pub stored: Arc<Notify>,
    pub stats: Arc<Stats>,
    /// `database.transaction_deadline`: the longest a round waits for PostgreSQL.
    pub deadline: std::time::Duration,
    /// Each processor task beats here once a round (see `Processors::period`).
    pub health: crate::health::ConsumerHealth,
}

/// What a round did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Round {
    pub claimed: usize,
    pub done: u64,
    pub retried: u64,
    pub failed: u64,
    pub effects: u64,
    pub business_duplicates: u64,
    /// Leased rows another processor had reclaimed.
    pub lease_lost: u64,
    /// Per topic: the applied messages' record timestamps (ms), effects, business duplicates;
    /// reported to the metrics once the round committed.
    pub by_topic: Vec<(String, Vec<i64>, Applied)>,
    /// Under `[consumer.version]`: rows acked without applying them, and held gaps.
    pub versions: crate::version::Skipped,
}

/// A processor whose round, with the failed rounds before it, has gone on for longer than the
/// consumer's `stall_after` is stalled (`effectively_inbox_processor_stalled` counts it) until a
/// round succeeds or the processor stops: a round waiting on a lock, or failing again and again
/// while the database is unavailable.
struct Stall<'a> {
    consumer: &'a str,
    after: std::time::Duration,
    /// When the first of the rounds that have not succeeded since started.
    failing_since: Option<tokio::time::Instant>,
    stalled: bool,
}

impl<'a> Stall<'a> {
    fn new(consumer: &'a str, after: std::time::Duration) -> Self {
        Stall {
            consumer,
            after,
            failing_since: None,
            stalled: false,
        }
    }

    /// Runs one round, marking the stall when it begins (while the round runs) and clearing
    /// it when a round succeeds.
    async fn watch<F>(&mut self, round: F) -> Result<Round, RoundError>
    where
        F: std::future::Future<Output = Result<Round, RoundError>>,
    {
        let since = *self
            .failing_since
            .get_or_insert_with(tokio::time::Instant::now);
        tokio::pin!(round);
        let out = match self.stalled {
            true => round.await,
            false => tokio::select! {
                out = &mut round => out,
                _ = tokio::time::sleep_until(since + self.after) => {
                    self.begin();
                    round.await
                }
            },
        };
        if out.is_ok() {
            self.ok();
        }
        out
    }

    fn begin(&mut self) {
        self.stalled = true;
        tracing::error!(consumer = %self.consumer,
            "inbox processor: a round has not succeeded for longer than stall_after ({}); nothing \
             is applied meanwhile (effectively_inbox_processor_stalled; docs/OPERATIONS.md \"A partition is stalled\")",
            humantime_serde::re::humantime::format_duration(self.after));
        crate::metrics::inbox_processor_stall(self.consumer, true);
    }

    fn ok(&mut self) {
        self.failing_since = None;
        if std::mem::take(&mut self.stalled) {
            tracing::info!(consumer = %self.consumer, "inbox processor: a round succeeded; no longer stalled");
            crate::metrics::inbox_processor_stall(self.consumer, false);
        }
    }
}

impl Drop for Stall<'_> {
    fn drop(&mut self) {
        self.ok();
    }
}

/// What [`Processors::apply_groups`] did with its rows (indexes, as given).
#[derive(Debug, Default)]
pub(super) struct Groups {
    pub applied: Vec<usize>,
    /// The rows that failed: whether no retry can fix it, and the error.
    pub failed: Vec<(usize, bool, String)>,
}

/// How a round failed.
pub(super) enum RoundError {
    /// Nothing committed; try again after a backoff.
    Unavailable(String),
    Fatal(String),
}

impl From<StoreError> for RoundError {
    fn from(e: StoreError) -> Self {
        match e.class() {
            ErrorClass::Fatal => RoundError::Fatal(e.describe()),
            // A failing statement of our own (not the handler's) is the database's problem.
            _ => RoundError::Unavailable(e.describe()),
        }
    }
}

impl From<tokio_postgres::Error> for RoundError {
    fn from(e: tokio_postgres::Error) -> Self {
        StoreError::from(e).into()
    }
}

impl From<deadpool_postgres::PoolError> for RoundError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        StoreError::from(e).into()
    }
}

impl Processors {
    /// One processor task: rounds until `stop`, each under a permit of `limit` (how many of
    /// this process's rounds run at once, [`crate::inbox::limit`]). A round that claimed any
    /// row is followed by another at once; one that found nothing due waits for the receiver's
    /// signal or `poll_interval`. Each round claims from the slice of the keys `members` gives
    /// its permit's slot (see [`table::Slice`]); a round that found no due row there looks at
    /// every key, for the keys of a member that died and of slices nobody took yet.
    pub async fn run(
        self: Arc<Self>,
        members: Members,
        limit: Arc<Limit>,
        stop: CancellationToken,
    ) -> Result<(), ProcessorError> {
        let inbox = &self.config.inbox;
        let beat = self.health.heartbeat("inbox processor", self.period());
        let mut unavailable = 0u32;
        let mut stall = Stall::new(&self.consumer, self.config.stall_after);
        loop {
            beat.beat();
            if stop.is_cancelled() {
                return Ok(());
            }
            let woken = self.stored.notified();
            // Bounded: the rounds holding the permits are (by the transaction deadline).
            let permit = tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                p = beat.during(limit.acquire()) => p,
            };
            let slice = members.slice(permit.slot());
            let round = async {
                let round = self.round(slice, &stop).await?;
                match round.claimed == 0 && slice.of > 1 && !stop.is_cancelled() {
                    true => self.round(table::Slice::ALL, &stop).await,
                    false => Ok(round),
                }
            };
            match stall.watch(round).await {
                Ok(round) => {
                    permit.done(round.claimed);
                    unavailable = 0;
                    // Rows were due: more may be (the next heads of the keys just applied).
                    // Waiting for a full claim instead left a slice of few keys, or a round
                    // that found part of its claim locked, idle for a poll interval after
                    // every round.
                    if round.claimed > 0 {
                        continue;
                    }
                }
                Err(RoundError::Fatal(reason)) => {
                    drop(permit);
                    return Err(ProcessorError::Fatal {
                        consumer: self.consumer.to_string(),
                        reason,
                    });
                }
                Err(RoundError::Unavailable(e)) => {
                    drop(permit);
                    unavailable += 1;
                    tracing::warn!(consumer = %self.consumer, attempt = unavailable, error = %e,
                        "inbox processor: database unavailable; round rolled back");
                    tokio::select! {
                        _ = stop.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(backoff(&self.config.retry, unavailable)) => {}
                    }
                    continue;
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = woken => {}
                _ = tokio::time::sleep(inbox.poll_interval) => {}
            }
        }
    }

    /// The longest gap between two rounds' starts when nothing is wrong: one round (bounded by
    /// the transaction deadline) and the longest wait after it (the poll interval, or a
    /// backoff while the database is unavailable).
    fn period(&self) -> std::time::Duration {
        let wait = (self.config.inbox.poll_interval).max(self.config.retry.max_backoff);
        self.deadline + wait
    }

    /// Claims, applies and marks one batch of due rows (tests drive processors with it).
    pub async fn round_once(&self) -> Result<Round, String> {
        self.round(table::Slice::ALL, &CancellationToken::new())
            .await
            .map_err(|e| match e {
                RoundError::Unavailable(t) | RoundError::Fatal(t) => t,
            })
    }

    /// One round. `stop` abandons it between the claim and the commit: the transaction rolls
    /// back, so a lock claim's rows are free at once and a lease claim's are given back.
    async fn round(
        &self,
        slice: table::Slice,
        stop: &CancellationToken,
    ) -> Result<Round, RoundError> {
        let started = Instant::now();
        let limit = self.config.inbox.claim_batch as i64;
        let mut conn = self.pool.get().await?;
        // Bounded like a batch (see `strategy::segments`): a frozen server must not hold the
        // processor, and a connection that failed is not handed to the next round.
        let work = async {
            match self.config.inbox.claim {
                ClaimMode::Lock => {
                    let tx = conn.transaction().await?;
                    let claimed = table::claim_locked(&tx, &self.consumer, limit, slice).await?;
                    let claim_took = started.elapsed();
                    let applied = tokio::select! {
                        biased;
                        _ = stop.cancelled() => None,
                        r = self.apply(&tx, claimed, true) => Some(r?),
                    };
                    match applied {
                        Some(round) => {
                            tx.commit().await?;
                            Ok(Some((round, claim_took)))
                        }
                        // Dropping the transaction rolls it back: the rows are unlocked.
                        None => Ok(None),
                    }
                }
                ClaimMode::Lease => {
                    let token = Uuid::new_v4();
                    let lease_ms = self.config.inbox.lease.as_millis() as i64;
                    let claimed =
                        table::claim_leased(&conn, &self.consumer, limit, slice, lease_ms, token)
                            .await?;
                    let claim_took = started.elapsed();
                    if claimed.is_empty() {
                        Ok(Some((Round::default(), claim_took)))
                    } else {
                        let keys: Vec<_> = claimed
                            .iter()
                            .map(|c| (c.message_id, c.event_date))
                            .collect();
                        let applied = {
                            let tx = conn.transaction().await?;
                            tokio::select! {
                                biased;
                                _ = stop.cancelled() => None,
                                r = self.apply_leased(&tx, claimed, token, &keys) => {
                                    let round = r?;
                                    tx.commit().await?;
                                    Some(round)
                                }
                            }
                        };
                        match applied {
                            Some(round) => Ok(Some((round, claim_took))),
                            None => {
                                table::release_leased(&**conn, &self.consumer, token, &keys)
                                    .await?;
                                Ok(None)
                            }
                        }
                    }
                }
            }
        };
        let answered = tokio::time::timeout(self.deadline, work)
            .await
            .unwrap_or(Err(RoundError::from(StoreError::Timeout(self.deadline))));
        let (round, claim_took) = match answered {
            Ok(Some(done)) => done,
            Ok(None) => return Ok(Round::default()),
            Err(e) => {
                if matches!(e, RoundError::Unavailable(_)) {
                    crate::store::pool::discard(conn);
                }
                return Err(e);
            }
        };
        // The e2e latency of an inbox message runs from its Kafka timestamp to its effect.
        for (topic, ts_ms, applied) in &round.by_topic {
            crate::metrics::effects_committed(&self.consumer, topic, ts_ms);
            crate::metrics::inbox_effects(
                &self.consumer,
                topic,
                applied.effects,
                applied.business_duplicates,
            );
        }
        crate::metrics::versions_skipped(&self.consumer, &round.versions);
        crate::metrics::inbox_round(
            &self.consumer,
            claim_took,
            started.elapsed(),
            round.done,
            round.retried,
            round.failed,
        );
        self.stats
            .inbox_applied(round.effects, round.business_duplicates);
        Ok(round)
    }

    /// The second transaction of a lease claim: lock the rows still leased to `token` (another
    /// processor may have reclaimed some after the lease expired) and apply only those.
    async fn apply_leased(
        &self,
        tx: &Transaction<'_>,
        claimed: Vec<Claimed>,
        token: Uuid,
        keys: &[(Uuid, chrono::NaiveDate)],
    ) -> Result<Round, RoundError> {
        let held = table::hold_leased(tx, &self.consumer, token, keys).await?;
        let n = claimed.len();
        let ours: Vec<Claimed> = claimed
            .into_iter()
            .filter(|c| held.contains(&(c.message_id, c.event_date)))
            .collect();
        let lost = (n - ours.len()) as u64;
        if lost > 0 {
            tracing::warn!(consumer = %self.consumer, rows = lost, lease = ?self.config.inbox.lease,
                "inbox lease expired before this processor applied its rows; another processor \
                 reclaimed them (raise inbox.lease above the stalls this process sees)");
            crate::metrics::inbox_lease_lost(&self.consumer, lost);
        }
        let mut round = self.apply(tx, ours, false).await?;
        round.claimed = n;
        round.lease_lost = lost;
        Ok(round)
    }

    /// [`Self::apply_rows`] under the round's span (when tracing is on): linked to the context
    /// each row kept from its message, a child of it when they all share one trace; the effect's
    /// outbox and notification rows keep the span's context. The span ends before `COMMIT`.
    async fn apply(
        &self,
        tx: &Transaction<'_>,
        claimed: Vec<Claimed>,
        count_attempt: bool,
    ) -> Result<Round, RoundError> {
        if claimed.is_empty() || !crate::telemetry::enabled() {
            return self.apply_rows(tx, claimed, count_attempt).await;
        }
        let first = claimed[0].topic.as_str();
        let topic = match claimed.iter().all(|c| c.topic == first) {
            true => first.to_string(),
            false => "(several topics)".to_string(),
        };
        let source = crate::telemetry::spans::Source {
            consumer: &self.consumer,
            topic: &topic,
            partition: None,
            strategy: "inbox-processor",
            group: None,
        };
        let contexts = (claimed.iter()).filter_map(|c| {
            crate::telemetry::context::from_columns(
                c.traceparent.as_deref(),
                c.tracestate.as_deref(),
            )
        });
        let span = crate::telemetry::Tx::start("inbox", source, claimed.len(), contexts);
        if let Some(s) = &span {
            let (parent, state) = s.carrier();
            crate::store::trace_context::set_local(tx, &parent, state.as_deref()).await?;
        }
        let started = Instant::now();
        let round = self.apply_rows(tx, claimed, count_attempt).await;
        if let Some(mut s) = span {
            match &round {
                Ok(r) => {
                    s.stage("apply", started, Instant::now());
                    s.end(crate::telemetry::Counts {
                        records: r.claimed as u64,
                        fresh: r.done,
                        effects: r.effects,
                        duplicates: r.business_duplicates,
                        parked: r.failed,
                        skipped: 0,
                        retried: r.retried,
                    })
                }
                Err(RoundError::Unavailable(e) | RoundError::Fatal(e)) => s.fail(e),
            }
        }
        round
    }

    /// Applies `claimed` in `tx` and records the outcome of every row (module docs, 1 to 4).
    /// `count_attempt`: the claim did not count this attempt (lock claims).
    async fn apply_rows(
        &self,
        tx: &Transaction<'_>,
        claimed: Vec<Claimed>,
        count_attempt: bool,
    ) -> Result<Round, RoundError> {
        let mut round = Round {
            claimed: claimed.len(),
            ..Round::default()
        };
        if claimed.is_empty() {
            return Ok(round);
        }
        let retry = &self.config.retry;
        // Attempts including this one.
        let attempt_of = |c: &Claimed| c.attempts + count_attempt as i32;
        let mut failures: Vec<Failure> = Vec::new();
        // A row that can never be applied (step 1): FAILED at once.
        let parked = |c: &Claimed, error: String| Failure {
            message_id: c.message_id,
            event_date: c.event_date,
            failed: true,
            delay_ms: 0,
            error,
        };

        // 1. Rebuild the messages; group them by topic, oldest first. One handler call per topic,
        // not per partition: a handler sorts the rows it locks within one call, so two
        // processors whose rounds span the same partitions cannot deadlock on shared rows (a
        // wallet credited by rows of two partitions would be locked in two orders).
        let mut groups: BTreeMap<String, Vec<(Claimed, Envelope)>> = BTreeMap::new();
        for c in claimed {
            // A lease claim counts its attempts when it claims: a row whose processors keep
            // dying (or outliving the lease) is parked instead of being claimed forever.
            if !count_attempt && c.attempts as u32 > retry.max_attempts {
                let why = format!(
                    "claimed {} times without finishing: each processor died or outlived \
                     the lease",
                    c.attempts - 1
                );
                failures.push(parked(&c, why));
                continue;
            }
            match self.envelope(&c) {
                Ok(env) => groups.entry(c.topic.clone()).or_default().push((c, env)),
                Err(why) => failures.push(parked(&c, why)),
            }
        }

        // 2, 3. Each group under a savepoint; a failing group one message at a time. Under
        // `[consumer.version]`, round by round (see `super::versioned`).
        let rows: Vec<(Claimed, Envelope)> = groups.into_values().flatten().collect();
        let mut done: Vec<(Uuid, chrono::NaiveDate)> = Vec::new();
        let failed = match &self.config.version {
            Some(cfg) => {
                let v = self.apply_versioned(cfg, tx, &rows, &mut round).await?;
                done = v.done;
                failures.extend(v.held_failures);
                v.failed
            }
            None => {
                let envs: Vec<&Envelope> = rows.iter().map(|(_, e)| e).collect();
                let topics: Vec<&str> = rows.iter().map(|(c, _)| c.topic.as_str()).collect();
                let all: Vec<usize> = (0..rows.len()).collect();
                let out = self
                    .apply_groups(tx, &envs, &topics, &all, None, &mut round)
                    .await?;
                done.extend(out.applied.iter().map(|&i| {
                    let c = &rows[i].0;
                    (c.message_id, c.event_date)
                }));
                out.failed
            }
        };
        for (i, permanent, why) in failed {
            let c = &rows[i].0;
            let attempt = attempt_of(c).max(1);
            let gave_up = permanent || attempt as u32 >= retry.max_attempts;
            failures.push(Failure {
                message_id: c.message_id,
                event_date: c.event_date,
                failed: gave_up,
                delay_ms: backoff(retry, attempt as u32).as_millis() as i64,
                error: if gave_up && !permanent {
                    format!("{why} (after {attempt} attempt(s))")
                } else {
                    why
                },
            });
        }

        // 4. Marks.
        let delete = self.config.inbox.done == DoneRows::Delete;
        table::finish(tx, &self.consumer, &done, delete, count_attempt).await?;
        table::fail(tx, &self.consumer, &failures, count_attempt).await?;
        round.done = done.len() as u64;
        for f in &failures {
            if f.failed {
                round.failed += 1;
                tracing::warn!(consumer = %self.consumer, message_id = %f.message_id,
                    error = %f.error, "inbox row FAILED (parked; `effectively inbox replay` after a fix)");
            } else {
                round.retried += 1;
                tracing::info!(consumer = %self.consumer, message_id = %f.message_id,
                    retry_in_ms = f.delay_ms, error = %f.error, "inbox row failed; retrying later");
            }
        }
        Ok(round)
    }

    /// Applies the rows `items` (indexes into `envs` and `topics`), one handler call per topic
    /// under a savepoint; a failing group is applied one row at a time, each under its own
    /// savepoint, so the failing rows are found and the rest applied. Adds the effects to
    /// `round`. `versions`: the facts of a versioned round, for the handler and its view.
    pub(super) async fn apply_groups(
        &self,
        tx: &Transaction<'_>,
        envs: &[&Envelope],
        topics: &[&str],
        items: &[usize],
        versions: Option<&crate::version::Versions>,
        round: &mut Round,
    ) -> Result<Groups, RoundError> {
        let mut by_topic: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for &i in items {
            by_topic.entry(topics[i]).or_default().push(i);
        }
        let mut out = Groups::default();
        for (topic, rows) in &by_topic {
            let ctx = BatchContext {
                consumer: &self.consumer,
                topic,
                partition: None,
                versions,
                business_row: false,
            };
            let group: Vec<&Envelope> = rows.iter().map(|&i| envs[i]).collect();
            let mut applied: Vec<usize> = Vec::new();
            let mut sum = Applied::default();
            match self.try_apply(tx, &ctx, &group).await {
                Ok(a) => {
                    sum = a;
                    applied.extend(rows);
                }
                Err(HandlerError::Fatal(t)) => return Err(RoundError::Fatal(t)),
                Err(HandlerError::Unavailable(t)) => return Err(RoundError::Unavailable(t)),
                // A group of one: its error is the row's, no second call.
                Err(only) if rows.len() == 1 => {
                    let (permanent, why) = row_error(only);
                    out.failed.push((rows[0], permanent, why));
                }
                Err(first) => {
                    tracing::warn!(consumer = %self.consumer, topic, rows = rows.len(),
                        error = %first, "inbox batch failed; applying its messages one by one");
                    for &i in rows {
                        match self.try_apply(tx, &ctx, &[envs[i]]).await {
                            Ok(a) => {
                                sum.effects += a.effects;
                                sum.business_duplicates += a.business_duplicates;
                                applied.push(i);
                            }
                            Err(HandlerError::Fatal(t)) => return Err(RoundError::Fatal(t)),
                            Err(HandlerError::Unavailable(t)) => {
                                return Err(RoundError::Unavailable(t))
                            }
                            Err(e) => {
                                let (permanent, why) = row_error(e);
                                out.failed.push((i, permanent, why));
                            }
                        }
                    }
                }
            }
            round.effects += sum.effects;
            round.business_duplicates += sum.business_duplicates;
            let ts_ms = applied
                .iter()
                .filter_map(|&i| envs[i].kafka_ts.map(|t| t.timestamp_millis()))
                .collect();
            round.by_topic.push((topic.to_string(), ts_ms, sum));
            out.applied.extend(applied);
        }
        Ok(out)
    }

    /// The handler over `envs` under a savepoint: released on success, rolled back on failure
    /// (the transaction stays usable).
    pub(super) async fn try_apply(
        &self,
        tx: &Transaction<'_>,
        ctx: &BatchContext<'_>,
        envs: &[&Envelope],
    ) -> Result<Applied, HandlerError> {
        tx.batch_execute("SAVEPOINT inbox_apply").await?;
        let result = async {
            if self.handler.stages_payload() {
                // The previous group's rows, if any, must not show in this group's view.
                tx.batch_execute("DELETE FROM staged_messages").await?;
                copy::stage(tx, envs, true, true, ctx.versions)
                    .await
                    .map_err(|e| match e {
                        StoreError::Postgres(pg) => HandlerError::from(pg),
                        other => HandlerError::Unavailable(other.to_string()),
                    })?;
            }
            self.handler.apply(tx, ctx, envs).await
        }
        .await;
        match result {
            Ok(a) => {
                tx.batch_execute("RELEASE SAVEPOINT inbox_apply").await?;
                Ok(a)
            }
            Err(e) => {
                tx.batch_execute("ROLLBACK TO SAVEPOINT inbox_apply")
                    .await?;
                Err(e)
            }
        }
    }

    /// The message as the handler sees it, from the stored row; or why it can never be applied.
    fn envelope(&self, c: &Claimed) -> Result<Envelope, String> {
        let env = Envelope::from_stored(
            c.partition,
            c.offset,
            c.message_id,
            c.event_date,
            c.kafka_ts,
            c.key.as_deref(),
            &c.payload,
            self.handler.needs_json() || self.config.version.is_some(),
        )
        .map_err(|r| r.to_string())?;
        self.handler.check(&env).map_err(|r| r.to_string())?;
        Ok(env)
    }
}

/// A row's handler error: whether no retry can fix it, and the text kept in `last_error`.
/// (`Fatal` and `Unavailable` are the round's, not the row's: the caller handles them first.)
fn row_error(e: HandlerError) -> (bool, String) {
    match e {
        HandlerError::Transient(t) | HandlerError::Unavailable(t) | HandlerError::Fatal(t) => {
            (false, t)
        }
        HandlerError::Reject(list) => {
            let why: Vec<String> = list.into_iter().map(|(_, w)| w).collect();
            (true, why.join("; "))
        }
        HandlerError::Permanent(t) => (true, t),
    }
}

/// Starts `n` processor tasks for one consumer on `tasks`, and the task that keeps this
/// process among the consumer's members (`worker`: this process's worker id).
pub fn spawn(
    processors: &Arc<Processors>,
    n: usize,
    worker: &str,
    stop: &CancellationToken,
    tasks: &mut tokio::task::JoinSet<Result<(), ProcessorError>>,
) {
    crate::metrics::inbox_consumer(&processors.consumer);
    let limit = Limit::new(
        Arc::clone(&processors.consumer),
        n,
        processors.config.inbox.adaptive,
    );
    let members = Members::following(Arc::clone(&processors.consumer), worker, Arc::clone(&limit));
    for _ in 0..n {
        let (members, limit) = (members.clone(), Arc::clone(&limit));
        tasks.spawn(Arc::clone(processors).run(members, limit, stop.child_token()));
    }
    let (pool, stop) = (processors.pool.clone(), stop.child_token());
    tasks.spawn(async move {
        members.run(pool, stop).await;
        Ok(())
    });
}
