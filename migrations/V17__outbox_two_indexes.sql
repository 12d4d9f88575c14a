-- Every outbox row is written unpublished, so every insert went into all four partial indexes
-- of the unpublished rows, at about 3 µs of PostgreSQL's CPU each in the batch drain: the
-- largest part of the cashback effect's cost (docs/PERFORMANCE.md, "PostgreSQL's CPU per
-- message"). Two serve every reader now:
--   outbox_unpublished (event_type, seq): the event types present, the backlog by type, the
--     console's unpublished rows in seq order;
--   outbox_unpublished_type_heads (event_type, aggregate_id, seq): the relay's heads and the
--     rows behind them, for the types it serves, or for every type present (src/store/outbox.rs).
DROP INDEX outbox_unpublished_heads;
DROP INDEX outbox_unpublished_by_aggregate;
