//! The web console (`effectively console`): server-rendered HTML, from this binary, for the
//! operator who asks "what is waiting, and why?".
//!
//! Pages: the overview (per consumer: lag and rate per partition, the inbox's counts, dead
//! letters by reason; the outbox's backlog; notifications by status), parked messages (dead
//! letters and FAILED inbox rows in one filtered list, and each message's page), the inbox by
//! status with held version gaps, the outbox, notifications, and the audit log of operator
//! actions. With `console.writes = true`, the actions: redrive, replay, discard and retry, for
//! one row or every row matching a filter, each behind a typed confirmation (`actions`).
//!
//! It sits above `store/` and `operator/`: it reads through [`crate::store::browse`] and the
//! parked rows' queries, and changes things only through [`crate::operator`], the same
//! functions the CLI calls, which write the audit row in the change's own transaction.
//!
//! Templates are askama's (`templates/console/`), compiled into the binary and escaped by
//! default; the one stylesheet is embedded too. No JavaScript: the live refresh is a
//! `<meta http-equiv="refresh">` that a "Pause" link turns off (`?refresh=off`), so the
//! Content-Security-Policy can forbid every script ([`auth`]).

mod actions;
pub mod auth;
mod control;
#[doc(hidden)]
pub mod fuzzing;
pub mod lag;
pub mod mask;
mod pages;
pub mod render;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use askama::Template;
use axum::http::{header, StatusCode, Uri};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use deadpool_postgres::Pool;

use crate::config::{Config, ConsoleConfig, ConsumerConfig, Secret, Strategy};
use crate::operator::control::KafkaLookup;
use crate::store::{pool, StoreError};

/// Why the console could not start, or a page could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    #[error("console: {0}")]
    Config(String),
    #[error("console: cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("console: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Pool(#[from] pool::PoolError),
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("template: {0}")]
    Template(#[from] askama::Error),
    /// A page for something that does not exist (an id no row has).
    #[error("{0}")]
    NotFound(String),
    /// A request the page cannot make sense of (a malformed filter).
    #[error("{0}")]
    BadRequest(String),
    /// Something the request needs did not answer (Kafka, for a reset's plan).
    #[error("{0}")]
    Unavailable(String),
}

impl From<deadpool_postgres::PoolError> for ConsoleError {
    fn from(e: deadpool_postgres::PoolError) -> Self {
        ConsoleError::Store(StoreError::Pool(e))
    }
}

impl From<tokio_postgres::Error> for ConsoleError {
    fn from(e: tokio_postgres::Error) -> Self {
        ConsoleError::Store(StoreError::Postgres(e))
    }
}

impl IntoResponse for ConsoleError {
    fn into_response(self) -> Response {
        let (status, title) = match &self {
            ConsoleError::NotFound(_) => (StatusCode::NOT_FOUND, "Not found"),
            ConsoleError::BadRequest(_) => (StatusCode::BAD_REQUEST, "Bad request"),
            ConsoleError::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "Unavailable"),
            _ => {
                tracing::warn!(error = %self, "console: page failed");
                (StatusCode::INTERNAL_SERVER_ERROR, "Error")
            }
        };
        error_page(status, title, &self.to_string())
    }
}

/// A consumer of the config, as the pages list it.
#[derive(Debug, Clone)]
pub struct ConsumerInfo {
    pub name: String,
    pub topics: Vec<String>,
    pub strategy: &'static str,
    /// Inbox strategy, or versioned writes (whose gaps wait in the inbox).
    pub uses_inbox: bool,
    /// The whole section, for the consumer page and its controls ([`crate::operator::control`]
    /// takes it: topics, `max_rate`).
    pub config: ConsumerConfig,
}

/// What every handler shares.
pub struct Shared {
    pub(crate) pool: Pool,
    pub(crate) settings: ConsoleConfig,
    pub(crate) token: Option<Secret>,
    pub(crate) mask: mask::Mask,
    pub(crate) consumers: Vec<ConsumerInfo>,
    pub(crate) watermarks: lag::Watermarks,
    pub(crate) rates: lag::Rates,
    /// Kafka's side of the consumer page and of offset resets (partitions, logs, offsets for a
    /// time), or why librdkafka refused its settings: the page then shows PostgreSQL's side.
    pub(crate) kafka: Result<KafkaLookup, String>,
    /// The producer redrives send with; only when writes are on.
    pub(crate) redriver: Option<crate::operator::Redriver>,
    /// The database shown, by name, when the config has more than one (the pages say which).
    pub(crate) database: Option<String>,
    /// The config's consumers on other databases, with their database: a page asked for one
    /// says where it is.
    pub(crate) elsewhere: std::collections::HashMap<String, String>,
}

impl Shared {
    /// A pooled connection for a page. Its session was opened with parallel query off
    /// (`PoolOptions::no_parallel_query`, once per connection rather than a `SET` per page): a
    /// page's capped count finishes sooner alone than with workers to start, and on a small
    /// machine those workers take the engine's cores (a time-window page's p99 on 1,000,000
    /// rows went from 213 ms to the figure in docs/PERFORMANCE.md).
    pub(crate) async fn db(&self) -> Result<deadpool_postgres::Object, ConsoleError> {
        Ok(self.pool.get().await?)
    }
}

/// A console bound to its address, not yet serving (tests bind `127.0.0.1:0` and read
/// [`Bound::addr`]).
pub struct Bound {
    pub addr: SocketAddr,
    listener: tokio::net::TcpListener,
    router: Router,
}

/// Checks the settings, reads the token, opens the pool and binds. `addr` (`--addr`) overrides
/// `console.addr`, under the same rule: not loopback, then a token.
pub async fn bind(config: &Config, addr: Option<SocketAddr>) -> Result<Bound, ConsoleError> {
    let mut settings = config.console.clone().unwrap_or_default();
    if let Some(a) = addr {
        settings.addr = a;
    }
    let mut problems = settings.problems();
    let token = settings.token().unwrap_or_else(|e| {
        problems.push(e);
        None
    });
    if !problems.is_empty() {
        return Err(ConsoleError::Config(problems.join("; ")));
    }
    // One database: `console.database` (or `--database`), else `[database]`. Its pages list
    // the consumers whose rows are there; the others have a console of their own.
    let name = (settings.database.as_deref()).unwrap_or(crate::config::DEFAULT_DATABASE);
    let db = config
        .database
        .get(Some(name))
        .map_err(ConsoleError::Config)?;
    // A wrong URL, CA or password stops the start, not every page.
    pool::connect_to(db).await?;
    let opts = pool::PoolOptions {
        size: 4,
        no_parallel_query: true,
        ..pool::PoolOptions::of(db)
    };
    let shared = Arc::new(Shared {
        pool: pool::build_for(db, &opts)?,
        mask: mask::Mask::new(&settings.mask),
        token,
        database: (!config.database.named.is_empty()).then(|| name.to_string()),
        elsewhere: (config.consumers.iter())
            .filter(|c| c.database_name() != name)
            .map(|c| (c.name.clone(), c.database_name().to_string()))
            .collect(),
        consumers: (config.consumers.iter())
            .filter(|c| c.database_name() == name)
            .map(|c| ConsumerInfo {
                name: c.name.clone(),
                topics: c.topics.clone(),
                strategy: match c.strategy {
                    Strategy::Batch => "batch",
                    Strategy::PerMessage => "per-message",
                    Strategy::Inbox => "inbox",
                },
                uses_inbox: c.strategy == Strategy::Inbox || c.version.is_some(),
                config: c.clone(),
            })
            .collect(),
        watermarks: lag::Watermarks::new(&config.kafka),
        rates: lag::Rates::default(),
        kafka: KafkaLookup::new(&config.kafka).map_err(|e| format!("kafka client: {e}")),
        redriver: match settings.writes {
            false => None,
            true => Some(
                crate::operator::Redriver::new(&config.kafka)
                    .map_err(|e| ConsoleError::Config(e.to_string()))?,
            ),
        },
        settings,
    });
    let listener = tokio::net::TcpListener::bind(shared.settings.addr)
        .await
        .map_err(|source| ConsoleError::Bind {
            addr: shared.settings.addr,
            source,
        })?;
    let addr = listener.local_addr()?;
    Ok(Bound {
        addr,
        listener,
        router: router(shared),
    })
}

impl Bound {
    /// Serves until `shutdown` resolves; requests in flight finish.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        axum::serve(
            self.listener,
            self.router
                .into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(shutdown)
        .await
    }
}

/// [`bind`], then [`Bound::run`]: what `effectively console` does.
pub async fn serve(
    config: Config,
    addr: Option<SocketAddr>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ConsoleError> {
    let bound = bind(&config, addr).await?;
    let writes = config.console.as_ref().is_some_and(|c| c.writes);
    tracing::info!(
        addr = %bound.addr,
        writes,
        "console listening on http://{}/",
        bound.addr
    );
    bound.run(shutdown).await?;
    Ok(())
}

fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/", get(pages::overview::page))
        .route("/parked", get(pages::parked::list))
        .route(
            "/parked/dead-letters/{id}",
            get(pages::message::dead_letter),
        )
        .route(
            "/parked/inbox/{consumer}/{message_id}",
            get(pages::message::inbox_row),
        )
        .route("/actions/confirm", post(actions::confirm))
        .route("/actions/do", post(actions::act))
        .route("/audit", get(pages::audit::page))
        .route("/consumer", get(pages::consumer::page))
        .route("/consumer/pause", post(control::pause))
        .route("/consumer/resume", post(control::resume))
        .route("/consumer/reset/confirm", post(control::plan))
        .route("/consumer/reset/do", post(control::reset))
        .route("/inbox", get(pages::inbox::page))
        .route("/outbox", get(pages::outbox::page))
        .route("/notifications", get(pages::notifications::page))
        .route("/static/console.css", get(stylesheet))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(&shared),
            auth::guard,
        ))
        .with_state(shared)
}

/// The one stylesheet, written for the console (no framework), embedded in the binary.
const CSS: &str = include_str!("../../templates/console/console.css");

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        CSS,
    )
        .into_response()
}

async fn not_found(uri: Uri) -> Response {
    error_page(
        StatusCode::NOT_FOUND,
        "Not found",
        &format!("No page at {}.", uri.path()),
    )
}

/// The frame around every page: title, navigation, live refresh.
#[derive(Debug, Clone)]
pub struct Chrome {
    pub title: String,
    /// Which navigation entry is current.
    pub nav: &'static str,
    /// Seconds between reloads, when the page reloads itself now.
    pub refresh: Option<u64>,
    /// The link that pauses the reloads (when they run).
    pub pause: Option<String>,
    /// The link that resumes them (when paused).
    pub resume: Option<String>,
    pub writes: bool,
    /// The database this console shows, when the config has several.
    pub database: Option<String>,
}

impl Chrome {
    /// A page that never reloads itself (a confirmation).
    pub fn still(shared: &Shared, title: impl Into<String>, nav: &'static str) -> Chrome {
        Chrome {
            title: title.into(),
            nav,
            refresh: None,
            pause: None,
            resume: None,
            writes: shared.settings.writes,
            database: shared.database.clone(),
        }
    }

    /// `live`: the page refreshes itself unless `?refresh=off` is in `uri`.
    pub fn new(
        shared: &Shared,
        title: impl Into<String>,
        nav: &'static str,
        uri: &Uri,
        live: bool,
    ) -> Chrome {
        let mut c = Chrome {
            title: title.into(),
            nav,
            refresh: None,
            pause: None,
            resume: None,
            writes: shared.settings.writes,
            database: shared.database.clone(),
        };
        let every = shared.settings.refresh.as_secs();
        if !live || every == 0 {
            return c;
        }
        let query = uri.query().unwrap_or_default();
        let kept: Vec<&str> = (query.split('&'))
            .filter(|p| !p.is_empty() && !p.starts_with("refresh="))
            .collect();
        let with = |extra: Option<&str>| {
            let mut parts = kept.clone();
            parts.extend(extra);
            match parts.is_empty() {
                true => uri.path().to_string(),
                false => format!("{}?{}", uri.path(), parts.join("&")),
            }
        };
        if query.split('&').any(|p| p == "refresh=off") {
            c.resume = Some(with(None));
        } else {
            c.refresh = Some(every);
            c.pause = Some(with(Some("refresh=off")));
        }
        c
    }
}

#[derive(Template)]
#[template(path = "console/error.html")]
struct ErrorPage<'a> {
    c: Chrome,
    message: &'a str,
}

/// An error or refusal as a page of the console's own look.
pub(crate) fn error_page(status: StatusCode, title: &str, message: &str) -> Response {
    let page = ErrorPage {
        c: Chrome {
            title: title.to_string(),
            nav: "",
            refresh: None,
            pause: None,
            resume: None,
            writes: false,
            database: None,
        },
        message,
    };
    match page.render() {
        Ok(html) => (status, Html(html)).into_response(),
        Err(_) => (status, message.to_string()).into_response(),
    }
}

/// Renders a page, or its error as a page.
pub(crate) fn html<T: Template>(page: T) -> Result<Response, ConsoleError> {
    Ok(Html(page.render()?).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pages_escape_what_they_show() {
        let r = error_page(StatusCode::NOT_FOUND, "x", "<script>alert(1)</script>\"'");
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let html = String::from_utf8(body.to_vec()).unwrap();
        assert!(!html.contains("<script>"), "{html}");
        assert!(
            html.contains("&#60;script&#62;") || html.contains("&lt;script&gt;"),
            "{html}"
        );
    }
}
