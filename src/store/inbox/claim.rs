//! The processors' claims on the `inbox` table: which rows a claim may take (the head of each
//! ordering key, within the processor's slice of the keys), by row lock or by lease, and a
//! lease's hold and release.

use chrono::{DateTime, NaiveDate, Utc};
use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;
use uuid::Uuid;

use super::split;
use crate::store::StoreError;

/// A claimed row: what the processor rebuilds the message from.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub message_id: Uuid,
    pub event_date: NaiveDate,
    pub seq: i64,
    /// Attempts before this one (lock claims), or including this one (lease claims).
    pub attempts: i32,
    pub ordering_key: String,
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    pub kafka_ts: Option<DateTime<Utc>>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    /// The message's W3C trace context, kept by the receiver when tracing was on (V14).
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// The per-key order predicate (see the module docs), for a row aliased `i`: no open row of
/// its key comes before it. A scalar subquery around `NOT EXISTS`, so that it stays a subplan
/// run per candidate (an index descent per `inbox` partition that stops at the first earlier
/// row) and is never made an anti-join: as a join PostgreSQL may hash every open row of the
/// consumer, which it did for a consumer the statistics had not seen yet (200 ms a claim
/// instead of 2 ms). Until issue 35 it was `i.seq = (SELECT h.seq ... ORDER BY h.seq LIMIT 1)`,
/// which PostgreSQL ran as an Append of the partitions and a sort: every open row of the key
/// was read for each candidate (`pg_stat_statements` in `make bench`: the claim was half of
/// PostgreSQL's time, and its cost grew with the rows per key, so full scale, 100 rows a key,
/// drained slower than quick scale's 10).
const HEAD_OF_KEY: &str = "(SELECT NOT EXISTS (
        SELECT FROM inbox h
        WHERE h.consumer = i.consumer AND h.ordering_key = i.ordering_key
          AND h.status IN ('PENDING', 'IN_PROGRESS') AND h.seq < i.seq))";

/// The share of the ordering keys one processor claims from: keys whose hash falls in slice
/// `index` of `of`. The slices are numbered across every process that processes the consumer
/// ([`crate::inbox::members`]; one worker's `n` processors alone take `0..n` of `n`), so they
/// stop walking over each other's locked heads: with every processor claiming from the same
/// oldest rows, each claim probed the heads the others held, and the work per row grew with
/// the processors
/// (`make bench`, 10,000 rows of 1,000 keys: index scans on `inbox` per row 10 with one
/// processor, 41 with four, 68 with eight). Slices narrow where a claim looks, never what it
/// may take: order and exclusion still come from the head-of-key check and the row locks, so
/// processes with different processor counts, or a dead processor's rows, are safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Slice {
    pub index: i32,
    pub of: i32,
}

impl Slice {
    /// Every key: one processor, or a claim made outside the processors' loop.
    pub const ALL: Slice = Slice { index: 0, of: 1 };
}

/// Whether a row aliased `i` is in the slice `$5` of `$4` (see [`Slice`]).
const IN_SLICE: &str = "mod(hashtext(i.ordering_key) & 2147483647, (SELECT $4::int)) = $5";

/// How many open rows, oldest first, a claim looks at by arrival order (per row it wants, at
/// least [`WINDOW_MIN`]) before it looks for the heads of the other keys instead.
const WINDOW_PER_ROW: i64 = 8;
const WINDOW_MIN: i64 = 512;

/// The `seq` of the first open row past the window (`$2` rows); none when the window holds
/// every open row.
const WINDOW_END: &str = "\
SELECT seq FROM inbox WHERE consumer = (SELECT $1::text) AND status IN ('PENDING', 'IN_PROGRESS')
ORDER BY seq OFFSET $2 LIMIT 1";

/// How a claim takes rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Lock,
    Lease,
}

impl Mode {
    /// Rows this claim may take, for a row aliased `i`: due PENDING rows, and for leases also
    /// IN_PROGRESS rows whose lease ran out.
    fn due(self) -> &'static str {
        match self {
            Mode::Lock => "i.status = 'PENDING' AND i.next_attempt_at <= now()",
            Mode::Lease => {
                "((i.status = 'PENDING' AND i.next_attempt_at <= now())
                  OR (i.status = 'IN_PROGRESS' AND i.lease_until < now()))"
            }
        }
    }
}

/// The claimable rows, locked with SKIP LOCKED, as a query selecting `select` (columns of
/// `i`). `$1` consumer, `$2` limit, `$3` the part of the window to read, `[after, end]` (see
/// [`claim_rows`]), `$4` and `$5` the slice ([`Slice`]), `${cursor}` (by keys only) the key the
/// walk starts after.
///
/// `by_keys = false`: rows after `after` and at or before the window's end, oldest first, each
/// checked to be the head of its key. Cheap when heads are near the front, which they are unless a few keys hold
/// most of the backlog: then nearly every row it looks at is blocked behind its key's head, and
/// a scan by arrival would read the whole backlog (5 s for 100,000 rows of 10 keys). The end
/// is hidden from the planner too (`(SELECT $3::bigint)`): seen, it made PostgreSQL read and
/// sort the whole window of `8 x limit` rows where reading in `seq` order stops at `limit`
/// (51 ms against 15 ms a claim).
/// `by_keys = true`: heads past the window's end, found by walking the distinct open keys
/// through the `(consumer, ordering_key, seq)` index, one index descent per key, until `$2`
/// are locked (8 ms for the same 100,000 rows).
fn pick_sql(mode: Mode, by_keys: bool, select: &str, cursor: usize) -> String {
    let due = mode.due();
    if !by_keys {
        return format!(
            "SELECT {select} FROM inbox i
             WHERE i.consumer = (SELECT $1::text) AND {due}
               AND i.seq > (SELECT ($3::int8[])[1]) AND i.seq <= (SELECT ($3::int8[])[2])
               AND {IN_SLICE} AND {HEAD_OF_KEY}
             ORDER BY i.seq LIMIT $2
             FOR UPDATE OF i SKIP LOCKED"
        );
    }
    // Evaluated lazily: the walk stops as soon as `$2` heads are locked, so a claim costs about
    // as many index descents as rows it takes, not one per open key (1.3 s for 1,000 keys whose
    // DONE rows vacuum had not cleared). It starts after `${cursor}`, the key where the last walk
    // of this consumer stopped, so that every key gets its turn. Each head is locked in a
    // lateral subquery of its own, looked up by primary key: `(i.status || '')` keeps the
    // open-row partial indexes out of reach, since on stale statistics PostgreSQL took one of
    // them for "1 row" and scanned every open row per key (3.6 s a walk, 6 ms now).
    let due_opaque = due.replace("i.status = ", "(i.status || '') = ");
    format!(
        "WITH RECURSIVE keys AS (
             (SELECT ordering_key FROM inbox
              WHERE consumer = (SELECT $1::text) AND status IN ('PENDING', 'IN_PROGRESS')
                AND ordering_key > ${cursor}
              ORDER BY ordering_key LIMIT 1)
             UNION ALL
             SELECT (SELECT n.ordering_key FROM inbox n
                     WHERE n.consumer = (SELECT $1::text)
                       AND n.status IN ('PENDING', 'IN_PROGRESS')
                       AND n.ordering_key > k.ordering_key
                     ORDER BY n.ordering_key LIMIT 1)
             FROM keys k WHERE k.ordering_key IS NOT NULL
         )
         SELECT x.* FROM keys k
         CROSS JOIN LATERAL (
             SELECT f.message_id, f.event_date FROM inbox f
             WHERE f.consumer = (SELECT $1::text) AND f.ordering_key = k.ordering_key
               AND f.status IN ('PENDING', 'IN_PROGRESS')
             ORDER BY f.seq LIMIT 1) h
         CROSS JOIN LATERAL (
             SELECT {select} FROM inbox i
             WHERE i.consumer = (SELECT $1::text) AND i.message_id = h.message_id
               AND i.event_date = h.event_date AND {due_opaque} AND i.seq > ($3::int8[])[2] AND {IN_SLICE}
             FOR UPDATE OF i SKIP LOCKED) x
         LIMIT $2"
    )
}

/// Where the window of each consumer's slice ended when a claim last measured it (see
/// [`claim_planned`]).
static WINDOW_ENDS: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<(String, Slice), i64>>,
> = std::sync::LazyLock::new(Default::default);

/// Where the last key walk of each consumer stopped (see [`pick_sql`]): the next one starts
/// after it, and after the last key it starts from the first again.
static WALK_CURSOR: std::sync::LazyLock<
    std::sync::Mutex<std::collections::HashMap<String, String>>,
> = std::sync::LazyLock::new(Default::default);

/// Claims up to `limit` rows of `slice` with `sql(by_keys)` (run with `params_after`, the
/// parameters after `$1`..`$5`): first by arrival order within the window, then, if that found
/// too few and open rows lie past the window, by walking the keys past it.
#[allow(clippy::too_many_arguments)]
async fn claim_rows<C, F>(
    client: &C,
    in_transaction: bool,
    consumer: &str,
    limit: i64,
    slice: Slice,
    sql: F,
    params_after: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Claimed>, StoreError>
where
    C: deadpool_postgres::GenericClient + Sync,
    F: Fn(bool) -> &'static str,
{
    planned(
        client,
        in_transaction,
        claim_planned(client, consumer, limit, slice, sql, params_after),
    )
    .await
}

/// [`claim_rows`], with the plan settings it runs under already set.
async fn claim_planned<C, F>(
    client: &C,
    consumer: &str,
    limit: i64,
    slice: Slice,
    sql: F,
    params_after: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<Claimed>, StoreError>
where
    C: deadpool_postgres::GenericClient + Sync,
    F: Fn(bool) -> &'static str,
{
    let cursor: String = WALK_CURSOR
        .lock()
        .expect("not poisoned")
        .get(consumer)
        .cloned()
        .unwrap_or_default();
    let cursor = &cursor;
    let sql = &sql;
    let run = |by_keys: bool, n: i64, part: [i64; 2]| async move {
        let part = part.to_vec();
        let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            vec![&consumer, &n, &part, &slice.of, &slice.index];
        params.extend_from_slice(params_after);
        if by_keys {
            params.push(cursor);
        }
        let rows = if by_keys {
            // A new statement each time: planned for this state of the inbox, never a cached
            // generic plan.
            client.query(sql(true), &params).await?
        } else {
            let stmt = client.prepare_cached(sql(false)).await?;
            client.query(&stmt, &params).await?
        };
        Ok::<_, StoreError>(rows.iter().map(claimed).collect::<Vec<_>>())
    };
    // First within the window this slice last measured, if any: the window's end is found by
    // reading `window` open rows, which cost more than the claim itself with many slices (the
    // window grows with them), so it is measured again only when the old one runs dry.
    let remembered = (WINDOW_ENDS.lock().expect("not poisoned"))
        .get(&(consumer.to_string(), slice))
        .copied();
    let mut out = Vec::new();
    let mut after = i64::MIN;
    if let Some(end) = remembered {
        out = run(false, limit, [after, end]).await?;
        if out.len() as i64 == limit {
            out.sort_by_key(|c| c.seq);
            return Ok(out);
        }
        after = end;
    }
    // A slice holds about `1 / of` of the window's rows: the window grows to match.
    let window = (limit * WINDOW_PER_ROW * slice.of as i64).max(WINDOW_MIN);
    let end: Option<i64> = client
        .query_opt(WINDOW_END, &[&consumer, &window])
        .await?
        .map(|r| r.get(0));
    {
        let mut ends = WINDOW_ENDS.lock().expect("not poisoned");
        // A window that held every open row is not remembered: a burst after it would be
        // read by arrival order to its end.
        match end {
            Some(end) => ends.insert((consumer.to_string(), slice), end),
            None => ends.remove(&(consumer.to_string(), slice)),
        };
    }
    let bound = end.unwrap_or(i64::MAX);
    if bound > after {
        let more = run(false, limit - out.len() as i64, [after, bound]).await?;
        out.extend(more);
    }
    if (out.len() as i64) < limit
        && end.is_some()
        && few_keys(client, consumer, bound, limit * slice.of as i64).await?
    {
        let t = std::time::Instant::now();
        let wanted = limit - out.len() as i64;
        let more = run(true, wanted, [i64::MIN, bound]).await?;
        // A full walk resumes after its last key; a short one reached the last key: start over.
        let next = match more.iter().map(|c| &c.ordering_key).max() {
            Some(last) if more.len() as i64 == wanted => last.clone(),
            _ => String::new(),
        };
        WALK_CURSOR
            .lock()
            .expect("not poisoned")
            .insert(consumer.to_string(), next);
        tracing::debug!(
            consumer,
            window = out.len(),
            by_keys = more.len(),
            ms = t.elapsed().as_millis() as u64,
            "inbox claim: too few rows in the window, walked the keys past it"
        );
        out.extend(more);
    }
    out.sort_by_key(|c| c.seq);
    Ok(out)
}

/// The distinct keys of the window's open rows, up to `$3`.
const WINDOW_KEYS: &str = "\
SELECT count(*) FROM (
    SELECT DISTINCT ordering_key FROM inbox
    WHERE consumer = (SELECT $1::text) AND status IN ('PENDING', 'IN_PROGRESS')
      AND seq <= (SELECT $2::bigint)
    LIMIT $3) k";

/// Whether the window holds fewer than twice the keys a claim wants: then its heads are behind
/// a few hot keys (with other processors holding some of them, it cannot fill a claim), and
/// only the key walk finds the rest. A window of many keys that fell short did so because
/// other processors held or had just finished its heads between this claim's statements: the
/// next claim finds more. Walking on every shortfall, when a walk still read every key, made 4
/// processors drain 418 rows/s in `make bench`.
async fn few_keys<C>(client: &C, consumer: &str, bound: i64, limit: i64) -> Result<bool, StoreError>
where
    C: deadpool_postgres::GenericClient + Sync,
{
    let stmt = client.prepare_cached(WINDOW_KEYS).await?;
    let keys: i64 = client
        .query_one(&stmt, &[&consumer, &bound, &(2 * limit)])
        .await?
        .get(0);
    Ok(keys < 2 * limit)
}

/// The planner settings a claim runs with: no sort, no bitmap scan, no hash or merge join.
const PLAN_SETTINGS: [&str; 4] = [
    "enable_sort",
    "enable_bitmapscan",
    "enable_hashjoin",
    "enable_mergejoin",
];

/// For [`planned`], built once: in a transaction, the statement that returns the settings'
/// values and turns them off, and the one that sets them back (`$1`.. the values, in
/// [`PLAN_SETTINGS`] order); outside one, the `BEGIN` that turns them off.
static PLAN_STATEMENTS: std::sync::LazyLock<[String; 3]> = std::sync::LazyLock::new(|| {
    let keep_and_set: Vec<String> = (PLAN_SETTINGS.iter())
        .map(|s| format!("current_setting('{s}')"))
        .chain(
            PLAN_SETTINGS
                .iter()
                .map(|s| format!("set_config('{s}', 'off', true)")),
        )
        .collect();
    let restore: Vec<String> = (PLAN_SETTINGS.iter().enumerate())
        .map(|(i, s)| format!("set_config('{s}', ${}, true)", i + 1))
        .collect();
    let off: String = (PLAN_SETTINGS.iter())
        .map(|s| format!(" SET LOCAL {s} = off;"))
        .collect();
    [
        format!("SELECT {}", keep_and_set.join(", ")),
        format!("SELECT {}", restore.join(", ")),
        format!("BEGIN;{off}"),
    ]
});

/// Runs `query` (statements on `client`) with [`PLAN_SETTINGS`] off, in the caller's
/// transaction (`in_transaction`, restoring them after, so the handler's statements plan as
/// usual) or in one of its own.
///
/// A claim's statements read the open rows in `seq` order (window end, arrival-order pick) or
/// key by key (the key walk) and stop after the rows they want; each head check is an index
/// descent per partition. On estimates that put "1 row" where 100,000 open rows are (statistics
/// from before a burst, or from when every row was DONE, or a slice's filter the planner
/// prices at 0.5%), PostgreSQL preferred to read and sort what it expected to be nothing: the
/// window's end was found by a bitmap scan and a sort of every open row (1,500 buffers a claim
/// instead of 50, `make bench`), the pick read the whole backlog (140 ms instead of 5), each
/// step of the key walk sorted the rest of the backlog (minutes for 10,000 keys), or it hashed
/// every open row of the consumer before the first head (spilling to disk: a 100,000-row drain
/// took 95 s). With those priced out, a claim costs what it takes, whatever the statistics say.
async fn planned<C, T>(
    client: &C,
    in_transaction: bool,
    query: impl std::future::Future<Output = Result<T, StoreError>>,
) -> Result<T, StoreError>
where
    C: deadpool_postgres::GenericClient + Sync,
{
    let [keep_and_set, restore, begin] = &*PLAN_STATEMENTS;
    if in_transaction {
        // One round trip to keep the values and set them, one to restore them.
        let stmt = client.prepare_cached(keep_and_set).await?;
        let was = client.query_one(&stmt, &[]).await?;
        let out = query.await?;
        let values: Vec<String> = (0..PLAN_SETTINGS.len()).map(|i| was.get(i)).collect();
        let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
            values.iter().map(|v| v as _).collect();
        let stmt = client.prepare_cached(restore).await?;
        client.query_one(&stmt, &params).await?;
        return Ok(out);
    }
    client.batch_execute(begin).await?;
    match query.await {
        Ok(out) => {
            client.batch_execute("COMMIT").await?;
            Ok(out)
        }
        Err(e) => {
            // The connection goes back to the pool: leave no transaction open on it.
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

fn claimed(r: &tokio_postgres::Row) -> Claimed {
    Claimed {
        message_id: r.get(0),
        event_date: r.get(1),
        seq: r.get(2),
        attempts: r.get(3),
        ordering_key: r.get(4),
        topic: r.get(5),
        partition: r.get(6),
        offset: r.get(7),
        kafka_ts: r.get(8),
        key: r.get(9),
        payload: r.get(10),
        traceparent: r.get(11),
        tracestate: r.get(12),
    }
}

static CLAIM_LOCKED: std::sync::LazyLock<[String; 2]> = std::sync::LazyLock::new(|| {
    [false, true].map(|by_keys| pick_sql(Mode::Lock, by_keys, COLUMNS_OF_I, 6))
});

/// `COLUMNS` qualified by the alias `i`.
const COLUMNS_OF_I: &str = "i.message_id, i.event_date, i.seq, i.attempts, i.ordering_key, \
    i.topic, i.partition, i.\"offset\", i.kafka_ts, i.key, i.payload, i.traceparent, i.tracestate";

/// `claim = "lock"`: locks up to `limit` due rows, oldest first, each the head of its key,
/// skipping rows other processors hold, in the caller's transaction (which applies them and
/// commits).
pub async fn claim_locked(
    tx: &Transaction<'_>,
    consumer: &str,
    limit: i64,
    slice: Slice,
) -> Result<Vec<Claimed>, StoreError> {
    claim_rows(
        tx,
        true,
        consumer,
        limit,
        slice,
        |k| &CLAIM_LOCKED[k as usize],
        &[],
    )
    .await
}

static CLAIM_LEASED: std::sync::LazyLock<[String; 2]> = std::sync::LazyLock::new(|| {
    let returning = COLUMNS_OF_I.replace("i.", "u.");
    [false, true].map(|by_keys| {
        format!(
            "WITH picked AS ({})
             UPDATE inbox u
             SET status = 'IN_PROGRESS', lease_until = now() + $6 * interval '1 millisecond',
                 claim_token = $7, attempts = u.attempts + 1
             FROM picked p
             WHERE u.consumer = (SELECT $1::text) AND u.message_id = p.message_id
               AND u.event_date = p.event_date
             RETURNING {returning}",
            pick_sql(Mode::Lease, by_keys, "i.message_id, i.event_date", 8)
        )
    })
});

/// `claim = "lease"`: marks up to `limit` due rows, or rows whose lease expired, IN_PROGRESS
/// under `token` until `lease_ms` from now, each the head of its key, and commits (autocommit
/// on `client`). Oldest first.
pub async fn claim_leased(
    client: &deadpool_postgres::Client,
    consumer: &str,
    limit: i64,
    slice: Slice,
    lease_ms: i64,
    token: Uuid,
) -> Result<Vec<Claimed>, StoreError> {
    let lease_ms = lease_ms as f64;
    claim_rows(
        client,
        false,
        consumer,
        limit,
        slice,
        |k| &CLAIM_LEASED[k as usize],
        &[&lease_ms, &token],
    )
    .await
}

const HOLD_LEASED: &str = "\
SELECT message_id, event_date FROM inbox
WHERE consumer = (SELECT $1::text) AND claim_token = $2 AND status = 'IN_PROGRESS'
  AND event_date = ANY($4::date[])
  AND (message_id, event_date) IN (SELECT * FROM unnest($3::uuid[], $4::date[]))
FOR UPDATE";

/// Locks the rows of a lease claim that are still this processor's (not reclaimed by another
/// after the lease expired), in the transaction that applies them.
pub async fn hold_leased(
    tx: &Transaction<'_>,
    consumer: &str,
    token: Uuid,
    keys: &[(Uuid, NaiveDate)],
) -> Result<Vec<(Uuid, NaiveDate)>, StoreError> {
    let (ids, dates) = split(keys);
    let stmt = tx.prepare_cached(HOLD_LEASED).await?;
    let rows = tx.query(&stmt, &[&consumer, &token, &ids, &dates]).await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

const RELEASE_LEASED: &str = "\
UPDATE inbox SET status = 'PENDING', lease_until = NULL, claim_token = NULL
WHERE consumer = (SELECT $1::text) AND claim_token = $2 AND status = 'IN_PROGRESS'
  AND event_date = ANY($4::date[])
  AND (message_id, event_date) IN (SELECT * FROM unnest($3::uuid[], $4::date[]))";

/// Gives back a lease claim's rows that were not finished (a processor stopping).
pub async fn release_leased<C: GenericClient + Sync>(
    client: &C,
    consumer: &str,
    token: Uuid,
    keys: &[(Uuid, NaiveDate)],
) -> Result<u64, StoreError> {
    let (ids, dates) = split(keys);
    Ok(client
        .execute(RELEASE_LEASED, &[&consumer, &token, &ids, &dates])
        .await?)
}
