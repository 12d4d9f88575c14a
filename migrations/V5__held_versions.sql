-- Versioned writes, part two: gaps wait in the inbox. In delta mode an event whose version is
-- past the aggregate's next one cannot be applied yet; it is stored as a HELD inbox row (with
-- its raw bytes, like any inbox row) in the transaction that sees it, and applied, in version
-- order, by the transaction that applies the missing version. A HELD row is not open: no claim
-- takes it and it does not hold its ordering key back. Retention keeps its day like any row that
-- is not DONE.
ALTER TABLE inbox ADD COLUMN aggregate text, ADD COLUMN version bigint;

ALTER TABLE inbox DROP CONSTRAINT inbox_status_check;
ALTER TABLE inbox ADD CONSTRAINT inbox_status_check
    CHECK (status IN ('PENDING', 'IN_PROGRESS', 'DONE', 'FAILED', 'HELD'));

CREATE INDEX inbox_held ON inbox (consumer, aggregate, version) WHERE status = 'HELD';

-- The built-in example of a versioned effect (`handler = { kind = "order-status" }`): the last
-- status of each order, moved only from the version the engine read (the seed's
-- `UPDATE ... WHERE order_id = $1 AND version = 7`, for a batch at once), and every move it made,
-- so a verifier can prove no order ever went back.
CREATE TABLE order_status_view (
    order_id   text        PRIMARY KEY,
    status     text        NOT NULL,
    version    bigint      NOT NULL CHECK (version >= 1),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE order_status_history (
    id           bigserial   PRIMARY KEY,
    order_id     text        NOT NULL,
    status       text        NOT NULL,
    from_version bigint,
    to_version   bigint      NOT NULL,
    message_id   uuid        NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX order_status_history_order ON order_status_history (order_id, id);
