-- W3C trace context (`traceparent`, `tracestate`) kept with the rows, so that a trace survives
-- the table (issue 37, docs/OPERATIONS.md "Following one payment through the engine"). NULL when
-- tracing is off or the message carried no context. Nullable columns without a default are a
-- catalog change only: no table is rewritten, however large.

-- The inbox receiver stores each message's context with its row; the processor's span links it.
ALTER TABLE inbox ADD COLUMN traceparent text, ADD COLUMN tracestate text;

-- The outbox and notification rows an effect writes keep its transaction's context: the relay's
-- record and the sender's request carry it on. The defaults read the transaction's settings,
-- which the engine sets (`SET LOCAL`-style, set_config(..., true)) only when tracing is on, so
-- any handler's insert (cashback, an SQL handler, a library user's) takes the context without
-- naming the columns. Another writer's rows, and everyone's with tracing off, get NULL (an unset
-- placeholder reads as NULL, or as '' once a session has set it before). A default set apart from
-- ADD COLUMN leaves the existing rows NULL without evaluating it for each one.
ALTER TABLE outbox ADD COLUMN traceparent text, ADD COLUMN tracestate text;
ALTER TABLE outbox
    ALTER COLUMN traceparent SET DEFAULT nullif(current_setting('effectively.traceparent', true), ''),
    ALTER COLUMN tracestate SET DEFAULT nullif(current_setting('effectively.tracestate', true), '');

ALTER TABLE notifications ADD COLUMN traceparent text, ADD COLUMN tracestate text;
ALTER TABLE notifications
    ALTER COLUMN traceparent SET DEFAULT nullif(current_setting('effectively.traceparent', true), ''),
    ALTER COLUMN tracestate SET DEFAULT nullif(current_setting('effectively.tracestate', true), '');
