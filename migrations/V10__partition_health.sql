-- What the worker that owns a partition sees wrong with it, for the console (its metrics say
-- the same to Prometheus): stuck (the partition's last fetch failed with a Kafka error and no
-- record arrived since: a codec the client lacks, a corrupt batch, a topic it may not read) and
-- stalled (a batch retrying for longer than the consumer's stall_after). One row per partition
-- while something is wrong, written on each change by the owner, deleted when it clears or the
-- owner lets go. The epoch is the owner's claim: a row from an older claim than the offsets
-- row's (a worker that died with it marked) is stale and ignored.
CREATE TABLE partition_health (
    consumer      text        NOT NULL,
    topic         text        NOT NULL,
    partition     int         NOT NULL,
    epoch         bigint      NOT NULL,
    stuck_since   timestamptz,
    stuck_error   text,
    stalled_since timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition)
);
