//! Wires a worker: config, pool, handlers, one source per configured consumer, shutdown.
//!
//! [`Worker::start`] returns once every consumer has joined its group (tests start workers
//! in-process with it); [`run`] is the whole life of the `effectively run` process.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, Strategy as StrategyKind};
use crate::handler::Registry;
use crate::health::{Health, Heartbeat};
use crate::inbox::processor::{self, ProcessorError, Processors};
use crate::prefilter::Prefilter;
use crate::source::consumer::{Source, SourceError};
use crate::stats::Stats;
use crate::store::partitions::Known;
use crate::store::pool::{self, PoolOptions, Pools};
use crate::store::retention;
use crate::strategy::{batched::Batched, inbox::Inbox, per_message::PerMessage, Strategy};

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error("database: {0}")]
    Store(#[from] crate::store::StoreError),
    #[error(
        "the schema is missing in database {database} ({url}): run `effectively migrate -c \
         CONFIG` first (it migrates every configured database)"
    )]
    NotMigrated { database: String, url: String },
    #[error(
        "consumer {consumer:?} has offsets stored in database {found}, but is configured on \
         database {configured}: started there it would begin again with an empty ledger and \
         apply again what it applied. Move its rows first, or put it back (docs/SCALING.md, \
         \"Moving a consumer to another database\")"
    )]
    Moved {
        consumer: String,
        found: String,
        configured: String,
    },
    #[error("consumer {consumer:?}: handler: {reason}")]
    Handler { consumer: String, reason: String },
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error(transparent)]
    Processor(#[from] ProcessorError),
}

/// A task of the worker: a consumer's source, an inbox processor, or maintenance.
#[derive(Debug)]
enum TaskError {
    Source(SourceError),
    Processor(ProcessorError),
}

impl From<TaskError> for WorkerError {
    fn from(e: TaskError) -> Self {
        match e {
            TaskError::Source(e) => WorkerError::Source(e),
            TaskError::Processor(e) => WorkerError::Processor(e),
        }
    }
}

/// A running worker.
pub struct Worker {
    stats: HashMap<String, Arc<Stats>>,
    health: Arc<Health>,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, if anywhere.
    endpoint: Option<std::net::SocketAddr>,
    shutdown: CancellationToken,
    tasks: JoinSet<Result<(), TaskError>>,
}

impl Worker {
    /// Checks the configuration against the database and starts every consumer.
    pub async fn start(config: Config, registry: Registry) -> Result<Worker, WorkerError> {
        // The whole config's cross-field checks (the revoke deadline below the session timeout
        // among them), again here: a config built or changed in code skips `Config::load`.
        config
            .validate()
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        if config.consumers.is_empty() {
            return Err(WorkerError::Config(
                "no [[consumer]] to run (a config with only [relay] is for `effectively relay`)"
                    .into(),
            ));
        }
        crate::telemetry::install(&config.tracing, crate::telemetry::Component::Worker)
            .map_err(|e| WorkerError::Config(e.to_string()))?;
        // One pool per database the consumers use; each consumer's partitions, claims,
        // control, inbox processors and gauges take their database's pool, and nothing else.
        let pools = Pools::for_consumers(&config, &config.consumers, PoolOptions::of)?;
        let mut clients = BTreeMap::new();
        for db in pools.iter() {
            // Also the start-up check of the TLS settings: a wrong CA or host name stops here.
            let client = pool::connect_to(&db.config).await?;
            let migrated: Option<String> = client
                .query_one("SELECT to_regclass('consumer_offsets')::text", &[])
                .await
                .map_err(crate::store::StoreError::from)?
                .get(0);
            if migrated.is_none() {
                return Err(WorkerError::NotMigrated {
                    database: db.name.clone(),
                    url: db.config.url.to_string(),
                });
            }
            clients.insert(db.name.clone(), client);
        }
        refuse_moved(&config, &clients).await?;

        let health = Health::new();
        let mut endpoint = None;
        if let Some(addr) = config.worker.metrics_addr {
            // A monitoring endpoint that cannot bind must not stop the ledger: say so loudly.
            match crate::endpoint::serve(addr, Arc::clone(&health)) {
                Ok(bound) => endpoint = Some(bound),
                Err(e) => tracing::error!(error = %e, "monitoring endpoint not started"),
            }
        }
        // Per database: which daily partitions exist, how far ahead to create them, and the
        // longest retention any of its consumers declares.
        let today = chrono::Utc::now().date_naive();
        let mut upkeep: BTreeMap<String, Upkeep> = BTreeMap::new();
        for c in &config.consumers {
            let name = c.database_name();
            let client = &clients[name];
            let u = upkeep.entry(name.to_string()).or_insert_with(|| Upkeep {
                known: Arc::new(Known::default()),
                ahead: 0,
                longest_retention: 1,
            });
            u.ahead = u.ahead.max(c.partitions_ahead);
            // Declare what each consumer needs kept, before any instance's maintenance could
            // drop it.
            let days = retention_days(c.retention);
            retention::declare(client, &c.name, days).await?;
            u.longest_retention = u.longest_retention.max(days);
            let made_by = c.keys_made_by();
            if let Some(before) = crate::store::keys::record(client, &c.name, &made_by).await? {
                tracing::warn!(consumer = %c.name, %before, now = %made_by, retention_days = days,
                    "this consumer's dedupe keys are now made another way: a copy of an event \
                     applied before the change gets another key and will be applied again, until \
                     the old keys pass retention");
            }
        }
        for (name, u) in &upkeep {
            u.known.create_ahead(&clients[name], today, u.ahead).await?;
        }

        let worker_id = config.worker_id();
        let shutdown = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut stats = HashMap::new();
        let mut sources = Vec::new();
        let mut inbox_processors = Vec::new();
        for c in &config.consumers {
            let db = pools.of(c).ok_or_else(|| {
                WorkerError::Config(format!("consumer {:?}: no pool for its database", c.name))
            })?;
            let (pg, client) = (db.pool.clone(), &clients[&db.name]);
            let deadline = db.config.transaction_deadline;
            crate::metrics::consumer_database(&c.name, &db.name);
            let handler = registry
                .build(&c.handler)
                .map_err(|reason| WorkerError::Handler {
                    consumer: c.name.clone(),
                    reason,
                })?;
            if c.dedupe == crate::config::Dedupe::BusinessRow && !handler.dedupes_by_row() {
                return Err(WorkerError::Handler {
                    consumer: c.name.clone(),
                    reason: "dedupe = \"business-row\" needs a handler that keeps the key on the \
                             one row it writes a message (Handler::dedupes_by_row); this one does \
                             not say so"
                        .into(),
                });
            }
            handler
                .prepare(client)
                .await
                .map_err(|e| WorkerError::Handler {
                    consumer: c.name.clone(),
                    reason: e.to_string(),
                })?;
            if c.version.is_some() {
                crate::metrics::version_consumer(&c.name);
            }
            let s = Arc::new(Stats::default());
            let prefilter = match &c.prefilter {
                Some(p) => Some(Arc::new(
                    Prefilter::new(&c.name, p, c.retention)
                        .map_err(|e| WorkerError::Config(e.to_string()))?,
                )),
                None => None,
            };
            let strategy: Arc<dyn Strategy> = match c.strategy {
                StrategyKind::Batch => Arc::new(Batched {
                    prefilter,
                    groups: c.commit_groups().then(|| {
                        Arc::new(crate::strategy::group::Groups::start(&c.batch, &c.topics))
                    }),
                }),
                StrategyKind::PerMessage => Arc::new(PerMessage { prefilter }),
                StrategyKind::Inbox => {
                    let stored = Arc::new(tokio::sync::Notify::new());
                    inbox_processors.push((
                        Arc::new(Processors {
                            consumer: Arc::from(c.name.as_str()),
                            config: Arc::new(c.clone()),
                            pool: pg.clone(),
                            handler: Arc::clone(&handler),
                            stored: Arc::clone(&stored),
                            stats: Arc::clone(&s),
                            deadline,
                            health: health.consumer(&c.name),
                        }),
                        c.inbox.processors,
                    ));
                    Arc::new(Inbox {
                        ordering_key: c.inbox.ordering_key.clone(),
                        done: c.inbox.done,
                        stored,
                        freshness: Default::default(),
                    })
                }
            };
            stats.insert(c.name.clone(), Arc::clone(&s));
            sources.push(Source {
                config: Arc::new(c.clone()),
                kafka: config.kafka.clone(),
                worker_id: worker_id.clone(),
                revoke_deadline: config.worker.revoke_deadline,
                transaction_deadline: deadline,
                pool: pg.clone(),
                handler,
                strategy,
                partitions: Arc::clone(&upkeep[&db.name].known),
                stats: s,
                health: health.consumer(&c.name),
                control: crate::source::control::SourceControl::new(c, pg, deadline),
            });
        }
        for source in sources {
            let stop = shutdown.child_token();
            tasks.spawn(async move { source.run(stop).await.map_err(TaskError::Source) });
        }
        for (p, n) in &inbox_processors {
            // A receive-only process (`processors = 0`) has no task to watch: a watcher that
            // ended at once would read as the worker's end (`Worker::failed`).
            if *n == 0 {
                continue;
            }
            let mut set = JoinSet::new();
            processor::spawn(p, *n, &worker_id, &shutdown, &mut set);
            let consumer = p.consumer.to_string();
            tasks.spawn(async move {
                while let Some(r) = set.join_next().await {
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => return Err(TaskError::Processor(e)),
                        Err(join) => {
                            return Err(TaskError::Processor(ProcessorError::Fatal {
                                consumer,
                                reason: format!("a processor task panicked: {join}"),
                            }))
                        }
                    }
                }
                Ok(())
            });
        }
        // Per database: its maintenance, its readiness probe, its gauges.
        for db in pools.iter() {
            let u = &upkeep[&db.name];
            let on: Vec<&crate::config::ConsumerConfig> = (config.consumers.iter())
                .filter(|c| c.database_name() == db.name)
                .collect();
            tasks.spawn(maintain_partitions(
                db.name.clone(),
                db.config.clone(),
                Arc::clone(&u.known),
                u.ahead,
                u.longest_retention,
                health.register(per_database("maintenance", &db.name), MAINTENANCE_PERIOD),
                shutdown.child_token(),
            ));
            let probe = crate::health::watch_database(
                db.name.clone(),
                db.config.clone(),
                Arc::clone(&health),
                shutdown.child_token(),
            );
            tasks.spawn(async move {
                probe.await;
                Ok(())
            });
            let sampled = Sampled {
                database: db.name.clone(),
                consumers: on.iter().map(|c| c.name.clone()).collect(),
                inbox: (on.iter())
                    .filter(|c| c.strategy == StrategyKind::Inbox)
                    .map(|c| c.name.clone())
                    .collect(),
                versioned: (on.iter())
                    .filter_map(|c| {
                        c.version
                            .as_ref()
                            .map(|v| (c.name.clone(), v.gap_alert_after))
                    })
                    .collect(),
            };
            tasks.spawn(sample_gauges(
                db.pool.clone(),
                sampled,
                shutdown.child_token(),
            ));
        }
        tracing::info!(worker = %worker_id, consumers = config.consumers.len(),
            databases = pools.len(), "worker started");
        Ok(Worker {
            stats,
            health,
            endpoint,
            shutdown,
            tasks,
        })
    }

    /// The counters of one consumer.
    pub fn stats(&self, consumer: &str) -> Option<Arc<Stats>> {
        self.stats.get(consumer).cloned()
    }

    /// The worker's liveness and readiness, as `/healthz` and `/readyz` report them.
    pub fn health(&self) -> Arc<Health> {
        Arc::clone(&self.health)
    }

    /// Where the monitoring endpoint listens (the bound port when `worker.metrics_addr` asked
    /// for port 0), if it started.
    pub fn endpoint(&self) -> Option<std::net::SocketAddr> {
        self.endpoint
    }

    /// Resolves when a consumer stopped on its own (a fatal error), with that error.
    pub async fn failed(&mut self) -> Result<(), WorkerError> {
        match self.tasks.join_next().await {
            Some(Ok(Ok(()))) | None => Ok(()),
            Some(Ok(Err(e))) => Err(e.into()),
            Some(Err(join)) => Err(WorkerError::Config(format!(
                "a consumer task panicked: {join}"
            ))),
        }
    }

    /// Stops fetching, finishes in-flight batches, leaves the groups.
    pub async fn stop(mut self) -> Result<(), WorkerError> {
        // First: readiness fails at once, and the loops that end now end on purpose.
        self.health.stopping();
        self.shutdown.cancel();
        let mut result = Ok(());
        while let Some(r) = self.tasks.join_next().await {
            if let Ok(Err(e)) = r {
                result = Err(e.into());
            }
        }
        // The spans of the last batches, before the process ends.
        crate::telemetry::flush().await;
        tracing::info!("worker stopped");
        result
    }
}

/// The life of `effectively run`: start, run until `shutdown` resolves or a consumer fails,
/// then stop cleanly.
pub async fn run(
    config: Config,
    registry: Registry,
    shutdown: impl Future<Output = ()>,
) -> Result<(), WorkerError> {
    let mut worker = Worker::start(config, registry).await?;
    tokio::select! {
        _ = shutdown => worker.stop().await,
        r = worker.failed() => {
            let stopped = worker.stop().await;
            r.and(stopped)
        }
    }
}

/// The maintenance loop's heartbeat period: it beats this often while it sleeps between
/// hourly runs, and one run (creating and dropping a few partitions, each statement bounded
/// by the server's own timeouts) may take up to two more periods before `/healthz` calls it
/// stale.
const MAINTENANCE_PERIOD: Duration = Duration::from_secs(600);

/// Retention maintenance, hourly: creates the dedupe partitions ahead and drops those past
/// the longest declared retention. Runs on a connection of its own (a detach cannot run in a
/// transaction) and only where it gets the maintenance lock: one instance at a time.
async fn maintain_partitions(
    database: String,
    db: crate::config::DatabaseConfig,
    known: Arc<Known>,
    ahead: u32,
    retention_days: i32,
    beat: Heartbeat,
    stop: CancellationToken,
) -> Result<(), TaskError> {
    loop {
        beat.beat();
        let today = chrono::Utc::now().date_naive();
        match pool::connect_to(&db).await {
            Ok(client) => {
                match retention::run(&client, &known, today, ahead, retention_days).await {
                    Ok(retention::Ran::Skipped) => {
                        tracing::debug!(%database, "maintenance: another instance holds the lock")
                    }
                    Ok(retention::Ran::Done { created, dropped }) => {
                        tracing::info!(%database, ?created, ?dropped, "retention maintenance done")
                    }
                    Err(e) => tracing::warn!(%database, error = %e, "retention maintenance failed"),
                }
            }
            Err(e) => tracing::warn!(%database, error = %e, "retention maintenance: no connection"),
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = beat.during(tokio::time::sleep(Duration::from_secs(3600))) => {}
        }
    }
}

/// What the worker keeps up in one database: its known daily partitions, how far ahead they
/// are created, and the longest retention its consumers declare.
struct Upkeep {
    known: Arc<Known>,
    ahead: u32,
    longest_retention: i32,
}

/// A loop's name in `/healthz`: `what` for the default database (as before there were others),
/// `what NAME` for a named one.
fn per_database(what: &str, database: &str) -> String {
    match database {
        crate::config::DEFAULT_DATABASE => what.to_string(),
        name => format!("{what} {name}"),
    }
}

/// Which gauges one database's sampler reads: the consumers on that database.
struct Sampled {
    /// The database's name, the label of its pool and partition gauges.
    database: String,
    consumers: Vec<String>,
    /// Inbox consumers.
    inbox: Vec<String>,
    /// Versioned consumers, with their `gap_alert_after`.
    versioned: Vec<(String, Duration)>,
}

/// Gauges read from one database, off the hot path: inbox rows, dead letters waiting, the
/// dedupe partitions' sizes and how far ahead they exist, and the pool's connections.
async fn sample_gauges(
    pool: deadpool_postgres::Pool,
    sampled: Sampled,
    stop: CancellationToken,
) -> Result<(), TaskError> {
    loop {
        let status = pool.status();
        crate::metrics::pool(
            &sampled.database,
            status.size - status.available,
            status.available,
        );
        if let Ok(client) = pool.get().await {
            if let Err(e) = sample_database(&client, &sampled).await {
                tracing::debug!(error = %e, "sampling database gauges failed");
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            _ = tokio::time::sleep(Duration::from_secs(15)) => {}
        }
    }
}

async fn sample_database(
    client: &deadpool_postgres::Object,
    sampled: &Sampled,
) -> Result<(), crate::store::StoreError> {
    let consumers = &sampled.consumers;
    if !sampled.inbox.is_empty() {
        for s in crate::store::inbox::status(&***client, &sampled.inbox).await? {
            crate::metrics::inbox_status(
                &s.consumer,
                s.pending,
                s.in_progress,
                s.failed,
                s.oldest_pending_s,
            );
        }
    }
    for (consumer, after) in &sampled.versioned {
        let (held, overdue) =
            crate::store::versions::held_and_overdue(&***client, consumer, *after).await?;
        crate::metrics::version_gaps(consumer, held, overdue);
    }
    for (consumer, rows) in crate::store::dead_letters::count_all(&***client, consumers).await? {
        crate::metrics::dead_letters_waiting(&consumer, rows);
    }
    let sizes = crate::store::partitions::sizes(&***client).await?;
    let today = chrono::Utc::now().date_naive();
    let ahead = sizes
        .iter()
        .map(|s| (s.date - today).num_days())
        .max()
        .unwrap_or(-1);
    crate::metrics::dedupe_partitions_ahead(&sampled.database, ahead);
    for s in sizes {
        crate::metrics::dedupe_partition(&sampled.database, s.date, s.rows, s.bytes);
    }
    Ok(())
}

/// A retention window in whole days (as the retention guard counts them), at least 1.
pub fn retention_days(retention: Duration) -> i32 {
    ((retention.as_secs() / 86_400).max(1)).min(i32::MAX as u64) as i32
}

/// A consumer's ledger and offsets are where it ran before: started on another database it
/// would begin again from `auto_offset_reset` with an empty ledger, and apply again what it had
/// applied. Refuses while a consumer's offsets are in another database of the config: every
/// one it names (a consumer moved off `[database]` is found there), the ones this worker does
/// not use looked at best-effort (one that cannot be reached within its `connect_timeout` is
/// warned of). Two
/// names of one database (`clients` by name, this worker's) are one database.
async fn refuse_moved(
    config: &Config,
    clients: &BTreeMap<String, tokio_postgres::Client>,
) -> Result<(), WorkerError> {
    // Which database this is (the server's start, its port, the database's name), and whether
    // it has been migrated (a database that never was holds no offsets).
    const IDENTITY: &str = "SELECT current_database() || '@' || pg_postmaster_start_time()::text \
                            || ':' || coalesce(inet_server_port(), 0)::text, \
                            to_regclass('consumer_offsets') IS NOT NULL";
    let mut others = BTreeMap::new();
    for (name, db) in config.database.iter() {
        if clients.contains_key(name) {
            continue;
        }
        let connect = tokio::time::timeout(db.connect_timeout, pool::connect_to(db));
        match connect.await {
            Ok(Ok(client)) => {
                others.insert(name.to_string(), client);
            }
            Ok(Err(e)) => {
                tracing::warn!(database = name, error = %e, "not looked at for offsets of moved consumers: cannot connect")
            }
            Err(_) => {
                tracing::warn!(
                    database = name,
                    "not looked at for offsets of moved consumers: no connection within its connect_timeout"
                )
            }
        }
    }
    let mut identity = BTreeMap::new();
    for (name, client) in clients.iter().chain(others.iter()) {
        let row =
            (client.query_one(IDENTITY, &[]).await).map_err(crate::store::StoreError::from)?;
        identity.insert(
            name.as_str(),
            (row.get::<_, String>(0), client, row.get::<_, bool>(1)),
        );
    }
    for c in &config.consumers {
        let own = c.database_name();
        let Some((own_id, _, _)) = identity.get(own) else {
            continue;
        };
        for (name, (id, client, migrated)) in &identity {
            if *name == own || id == own_id || !migrated {
                continue;
            }
            if crate::store::offsets::any_stored(*client, &c.name).await? {
                return Err(WorkerError::Moved {
                    consumer: c.name.clone(),
                    found: name.to_string(),
                    configured: own.to_string(),
                });
            }
        }
    }
    Ok(())
}
