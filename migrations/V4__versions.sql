-- Versioned writes (`[consumer.version]`): the last version applied to each aggregate, per
-- consumer. Not partitioned and never dropped by retention: a version must outlive every copy of
-- its events, including a compacted topic replayed from the start years later.
CREATE TABLE aggregate_versions (
    consumer   text        NOT NULL,
    aggregate  text        NOT NULL,
    version    bigint      NOT NULL CHECK (version >= 1),
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate)
);
