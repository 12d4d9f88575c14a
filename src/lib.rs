//! # effectively
//!
//! Consumes Apache Kafka and applies every message's effect to PostgreSQL exactly once, although
//! Kafka delivers at least once. Per partition, one PostgreSQL transaction per batch holds the
//! batch's dedupe keys, the effect on the fresh messages, and the partition's next offset
//! (fenced against zombies); Kafka hears about it only after `COMMIT`.
//!
//! # Layout
//!
//! Each module uses only the ones listed below it.
//!
//! - [`cli`]: the command line (`effectively run | migrate | check-config`).
//! - [`store`]: every SQL statement, each function taking the caller's client or transaction;
//!   [`store::migrate`] applies `migrations/`.

pub mod cli;
pub mod store;
