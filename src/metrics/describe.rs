//! Every metric's description and unit, registered with the recorder when it is installed.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};

use super::*;

pub(super) fn describe() {
    describe_histogram!(
        E2E_LATENCY,
        Unit::Seconds,
        "From the record's timestamp to the commit of its transaction, per fresh message (a new dedupe key: its effect, or a business-key duplicate's no-op)."
    );
    describe_histogram!(
        BATCH_SIZE,
        Unit::Count,
        "Records per batch handed to the strategy."
    );
    describe_histogram!(
        BATCH_DURATION,
        Unit::Seconds,
        "Wall time of a batch, all its transactions and retries included."
    );
    describe_histogram!(
        BATCH_PHASE,
        Unit::Seconds,
        "Time in each phase of a batch transaction: fence, stage (COPY), dedupe, effect, commit; and arrive: from the batch's oldest Kafka record timestamp to the batch's cut (producer, broker, fetch, the partition's queue), before any transaction."
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "Time in the handler's apply, per transaction."
    );
    describe_counter!(RECORDS_RECEIVED, Unit::Count, "Records read from Kafka.");
    describe_counter!(
        EFFECTS_APPLIED,
        Unit::Count,
        "Effects the handler applied (committed)."
    );
    describe_counter!(
        TRANSACTIONS_COMMITTED,
        Unit::Count,
        "Batch transactions committed (a commit group's transaction counts once for its batches)."
    );
    describe_counter!(
        DUPLICATES_SKIPPED,
        Unit::Count,
        "Copies skipped, by reason: dedupe_key, business_key, below_stored_offset."
    );
    describe_counter!(
        PARKED,
        Unit::Count,
        "Messages parked in dead_letters, by reason."
    );
    describe_counter!(
        RECORDS_SKIPPED,
        Unit::Count,
        "Records passed over on purpose, by reason (tombstone: on_tombstone = \"skip\"); the offset moved past them."
    );
    describe_counter!(
        TRANSIENT_RETRIES,
        Unit::Count,
        "Batch transactions rolled back and tried again."
    );
    describe_counter!(
        FENCED,
        Unit::Count,
        "Transactions rolled back by the epoch fence: this worker was a zombie for the partition."
    );
    describe_counter!(
        OFFSET_STORE_WENT_BACK,
        Unit::Count,
        "Batches refused because PostgreSQL no longer held the partition's last committed offset \
         (a failover that lost commits, a restore); the partition was read again from the offset it holds."
    );
    describe_counter!(
        OFFSET_STORE_REWOUND,
        Unit::Count,
        "Kafka offsets the stored offset went back by (records read and applied again)."
    );
    describe_counter!(
        REBALANCES,
        Unit::Count,
        "Assignments this worker received from the group."
    );
    describe_counter!(
        PARTITIONS_ASSIGNED,
        Unit::Count,
        "Partitions assigned to this worker."
    );
    describe_counter!(
        PARTITIONS_REVOKED,
        Unit::Count,
        "Partitions revoked from this worker."
    );
    describe_gauge!(
        CONSUMER_LAG,
        Unit::Count,
        "Records behind: the partition's high watermark minus the offset stored in PostgreSQL."
    );
    describe_gauge!(
        ASSIGNED_PARTITIONS,
        Unit::Count,
        "Partitions this worker consumes now."
    );
    describe_gauge!(
        DEAD_LETTERS_WAITING,
        Unit::Count,
        "Rows in dead_letters for the consumer (sampled)."
    );
    describe_gauge!(
        DEDUPE_PARTITION_ROWS,
        Unit::Count,
        "Estimated rows of each daily processed_messages partition, by database and day (sampled)."
    );
    describe_gauge!(
        DEDUPE_PARTITION_BYTES,
        Unit::Bytes,
        "Size of each daily processed_messages partition with its index, by database and day (sampled)."
    );
    describe_gauge!(
        DEDUPE_PARTITIONS_AHEAD,
        Unit::Count,
        "Days after today that already have a dedupe partition, by database (sampled)."
    );
    describe_gauge!(
        INBOX_ROWS,
        Unit::Count,
        "Inbox rows by status: pending, in_progress, failed (sampled). Alarm on failed > 0."
    );
    describe_gauge!(
        INBOX_OLDEST_PENDING_AGE,
        Unit::Seconds,
        "Age of the oldest PENDING inbox row, 0 when none (sampled). Alarm when it grows."
    );
    describe_histogram!(
        INBOX_CLAIM_DURATION,
        Unit::Seconds,
        "Time of one inbox claim statement (FOR UPDATE SKIP LOCKED)."
    );
    describe_histogram!(
        INBOX_PROCESS_DURATION,
        Unit::Seconds,
        "One inbox processor round, from the claim to the commit of the effects and marks."
    );
    describe_counter!(
        INBOX_PROCESSED,
        Unit::Count,
        "Inbox rows a processor finished an attempt on, by outcome: done, retry, failed."
    );
    describe_gauge!(
        OUTBOX_UNPUBLISHED,
        Unit::Count,
        "Outbox rows of the event types this relay serves that no relay has published yet (sampled every 15 s by each relay)."
    );
    describe_gauge!(
        OUTBOX_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest unpublished outbox row this relay serves, 0 when none (sampled). Alarm when it grows: events are not leaving the database."
    );
    describe_histogram!(
        OUTBOX_PUBLISH_LATENCY,
        Unit::Seconds,
        "From an outbox row's created_at to the commit that marks it published, after the broker acknowledged it."
    );
    describe_counter!(
        OUTBOX_PUBLISHED,
        Unit::Count,
        "Outbox rows this relay published and marked (a row republished after a crash counts again)."
    );
    describe_counter!(
        NOTIFICATIONS,
        Unit::Count,
        "Notification deliveries by channel and outcome: sent, replayed (the provider answered from its record of the key), reconciled (found sent by asking the provider), retried, failed, skipped."
    );
    describe_gauge!(
        NOTIFICATION_ROWS,
        Unit::Count,
        "Notifications by channel and status: pending, sending, failed (sampled every 15 s by each sender). Alarm on failed > 0."
    );
    describe_gauge!(
        NOTIFICATION_OLDEST_AGE,
        Unit::Seconds,
        "Age of the oldest PENDING notification per channel, 0 when none (sampled)."
    );
    describe_counter!(
        VERSION_SKIPPED,
        Unit::Count,
        "Versioned events acked without applying them, by reason: stale (older than the stored version), duplicate (the stored version again), held (a gap, waiting for a missing version), released (a held event applied once its gap filled)."
    );
    describe_gauge!(
        VERSION_HELD,
        Unit::Count,
        "Events held behind a missing version, HELD inbox rows (sampled)."
    );
    describe_gauge!(
        VERSION_GAPS_OVERDUE,
        Unit::Count,
        "Aggregates whose oldest held event waited longer than version.gap_alert_after (sampled). Alarm when above 0: a version never arrived."
    );
    describe_counter!(
        INBOX_LEASE_LOST,
        Unit::Count,
        "Leased inbox rows a processor skipped because their lease ran out before it locked them and another processor reclaimed them (a stalled process, or a lease too short)."
    );
    describe_counter!(
        PREFILTER_LOOKUPS,
        Unit::Count,
        "Dedupe keys looked up in the Redis pre-filter before a transaction, by result: hit (committed already: skipped), miss (to PostgreSQL), error (Redis did not answer in time, failed, or is away: to PostgreSQL)."
    );
    describe_counter!(
        PREFILTER_SETS,
        Unit::Count,
        "Committed dedupe keys written to the Redis pre-filter after COMMIT, by result: ok, error (not written: only future hits are lost)."
    );
    describe_counter!(
        PREFILTER_ERRORS,
        Unit::Count,
        "Redis round trips of the pre-filter that failed, by op (lookup, set, connect) and kind (timeout, error). Each opens a short circuit during which batches skip Redis."
    );
    describe_histogram!(
        PREFILTER_DURATION,
        Unit::Seconds,
        "Time of one pre-filter round trip to Redis, by op: lookup (one MGET per batch), set (one pipeline per commit)."
    );
    describe_gauge!(
        POOL_CONNECTIONS,
        Unit::Count,
        "PostgreSQL connections of the pool, by database (default for [database], else the [database.NAME]) and state: in_use, idle."
    );
    describe_gauge!(
        CONSUMER_DATABASE,
        Unit::Count,
        "1 for the database that holds the consumer's ledger, offsets, inbox and dead letters (default for [database], else the consumer's [database.NAME])."
    );
    describe_gauge!(
        OFFSET_OUT_OF_RANGE,
        Unit::Count,
        "1 while a partition is stopped because the offset PostgreSQL stores for it is outside the partition's log, by end: above (past the log end: the topic recreated, an unclean leader election) or below (before the log start: retention deleted records never applied). on_offset_out_of_range = \"stop\"; nothing of the partition is read until an operator acts."
    );
    describe_counter!(
        OFFSET_OUT_OF_RANGE_RESETS,
        Unit::Count,
        "Partitions moved to the log start or end because their offset was outside the log (on_offset_out_of_range = \"earliest\" or \"latest\"), by end: above or below."
    );
    describe_counter!(
        PARTITION_ERRORS,
        Unit::Count,
        "Kafka errors a partition's fetch returned instead of records, by code (librdkafka's name: NotImplemented for a codec the client lacks, TopicAuthorizationFailed, a corrupt batch's BadMessage ...). The partition does not progress while they repeat."
    );
    describe_counter!(
        GROUP_REBALANCES,
        Unit::Count,
        "Rebalances of the group this member took part in (librdkafka's rebalance callbacks, assign or revoke, even those that moved none of its partitions). With static membership (kafka.static_membership) a member restarted within the session timeout causes none."
    );
    describe_gauge!(
        PARTITION_PAUSED,
        Unit::Count,
        "1 while an operator has the partition paused (`effectively pause`): it stays assigned, fetches nothing, and its lag grows. 0 after `effectively resume`."
    );
    describe_gauge!(
        MAX_RATE,
        Unit::Count,
        "Messages a second this worker takes of the consumer at most (`max_rate`, or `effectively throttle`); 0 when unlimited."
    );
    describe_gauge!(
        PARTITION_STUCK,
        Unit::Count,
        "1 while a partition's last fetch failed with a Kafka error and no record arrived since: nothing of it is consumed (effectively_partition_errors_total says which error). 0 again at the first record."
    );
    describe_gauge!(
        PARTITION_STALLED,
        Unit::Count,
        "1 while a partition's batch has been retrying (not committed) for longer than the consumer's stall_after, whatever the cause: PostgreSQL unavailable, a lock it waits for, a statement that keeps failing. 0 when the batch ends."
    );
    describe_gauge!(
        INBOX_PROCESSOR_STALLED,
        Unit::Count,
        "Inbox processors of a consumer whose round has not succeeded for longer than the consumer's stall_after: a round waiting on a lock, or rounds failing again and again (the database unavailable)."
    );
    describe_gauge!(
        INBOX_ROUND_LIMIT,
        Unit::Count,
        "How many of this process's inbox processors of a consumer may run a round at once: between 1 and inbox.processors, adapted to what PostgreSQL runs without queueing (inbox.adaptive), or inbox.processors."
    );
}
