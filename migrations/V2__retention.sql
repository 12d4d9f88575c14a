-- What each consumer needs kept. processed_messages' daily partitions are shared by every
-- consumer, so a partition may be dropped only when it is older than the longest retention
-- any consumer has declared (workers upsert their consumers' retention at start-up).
CREATE TABLE retention_policies (
    consumer       text        PRIMARY KEY,
    retention_days int         NOT NULL CHECK (retention_days >= 1),
    updated_at     timestamptz NOT NULL DEFAULT now()
);
