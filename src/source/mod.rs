//! The Kafka side: group membership and rebalances ([`consumer`]), and one task per assigned
//! partition that batches records and hands them to the strategy ([`partition`]).

pub mod consumer;
pub mod partition;
