-- The web console's parked list filtered by time (`since`/`until`: a dead letter's last_seen,
-- a FAILED inbox row's received_at) pages by that time, newest first. Without these, a window
-- an hour back is found by walking every newer parked row in id order (260 ms with 1,000,000
-- dead letters, docs/PERFORMANCE.md "Console on big tables"). Partial: only rows that wait for
-- an operator are indexed, so parking and resolving cost one small index entry each, and the
-- engine's hot path (which never writes these rows) nothing.
CREATE INDEX dead_letters_parked_seen ON dead_letters (consumer, last_seen, id)
    WHERE resolution IS NULL;
CREATE INDEX dead_letters_parked_seen_all ON dead_letters (last_seen, id)
    WHERE resolution IS NULL;
CREATE INDEX inbox_failed_received ON inbox (consumer, received_at, seq)
    WHERE status = 'FAILED';
CREATE INDEX inbox_failed_received_all ON inbox (received_at, seq)
    WHERE status = 'FAILED';
