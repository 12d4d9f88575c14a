-- Message ids that are not UUIDs (a Stripe-like `evt_...`, a CloudEvents id, a template's business
-- key such as `pay_42:CAPTURED`) become name-based UUIDs for the ledger, which keeps 16-byte keys
-- (src/envelope/mod.rs, KEY_NAMESPACE). The text they were made from is kept where a person
-- looks for it: a parked record's row. NULL when the id was a UUID.
ALTER TABLE dead_letters ADD COLUMN message_key text;

-- How each consumer makes its dedupe keys (its message_id and event_date settings, as
-- `check-config` prints them). Written by a worker at start; a worker whose settings differ
-- from the row logs a warning and records the change. `check-config --connect` warns too: a
-- copy of an event applied before the change gets another key and would be applied again.
CREATE TABLE consumer_keys (
    consumer    text        PRIMARY KEY,
    made_by     text        NOT NULL,
    since       timestamptz NOT NULL DEFAULT now(),
    previous    text                                 -- what made the keys before `since`
);
