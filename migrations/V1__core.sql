-- The engine's own tables. Every effect transaction touches consumer_offsets and
-- processed_messages; dead_letters only when something is parked.

-- PostgreSQL, not Kafka, is the source of truth for where each partition resumes.
-- `epoch` fences zombies: a worker bumps it when it takes the partition, and every batch
-- updates the row `WHERE epoch = <the epoch it took>`; 0 rows means another worker owns the
-- partition now, and the whole batch transaction rolls back.
CREATE TABLE consumer_offsets (
    consumer    text        NOT NULL,
    topic       text        NOT NULL,
    partition   int         NOT NULL,
    next_offset bigint,                      -- NULL: nothing applied yet, use the reset policy
    epoch       bigint      NOT NULL DEFAULT 1,
    owner       text        NOT NULL,        -- the worker that holds `epoch` (for operators)
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition)
);

-- The dedupe ledger, partitioned by the event's own date (never the processing date), so every
-- copy of one event maps to the same partition and meets the same primary key. Daily partitions
-- (processed_messages_pYYYYMMDD) are created ahead by the engine and dropped past retention.
CREATE TABLE processed_messages (
    consumer     text        NOT NULL,
    message_id   uuid        NOT NULL,
    event_date   date        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id, event_date)
) PARTITION BY RANGE (event_date);

-- Messages that cannot be applied, parked in the same transaction that moves the partition's
-- offset past them: raw bytes intact, with the reason, so nothing is lost silently.
CREATE TABLE dead_letters (
    id            bigserial   PRIMARY KEY,
    consumer      text        NOT NULL,
    topic         text        NOT NULL,
    partition     int         NOT NULL,
    "offset"      bigint      NOT NULL,
    message_id    uuid,                      -- when the message had a readable one
    reason        text        NOT NULL,      -- a stable code, e.g. missing_event_id
    detail        text        NOT NULL,      -- the human explanation
    key           bytea,
    header_names  text[]      NOT NULL DEFAULT '{}',
    header_values bytea[]     NOT NULL DEFAULT '{}',
    payload       bytea,
    kafka_ts      timestamptz,
    attempts      int         NOT NULL DEFAULT 1,
    first_seen    timestamptz NOT NULL DEFAULT now(),
    last_seen     timestamptz NOT NULL DEFAULT now(),
    UNIQUE (consumer, topic, partition, "offset")
);
CREATE INDEX dead_letters_consumer_reason ON dead_letters (consumer, reason);

-- The built-in cashback handler (the seed's walk-through): 2% of every PaymentSucceeded,
-- one credit per payment (the business key), the wallet credited in the same transaction,
-- and a CashbackCredited row in the handler's own outbox.
CREATE TABLE wallets (
    user_id       text        PRIMARY KEY,
    balance_paise bigint      NOT NULL DEFAULT 0,
    updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE cashback_credits (
    payment_id     text        NOT NULL UNIQUE,   -- belt and braces: one credit per payment
    event_id       uuid        NOT NULL,
    consumer       text        NOT NULL,
    user_id        text        NOT NULL,
    amount_paise   bigint      NOT NULL,
    rate_bp        int         NOT NULL,          -- basis points, taken from the event or config
    cashback_paise bigint      NOT NULL,
    occurred_at    timestamptz NOT NULL,
    kafka_ts       timestamptz,                   -- the record's timestamp (produce time)
    credited_at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX cashback_credits_consumer ON cashback_credits (consumer);

CREATE TABLE outbox (
    id           uuid        PRIMARY KEY,
    aggregate_id text        NOT NULL,
    event_type   text        NOT NULL,
    payload      jsonb       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
