-- The operator's way back (`effectively dead-letters | inbox | notifications`, the console):
-- parked rows are redriven, replayed, retried or discarded, never deleted, and every such action
-- leaves an audit row written in the same transaction as the change.

-- A dead letter stays after the operator dealt with it: `resolution` says what was done
-- ('redriven': a copy was produced back to its topic; 'discarded': the operator gave it up),
-- by whom, when and under which audit action. Only rows with `resolution IS NULL` are parked.
ALTER TABLE dead_letters
    ADD COLUMN resolution      text CHECK (resolution IN ('redriven', 'discarded')),
    ADD COLUMN resolved_at     timestamptz,
    ADD COLUMN resolved_by     text,
    ADD COLUMN resolved_action uuid,
    -- Where the redriven copy landed (the broker's acknowledgement).
    ADD COLUMN redriven_to     text;

-- Keyset pages of parked rows, newest first, per consumer or over all of them, stay index
-- scans however many resolved rows are kept.
CREATE INDEX dead_letters_parked ON dead_letters (id) WHERE resolution IS NULL;
CREATE INDEX dead_letters_parked_consumer ON dead_letters (consumer, reason, id)
    WHERE resolution IS NULL;
-- The old index answered "how many per consumer and reason" over every row; the partial one
-- above answers it over the parked rows, which is the question.
DROP INDEX dead_letters_consumer_reason;

-- An inbox row the operator gave up: kept with its bytes, never applied, never DONE.
ALTER TABLE inbox DROP CONSTRAINT inbox_status_check;
ALTER TABLE inbox ADD CONSTRAINT inbox_status_check
    CHECK (status IN ('PENDING', 'IN_PROGRESS', 'DONE', 'FAILED', 'HELD', 'DISCARDED'));
-- FAILED rows of every consumer, newest first (inbox_failed serves one consumer's).
CREATE INDEX inbox_failed_seq ON inbox (seq) WHERE status = 'FAILED';

-- A notification the operator gave up (status SKIPPED already means "never sent on purpose";
-- DISCARDED says an operator decided it).
ALTER TABLE notifications DROP CONSTRAINT notifications_status_check;
ALTER TABLE notifications ADD CONSTRAINT notifications_status_check
    CHECK (status IN ('PENDING', 'SENDING', 'SENT', 'FAILED', 'SKIPPED', 'DISCARDED'));
CREATE INDEX notifications_failed ON notifications (channel, created_at) WHERE status = 'FAILED';

-- Who did what to which parked rows. One action (a redrive of 10,000 rows) may commit in
-- several chunks: each chunk writes its own row, with the count it changed, under one `action`.
CREATE TABLE operator_actions (
    id       bigserial   PRIMARY KEY,
    action   uuid        NOT NULL,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text        NOT NULL,          -- "cli:alice", "console:127.0.0.1"
    verb     text        NOT NULL,          -- redrive, discard, replay, retry
    target   text        NOT NULL,          -- dead_letters, inbox, notifications
    filter   jsonb       NOT NULL,          -- the id or the filter, as the operator gave it
    count    bigint      NOT NULL,          -- rows this chunk changed
    note     text                           -- the operator's reason, if given
);
CREATE INDEX operator_actions_action ON operator_actions (action);
