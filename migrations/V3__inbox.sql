-- The inbox strategy: store first, process later. The receiver inserts every message of a
-- partition batch here (ON CONFLICT DO NOTHING: the primary key dedupes), stores the partition's
-- offset, commits and lets Kafka move on; processors claim due rows with FOR UPDATE SKIP LOCKED,
-- apply the effect and mark them DONE in one transaction. Partitioned by the event's date like
-- processed_messages (the daily partitions inbox_pYYYYMMDD are created and dropped with it), so
-- every copy of one event meets the same key, and retention drops kept rows a day at a time.

-- Arrival order. No CACHE: a cached block per session would number a later batch of a partition
-- below an earlier one whenever the two ran on different connections, and break per-key order.
CREATE SEQUENCE inbox_seq;

CREATE TABLE inbox (
    consumer        text        NOT NULL,
    message_id      uuid        NOT NULL,
    event_date      date        NOT NULL,
    seq             bigint      NOT NULL,
    -- Rows of one key are applied in seq order: only a key's oldest open row is claimable.
    ordering_key    text        NOT NULL,
    status          text        NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'IN_PROGRESS', 'DONE', 'FAILED')),
    attempts        int         NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- claim = "lease": who holds an IN_PROGRESS row, and until when.
    lease_until     timestamptz,
    claim_token     uuid,
    last_error      text,
    -- The record as Kafka delivered it: a FAILED row keeps its exact bytes.
    topic           text        NOT NULL,
    partition       int         NOT NULL,
    "offset"        bigint      NOT NULL,
    kafka_ts        timestamptz,
    key             bytea,
    header_names    text[]      NOT NULL DEFAULT '{}',
    header_values   bytea[]     NOT NULL DEFAULT '{}',
    payload         bytea       NOT NULL,
    received_at     timestamptz NOT NULL DEFAULT now(),
    done_at         timestamptz,
    PRIMARY KEY (consumer, message_id, event_date)
) PARTITION BY RANGE (event_date);

-- Only open rows are indexed for claiming, so the claim's index stays as small as the backlog
-- however many DONE rows are kept for audit. (Because `status` is in these predicates, a status
-- change is not a HOT update; a retry, which changes attempts and next_attempt_at only, can be.)
CREATE INDEX inbox_open ON inbox (consumer, seq)
    WHERE status IN ('PENDING', 'IN_PROGRESS');
CREATE INDEX inbox_open_by_key ON inbox (consumer, ordering_key, seq)
    WHERE status IN ('PENDING', 'IN_PROGRESS');
CREATE INDEX inbox_failed ON inbox (consumer, seq)
    WHERE status = 'FAILED';
