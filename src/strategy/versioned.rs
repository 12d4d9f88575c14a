//! The effect step of the batch and per-message strategies under `[consumer.version]`, after
//! the dedupe insert has picked the fresh messages (see `crate::version` for the rules):
//!
//! 1. lock the batch's aggregates ([`versions::lock`]), read their stored versions and, in
//!    delta mode, the events held for them (HELD inbox rows from earlier batches);
//! 2. plan the fresh and the held events together;
//! 3. call the handler once per round with that round's events (for SQL, `fresh_messages`
//!    shows only them, with `aggregate`, `version` and `stored_version`);
//! 4. store the new gaps as HELD rows (with their raw bytes), delete the held rows that were
//!    applied (or that turned out stale), and move the stored versions.
//!
//! All in the batch's transaction: a held version 4 is applied in the transaction that applies
//! the missing 3, or not at all. Stale and duplicate events commit their dedupe key and change
//! nothing else; they are counted by reason.

use std::collections::HashMap;

use deadpool_postgres::Transaction;

use super::{AttemptError, PartitionCtx};
use crate::batch::Raw;
use crate::config::{VersionConfig, VersionMode};
use crate::envelope::Envelope;
use crate::handler::{Applied, BatchContext, Handler, HandlerError};
use crate::store::inbox::{self, Failure, Incoming};
use crate::store::{copy, versions, StoreError};
use crate::version::{self, Skipped, Stamp, Verdict, Versions};

/// What the versioned effect did.
#[derive(Debug, Default)]
pub(crate) struct Effect {
    pub applied: Applied,
    pub skipped: Skipped,
}

/// Applies `fresh` (first copies whose dedupe key is new, in offset order; `raws[i]` is the
/// record of `fresh[i]`) in `tx`. A rejection names indexes into `fresh`; a held event the
/// handler refuses is blamed on the fresh event of its aggregate that released it (the held
/// row stays HELD, and the gap alert shows it).
pub(crate) async fn apply(
    ctx: &PartitionCtx,
    cfg: &VersionConfig,
    tx: &Transaction<'_>,
    fresh: &[&Envelope],
    raws: &[&Raw],
) -> Result<Effect, AttemptError> {
    let consumer: &str = &ctx.consumer;
    let mut stamps: Vec<Stamp> = Vec::with_capacity(fresh.len());
    let mut unreadable = Vec::new();
    for (i, env) in fresh.iter().enumerate() {
        match version::read(cfg, env) {
            Ok(s) => stamps.push(s),
            Err(r) => unreadable.push((i, r.to_string())),
        }
    }
    if !unreadable.is_empty() {
        // Admission checks the stamp, so only a config changed between the two gets here.
        return Err(AttemptError::Reject(unreadable));
    }
    let (stored, held) = load(tx, consumer, cfg.mode, stamps.iter()).await?;
    let (held_envs, unusable) = held_envelopes(ctx.handler.as_ref(), &held);
    inbox::fail(tx, consumer, &unusable, false).await?;

    let n = fresh.len();
    let mut events = stamps;
    events.extend(held_envs.iter().map(|(h, _)| h.stamp()));
    let all: Vec<&Envelope> = fresh
        .iter()
        .copied()
        .chain(held_envs.iter().map(|(_, e)| e))
        .collect();
    let plan = version::plan(cfg.mode, &stored, &events);

    let mut skipped = Skipped::default();
    let mut to_hold = Vec::new();
    let mut finished = Vec::new();
    for (i, v) in plan.verdicts.iter().enumerate() {
        if i < n {
            skipped.count(*v);
            if *v == Verdict::Gap {
                let incoming =
                    Incoming::new(fresh[i], events[i].aggregate.clone(), &raws[i].headers);
                to_hold.push((incoming, &events[i]));
            }
            continue;
        }
        let h = held_envs[i - n].0;
        match v {
            Verdict::Gap => {}
            Verdict::Apply { .. } => {
                skipped.released += 1;
                finished.push((h.message_id, h.event_date));
            }
            other => {
                skipped.count(*other);
                finished.push((h.message_id, h.event_date));
            }
        }
    }

    let mut applied = Applied::default();
    for r in 0..plan.rounds {
        let idx = plan.round(r);
        let envs: Vec<&Envelope> = idx.iter().map(|&i| all[i]).collect();
        let facts = Versions::of(cfg.mode, &stored, &events, &all, &idx);
        if ctx.handler.stages_payload() {
            // The view shows this round's events only.
            tx.batch_execute("DELETE FROM staged_messages").await?;
            copy::stage(tx, &envs, true, true, Some(&facts)).await?;
        }
        let bctx = BatchContext {
            consumer,
            topic: &ctx.topic,
            partition: Some(ctx.partition),
            versions: Some(&facts),
            business_row: false,
        };
        match ctx.handler.apply(tx, &bctx, &envs).await {
            Ok(a) => {
                applied.effects += a.effects;
                applied.business_duplicates += a.business_duplicates;
            }
            Err(HandlerError::Reject(list)) => {
                let blame = |i: usize| {
                    if i < n {
                        return i;
                    }
                    let aggregate = &events[i].aggregate;
                    (0..n)
                        .find(|&f| &events[f].aggregate == aggregate)
                        .expect("held rows are loaded for the fresh events' aggregates only")
                };
                return Err(AttemptError::Reject(
                    list.into_iter()
                        .map(|(k, why)| {
                            let i = idx[k];
                            let why = if i < n {
                                why
                            } else {
                                format!(
                                    "releasing held version {} of aggregate {:?} failed: {why}",
                                    events[i].version, events[i].aggregate
                                )
                            };
                            (blame(i), why)
                        })
                        .collect(),
                ));
            }
            Err(e) => return Err(e.into()),
        }
    }

    versions::hold(tx, consumer, &ctx.topic, &to_hold).await?;
    inbox::finish(tx, consumer, &finished, true, false).await?;
    if let Err(moved) = versions::advance(tx, consumer, &stored, &plan.advanced).await? {
        return Err(AttemptError::Unavailable(moved.to_string()));
    }
    Ok(Effect { applied, skipped })
}

/// Locks the aggregates of `stamps` ([`versions::lock`]), then reads their stored versions
/// and, in delta mode, their held events: steps 1 and 2 of the module docs, shared with the
/// inbox's processors.
pub(crate) async fn load<'s>(
    tx: &Transaction<'_>,
    consumer: &str,
    mode: VersionMode,
    stamps: impl Iterator<Item = &'s Stamp>,
) -> Result<(HashMap<String, i64>, Vec<versions::Held>), StoreError> {
    let mut aggregates: Vec<&str> = stamps.map(|s| s.aggregate.as_str()).collect();
    aggregates.sort_unstable();
    aggregates.dedup();
    versions::lock(tx, consumer, &aggregates).await?;
    let stored = versions::read(tx, consumer, &aggregates).await?;
    let held = match mode {
        VersionMode::Delta => versions::held(tx, consumer, &aggregates).await?,
        VersionMode::FullState => Vec::new(),
    };
    Ok((stored, held))
}

/// Held rows as the handler sees them. One that no longer reads (the consumer's config or
/// handler changed since it was held) comes back as a FAILED mark, to be parked with its bytes
/// instead of blocking its aggregate unseen.
pub(crate) fn held_envelopes<'h>(
    handler: &dyn Handler,
    held: &'h [versions::Held],
) -> (Vec<(&'h versions::Held, Envelope)>, Vec<Failure>) {
    let mut envs = Vec::with_capacity(held.len());
    let mut unusable = Vec::new();
    for h in held {
        let env = Envelope::from_stored(
            h.partition,
            h.offset,
            h.message_id,
            h.event_date,
            h.kafka_ts,
            h.key.as_deref(),
            &h.payload,
            true,
        )
        .map_err(|r| r.to_string())
        .and_then(|env| {
            handler.check(&env).map_err(|r| r.to_string())?;
            Ok(env)
        });
        match env {
            Ok(env) => envs.push((h, env)),
            Err(error) => unusable.push(Failure {
                message_id: h.message_id,
                event_date: h.event_date,
                failed: true,
                delay_ms: 0,
                error: format!("held version {} no longer reads: {error}", h.version),
            }),
        }
    }
    (envs, unusable)
}
