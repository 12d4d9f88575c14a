-- Message ids that are not UUIDs (a Stripe-like `evt_...`, a CloudEvents id, a template's business
-- key such as `pay_42:CAPTURED`) become name-based UUIDs for the ledger, which keeps 16-byte keys
-- (src/envelope/mod.rs, KEY_NAMESPACE). The text they were made from is kept where a person
-- looks for it: a parked record's row. NULL when the id was a UUID.
ALTER TABLE dead_letters ADD COLUMN message_key text;
