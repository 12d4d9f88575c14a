//! The poison run of tests/failures.rs and tests/per_message.rs: 20 payments on a new topic's
//! one partition, one of them with the poison amount 666, produced before a worker with a
//! [`Faulty`] handler starts.

use std::sync::Arc;

use effectively::stats::Stats;
use effectively::worker::Worker;

use super::{
    create_topic, pg, producer, send_payments, start_faulty, unique, Fault, Faulty, Payment,
};

/// 20 payments on one partition, produced before the worker starts so they form one batch, the
/// 11th with the poison amount 666.
pub fn with_poison(user: &str) -> (Vec<Payment>, usize) {
    let payments: Vec<Payment> = (0..20)
        .map(|i| Payment::new(user, if i == 10 { 666 } else { 10_000 + i * 100 }))
        .collect();
    (payments, 10)
}

/// What [`start_poisoned`] set up.
pub struct Poisoned {
    pub topic: String,
    pub consumer: String,
    /// The payments of [`with_poison`], at offsets 0 to 19 of partition 0.
    pub payments: Vec<Payment>,
    /// The poison's index in `payments`, which is its offset.
    pub poison: usize,
    pub handler: Arc<Faulty>,
    pub worker: Worker,
    pub stats: Arc<Stats>,
    pub db: tokio_postgres::Client,
}

/// A new topic (named after `prefix`) of one partition holding the payments of
/// [`with_poison`] of a new user, then a worker for a new consumer `rewards-…` started by
/// [`start_faulty`] with `fault` as the handler `name` and `extra`; its stats, and a connection
/// to PostgreSQL.
pub async fn start_poisoned(prefix: &str, fault: Fault, name: &str, extra: &str) -> Poisoned {
    let topic = unique(prefix);
    let consumer = unique("rewards");
    create_topic(&topic, 1).await;
    let user = unique("u");
    let (payments, poison) = with_poison(&user);
    send_payments(&producer(), &topic, Some(0), &payments).await;

    let (handler, worker) = start_faulty(&consumer, &topic, fault, name, extra).await;
    let stats = worker.stats(&consumer).unwrap();
    let db = pg().await;
    Poisoned {
        topic,
        consumer,
        payments,
        poison,
        handler,
        worker,
        stats,
        db,
    }
}
