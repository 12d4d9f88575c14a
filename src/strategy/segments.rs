//! The retry and isolation driver both strategies share.
//!
//! A *segment* is a run of consecutive records of the batch, committed by one transaction that
//! advances the partition's offset to just past its last record, parks its rejected records,
//! and hands its candidates to the strategy's body. When a segment fails:
//! - the database is unavailable (connection lost, deadlock, serialization failure): retry the
//!   same segment with backoff, for as long as it takes (nothing can be parked without the
//!   database anyway);
//! - the handler rejects given messages: mark them, and retry at once (they are parked);
//! - the handler fails transiently: retry with backoff up to `retry.max_attempts`;
//! - the handler fails on the data without naming a message, or transient failures are used
//!   up: split the segment in two and commit each half on its own, one attempt per half, until
//!   the failing message is alone; alone, it gets its full attempts and is then parked.
//!
//! Whatever happens, a dedupe key commits only together with its effect, and a message leaves
//! the partition only as an effect, a counted duplicate, or a dead letter.
//!
//! With a Redis pre-filter, the batch's keys are looked up once before the first transaction:
//! a hit is a duplicate that is no candidate (no staging, no dedupe insert, no effect), while its
//! record still moves the fenced offset. Segments are cut by the records that are not hits, so
//! a run of hits rides in the transaction of the next message instead of one of its own. After
//! each `COMMIT`, the keys of that transaction's candidates (all committed in PostgreSQL now:
//! inserted by it, or already there) are set in Redis.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use deadpool_postgres::Transaction;

use super::{wait, AttemptError, BatchError, Committed, Outcome, PartitionCtx};
use crate::batch::{Batch, Raw};
use crate::envelope::{Envelope, Reason, Rejection};
use crate::prefilter::{Key, Prefilter};
use crate::store::offsets::{self, Refusal};
use crate::store::{dead_letters, trace_context};
use crate::telemetry;

/// What a body did with a segment's candidates.
#[derive(Debug, Default)]
pub(crate) struct BodyOutcome {
    /// Record timestamps (ms) of the messages whose effect this transaction applies.
    pub fresh_ts_ms: Vec<i64>,
    pub stage: Duration,
    pub dedupe: Duration,
    pub effect: Duration,
    pub fresh: u64,
    pub effects: u64,
    pub duplicates: u64,
    pub business_duplicates: u64,
    pub versions: crate::version::Skipped,
}

/// The part of the transaction that differs between strategies: dedupe and effect.
#[async_trait]
pub(crate) trait Body: Send + Sync {
    /// Applies `candidates` (first copies, in offset order) in `tx`; `raws[i]` is the record
    /// `candidates[i]` was decoded from. A rejection names candidates by their index.
    async fn run(
        &self,
        ctx: &PartitionCtx,
        tx: &Transaction<'_>,
        candidates: &[&Envelope],
        raws: &[&Raw],
    ) -> Result<BodyOutcome, AttemptError>;
}

/// How the driver cuts and orders the work.
pub(crate) struct Shape {
    /// At most this many records per transaction (`usize::MAX`: the whole batch).
    pub segment_len: usize,
    /// Advance the fenced offset first (the batch strategy: a zombie fails at its first
    /// statement), or last (the seed's per-message order: key, effect, offset).
    pub fence_first: bool,
    /// The strategy's name, for the transaction's span.
    pub strategy: &'static str,
}

struct Segment {
    range: Range<usize>,
    /// Produced by a split: one attempt before splitting again.
    isolating: bool,
}

pub(crate) async fn drive(
    ctx: &PartitionCtx,
    batch: &Batch,
    shape: &Shape,
    body: &dyn Body,
    prefilter: Option<&Prefilter>,
    committed: Committed<'_>,
) -> Result<Outcome, BatchError> {
    let mut out = Outcome::default();
    // Records the handler refused or that ran out of attempts, by index in the batch.
    let mut rejected: HashMap<usize, (Rejection, i32)> = HashMap::new();
    let hits = match prefilter {
        Some(p) => look_up(p, batch).await,
        None => HashSet::new(),
    };
    let filter = prefilter.map(|p| Filter {
        prefilter: p,
        hits: &hits,
    });
    // A stack, last segment at the bottom, so segments commit in offset order.
    let mut todo: Vec<Segment> = cut(batch.len(), shape.segment_len, |i| hits.contains(&i))
        .into_iter()
        .map(|range| Segment {
            range,
            isolating: false,
        })
        .rev()
        .collect();
    // Where the stored offset stands: each committed segment moves it on.
    let mut from = batch.stored;
    while let Some(seg) = todo.pop() {
        let mut attempts = 0u32;
        let mut unavailable = 0u32;
        // Committed (or split in two, each half its own segment).
        let mut done = false;
        let mv = offsets::Move {
            epoch: ctx.epoch,
            from,
            to: batch.records[seg.range.end - 1].raw.offset + 1,
        };
        loop {
            match attempt(
                ctx,
                batch,
                Step {
                    range: &seg.range,
                    mv,
                },
                &rejected,
                shape,
                body,
                filter.as_ref(),
            )
            .await
            {
                Ok(o) => {
                    out.add(o);
                    out.commits += 1;
                    committed(mv.to);
                    done = true;
                    break;
                }
                Err(AttemptError::Refused(Refusal::Committed)) => {
                    // An earlier attempt committed; its answer was lost with its connection.
                    tracing::info!(consumer = %ctx.consumer, topic = %ctx.topic, partition = ctx.partition,
                        next_offset = mv.to, "an attempt whose answer was lost had committed; moving on");
                    out.records += seg.range.len() as u64;
                    committed(mv.to);
                    done = true;
                    break;
                }
                Err(AttemptError::Refused(Refusal::Fenced { .. })) => {
                    return Err(BatchError::Fenced)
                }
                Err(AttemptError::Refused(Refusal::WentBack { stored, .. })) => {
                    return Err(BatchError::WentBack { from, stored })
                }
                Err(AttemptError::Fatal(t)) => return Err(BatchError::Fatal(t)),
                Err(AttemptError::Unavailable(t)) => {
                    unavailable += 1;
                    out.retries += 1;
                    tracing::warn!(consumer = %ctx.consumer, topic = %ctx.topic, partition = ctx.partition,
                        attempt = unavailable, error = %t, "database unavailable; retrying the batch");
                    wait(ctx, unavailable).await?;
                }
                Err(AttemptError::Reject(list)) => {
                    out.retries += 1;
                    for (idx, why) in list {
                        let mut r = Rejection::new(Reason::HandlerRejected, why);
                        if let Ok(env) = &batch.records[idx].decoded {
                            r = r.for_envelope(env);
                        }
                        rejected.insert(idx, (r, attempts as i32 + 1));
                    }
                }
                Err(e @ (AttemptError::Transient(_) | AttemptError::Permanent(_))) => {
                    attempts += 1;
                    out.retries += 1;
                    let (permanent, text) = match e {
                        AttemptError::Permanent(t) => (true, t),
                        AttemptError::Transient(t) => (false, t),
                        _ => unreachable!("matched above"),
                    };
                    let candidates: Vec<usize> = seg
                        .range
                        .clone()
                        .filter(|i| !rejected.contains_key(i) && batch.records[*i].decoded.is_ok())
                        .collect();
                    let limit = if seg.isolating && candidates.len() > 1 {
                        1
                    } else {
                        ctx.retry.max_attempts
                    };
                    tracing::warn!(consumer = %ctx.consumer, topic = %ctx.topic, partition = ctx.partition,
                        first_offset = batch.records[seg.range.start].raw.offset,
                        records = seg.range.len(), attempt = attempts, error = %text,
                        "batch failed; rolled back");
                    if !permanent && attempts < limit {
                        wait(ctx, attempts).await?;
                        continue;
                    }
                    if candidates.len() > 1 && seg.range.len() > 1 {
                        let mid = seg.range.start + seg.range.len() / 2;
                        todo.push(Segment {
                            range: mid..seg.range.end,
                            isolating: true,
                        });
                        todo.push(Segment {
                            range: seg.range.start..mid,
                            isolating: true,
                        });
                        break;
                    }
                    let Some(&idx) = candidates.first() else {
                        // No candidate left and still failing: nothing to blame on a message.
                        wait(ctx, attempts).await?;
                        continue;
                    };
                    let reason = if permanent {
                        Reason::HandlerRejected
                    } else {
                        Reason::RetriesExhausted
                    };
                    let mut r =
                        Rejection::new(reason, format!("{text} (after {attempts} attempt(s))"));
                    if let Ok(env) = &batch.records[idx].decoded {
                        r = r.for_envelope(env);
                    }
                    rejected.insert(idx, (r, attempts as i32));
                }
            }
        }
        if done {
            from = Some(mv.to);
        }
    }
    Ok(out)
}

/// Ends a transaction's span (if traced) as failed with `e`, and gives `e` back.
fn traced(span: Option<telemetry::Tx>, e: AttemptError) -> AttemptError {
    if let Some(s) = span {
        s.fail(&format!("{e:?}"));
    }
    e
}

/// The batch's pre-filter and what its lookup said.
struct Filter<'a> {
    prefilter: &'a Prefilter,
    /// Indexes (in the batch) of the records whose key Redis knows as committed.
    hits: &'a HashSet<usize>,
}

/// One lookup for the whole batch (every segment and retry uses its answer: a hit stays a
/// committed key). Returns the indexes of the hits.
async fn look_up(prefilter: &Prefilter, batch: &Batch) -> HashSet<usize> {
    let (idx, keys): (Vec<usize>, Vec<Key>) = (batch.records.iter().enumerate())
        .filter_map(|(i, r)| {
            let env = r.decoded.as_ref().ok()?;
            Some((i, (env.message_id, env.event_date)))
        })
        .unzip();
    let hits = prefilter.lookup(&keys).await;
    (idx.into_iter().zip(hits))
        .filter_map(|(i, hit)| hit.then_some(i))
        .collect()
}

/// Cuts `0..n` into segments of at most `len` records that are not hits (a hit needs no
/// transaction of its own: it rides with the next record, or the last segment).
fn cut(n: usize, len: usize, is_hit: impl Fn(usize) -> bool) -> Vec<Range<usize>> {
    let len = len.max(1);
    let mut out = Vec::new();
    let (mut start, mut counted) = (0, 0);
    for i in 0..n {
        if !is_hit(i) {
            counted += 1;
        }
        if counted == len {
            out.push(start..i + 1);
            (start, counted) = (i + 1, 0);
        }
    }
    if start < n {
        out.push(start..n);
    }
    out
}

/// What one transaction covers: its records (by index in the batch), and the offset move that
/// fences it.
struct Step<'a> {
    range: &'a Range<usize>,
    mv: offsets::Move,
}

/// One transaction over one segment.
async fn attempt(
    ctx: &PartitionCtx,
    batch: &Batch,
    Step { range, mv }: Step<'_>,
    rejected: &HashMap<usize, (Rejection, i32)>,
    shape: &Shape,
    body: &dyn Body,
    filter: Option<&Filter<'_>>,
) -> Result<Outcome, AttemptError> {
    let records = &batch.records[range.clone()];
    let mut parked = Vec::new();
    let mut parked_reasons = Vec::new();
    let mut skipped = Vec::new();
    let mut candidates: Vec<&Envelope> = Vec::new();
    let mut candidate_idx: Vec<usize> = Vec::new();
    let mut candidate_raw: Vec<&Raw> = Vec::new();
    let mut seen = HashSet::new();
    let mut duplicates_in_batch = 0u64;
    let mut prefilter_hits = 0u64;
    for (i, rec) in records.iter().enumerate() {
        let idx = range.start + i;
        let verdict = match rejected.get(&idx) {
            Some((r, attempts)) => Err((r, *attempts)),
            None => rec.decoded.as_ref().map_err(|r| (r, 1)),
        };
        match verdict {
            // Passed over on purpose: the offset moves with this transaction, nothing else.
            Err((rej, _)) if rej.skip => skipped.push(rej.reason),
            Err((rej, attempts)) => {
                parked.push(rec.raw.parked(&ctx.topic, rej, attempts));
                parked_reasons.push(rej.reason);
            }
            // Committed already, as Redis knows: nothing to insert or apply.
            Ok(_) if filter.is_some_and(|f| f.hits.contains(&idx)) => prefilter_hits += 1,
            // A copy repeated inside the batch: the first copy wins, the rest are duplicates.
            Ok(env) if !seen.insert(env.message_id) => duplicates_in_batch += 1,
            Ok(env) => {
                candidates.push(env);
                candidate_idx.push(idx);
                candidate_raw.push(&rec.raw);
            }
        }
    }

    // Tracing off: `None`, and no header is read.
    let mut span = telemetry::Tx::start(
        "process",
        telemetry::spans::Source {
            consumer: &ctx.consumer,
            topic: &ctx.topic,
            partition: Some(ctx.partition),
            strategy: shape.strategy,
            group: None,
        },
        records.len(),
        (records.iter()).filter_map(|r| telemetry::context::from_headers(&r.raw.headers)),
    );
    let carrier = span.as_ref().map(telemetry::Tx::carrier);
    let t0 = Instant::now();
    let mut conn = match ctx.pool.get().await {
        Ok(c) => c,
        Err(e) => return Err(traced(span, e.into())),
    };
    // Everything up to COMMIT, bounded by the deadline: a server that stopped answering (a
    // SIGSTOPped or frozen primary, whose kernel still acknowledges every packet, so neither
    // keepalives nor the TCP user timeout notice) must not hold the partition for ever.
    let transaction = async {
        super::stage::ensure_partitions(ctx, &**conn, &candidates).await?;
        let tx = conn.transaction().await?;
        if let Some((parent, state)) = &carrier {
            trace_context::set_local(&tx, parent, state.as_deref()).await?;
        }
        let fence = || async {
            if offsets::advance(&tx, &ctx.consumer, &ctx.topic, ctx.partition, mv).await? {
                return Ok(());
            }
            let why = offsets::why_refused(&*tx, &ctx.consumer, &ctx.topic, ctx.partition, mv);
            Err(AttemptError::Refused(why.await?))
        };
        if shape.fence_first {
            fence().await?;
        }
        let fenced_at = Instant::now();
        dead_letters::park(&tx, &ctx.consumer, &parked).await?;
        let body_at = Instant::now();
        let body_out = if candidates.is_empty() {
            BodyOutcome::default()
        } else {
            match body.run(ctx, &tx, &candidates, &candidate_raw).await {
                Ok(o) => o,
                Err(AttemptError::Reject(list)) => {
                    return Err(AttemptError::Reject(
                        list.into_iter()
                            .map(|(c, why)| (candidate_idx[c], why))
                            .collect(),
                    ))
                }
                Err(e) => return Err(e),
            }
        };
        if !shape.fence_first {
            fence().await?;
        }
        // Chaos: the process dies with the transaction complete but not committed.
        fail::fail_point!("before_commit", |_| std::process::abort());
        let committing = Instant::now();
        tx.commit().await?;
        Ok((body_out, fenced_at, body_at, committing))
    };
    let answered = match tokio::time::timeout(ctx.deadline, transaction).await {
        Ok(r) => r,
        Err(_) => Err(crate::store::StoreError::Timeout(ctx.deadline).into()),
    };
    let (body_out, fenced_at, body_at, committing) = match answered {
        Ok(done) => done,
        Err(e) => {
            if matches!(e, AttemptError::Unavailable(_)) {
                // The connection may be dead, stuck behind a statement that never returns, or
                // on a server that is read-only now: never hand it to another transaction.
                crate::store::pool::discard(conn);
            }
            return Err(traced(span, e));
        }
    };
    let commit_took = committing.elapsed();
    // Chaos: committed in PostgreSQL, Kafka not told yet.
    fail::fail_point!("after_commit", |_| std::process::abort());
    if let Some(f) = filter {
        // Every candidate's key is committed now: inserted by this transaction, or found there.
        let keys: Vec<Key> = (candidates.iter())
            .map(|e| (e.message_id, e.event_date))
            .collect();
        f.prefilter.remember(&keys).await;
    }
    let phases = super::Phases {
        fence: fenced_at - t0,
        stage: body_out.stage,
        dedupe: body_out.dedupe,
        effect: body_out.effect,
        commit: commit_took,
    };
    crate::metrics::effects_committed(&ctx.consumer, &ctx.topic, &body_out.fresh_ts_ms);
    crate::metrics::versions_skipped(&ctx.consumer, &body_out.versions);

    for p in &parked {
        tracing::warn!(consumer = %ctx.consumer, topic = p.topic, partition = p.partition,
            offset = p.offset, reason = p.reason, detail = p.detail, "message parked in dead_letters");
    }
    if let Some(mut s) = span.take() {
        s.stage("fence", t0, fenced_at);
        let mut at = body_at;
        let stages = [
            ("stage", body_out.stage),
            ("dedupe", body_out.dedupe),
            ("effect", body_out.effect),
        ];
        for (name, took) in stages.into_iter().filter(|(_, d)| !d.is_zero()) {
            s.stage(name, at, at + took);
            at += took;
        }
        s.stage("commit", committing, committing + commit_took);
        s.end(telemetry::Counts {
            records: records.len() as u64,
            fresh: body_out.fresh,
            effects: body_out.effects,
            duplicates: duplicates_in_batch + prefilter_hits + body_out.duplicates,
            parked: parked.len() as u64,
            skipped: skipped.len() as u64,
            retried: 0,
        });
    }
    Ok(Outcome {
        records: records.len() as u64,
        fresh: body_out.fresh,
        effects: body_out.effects,
        duplicates: duplicates_in_batch + prefilter_hits + body_out.duplicates,
        prefilter_hits,
        business_duplicates: body_out.business_duplicates,
        parked: parked_reasons,
        skipped,
        retries: 0,
        commits: 0,
        phases,
        versions: body_out.versions,
    })
}

#[cfg(test)]
mod tests {
    use super::cut;

    #[test]
    fn segments_are_cut_by_the_records_that_are_not_hits() {
        let hits = [true, true, false, true, false, true, true];
        let is_hit = |i: usize| hits[i];
        // Per message: each hit rides with the next message; trailing hits get one segment.
        assert_eq!(cut(7, 1, is_hit), vec![0..3, 3..5, 5..7]);
        assert_eq!(cut(7, 2, is_hit), vec![0..5, 5..7]);
        // The batch strategy: one segment, hits or not.
        assert_eq!(cut(7, usize::MAX, is_hit), vec![0..7]);
        // Without hits, as before: segments of `len` records.
        assert_eq!(cut(5, 2, |_| false), vec![0..2, 2..4, 4..5]);
        assert_eq!(cut(3, 1, |_| true), vec![0..3]);
        assert!(cut(0, 1, |_| false).is_empty());
    }
}
