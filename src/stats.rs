//! In-process counters per consumer: what the worker has done since it started. Tests read
//! them to compare with the ledger; the Prometheus metrics are fed from the same events.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::batch::Outcome;
use crate::store::offsets::End;

/// Counters of one consumer.
#[derive(Debug, Default)]
pub struct Stats {
    pub records: AtomicU64,
    pub fresh: AtomicU64,
    pub effects: AtomicU64,
    pub duplicates: AtomicU64,
    /// Duplicates the Redis pre-filter caught (counted in `duplicates` too).
    pub prefilter_hits: AtomicU64,
    pub business_duplicates: AtomicU64,
    pub below_stored_offset: AtomicU64,
    pub parked: AtomicU64,
    /// Records passed over on purpose (skipped tombstones).
    pub skipped: AtomicU64,
    pub retries: AtomicU64,
    pub commits: AtomicU64,
    pub batches: AtomicU64,
    pub fenced: AtomicU64,
    /// Batches refused because the offset store went back (see `store::offsets`).
    pub went_back: AtomicU64,
    pub rebalances: AtomicU64,
    /// Rebalance callbacks librdkafka made, whatever they carried: each is a rebalance of the
    /// group this member took part in (with the cooperative protocol, one that moved nothing
    /// of this member's still calls it, with no partitions).
    pub group_rebalances: AtomicU64,
    /// Where PostgreSQL has each (topic, partition) this worker holds.
    committed: Mutex<BTreeMap<(String, i32), i64>>,
    /// Partitions moved to the log start or end because their stored offset was outside the
    /// log (`on_offset_out_of_range = "earliest" | "latest"`).
    pub offset_resets: AtomicU64,
    /// Partitions held (not consumed) because their stored offset is outside the log, with
    /// the end it is past and the epoch of the claim that found it
    /// (`on_offset_out_of_range = "stop"`).
    out_of_range: Mutex<BTreeMap<(String, i32), (End, i64)>>,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub records: u64,
    pub fresh: u64,
    pub effects: u64,
    pub duplicates: u64,
    pub prefilter_hits: u64,
    pub business_duplicates: u64,
    pub below_stored_offset: u64,
    pub parked: u64,
    pub skipped: u64,
    pub retries: u64,
    pub commits: u64,
    pub batches: u64,
    pub fenced: u64,
    pub went_back: u64,
    pub rebalances: u64,
    pub group_rebalances: u64,
    pub offset_resets: u64,
}

impl Stats {
    pub fn batch(&self, o: &Outcome) {
        self.records.fetch_add(o.records, Relaxed);
        self.fresh.fetch_add(o.fresh, Relaxed);
        self.effects.fetch_add(o.effects, Relaxed);
        self.duplicates.fetch_add(o.duplicates, Relaxed);
        self.prefilter_hits.fetch_add(o.prefilter_hits, Relaxed);
        self.business_duplicates
            .fetch_add(o.business_duplicates, Relaxed);
        self.parked.fetch_add(o.parked.len() as u64, Relaxed);
        self.skipped.fetch_add(o.skipped.len() as u64, Relaxed);
        self.retries.fetch_add(o.retries, Relaxed);
        self.commits.fetch_add(o.commits, Relaxed);
        self.batches.fetch_add(1, Relaxed);
    }

    /// An inbox processor committed `effects` effects and `business_duplicates` no-ops.
    pub fn inbox_applied(&self, effects: u64, business_duplicates: u64) {
        self.effects.fetch_add(effects, Relaxed);
        self.business_duplicates
            .fetch_add(business_duplicates, Relaxed);
    }

    pub fn below_stored_offset(&self) {
        self.below_stored_offset.fetch_add(1, Relaxed);
    }

    pub fn fenced(&self) {
        self.fenced.fetch_add(1, Relaxed);
    }

    pub fn went_back(&self) {
        self.went_back.fetch_add(1, Relaxed);
    }

    pub fn rebalance(&self) {
        self.rebalances.fetch_add(1, Relaxed);
    }

    pub fn group_rebalance(&self) {
        self.group_rebalances.fetch_add(1, Relaxed);
    }

    pub fn committed_offset(&self, topic: &str, partition: i32, next: i64) {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((topic.to_string(), partition), next);
    }

    /// The partition is no longer this worker's: forget where it was.
    pub fn released(&self, topic: &str, partition: i32) {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(topic.to_string(), partition));
    }

    /// The next offset stored in PostgreSQL for each (topic, partition) this worker holds.
    pub fn committed_offsets(&self) -> BTreeMap<(String, i32), i64> {
        self.committed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            records: self.records.load(Relaxed),
            fresh: self.fresh.load(Relaxed),
            effects: self.effects.load(Relaxed),
            duplicates: self.duplicates.load(Relaxed),
            prefilter_hits: self.prefilter_hits.load(Relaxed),
            business_duplicates: self.business_duplicates.load(Relaxed),
            below_stored_offset: self.below_stored_offset.load(Relaxed),
            parked: self.parked.load(Relaxed),
            skipped: self.skipped.load(Relaxed),
            retries: self.retries.load(Relaxed),
            commits: self.commits.load(Relaxed),
            batches: self.batches.load(Relaxed),
            fenced: self.fenced.load(Relaxed),
            went_back: self.went_back.load(Relaxed),
            rebalances: self.rebalances.load(Relaxed),
            group_rebalances: self.group_rebalances.load(Relaxed),
            offset_resets: self.offset_resets.load(Relaxed),
        }
    }

    pub fn offset_reset(&self) {
        self.offset_resets.fetch_add(1, Relaxed);
    }

    /// The partition is held (`Some`: its stored offset is past that end of the log, found by
    /// the claim of that epoch) or not (`None`).
    pub fn out_of_range(&self, topic: &str, partition: i32, held: Option<(End, i64)>) {
        let mut map = self.out_of_range.lock().unwrap_or_else(|p| p.into_inner());
        let key = (topic.to_string(), partition);
        match held {
            Some(h) => map.insert(key, h),
            None => map.remove(&key),
        };
    }

    /// The partitions this worker holds because their stored offset is outside the log, with
    /// the end and the claim's epoch.
    pub fn held_out_of_range(&self) -> BTreeMap<(String, i32), (End, i64)> {
        self.out_of_range
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}
