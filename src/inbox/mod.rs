//! The inbox strategy's processing side: the receiver ([`crate::strategy::inbox`]) stores
//! every message in the `inbox` table and lets Kafka move on; here processors apply the effects
//! from the table on their own schedule ([`processor`]), and operators look at and replay rows
//! ([`admin`]). Used by the worker and the command line, never by the Kafka source.

pub mod admin;
pub mod limit;
pub mod members;
pub mod processor;
mod versioned;
