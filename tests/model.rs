//! Model-based test of the pipeline's bookkeeping against the real PostgreSQL, without Kafka.
//!
//! The "broker" is an in-memory log per partition that the test owns (2 partitions of one
//! topic). Each "worker" is a [`PartitionCtx`] holding the epoch it claimed with
//! [`offsets::claim`]; a batch is a run of the log starting at the offset PostgreSQL stores for
//! the partition (where a worker seeking to it would start), handed to the strategy under test
//! (`Batched` or `PerMessage`, one per case) with the built-in cashback handler at 2%.
//!
//! proptest generates a sequence of operations; each is applied to the real system and to a
//! small model, and after every operation the whole state PostgreSQL holds for the case's
//! consumer is read back and compared with the model:
//!
//! - the cashback credits are exactly the distinct payments whose record (any copy) lies below
//!   the stored offset of its partition, once each, with 2% of the amount rounded down; the
//!   wallets and the outbox agree;
//! - the dedupe keys are exactly the distinct event ids below the stored offsets;
//! - the dead letters are exactly the junk records below the stored offsets, parked once;
//! - the stored offsets and epochs are the model's;
//! - the "Kafka committed offset" (what the `committed` callback reported, the last value per
//!   partition) only grows and is never ahead of the stored offset.
//!
//! The model's offsets are exact after a delivery that completes; after a batch whose future
//! is dropped (a crash) they are resolved from what PostgreSQL stored, after checking it is a
//! legal outcome (the batch strategy: nothing or everything; per message: a prefix).
//!
//! Not modelled: database outages. Terminating the pool's connections
//! (`pg_terminate_backend` on `application_name = 'effectively'`) would also kill the
//! connections of the other integration tests that share this database and run in parallel,
//! so it is left to tests that own their database. Handler failures (transient, reject,
//! split-and-isolate) have their own tests in `tests/failures.rs`.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use deadpool_postgres::Pool;
use effectively::batch::{Batch, Raw, Record};
use effectively::config::{EventDateSource, MessageIdConfig, RetryConfig};
use effectively::envelope::{Decoder, RawRecord};
use effectively::handler::cashback::{cashback_paise, outbox_id, Cashback};
use effectively::handler::Handler;
use effectively::store::offsets;
use effectively::store::partitions::Known;
use effectively::store::pool::{self, PoolOptions};
use effectively::strategy::batched::Batched;
use effectively::strategy::per_message::PerMessage;
use effectively::strategy::{BatchError, Outcome, PartitionCtx, Strategy as BatchStrategy};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, TestCaseError, TestError, TestRunner};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const PARTITIONS: usize = 2;
const USERS: u8 = 4;
const RATE_BP: i32 = 200;
/// A batch that takes longer than this is a hang (a lock never released, a retry loop).
const BATCH_DEADLINE: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strat {
    Batched,
    PerMessage,
}

#[derive(Debug, Clone)]
enum Op {
    /// Appends new payments `(user, amount_paise)` to a partition's log.
    Produce { p: usize, payments: Vec<(u8, i64)> },
    /// Appends a record that does not decode (not JSON) but has an event id: it must be parked.
    ProduceJunk { p: usize },
    /// Appends a copy (same key, headers and bytes) of an already produced payment, picked
    /// among all partitions' payments, at the partition's next offset: a relay resend.
    Redeliver { p: usize, k: Index },
    /// The owner processes up to `max` records from the stored offset.
    Deliver { p: usize, max: usize },
    /// Both owners process a batch at the same time.
    DeliverBoth { max: [usize; 2] },
    /// Like `Deliver`, but the batch's future is dropped after it returned `Pending` `polls`
    /// times (if it has not finished by then).
    CrashMidBatch { p: usize, max: usize, polls: u32 },
    /// A new owner claims the partition; the old one becomes a zombie.
    Rebalance { p: usize },
    /// The owner processes a batch while, `delay_us` after it started, a new owner claims the
    /// partition.
    RacingRebalance { p: usize, max: usize, delay_us: u64 },
    /// A fenced-off owner processes a batch: it must fail with `Fenced` and change nothing.
    ZombieDeliver { p: usize, which: Index, max: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let p = 0..PARTITIONS;
    let max = 1usize..8;
    let amount = prop_oneof![0i64..200, 0i64..2_000_000];
    prop_oneof![
        4 => (p.clone(), prop::collection::vec((0..USERS, amount), 1..5))
            .prop_map(|(p, payments)| Op::Produce { p, payments }),
        1 => p.clone().prop_map(|p| Op::ProduceJunk { p }),
        2 => (p.clone(), any::<Index>()).prop_map(|(p, k)| Op::Redeliver { p, k }),
        4 => (p.clone(), max.clone()).prop_map(|(p, max)| Op::Deliver { p, max }),
        1 => (max.clone(), max.clone()).prop_map(|(a, b)| Op::DeliverBoth { max: [a, b] }),
        3 => (p.clone(), max.clone(), 0u32..30)
            .prop_map(|(p, max, polls)| Op::CrashMidBatch { p, max, polls }),
        1 => p.clone().prop_map(|p| Op::Rebalance { p }),
        1 => (p.clone(), max.clone(), 0u64..4_000)
            .prop_map(|(p, max, delay_us)| Op::RacingRebalance { p, max, delay_us }),
        2 => (p, any::<Index>(), max).prop_map(|(p, which, max)| Op::ZombieDeliver { p, which, max }),
    ]
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Pay {
    payment_id: String,
    user_id: String,
    amount_paise: i64,
    /// The event's date (its `occurred_at`), part of its outbox row's id.
    event_date: chrono::NaiveDate,
}

/// One record of the in-memory log.
#[derive(Debug, Clone)]
struct Logged {
    raw: Raw,
    event_id: Uuid,
    /// Does not decode: parked when its batch commits.
    junk: bool,
}

#[derive(Debug, Default)]
struct Model {
    logs: [Vec<Logged>; PARTITIONS],
    /// Every payment produced, by event id.
    payments: BTreeMap<Uuid, Pay>,
    /// Where each payment was first produced, `(partition, offset)`, in production order: what
    /// `Redeliver` picks from.
    produced: Vec<(usize, usize)>,
    /// PostgreSQL's `next_offset` (None: nothing committed yet).
    stored: [Option<i64>; PARTITIONS],
    epoch: [i64; PARTITIONS],
}

impl Model {
    fn position(&self, p: usize) -> usize {
        self.stored[p].unwrap_or(0) as usize
    }

    /// The records a worker starting at the stored offset would batch, at most `max`.
    fn next_batch(&self, p: usize, max: usize) -> Vec<Logged> {
        let from = self.position(p).min(self.logs[p].len());
        let to = (from + max).min(self.logs[p].len());
        self.logs[p][from..to].to_vec()
    }

    /// Records below the stored offsets: they left the partition.
    fn consumed(&self) -> impl Iterator<Item = &Logged> + '_ {
        (0..PARTITIONS).flat_map(move |p| self.logs[p][..self.position(p)].iter())
    }

    /// The payment events that must be applied, once each.
    fn applied(&self) -> BTreeSet<Uuid> {
        self.consumed()
            .filter(|l| !l.junk)
            .map(|l| l.event_id)
            .collect()
    }

    /// The junk records that must be parked: `(partition, offset)` → event id.
    fn parked(&self) -> BTreeMap<(i32, i64), (Uuid, Bytes)> {
        self.consumed()
            .filter(|l| l.junk)
            .map(|l| {
                (
                    (l.raw.partition, l.raw.offset),
                    (l.event_id, l.raw.payload.clone().unwrap_or_default()),
                )
            })
            .collect()
    }

    fn append(&mut self, p: usize, mut raw: Raw, event_id: Uuid, junk: bool) {
        raw.partition = p as i32;
        raw.offset = self.logs[p].len() as i64;
        raw.timestamp_ms = Some(chrono::Utc::now().timestamp_millis());
        self.logs[p].push(Logged {
            raw,
            event_id,
            junk,
        });
    }
}

// ---------------------------------------------------------------------------------------------
// The system under test
// ---------------------------------------------------------------------------------------------

/// What the `committed` callback of a partition reported: the "Kafka committed offsets", in
/// call order.
type History = Arc<Mutex<Vec<i64>>>;

struct Sut {
    consumer: Arc<str>,
    topic: Arc<str>,
    strat: Arc<dyn BatchStrategy>,
    kind: Strat,
    pool: Pool,
    known: Arc<Known>,
    handler: Arc<dyn Handler>,
    db: tokio_postgres::Client,
    decoder: Decoder,
    users: Vec<String>,
    owners: Vec<PartitionCtx>,
    zombies: [Vec<PartitionCtx>; PARTITIONS],
    kafka: [History; PARTITIONS],
    /// Commits reported by zombies (must stay 0).
    zombie_commits: Arc<AtomicU64>,
    claims: u64,
}

#[derive(Debug, Default)]
struct Stats {
    crashes_interrupted: AtomicU64,
    crashes_completed: AtomicU64,
    crash_committed: AtomicU64,
    races_fenced: AtomicU64,
    races_won: AtomicU64,
    zombie_batches: AtomicU64,
    delivered_records: AtomicU64,
}

macro_rules! check {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

macro_rules! check_eq {
    ($left:expr, $right:expr, $($fmt:tt)+) => {{
        let (l, r) = (&$left, &$right);
        if l != r {
            return Err(format!("{}: {:?} != {:?}", format!($($fmt)+), l, r));
        }
    }};
}

impl Sut {
    async fn new(kind: Strat) -> Sut {
        let consumer: Arc<str> = Arc::from(common::unique("model").as_str());
        let topic: Arc<str> = Arc::from(common::unique("model-topic").as_str());
        let pool = pool::build(
            &common::database_url(),
            &PoolOptions {
                size: 4,
                connect_timeout: Duration::from_secs(5),
                idle_in_transaction_timeout: Duration::from_secs(60),
                no_parallel_query: false,
            },
        )
        .expect("pool");
        let strat: Arc<dyn BatchStrategy> = match kind {
            Strat::Batched => Arc::new(Batched::default()),
            Strat::PerMessage => Arc::new(PerMessage::default()),
        };
        let users = (0..USERS).map(|u| format!("{consumer}-u{u}")).collect();
        let mut sut = Sut {
            consumer,
            topic,
            strat,
            kind,
            pool,
            known: Arc::new(Known::default()),
            handler: Arc::new(Cashback::new(RATE_BP as u32)),
            db: common::pg().await,
            decoder: Decoder::new(
                &MessageIdConfig::header("event_id"),
                &EventDateSource::Auto,
                1 << 20,
                true,
            ),
            users,
            owners: Vec::new(),
            zombies: Default::default(),
            kafka: Default::default(),
            zombie_commits: Arc::new(AtomicU64::new(0)),
            claims: 0,
        };
        for p in 0..PARTITIONS {
            let (ctx, claim) = sut.claim(p).await;
            assert_eq!(claim.epoch, 1, "a new consumer's first claim");
            assert_eq!(claim.next_offset, None);
            sut.owners.push(ctx);
        }
        sut
    }

    async fn claim(&mut self, p: usize) -> (PartitionCtx, offsets::Claim) {
        self.claims += 1;
        let claim = offsets::claim(
            &self.db,
            &self.consumer,
            &self.topic,
            p as i32,
            &format!("worker-{}", self.claims),
        )
        .await
        .expect("claim");
        let ctx = PartitionCtx {
            consumer: Arc::clone(&self.consumer),
            topic: Arc::clone(&self.topic),
            partition: p as i32,
            epoch: claim.epoch,
            pool: self.pool.clone(),
            handler: Arc::clone(&self.handler),
            retry: RetryConfig {
                max_attempts: 5,
                initial_backoff: Duration::from_millis(5),
                max_backoff: Duration::from_millis(200),
            },
            partitions: Arc::clone(&self.known),
            cancel: CancellationToken::new(),
            version: None,
            deadline: std::time::Duration::from_secs(30),
            dedupe: effectively::config::Dedupe::Ledger,
        };
        (ctx, claim)
    }

    /// A batch of `records` for a worker that last saw the partition's offset at `stored`.
    fn batch(&self, records: &[Logged], stored: Option<i64>) -> Batch {
        let mut b = Batch {
            stored,
            ..Batch::default()
        };
        for l in records {
            let raw = l.raw.clone();
            let decoded = raw.with_view(|v: &RawRecord<'_>| self.decoder.decode(v));
            b.push(Record { raw, decoded });
        }
        b
    }

    fn recorder(&self, p: usize) -> impl Fn(i64) + Send + Sync + 'static {
        let history = Arc::clone(&self.kafka[p]);
        move |o| history.lock().unwrap().push(o)
    }

    /// Waits until every connection of the pool has finished what a dropped future left on it
    /// (a `ROLLBACK` queued by a dropped transaction, or a `COMMIT` already sent): a statement
    /// on a connection is answered only after the ones sent before it.
    async fn settle(&self) {
        let max = self.pool.status().max_size;
        let mut conns = Vec::with_capacity(max);
        for _ in 0..max {
            conns.push(self.pool.get().await.expect("pool connection"));
        }
        for c in &conns {
            c.simple_query("SELECT 1")
                .await
                .expect("a pooled connection works after a dropped batch");
        }
    }

    async fn stored(&self, p: usize) -> Option<i64> {
        common::stored_offset(&self.db, &self.consumer, &self.topic, p as i32).await
    }
}

/// Polls `fut` until it is ready or has returned `Pending` `polls` times; then drops it.
async fn crash_after<F: Future>(polls: u32, fut: F) -> Option<F::Output> {
    let mut fut = pin!(fut);
    let mut pending = 0;
    std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
        Poll::Ready(v) => Poll::Ready(Some(v)),
        Poll::Pending if pending >= polls => Poll::Ready(None),
        Poll::Pending => {
            pending += 1;
            Poll::Pending
        }
    })
    .await
}

async fn deadline<F: Future>(what: &str, fut: F) -> Result<F::Output, String> {
    tokio::time::timeout(BATCH_DEADLINE, fut)
        .await
        .map_err(|_| format!("{what}: no answer in {BATCH_DEADLINE:?}"))
}

/// What a batch's outcome must say, given what was applied before it.
fn expect_outcome(
    kind: Strat,
    out: &Outcome,
    records: &[Logged],
    applied_before: &BTreeSet<Uuid>,
) -> Result<(), String> {
    let junk = records.iter().filter(|l| l.junk).count() as u64;
    let payments = records.len() as u64 - junk;
    let fresh = records
        .iter()
        .filter(|l| !l.junk && !applied_before.contains(&l.event_id))
        .map(|l| l.event_id)
        .collect::<BTreeSet<_>>()
        .len() as u64;
    check_eq!(out.records, records.len() as u64, "outcome.records");
    check_eq!(out.fresh, fresh, "outcome.fresh");
    check_eq!(
        out.effects,
        fresh,
        "outcome.effects (payment ids are unique)"
    );
    check_eq!(out.duplicates, payments - fresh, "outcome.duplicates");
    check_eq!(out.business_duplicates, 0, "outcome.business_duplicates");
    check_eq!(out.parked.len() as u64, junk, "outcome.parked");
    check_eq!(out.retries, 0, "outcome.retries (nothing fails here)");
    let commits = match kind {
        Strat::Batched => 1,
        Strat::PerMessage => records.len() as u64,
    };
    check_eq!(out.commits, commits, "outcome.commits");
    Ok(())
}

/// Is `after` a legal stored offset after a batch of `records` that started at `before` and
/// stopped part-way (dropped, or fenced by a claim)?
fn legal_partial(
    kind: Strat,
    before: Option<i64>,
    after: Option<i64>,
    records: &[Logged],
) -> Result<(), String> {
    let end = records.last().map(|l| l.raw.offset + 1);
    match kind {
        // One transaction: all or nothing.
        Strat::Batched => check!(
            after == before || after == end,
            "batch strategy: stored offset {after:?} is neither {before:?} (nothing) nor {end:?} (all)"
        ),
        // One transaction per record: any prefix.
        Strat::PerMessage => {
            let start = records.first().map(|l| l.raw.offset);
            check!(
                after == before || (after >= start.map(|s| s + 1) && after <= end),
                "per-message strategy: stored offset {after:?} is not a prefix of {start:?}..{end:?} (was {before:?})"
            )
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Applying one operation
// ---------------------------------------------------------------------------------------------

async fn apply(sut: &mut Sut, model: &mut Model, op: &Op, stats: &Stats) -> Result<(), String> {
    match op {
        Op::Produce { p, payments } => {
            for &(user, amount) in payments {
                let pay = common::Payment::new(&sut.users[user as usize], amount);
                let raw = Raw {
                    partition: 0,
                    offset: 0,
                    timestamp_ms: None,
                    key: Some(Bytes::from(pay.user_id.clone())),
                    payload: Some(Bytes::from(pay.json())),
                    headers: vec![(
                        "event_id".into(),
                        Some(Bytes::from(pay.event_id.to_string())),
                    )],
                };
                model.payments.insert(
                    pay.event_id,
                    Pay {
                        payment_id: pay.payment_id.clone(),
                        user_id: pay.user_id.clone(),
                        amount_paise: amount,
                        event_date: pay.occurred_at.date_naive(),
                    },
                );
                model.produced.push((*p, model.logs[*p].len()));
                model.append(*p, raw, pay.event_id, false);
            }
        }
        Op::ProduceJunk { p } => {
            let id = Uuid::now_v7();
            let raw = Raw {
                partition: 0,
                offset: 0,
                timestamp_ms: None,
                key: None,
                payload: Some(Bytes::from(format!("not json {id}"))),
                headers: vec![("event_id".into(), Some(Bytes::from(id.to_string())))],
            };
            model.append(*p, raw, id, true);
        }
        Op::Redeliver { p, k } => {
            if model.produced.is_empty() {
                return Ok(());
            }
            let (from_p, at) = model.produced[k.index(model.produced.len())];
            let original = model.logs[from_p][at].clone();
            model.append(*p, original.raw, original.event_id, false);
        }
        Op::Deliver { p, max } => {
            let records = model.next_batch(*p, *max);
            if records.is_empty() {
                return Ok(());
            }
            let before = model.applied();
            let cb = sut.recorder(*p);
            let out = deadline(
                "deliver",
                sut.strat
                    .process(&sut.owners[*p], sut.batch(&records, model.stored[*p]), &cb),
            )
            .await?
            .map_err(|e| format!("the owner's batch failed: {e}"))?;
            expect_outcome(sut.kind, &out, &records, &before)?;
            model.stored[*p] = Some(records.last().unwrap().raw.offset + 1);
            stats
                .delivered_records
                .fetch_add(records.len() as u64, Ordering::Relaxed);
        }
        Op::DeliverBoth { max } => {
            let r0 = model.next_batch(0, max[0]);
            let r1 = model.next_batch(1, max[1]);
            let before = model.applied();
            let (cb0, cb1) = (sut.recorder(0), sut.recorder(1));
            let (b0, b1) = (
                sut.batch(&r0, model.stored[0]),
                sut.batch(&r1, model.stored[1]),
            );
            let (ctx0, ctx1) = (&sut.owners[0], &sut.owners[1]);
            let strat = &sut.strat;
            let (o0, o1) = deadline(
                "deliver on both partitions",
                futures::future::join(
                    async {
                        if b0.is_empty() {
                            return Ok(Outcome::default());
                        }
                        strat.process(ctx0, b0, &cb0).await
                    },
                    async {
                        if b1.is_empty() {
                            return Ok(Outcome::default());
                        }
                        strat.process(ctx1, b1, &cb1).await
                    },
                ),
            )
            .await?;
            let o0 = o0.map_err(|e| format!("partition 0's batch failed: {e}"))?;
            let o1 = o1.map_err(|e| format!("partition 1's batch failed: {e}"))?;
            for (p, r) in [(0, &r0), (1, &r1)] {
                if let Some(last) = r.last() {
                    model.stored[p] = Some(last.raw.offset + 1);
                }
            }
            let after = model.applied();
            let fresh = (after.len() - before.len()) as u64;
            let payments = r0.iter().chain(&r1).filter(|l| !l.junk).count() as u64;
            check_eq!(o0.fresh + o1.fresh, fresh, "fresh over both batches");
            check_eq!(o0.effects + o1.effects, fresh, "effects over both batches");
            check_eq!(
                o0.duplicates + o1.duplicates,
                payments - fresh,
                "duplicates over both batches"
            );
            check_eq!(o0.records, r0.len() as u64, "partition 0 records");
            check_eq!(o1.records, r1.len() as u64, "partition 1 records");
            stats
                .delivered_records
                .fetch_add((r0.len() + r1.len()) as u64, Ordering::Relaxed);
        }
        Op::CrashMidBatch { p, max, polls } => {
            let records = model.next_batch(*p, *max);
            if records.is_empty() {
                return Ok(());
            }
            let before = model.applied();
            let cb = sut.recorder(*p);
            let result = deadline(
                "crashing batch",
                crash_after(
                    *polls,
                    sut.strat
                        .process(&sut.owners[*p], sut.batch(&records, model.stored[*p]), &cb),
                ),
            )
            .await?;
            match result {
                Some(done) => {
                    stats.crashes_completed.fetch_add(1, Ordering::Relaxed);
                    let out = done.map_err(|e| format!("the owner's batch failed: {e}"))?;
                    expect_outcome(sut.kind, &out, &records, &before)?;
                    model.stored[*p] = Some(records.last().unwrap().raw.offset + 1);
                }
                None => {
                    stats.crashes_interrupted.fetch_add(1, Ordering::Relaxed);
                    sut.settle().await;
                    let stored = sut.stored(*p).await;
                    legal_partial(sut.kind, model.stored[*p], stored, &records)?;
                    if stored != model.stored[*p] {
                        stats.crash_committed.fetch_add(1, Ordering::Relaxed);
                    }
                    model.stored[*p] = stored;
                }
            }
        }
        Op::Rebalance { p } => {
            let (ctx, claim) = sut.claim(*p).await;
            check_eq!(claim.epoch, model.epoch[*p] + 1, "claim's epoch");
            check_eq!(
                claim.next_offset,
                model.stored[*p],
                "claim's offset (where the new owner resumes)"
            );
            model.epoch[*p] = claim.epoch;
            let old = std::mem::replace(&mut sut.owners[*p], ctx);
            sut.zombies[*p].push(old);
        }
        Op::RacingRebalance { p, max, delay_us } => {
            let records = model.next_batch(*p, *max);
            let before_offset = model.stored[*p];
            let task = {
                let strat = Arc::clone(&sut.strat);
                let ctx = sut.owners[*p].clone();
                let batch = sut.batch(&records, before_offset);
                let cb = sut.recorder(*p);
                tokio::spawn(async move {
                    if batch.is_empty() {
                        return Ok(Outcome::default());
                    }
                    strat.process(&ctx, batch, &cb).await
                })
            };
            // The block_on thread is not one of the runtime's workers: the batch goes on.
            let until = Instant::now() + Duration::from_micros(*delay_us);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
            let (ctx, claim) = sut.claim(*p).await;
            let result = deadline("racing batch", task)
                .await?
                .map_err(|e| format!("batch task panicked: {e}"))?;
            let stored = sut.stored(*p).await;
            check_eq!(claim.epoch, model.epoch[*p] + 1, "claim's epoch");
            check_eq!(
                claim.next_offset,
                stored,
                "the claim read the stored offset, and nothing committed under the old epoch after it"
            );
            match result {
                Ok(_) => {
                    stats.races_won.fetch_add(1, Ordering::Relaxed);
                    check_eq!(
                        stored,
                        records.last().map(|l| l.raw.offset + 1).or(before_offset),
                        "a batch that returned Ok committed all of it"
                    );
                }
                Err(BatchError::Fenced) => {
                    stats.races_fenced.fetch_add(1, Ordering::Relaxed);
                    legal_partial(sut.kind, before_offset, stored, &records)?;
                    if sut.kind == Strat::Batched {
                        check_eq!(stored, before_offset, "a fenced batch committed nothing");
                    }
                }
                Err(e) => return Err(format!("racing batch: unexpected error {e}")),
            }
            model.stored[*p] = stored;
            model.epoch[*p] = claim.epoch;
            let old = std::mem::replace(&mut sut.owners[*p], ctx);
            sut.zombies[*p].push(old);
        }
        Op::ZombieDeliver { p, which, max } => {
            if sut.zombies[*p].is_empty() {
                return Ok(());
            }
            let zombie = sut.zombies[*p][which.index(sut.zombies[*p].len())].clone();
            // What the zombie still has in hand: the next records if any, else the last ones.
            let mut records = model.next_batch(*p, *max);
            if records.is_empty() {
                let log = &model.logs[*p];
                records = log[log.len().saturating_sub(*max)..].to_vec();
            }
            if records.is_empty() {
                return Ok(());
            }
            let before = snapshot(sut).await?;
            let commits = Arc::clone(&sut.zombie_commits);
            let cb = move |_| {
                commits.fetch_add(1, Ordering::SeqCst);
            };
            let result = deadline(
                "zombie batch",
                sut.strat
                    .process(&zombie, sut.batch(&records, model.stored[*p]), &cb),
            )
            .await?;
            check!(
                matches!(result, Err(BatchError::Fenced)),
                "a zombie (epoch {}, current {}) must be fenced, got {result:?}",
                zombie.epoch,
                model.epoch[*p]
            );
            check_eq!(
                sut.zombie_commits.load(Ordering::SeqCst),
                0,
                "commits reported to a zombie"
            );
            check_eq!(
                snapshot(sut).await?,
                before,
                "the state after a zombie's batch"
            );
            stats.zombie_batches.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}

/// Everything a batch can change, in a comparable form: offset rows (with `updated_at`),
/// per-table counts and sums, wallets.
async fn snapshot(sut: &Sut) -> Result<(Vec<offsets::Stored>, Vec<String>), String> {
    let offsets = offsets::load(&sut.db, &sut.consumer, &sut.topic)
        .await
        .map_err(|e| e.to_string())?;
    let row = sut
        .db
        .query_one(
            "SELECT (SELECT count(*) FROM cashback_credits WHERE consumer = $1),
                    (SELECT coalesce(sum(cashback_paise), 0)::bigint
                       FROM cashback_credits WHERE consumer = $1),
                    (SELECT count(*) FROM processed_messages WHERE consumer = $1),
                    (SELECT count(*) FROM dead_letters WHERE consumer = $1),
                    (SELECT coalesce(string_agg(user_id || '=' || balance_paise || '@' || updated_at,
                                                ',' ORDER BY user_id), '')
                       FROM wallets WHERE user_id = ANY($2)),
                    (SELECT coalesce(string_agg(partition || ':' || updated_at, ',' ORDER BY partition), '')
                       FROM consumer_offsets WHERE consumer = $1 AND topic = $3)",
            &[&&*sut.consumer, &sut.users, &&*sut.topic],
        )
        .await
        .map_err(|e| e.to_string())?;
    let counts = vec![
        format!("credits {}", row.get::<_, i64>(0)),
        format!("cashback {}", row.get::<_, i64>(1)),
        format!("keys {}", row.get::<_, i64>(2)),
        format!("dead letters {}", row.get::<_, i64>(3)),
        format!("wallets {}", row.get::<_, String>(4)),
        format!("offsets updated {}", row.get::<_, String>(5)),
    ];
    Ok((offsets, counts))
}

// ---------------------------------------------------------------------------------------------
// The invariants, read from PostgreSQL
// ---------------------------------------------------------------------------------------------

async fn check_invariants(sut: &Sut, model: &Model) -> Result<(), String> {
    let db = &sut.db;
    let consumer: &str = &sut.consumer;
    let err = |e: tokio_postgres::Error| e.to_string();

    // Offsets and epochs.
    let stored = offsets::load(db, consumer, &sut.topic)
        .await
        .map_err(|e| e.to_string())?;
    check_eq!(stored.len(), PARTITIONS, "consumer_offsets rows");
    for (p, row) in stored.iter().enumerate() {
        check_eq!(row.partition, p as i32, "consumer_offsets partition");
        check_eq!(
            row.next_offset,
            model.stored[p],
            "stored offset of partition {p}"
        );
        check_eq!(row.epoch, model.epoch[p], "epoch of partition {p}");
        // The "Kafka committed offset" only grows and is never ahead of PostgreSQL's.
        let history = sut.kafka[p].lock().unwrap().clone();
        check!(
            history.windows(2).all(|w| w[0] < w[1]),
            "Kafka commits of partition {p} went backwards: {history:?}"
        );
        if let Some(&last) = history.last() {
            check!(
                Some(last) <= row.next_offset,
                "Kafka committed offset {last} of partition {p} is ahead of PostgreSQL's {:?}",
                row.next_offset
            );
        }
    }

    let applied = model.applied();

    // Credits: exactly the applied payments, once each, 2% rounded down.
    let rows = db
        .query(
            "SELECT payment_id, event_id, user_id, amount_paise, rate_bp, cashback_paise
             FROM cashback_credits WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .map_err(err)?;
    check_eq!(rows.len(), applied.len(), "cashback_credits rows");
    let mut credited = BTreeSet::new();
    let mut total = 0i64;
    for r in &rows {
        let payment_id: String = r.get(0);
        let event_id: Uuid = r.get(1);
        let pay = model
            .payments
            .get(&event_id)
            .ok_or_else(|| format!("credit for unknown event {event_id}"))?;
        check!(
            applied.contains(&event_id),
            "payment {payment_id} (event {event_id}) is credited but none of its records is below the stored offsets"
        );
        check_eq!(payment_id, pay.payment_id, "payment id of event {event_id}");
        check_eq!(r.get::<_, String>(2), pay.user_id, "user of {payment_id}");
        check_eq!(
            r.get::<_, i64>(3),
            pay.amount_paise,
            "amount of {payment_id}"
        );
        check_eq!(r.get::<_, i32>(4), RATE_BP, "rate of {payment_id}");
        let cashback: i64 = r.get(5);
        check_eq!(
            cashback,
            pay.amount_paise * RATE_BP as i64 / 10_000,
            "cashback of {payment_id}"
        );
        check_eq!(
            cashback,
            cashback_paise(pay.amount_paise, RATE_BP),
            "cashback of {payment_id}"
        );
        check!(credited.insert(event_id), "event {event_id} credited twice");
        total += cashback;
    }
    let expected_total: i64 = applied
        .iter()
        .map(|e| model.payments[e].amount_paise * 2 / 100)
        .sum();
    check_eq!(total, expected_total, "sum of cashback_paise");

    // Wallets: each user's balance is the cashback of their applied payments.
    let wallets: BTreeMap<String, i64> = db
        .query(
            "SELECT user_id, balance_paise FROM wallets WHERE user_id = ANY($1)",
            &[&sut.users],
        )
        .await
        .map_err(err)?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for user in &sut.users {
        let expected: i64 = applied
            .iter()
            .map(|e| &model.payments[e])
            .filter(|p| &p.user_id == user)
            .map(|p| cashback_paise(p.amount_paise, RATE_BP))
            .sum();
        check_eq!(
            wallets.get(user).copied().unwrap_or(0),
            expected,
            "wallet of {user}"
        );
    }

    // Outbox: one CashbackCredited per applied payment.
    let outbox_of = |e: &Uuid| outbox_id(consumer, model.payments[e].event_date, e);
    let all_outbox: Vec<Uuid> = model.payments.keys().map(outbox_of).collect();
    let outbox: BTreeSet<Uuid> = db
        .query("SELECT id FROM outbox WHERE id = ANY($1)", &[&all_outbox])
        .await
        .map_err(err)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let expected_outbox: BTreeSet<Uuid> = applied.iter().map(outbox_of).collect();
    check_eq!(outbox, expected_outbox, "outbox rows");

    // Dedupe keys: exactly the distinct event ids below the stored offsets.
    let keys: Vec<Uuid> = db
        .query(
            "SELECT message_id FROM processed_messages WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .map_err(err)?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let key_set: BTreeSet<Uuid> = keys.iter().copied().collect();
    check_eq!(keys.len(), key_set.len(), "dedupe keys are unique");
    check_eq!(key_set, applied, "processed_messages keys");

    // Dead letters: exactly the junk records below the stored offsets, parked once.
    let parked: BTreeMap<(i32, i64), (Uuid, Bytes)> = db
        .query(
            "SELECT partition, \"offset\", message_id, reason, attempts, payload, topic
             FROM dead_letters WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .map_err(err)?
        .iter()
        .map(|r| {
            let key = (r.get::<_, i32>(0), r.get::<_, i64>(1));
            let reason: String = r.get(3);
            let attempts: i32 = r.get(4);
            let topic: String = r.get(6);
            if reason != "undecodable_payload" || attempts != 1 || topic != *sut.topic {
                return Err(format!(
                    "dead letter {key:?}: reason {reason}, attempts {attempts}, topic {topic}"
                ));
            }
            let payload: Option<Vec<u8>> = r.get(5);
            Ok((
                key,
                (
                    r.get::<_, Option<Uuid>>(2).unwrap_or_default(),
                    Bytes::from(payload.unwrap_or_default()),
                ),
            ))
        })
        .collect::<Result<_, String>>()?;
    check_eq!(parked, model.parked(), "dead_letters");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The test
// ---------------------------------------------------------------------------------------------

async fn run_case(kind: Strat, ops: &[Op], stats: &Stats) -> Result<(), TestCaseError> {
    let mut sut = Sut::new(kind).await;
    let mut model = Model {
        epoch: [1; PARTITIONS],
        ..Model::default()
    };
    let name = sut.consumer.to_string();
    eprintln!(
        "case: consumer {name}, strategy {kind:?}, {} ops",
        ops.len()
    );
    let mut result = check_invariants(&sut, &model).await;
    for (i, op) in ops.iter().enumerate() {
        if result.is_err() {
            break;
        }
        result = match apply(&mut sut, &mut model, op, stats).await {
            Ok(()) => check_invariants(&sut, &model).await,
            Err(e) => Err(e),
        }
        .map_err(|e| format!("after op #{i} {op:?}: {e}"));
    }
    result.map_err(|e| {
        TestCaseError::fail(format!(
            "consumer {name} (topic {}), strategy {kind:?}: {e}",
            sut.topic
        ))
    })
}

#[test]
fn bookkeeping_matches_the_model() {
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(async {
        let mut db = common::pg().await;
        effectively::store::migrate::run(&mut db)
            .await
            .expect("migrations");
    });
    let cases = std::env::var("MODEL_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(24);
    let mut runner = TestRunner::new(Config {
        cases,
        // Every shrink step replays a whole case against PostgreSQL: keep shrinking bounded.
        max_shrink_iters: 200,
        // Regressions are reported, not written into the work tree.
        failure_persistence: None,
        ..Config::default()
    });
    let stats = Stats::default();
    let input = (
        prop_oneof![Just(Strat::Batched), Just(Strat::PerMessage)],
        prop::collection::vec(op(), 10..=30),
    );
    let started = Instant::now();
    let result = runner.run(&input, |(kind, ops)| {
        rt.block_on(run_case(kind, &ops, &stats))
    });
    eprintln!(
        "model: {cases} cases in {:.1} s; {stats:?}",
        started.elapsed().as_secs_f64()
    );
    match result {
        Ok(()) => {}
        Err(TestError::Fail(why, (kind, ops))) => {
            panic!(
                "minimal failing case ({kind:?}, {} ops): {why}\nops: {ops:#?}",
                ops.len()
            )
        }
        Err(e) => panic!("{e}"),
    }
}
