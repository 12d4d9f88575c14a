-- The inbox processors of one consumer across processes. Every worker process with processors
-- keeps a row here, beating every second; the live rows, ordered by `member`, give each process
-- its processors' slices of the ordering keys (src/inbox/members.rs), so two processes' processors
-- never claim from the same slice. A row whose beat is older than the time-to-live is a dead
-- process's: the next beat of any process deletes it. Slices only narrow where a claim looks:
-- order and exclusion still come from the head-of-key check and the row locks.
CREATE TABLE inbox_members (
    consumer     text        NOT NULL,
    member       uuid        NOT NULL,
    processors   int         NOT NULL CHECK (processors > 0),
    -- The process's worker id (`worker.id`, or host and pid), for an operator.
    worker       text        NOT NULL,
    joined_at    timestamptz NOT NULL DEFAULT now(),
    beat_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, member)
);
