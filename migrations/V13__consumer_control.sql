-- The operator's control of running consumers (`effectively pause | resume | throttle`, the
-- console). Workers read these tables about once a second and apply them without a restart
-- or a rebalance; every change writes its `operator_actions` row in the same transaction.
-- (`effectively offsets reset` needs no table: it moves `consumer_offsets` and bumps the
-- partition's epoch, which fences the current owner.)

-- A paused scope: the whole consumer (topic NULL), one topic (partition NULL) or one
-- partition. A partition is paused while any row covers it; it stays owned, fetches nothing,
-- and its lag grows. Rows outlive restarts and rebalances: only a resume deletes them.
CREATE TABLE consumer_pauses (
    consumer  text        NOT NULL,
    topic     text,
    partition integer,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text        NOT NULL,
    action    uuid        NOT NULL,
    note      text,
    CHECK (partition IS NULL OR topic IS NOT NULL)
);
CREATE UNIQUE INDEX consumer_pauses_scope
    ON consumer_pauses (consumer, coalesce(topic, ''), coalesce(partition, -1));

-- A rate set at run time (`effectively throttle`): messages a second across each worker's
-- partitions of the consumer, with a burst. It overrides the config's `max_rate` until
-- `throttle --off` deletes it.
CREATE TABLE consumer_throttles (
    consumer  text             PRIMARY KEY,
    max_rate  double precision NOT NULL CHECK (max_rate > 0),
    burst     integer          NOT NULL CHECK (burst > 0),
    set_at    timestamptz      NOT NULL DEFAULT now(),
    set_by    text             NOT NULL,
    action    uuid             NOT NULL,
    note      text
);
