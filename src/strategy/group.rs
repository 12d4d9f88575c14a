//! Commit groups (`batch.group_partitions`): the small batches of several partitions of one topic
//! committed by one transaction.
//!
//! A topic of many quiet partitions gives each partition a record now and then, and one
//! transaction per partition's batch then means one `COMMIT` (one WAL flush) per record: the
//! database's commit rate, not the message rate, sets the latency. Here a partition task hands
//! its batch to the topic's committer and waits for the answer, as it waits for its own
//! transaction otherwise (still one batch in flight per partition, offsets in order). The
//! committer takes every batch waiting, up to `group_max_records`, and runs one transaction:
//!
//! 1. lock the partitions' offset rows in partition order, then move each one fenced by its own
//!    epoch and `from` offset, as [`super::batched`] does for one;
//! 2. park the records that could not be decoded or that the handler's check refused;
//! 3. one binary `COPY` of every first copy, one dedupe insert, the handler once over all fresh
//!    messages (`BatchContext::partition` is `None`; each message carries its own);
//! 4. `COMMIT`, then every task hears it committed and tells Kafka.
//!
//! While `group_connections` groups are in flight, the next batches wait and the next group is
//! larger: group commit without a timer. Failure handling stays the code that exists: a refused
//! fence sends that partition's batch back to its own task (whose transaction finds out why:
//! fenced, went back, or committed already) and the group runs again without it; any other
//! failure sends every batch of the group back, each then committed on its own by
//! `super::segments`, with its retries and its split in halves. Nothing is half-applied: the
//! group's transaction commits whole or not at all.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot, Semaphore};

use super::{AttemptError, BatchError, Outcome, PartitionCtx, Phases};
use crate::batch::Batch;
use crate::config::BatchConfig;
use crate::envelope::Envelope;
use crate::handler::BatchContext;
use crate::store::dead_letters::{self, Parked};
use crate::store::offsets::{self, Move};
use crate::store::trace_context;
use crate::telemetry;

/// The committers of one consumer, one per topic.
pub struct Groups {
    max_records: usize,
    by_topic: HashMap<String, mpsc::Sender<Member>>,
}

/// What the committer answers a partition task.
pub enum Reply {
    /// Committed with the group.
    Committed(Outcome),
    /// Not committed: the task commits the batch on its own. `rolled_back`: the group's
    /// transaction failed with this batch in it (the handler or the database), an attempt that
    /// counts as a retry of the batch; otherwise the group never tried it, or refused its fence.
    Alone { batch: Batch, rolled_back: bool },
}

struct Member {
    ctx: PartitionCtx,
    batch: Batch,
    reply: oneshot::Sender<Reply>,
}

impl Groups {
    /// Starts a committer for each of `topics` (on the current tokio runtime).
    pub fn start(cfg: &BatchConfig, topics: &[String]) -> Groups {
        let connections = cfg.group_connections.max(1);
        let max_records = cfg.group_max_records.max(1);
        let by_topic = (topics.iter())
            .map(|topic| {
                let (tx, rx) = mpsc::channel(1024);
                tokio::spawn(committer(rx, connections, max_records));
                (topic.clone(), tx)
            })
            .collect();
        Groups {
            max_records,
            by_topic,
        }
    }

    /// Whether `batch` joins a group: a batch as large as a group commits on its own anyway.
    pub fn takes(&self, batch: &Batch) -> bool {
        !batch.is_empty() && batch.len() < self.max_records
    }

    /// Hands `batch` to its topic's committer and waits for the answer.
    pub async fn submit(&self, ctx: &PartitionCtx, batch: Batch) -> Result<Reply, BatchError> {
        let Some(sender) = self.by_topic.get(&*ctx.topic) else {
            return Ok(Reply::Alone {
                batch,
                rolled_back: false,
            });
        };
        let (reply, answer) = oneshot::channel();
        let member = Member {
            ctx: ctx.clone(),
            batch,
            reply,
        };
        if let Err(mpsc::error::SendError(m)) = sender.send(member).await {
            return Ok(Reply::Alone {
                batch: m.batch,
                rolled_back: false,
            });
        }
        // The committer always answers, unless its task died (a handler that panicked). Whether
        // that group committed is unknown here: the worker stops, and the partition's next owner
        // resumes from the offset PostgreSQL holds.
        answer
            .await
            .map_err(|_| BatchError::Fatal("a commit group's task ended without answering".into()))
    }
}

/// Takes every waiting batch into a group, up to `max_records`, and commits it, with at most
/// `connections` groups in flight.
async fn committer(mut rx: mpsc::Receiver<Member>, connections: usize, max_records: usize) {
    let slots = Arc::new(Semaphore::new(connections));
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let Some(first) = rx.recv().await else {
            return;
        };
        let mut records = first.batch.len();
        let mut members = vec![first];
        while records < max_records {
            match rx.try_recv() {
                Ok(m) => {
                    records += m.batch.len();
                    members.push(m);
                }
                Err(_) => break,
            }
        }
        tokio::spawn(async move {
            commit(members).await;
            drop(slot);
        });
    }
}

/// Commits `members` in one transaction, answering each task.
async fn commit(mut members: Vec<Member>) {
    loop {
        match attempt(&members).await {
            Ok(outcomes) => {
                for (m, o) in members.into_iter().zip(outcomes) {
                    let _ = m.reply.send(Reply::Committed(o));
                }
                return;
            }
            Err(Failure::Refused(partitions)) => {
                let (refused, rest): (Vec<Member>, Vec<Member>) = members
                    .into_iter()
                    .partition(|m| partitions.contains(&m.ctx.partition));
                for m in refused {
                    let _ = m.reply.send(Reply::Alone {
                        batch: m.batch,
                        rolled_back: false,
                    });
                }
                if rest.is_empty() {
                    return;
                }
                members = rest;
            }
            Err(Failure::Other(e)) => {
                tracing::debug!(topic = %members[0].ctx.topic, members = members.len(), error = ?e,
                    "commit group rolled back; each batch commits on its own");
                for m in members {
                    let _ = m.reply.send(Reply::Alone {
                        batch: m.batch,
                        rolled_back: true,
                    });
                }
                return;
            }
        }
    }
}

enum Failure {
    /// These partitions' fences did not move.
    Refused(Vec<i32>),
    Other(AttemptError),
}

macro_rules! other {
    ($($t:ty),*) => {$(
        impl From<$t> for Failure {
            fn from(e: $t) -> Self {
                Failure::Other(e.into())
            }
        }
    )*};
}
other!(
    AttemptError,
    crate::store::StoreError,
    tokio_postgres::Error,
    deadpool_postgres::PoolError,
    crate::handler::HandlerError
);

/// Where each message of the group comes from.
struct Sorted<'a> {
    parked: Vec<Parked<'a>>,
    /// Per member: its parked records' reasons.
    reasons: Vec<Vec<crate::envelope::Reason>>,
    /// Per member: its records passed over on purpose (skipped tombstones).
    skipped: Vec<Vec<crate::envelope::Reason>>,
    candidates: Vec<&'a Envelope>,
    /// The member each candidate belongs to.
    owner: Vec<usize>,
    /// Per member: copies repeated inside the group (the first copy wins).
    repeated: Vec<u64>,
}

fn sort(members: &[Member]) -> Sorted<'_> {
    let mut s = Sorted {
        parked: Vec::new(),
        reasons: vec![Vec::new(); members.len()],
        skipped: vec![Vec::new(); members.len()],
        candidates: Vec::new(),
        owner: Vec::new(),
        repeated: vec![0; members.len()],
    };
    let mut seen = HashSet::new();
    for (i, m) in members.iter().enumerate() {
        for rec in &m.batch.records {
            match &rec.decoded {
                Err(rej) if rej.skip => s.skipped[i].push(rej.reason),
                Err(rej) => {
                    s.parked.push(rec.raw.parked(&m.ctx.topic, rej, 1));
                    s.reasons[i].push(rej.reason);
                }
                Ok(env) if !seen.insert(env.message_id) => s.repeated[i] += 1,
                Ok(env) => {
                    s.candidates.push(env);
                    s.owner.push(i);
                }
            }
        }
    }
    s
}

/// One transaction for the whole group. The outcomes follow `members`; the group's commit, its
/// effects and its phases are counted on the first.
async fn attempt(members: &[Member]) -> Result<Vec<Outcome>, Failure> {
    let ctx = &members[0].ctx;
    let sorted = sort(members);
    let moves: Vec<(i32, Move)> = members
        .iter()
        .map(|m| {
            let to = m.batch.next_offset().expect("a group member is not empty");
            let mv = Move {
                epoch: m.ctx.epoch,
                from: m.batch.stored,
                to,
            };
            (m.ctx.partition, mv)
        })
        .collect();
    // Tracing off: `None`, and nothing is counted or read.
    let span = telemetry::enabled().then(|| {
        let records = members.iter().flat_map(|m| &m.batch.records);
        telemetry::Tx::start(
            "process",
            telemetry::spans::Source {
                consumer: &ctx.consumer,
                topic: &ctx.topic,
                // One member: its partition; several: each member's record says its own.
                partition: (members.len() == 1).then_some(ctx.partition),
                strategy: "batch",
                group: Some(members.len()),
            },
            records.clone().count(),
            records.filter_map(|r| telemetry::context::from_headers(&r.raw.headers)),
        )
    });
    let span = span.flatten();
    let carrier = span.as_ref().map(telemetry::Tx::carrier);
    let t0 = Instant::now();
    let mut conn = ctx.pool.get().await?;
    let transaction = async {
        super::stage::ensure_partitions(ctx, &**conn, &sorted.candidates).await?;
        let tx = conn.transaction().await?;
        if let Some((parent, state)) = &carrier {
            trace_context::set_local(&tx, parent, state.as_deref()).await?;
        }
        let refused = offsets::advance_many(&tx, &ctx.consumer, &ctx.topic, &moves).await?;
        if !refused.is_empty() {
            return Err(Failure::Refused(refused));
        }
        let t1 = Instant::now();
        dead_letters::park(&tx, &ctx.consumer, &sorted.parked).await?;
        let mut fresh_seq = Vec::new();
        let mut applied = crate::handler::Applied::default();
        let (t2, t3) = if sorted.candidates.is_empty() {
            (t1, t1)
        } else {
            let t2;
            (t2, fresh_seq) = super::stage::stage_and_dedupe(ctx, &tx, &sorted.candidates).await?;
            let t3 = Instant::now();
            if !fresh_seq.is_empty() {
                let fresh: Vec<&Envelope> =
                    fresh_seq.iter().map(|&i| sorted.candidates[i]).collect();
                let bctx = BatchContext {
                    consumer: &ctx.consumer,
                    topic: &ctx.topic,
                    partition: None,
                    versions: None,
                    business_row: ctx.dedupe == crate::config::Dedupe::BusinessRow,
                };
                applied = ctx.handler.apply(&tx, &bctx, &fresh).await?;
            }
            (t2, t3)
        };
        let t4 = Instant::now();
        // Chaos: the process dies with the group's transaction complete but not committed.
        fail::fail_point!("before_commit", |_| std::process::abort());
        tx.commit().await?;
        let phases = Phases {
            fence: t1 - t0,
            stage: t2 - t1,
            dedupe: t3 - t2,
            effect: t4 - t3,
            commit: t4.elapsed(),
        };
        Ok((fresh_seq, applied, phases))
    };
    let answered = match tokio::time::timeout(ctx.deadline, transaction).await {
        Ok(r) => r,
        Err(_) => Err(AttemptError::from(crate::store::StoreError::Timeout(ctx.deadline)).into()),
    };
    let (fresh_seq, applied, phases) = match answered {
        Ok(done) => done,
        Err(e) => {
            if let Some(s) = span {
                s.fail(&match &e {
                    Failure::Refused(p) => format!("fence refused for partitions {p:?}"),
                    Failure::Other(e) => format!("{e:?}"),
                });
            }
            if matches!(e, Failure::Other(AttemptError::Unavailable(_))) {
                // As in `segments`: a connection that failed this way is never reused.
                crate::store::pool::discard(conn);
            }
            return Err(e);
        }
    };
    // Chaos: committed in PostgreSQL, Kafka not told yet.
    fail::fail_point!("after_commit", |_| std::process::abort());
    let fresh_ts: Vec<i64> = (fresh_seq.iter())
        .filter_map(|&i| sorted.candidates[i].kafka_ts.map(|t| t.timestamp_millis()))
        .collect();
    crate::metrics::effects_committed(&ctx.consumer, &ctx.topic, &fresh_ts);
    for p in &sorted.parked {
        tracing::warn!(consumer = %ctx.consumer, topic = p.topic, partition = p.partition,
            offset = p.offset, reason = p.reason, detail = p.detail, "message parked in dead_letters");
    }

    let mut fresh = vec![0u64; members.len()];
    for &i in &fresh_seq {
        fresh[sorted.owner[i]] += 1;
    }
    // Copies the handler's row recognised (business-row only), counted as duplicates of their
    // key; the handler says how many, not whose, so they are taken from the members in order.
    let mut redelivered = applied.redelivered;
    for f in fresh.iter_mut() {
        let take = redelivered.min(*f);
        *f -= take;
        redelivered -= take;
    }
    let mut candidates = vec![0u64; members.len()];
    for &o in &sorted.owner {
        candidates[o] += 1;
    }
    if let Some(mut s) = span {
        let mut at = t0;
        for (name, took) in [
            ("fence", phases.fence),
            ("stage", phases.stage),
            ("dedupe", phases.dedupe),
            ("effect", phases.effect),
            ("commit", phases.commit),
        ] {
            s.stage(name, at, at + took);
            at += took;
        }
        s.end(telemetry::Counts {
            records: members.iter().map(|m| m.batch.len() as u64).sum(),
            fresh: fresh.iter().sum(),
            effects: applied.effects,
            duplicates: (sorted.repeated.iter().sum::<u64>())
                + (sorted.candidates.len() as u64 - fresh.iter().sum::<u64>()),
            parked: sorted.parked.len() as u64,
            skipped: sorted.skipped.iter().map(|v| v.len() as u64).sum(),
            retried: 0,
        });
    }
    let mut reasons = sorted.reasons;
    let mut skipped = sorted.skipped;
    Ok((members.iter().enumerate())
        .map(|(i, m)| {
            let first = i == 0;
            Outcome {
                records: m.batch.len() as u64,
                fresh: fresh[i],
                effects: if first { applied.effects } else { 0 },
                duplicates: sorted.repeated[i] + candidates[i] - fresh[i],
                prefilter_hits: 0,
                business_duplicates: if first {
                    applied.business_duplicates
                } else {
                    0
                },
                parked: std::mem::take(&mut reasons[i]),
                skipped: std::mem::take(&mut skipped[i]),
                retries: 0,
                commits: u64::from(first),
                phases: if first { phases } else { Phases::default() },
                versions: Default::default(),
            }
        })
        .collect())
}
