//! Everything that talks SQL. Each function takes the caller's client or transaction, so that
//! dedupe keys, the effect and the stored offset compose into one transaction.

pub mod migrate;
pub mod pool;
