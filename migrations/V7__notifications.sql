-- External effects (`effectively send`): an effect outside the database (an SMS, an e-mail, a
-- card charge) cannot join the transaction, so a handler records the intent in it instead: one
-- row per event and channel (the UNIQUE key makes a redelivered event record nothing new), sent
-- later by a sender that calls the provider with an idempotency key derived from the event.
CREATE TABLE notifications (
    event_id        uuid        NOT NULL,
    channel         text        NOT NULL,
    status          text        NOT NULL DEFAULT 'PENDING'
                    CHECK (status IN ('PENDING', 'SENDING', 'SENT', 'FAILED', 'SKIPPED')),
    payload         jsonb       NOT NULL,
    -- `channel:event_id`, and `#n` after it once a provider saved a failure under the key and
    -- confirmed that nothing was sent (a new key is then the only way to send).
    key_generation  int         NOT NULL DEFAULT 0,
    attempts        int         NOT NULL DEFAULT 0,
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    -- When the sender that holds a SENDING row took it: a row SENDING for longer than the
    -- sender's sending_timeout was interrupted (the sender died mid-call).
    sending_since   timestamptz,
    provider_id     text,
    last_error      text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    sent_at         timestamptz,
    PRIMARY KEY (event_id, channel)
);

CREATE INDEX notifications_open ON notifications (channel, next_attempt_at)
    WHERE status IN ('PENDING', 'SENDING');
