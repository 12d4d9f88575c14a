//! PostgreSQL's own counters around a phase: WAL bytes, full-page images, checkpoints and row
//! writes, so each phase's cost is reported beside its speed.

use std::collections::HashMap;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;

use super::{procfs, round1, BenchArgs};

/// What PostgreSQL did during a phase, from [`DbMark`]s taken around it.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(super) struct DbCost {
    /// `pg_wal_lsn_diff` of `pg_current_wal_lsn()`: every database of the cluster, and
    /// autovacuum's and the checkpointer's writes too.
    pub(super) wal_bytes: i64,
    /// Full-page images among them (`pg_stat_wal.wal_fpi`): a page's first change after a
    /// checkpoint is logged whole.
    pub(super) wal_fpi: i64,
    /// Checkpoints counted in the phase (`pg_stat_bgwriter`, which counts one as it ends).
    pub(super) checkpoints: i64,
    /// `n_tup_ins + n_tup_upd + n_tup_del` over the `public` tables (each partition counted;
    /// the sessions' temporary staging tables, which write no WAL, are not).
    pub(super) row_writes: i64,
    /// Index scans on the `inbox` table's partitions (`pg_stat_user_tables.idx_scan`): the
    /// processors' claims probe each key's head, once per partition.
    pub(super) inbox_index_scans: i64,
    /// Buffer accesses (hits and reads, heap and indexes) on the `inbox` partitions, from
    /// `pg_statio_user_tables`: the work PostgreSQL does for the claims and the marking.
    pub(super) inbox_buffers: i64,
    /// CPU seconds of PostgreSQL's processes ([`pg_cpu_seconds`]; 0 for a server elsewhere).
    pub(super) pg_cpu_s: f64,
}

impl DbCost {
    pub(super) fn plus(&self, o: &DbCost) -> DbCost {
        DbCost {
            wal_bytes: self.wal_bytes + o.wal_bytes,
            wal_fpi: self.wal_fpi + o.wal_fpi,
            checkpoints: self.checkpoints + o.checkpoints,
            row_writes: self.row_writes + o.row_writes,
            inbox_index_scans: self.inbox_index_scans + o.inbox_index_scans,
            inbox_buffers: self.inbox_buffers + o.inbox_buffers,
            pg_cpu_s: self.pg_cpu_s + o.pg_cpu_s,
        }
    }

    pub(super) fn wal_bytes_per(&self, records: u64) -> f64 {
        round1(self.wal_bytes as f64 / records.max(1) as f64)
    }

    pub(super) fn row_writes_per(&self, records: u64) -> f64 {
        (self.row_writes as f64 / records.max(1) as f64 * 100.0).round() / 100.0
    }

    /// PostgreSQL's CPU microseconds per record.
    pub(super) fn pg_cpu_us_per(&self, records: u64) -> f64 {
        round1(self.pg_cpu_s * 1e6 / records.max(1) as f64)
    }
}

/// A connection that reads PostgreSQL's counters around a phase.
pub(super) struct Db {
    pub(super) client: tokio_postgres::Client,
}

/// The cluster's WAL position and write counters at one moment.
pub(super) struct DbMark {
    pub(super) lsn: String,
    pub(super) wal_fpi: i64,
    pub(super) checkpoints: i64,
    /// Per table (oid): rows inserted, updated and deleted so far.
    pub(super) row_writes: HashMap<u32, i64>,
    /// Per partition of `inbox` (oid): index scans and buffer accesses so far.
    pub(super) inbox_reads: HashMap<u32, (i64, i64)>,
    pub(super) pg_cpu_s: f64,
    /// Per statement (`pg_stat_statements`, when the server loads it): the counters so far.
    pub(super) statements: HashMap<i64, Statement>,
}

/// One statement's share of a phase, from `pg_stat_statements` (the stack's PostgreSQL loads
/// it; a server that does not leaves the list empty): the profile of where PostgreSQL's time
/// went, by statement.
#[derive(Debug, Default, Clone, Serialize)]
pub(super) struct Statement {
    /// The normalized text, its first 160 characters on one line.
    pub(super) query: String,
    pub(super) calls: i64,
    /// Execution time, all calls together (plan time excluded; it is off by default).
    pub(super) exec_ms: f64,
    pub(super) rows: i64,
    /// Shared buffers hit and read.
    pub(super) buffers: i64,
}

impl Db {
    pub(super) async fn connect(args: &BenchArgs) -> anyhow::Result<Db> {
        let (client, conn) =
            tokio_postgres::connect(&args.services.database_url, tokio_postgres::NoTls)
                .await
                .context("connecting to PostgreSQL")?;
        tokio::spawn(conn);
        // The per-statement profile: present when the server preloads the module (the stack's
        // does, scripts/lib.sh); elsewhere the profile stays empty.
        let _ = client
            .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            .await;
        Ok(Db { client })
    }

    /// The statements' counters now (empty without `pg_stat_statements`).
    async fn statements(&self) -> HashMap<i64, Statement> {
        let rows = self
            .client
            .query(
                "SELECT queryid, left(regexp_replace(query, '\\s+', ' ', 'g'), 160), calls,
                        total_exec_time, rows, shared_blks_hit + shared_blks_read
                 FROM pg_stat_statements WHERE queryid IS NOT NULL",
                &[],
            )
            .await
            .unwrap_or_default();
        rows.iter()
            .map(|r| {
                let s = Statement {
                    query: r.get(1),
                    calls: r.get(2),
                    exec_ms: r.get(3),
                    rows: r.get(4),
                    buffers: r.get(5),
                };
                (r.get::<_, i64>(0), s)
            })
            .collect()
    }

    /// The `n` statements that took the most execution time since `since`, most first.
    pub(super) async fn top_statements(&self, since: &DbMark, n: usize) -> Vec<Statement> {
        let now = self.statements().await;
        let mut out: Vec<Statement> = now
            .into_iter()
            .map(|(id, s)| {
                let was = since.statements.get(&id).cloned().unwrap_or_default();
                Statement {
                    calls: s.calls - was.calls,
                    exec_ms: round1(s.exec_ms - was.exec_ms),
                    rows: s.rows - was.rows,
                    buffers: s.buffers - was.buffers,
                    query: s.query,
                }
            })
            .filter(|s| s.calls > 0)
            .collect();
        out.sort_by(|a, b| b.exec_ms.total_cmp(&a.exec_ms));
        out.truncate(n);
        out
    }

    /// Waits (up to 10 s) until no engine session is connected: a session reports its row
    /// counts and WAL statistics when it exits, and they must fall in the phase they belong to.
    pub(super) async fn settle(&self) -> anyhow::Result<()> {
        settle(&self.client, Duration::from_secs(10)).await
    }

    /// Makes the cluster's maintenance happen now, not in the phase about to be measured:
    /// `VACUUM` of the database (what autovacuum owes for earlier phases, such as the retention
    /// phase's day of millions of keys prepared just before the batch drain; pages all visible
    /// already are skipped, so a table no phase wrote costs next to nothing), then a
    /// `CHECKPOINT` (their dirty pages written). Returns PostgreSQL's CPU seconds it took. Run
    /// again right after a phase, it measures the maintenance that phase leaves behind (its
    /// tables' vacuum, its pages' writes), which autovacuum and the checkpointer do
    /// at their own times: inside the next phase's window or not, which is how two full runs of
    /// the same drain came to report 27 and 58 µs of PostgreSQL CPU per message.
    pub(super) async fn maintain(&self) -> anyhow::Result<f64> {
        let before = pg_cpu_seconds(&self.client).await.unwrap_or(0.0);
        // Two messages: one simple query of both would run them as one transaction, where
        // VACUUM refuses to run.
        for sql in ["VACUUM", "CHECKPOINT"] {
            self.client
                .batch_execute(sql)
                .await
                .with_context(|| format!("{sql} before or after a phase"))?;
        }
        // Autovacuum workers that started before our VACUUM finish their table first.
        for _ in 0..600 {
            let busy: i64 = (self.client)
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE backend_type = 'autovacuum worker'",
                    &[],
                )
                .await?
                .get(0);
            if busy == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(pg_cpu_seconds(&self.client).await.unwrap_or(0.0) - before)
    }

    /// Once the engine's sessions are gone: the counters now.
    pub(super) async fn mark(&self) -> anyhow::Result<DbMark> {
        self.settle().await?;
        let r = self
            .client
            .query_one(
                "SELECT pg_current_wal_lsn()::text, (SELECT wal_fpi FROM pg_stat_wal),
                        (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)",
                &[],
            )
            .await?;
        let row_writes = self
            .client
            .query(
                "SELECT relid, n_tup_ins + n_tup_upd + n_tup_del FROM pg_stat_user_tables
                 WHERE schemaname = 'public'",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get::<_, u32>(0), r.get::<_, i64>(1)))
            .collect();
        let inbox_reads = self
            .client
            .query(
                "SELECT s.relid, coalesce(s.idx_scan, 0),
                        coalesce(io.heap_blks_hit, 0) + coalesce(io.heap_blks_read, 0)
                        + coalesce(io.idx_blks_hit, 0) + coalesce(io.idx_blks_read, 0)
                 FROM pg_stat_user_tables s JOIN pg_statio_user_tables io USING (relid)
                 WHERE s.relid IN (SELECT inhrelid FROM pg_inherits
                                   WHERE inhparent = 'public.inbox'::regclass)",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get::<_, u32>(0), (r.get::<_, i64>(1), r.get::<_, i64>(2))))
            .collect();
        Ok(DbMark {
            lsn: r.get(0),
            wal_fpi: r.get(1),
            checkpoints: r.get(2),
            row_writes,
            inbox_reads,
            pg_cpu_s: pg_cpu_seconds(&self.client).await.unwrap_or(0.0),
            statements: self.statements().await,
        })
    }

    /// What was written since `since` (tables dropped since are left out; tables created
    /// since count from zero).
    pub(super) async fn cost_since(&self, since: &DbMark) -> anyhow::Result<DbCost> {
        let now = self.mark().await?;
        let wal_bytes: i64 = self
            .client
            .query_one(
                "SELECT pg_wal_lsn_diff($1::text::pg_lsn, $2::text::pg_lsn)::bigint",
                &[&now.lsn, &since.lsn],
            )
            .await?
            .get(0);
        let row_writes = (now.row_writes.iter())
            .map(|(rel, n)| n - since.row_writes.get(rel).copied().unwrap_or(0))
            .sum();
        let (mut inbox_index_scans, mut inbox_buffers) = (0, 0);
        for (rel, (scans, buffers)) in &now.inbox_reads {
            let (s0, b0) = since.inbox_reads.get(rel).copied().unwrap_or((0, 0));
            inbox_index_scans += scans - s0;
            inbox_buffers += buffers - b0;
        }
        Ok(DbCost {
            wal_bytes,
            wal_fpi: now.wal_fpi - since.wal_fpi,
            checkpoints: now.checkpoints - since.checkpoints,
            row_writes,
            inbox_index_scans,
            inbox_buffers,
            pg_cpu_s: now.pg_cpu_s - since.pg_cpu_s,
        })
    }
}

/// Waits (up to `limit`) until no session named `effectively` is connected to the database.
pub(crate) async fn settle(client: &tokio_postgres::Client, limit: Duration) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    while started.elapsed() < limit {
        let n: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE application_name = 'effectively' AND datname = current_database()",
                &[],
            )
            .await?
            .get(0);
        if n == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// CPU seconds the engine's sessions (`application_name = 'effectively'`) of this database have
/// used so far, the live ones (a worker's pool holds its connections through a drain): the
/// cost of the engine's own statements, without autovacuum, the checkpointer or the WAL writer,
/// which run when their thresholds and timers say (an autoanalyze of the outbox falling inside
/// one drain and not the next moved the whole cluster's CPU per message by 4 µs between two
/// runs of the same drain). `None` for a server elsewhere.
pub(crate) async fn engine_cpu_seconds(client: &tokio_postgres::Client) -> Option<f64> {
    let pids = client
        .query(
            "SELECT pid FROM pg_stat_activity
             WHERE application_name = 'effectively' AND datname = current_database()",
            &[],
        )
        .await
        .ok()?;
    let mut cpu = 0.0;
    for r in pids {
        cpu += procfs::stat(r.get::<_, i32>(0) as u32)?.cpu_s;
    }
    Some(cpu)
}

/// CPU seconds PostgreSQL's processes have used so far (user and system): the postmaster's own
/// and its exited children's (backends and autovacuum workers that ended, reaped by it), plus
/// every live child's. Read from `/proc`, so only for a server on this machine; `None`
/// elsewhere. The difference over a phase is the whole cluster's CPU in it.
pub(crate) async fn pg_cpu_seconds(client: &tokio_postgres::Client) -> Option<f64> {
    let backend: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .ok()?
        .get(0);
    let postmaster = procfs::stat(backend as u32)?.ppid;
    let own = procfs::stat(postmaster)?;
    let children: f64 = procfs::pids()
        .filter_map(procfs::stat)
        .filter(|s| s.ppid == postmaster)
        .map(|s| s.cpu_s)
        .sum();
    Some(own.cpu_s + own.children_cpu_s + children)
}
