//! Connections to Postgres: the pools ([`PgPool`]), the schema migration ([`migrate`]),
//! and the deadline of every call with what its phase makes of it.
//!
//! # Behavior
//!
//! - A pool hands out its most recently used connection first. A watched pool admits a
//!   new connection only once its server was audited ([`super::server_watch`]); at start
//!   the settings pinned in the start-up packet ([`super::session`]) are read back on
//!   one connection, and a pool can be opened whole before the first request.
//! - Every call runs within a deadline ([`with_client_until`]). A connection whose call
//!   timed out is not returned to the pool but closed, which rolls back a transaction
//!   whose `COMMIT` was not sent. Before that, a cancel request stops what it still runs
//!   in Postgres, so that nothing holds a lock on after the answer — unless the call had
//!   sent a statement that commits ([`committing`]): a commit waiting for a synchronous
//!   standby is left alone, so that it becomes visible only once a standby has it.
//! - What a timed-out call answers follows its phase: inside an explicit transaction
//!   ([`begin`], [`in_own_transaction`]) nothing applied (`write_applied: false`);
//!   otherwise — statements that may autocommit, or a `COMMIT` sent — it is unknown.
//! - [`migrate`] creates or migrates the `fencegate` schema in one transaction,
//!   serialised with other gateways starting at the same time, and defines its functions
//!   again whenever their text changed.
//!
//! Beside them, what several callers share: [`read_row`] (a read of one row, its
//! statement prepared once per connection), `uses_tls`, and [`describe`], the database
//! as the logs name it, without user or password. What a Postgres error means for the
//! gateway, judged by SQLSTATE and never by message, is [`super::errors`]; which server
//! a connection reaches, [`super::server_watch`].

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{
    Hook, HookError, Manager, ManagerConfig, Object, Pool, PoolError, QueueMode, RecyclingMethod,
    Runtime,
};
use tokio::time::{timeout_at, Instant};
use tokio_postgres::CancelToken;

use super::errors::{classify, error_text, Sent};
use super::server_watch::{OnNewServer, ServerWatch};
use super::statements;
use crate::pgtls::{PgUrlError, UpstreamTls};
use crate::store::{StoreError, UnavailableReason};

/// Why the backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum PgStartError {
    #[error("--database-url: {0}")]
    InvalidUrl(PgUrlError),
    #[error("could not connect with --database-url: {0}")]
    Connect(String),
    #[error("could not prepare the fencegate schema: {0}")]
    Migrate(StoreError),
    #[error("the database holds fencegate schema version {found}, newer than this gateway's {supported}; upgrade the gateway")]
    SchemaTooNew { found: i32, supported: i32 },
    #[error("the store's {pool} run with settings the gateway does not allow, although it sets them when it connects (start-up options): {wrong}. A connection pooler between the gateway and Postgres may drop start-up options: connect the gateway to Postgres directly, or have the pooler pass them")]
    Unpinned { pool: &'static str, wrong: String },
}

/// A pool of connections to one database, with the TLS they are made with.
///
/// A cancel request goes as the pool's sessions do: over TLS, with the same certificate
/// checks, when their `sslmode` asks for it.
#[derive(Clone)]
pub struct PgPool {
    pool: Pool,
    tls: UpstreamTls,
}

impl PgPool {
    /// At most `size` connections of `config`, each checked by `recycling` when it is
    /// taken from the pool.
    pub fn new(
        config: tokio_postgres::Config,
        tls: &UpstreamTls,
        size: usize,
        recycling: RecyclingMethod,
    ) -> PgPool {
        PgPool::build(config, tls, size, recycling, None)
    }

    /// As [`PgPool::new`], each new connection admitted by `watch` once its server was
    /// audited (`ServerWatch::ensure_audited`).
    pub fn watched(
        config: tokio_postgres::Config,
        tls: &UpstreamTls,
        size: usize,
        recycling: RecyclingMethod,
        watch: (Arc<ServerWatch>, OnNewServer),
    ) -> PgPool {
        PgPool::build(config, tls, size, recycling, Some(watch))
    }

    fn build(
        config: tokio_postgres::Config,
        tls: &UpstreamTls,
        size: usize,
        recycling: RecyclingMethod,
        watch: Option<(Arc<ServerWatch>, OnNewServer)>,
    ) -> PgPool {
        let manager = Manager::from_config(
            config,
            tls.make_tls_connect(),
            ManagerConfig {
                recycling_method: recycling,
            },
        );
        let mut builder = Pool::builder(manager)
            .max_size(size)
            // The most recently used connection first: its Postgres backend is awake and
            // its caches warm. First-in-first-out would rotate every write through every
            // idle connection.
            .queue_mode(QueueMode::Lifo)
            .runtime(Runtime::Tokio1);
        if let Some((watch, on_new_server)) = watch {
            builder = builder.post_create(Hook::async_fn(move |client, _| {
                let watch = Arc::clone(&watch);
                Box::pin(async move {
                    watch
                        .ensure_audited(client, on_new_server)
                        .await
                        .map_err(|error| {
                            HookError::Message(format!("the server's fence audit: {error}").into())
                        })
                })
            }));
        }
        let pool = builder
            .build()
            .expect("a pool with a runtime always builds");
        PgPool {
            pool,
            tls: tls.clone(),
        }
    }

    /// Reads back, on one connection, the settings `pins` sets at connection start,
    /// refuses any that differ, and logs them (`pool` names the connections).
    pub(crate) async fn check_pins(
        &self,
        pins: &super::session::Pins,
        pool: &'static str,
    ) -> Result<(), PgStartError> {
        let client = self
            .pool
            .get()
            .await
            .map_err(|error| PgStartError::Connect(error.to_string()))?;
        let found: Vec<(String, String)> = client
            .query(super::session::SETTINGS, &[&pins.names()])
            .await
            .map_err(|e| PgStartError::Connect(error_text(&e)))?
            .iter()
            .map(|row| (row.get(0), row.get(1)))
            .collect();
        let settings = found
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join(" ");
        tracing::info!(pool, %settings, "store session settings");
        pins.check(&found)
            .map_err(|wrong| PgStartError::Unpinned { pool, wrong })
    }

    /// The deadpool pool itself, for callers that need no cancel requests.
    pub fn into_inner(self) -> Pool {
        self.pool
    }

    /// Opens `size` connections now (the pool's size) and leaves them idle in the pool,
    /// which keeps them: a pool never closes an idle connection, only a broken one.
    /// `flag` names the setting in the error.
    pub(crate) async fn warm(&self, size: usize, flag: &str) -> Result<(), String> {
        let taken = futures_util::future::join_all((0..size).map(|_| self.pool.get())).await;
        for taken in taken {
            match taken {
                Ok(_) => {}
                Err(PoolError::Backend(error)) => {
                    return Err(format!(
                        "could not open the {size} connections of {flag}: {}",
                        error_text(&error)
                    ))
                }
                Err(error) => {
                    return Err(format!(
                        "could not open the {size} connections of {flag}: {error}"
                    ))
                }
            }
        }
        Ok(())
    }
}

/// A pool of at most `size` connections of `config`, as the gateway's writes use.
pub fn new_pool(config: tokio_postgres::Config, tls: &UpstreamTls, size: usize) -> PgPool {
    PgPool::new(config, tls, size, RecyclingMethod::Fast)
}

/// Whether the session of `client` is encrypted, as the server sees it.
pub(crate) async fn uses_tls(client: &tokio_postgres::Client) -> Result<bool, StoreError> {
    let row = client
        .query_one(
            "SELECT coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false)",
            &[],
        )
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    Ok(row.get(0))
}

/// Creates or migrates the `fencegate` schema on `client`, in one transaction,
/// serialised with other gateways starting at the same time.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<(), PgStartError> {
    let supported = statements::MIGRATIONS
        .last()
        .map_or(0, |(version, _)| *version);
    let failed = |e| PgStartError::Migrate(classify(e, Sent::NoCommit));
    let tx = client.transaction().await.map_err(failed)?;
    tx.batch_execute(statements::PREPARE_MIGRATIONS)
        .await
        .map_err(failed)?;
    let found: i32 = tx
        .query_one(statements::SCHEMA_VERSION, &[])
        .await
        .map_err(failed)?
        .get(0);
    if found > supported {
        return Err(PgStartError::SchemaTooNew { found, supported });
    }
    for (version, text) in statements::MIGRATIONS
        .iter()
        .filter(|(version, _)| *version > found)
    {
        tx.batch_execute(text).await.map_err(failed)?;
        tx.execute(statements::RECORD_MIGRATION, &[version])
            .await
            .map_err(failed)?;
        tracing::info!(version, "applied fencegate schema migration");
    }
    // The functions, defined once, whenever their text changed.
    let digest = functions_digest();
    let applied: Option<String> = tx
        .query_opt(statements::FUNCTIONS_DIGEST, &[])
        .await
        .map_err(failed)?
        .map(|row| row.get(0));
    if applied.as_deref() != Some(digest.as_str()) {
        tx.batch_execute(crate::dbfence::FUNCTIONS_SQL)
            .await
            .map_err(failed)?;
        tx.execute(statements::RECORD_FUNCTIONS, &[&digest])
            .await
            .map_err(failed)?;
        tracing::info!(%digest, "applied the fencegate schema's functions");
    }
    tx.execute(statements::FORGET_DROPPED_TABLES, &[])
        .await
        .map_err(failed)?;
    tx.commit().await.map_err(failed)
}

/// The SHA-256 of the schema's functions, in hex.
fn functions_digest() -> String {
    ring::digest::digest(
        &ring::digest::SHA256,
        crate::dbfence::FUNCTIONS_SQL.as_bytes(),
    )
    .as_ref()
    .iter()
    .map(|byte| format!("{byte:02x}"))
    .collect()
}

/// How long a cancel request may take before the gateway answers anyway.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(1);

/// Where the call [`with_client_until`] runs is, for what its deadline means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
    /// Nothing said: its statements may autocommit, so a deadline leaves it unknown
    /// whether they applied.
    Unknown = 0,
    /// Inside an explicit transaction whose COMMIT is not sent: a deadline rolls it
    /// back, so nothing applied.
    InTransaction = 1,
    /// A statement that commits was sent.
    Committing = 2,
}

tokio::task_local! {
    /// The [`Phase`] of the call [`with_client_until`] runs.
    static PHASE: Arc<AtomicU8>;
}

/// Says that the call running on this task is about to send a statement that commits
/// (COMMIT, or a write in autocommit). From then on its deadline closes its connection
/// without a cancel request: a commit waiting for a synchronous standby is already
/// written on the primary, and cancelling the wait would make it visible there
/// although no standby has it — a write a failover then loses after others saw it.
/// Left alone, it becomes visible only once a standby has it.
pub(crate) fn committing() {
    let _ = PHASE.try_with(|phase| phase.store(Phase::Committing as u8, Ordering::Release));
}

/// Begins the explicit transaction of the call running on this task: until its
/// [`commit`], a deadline answers that nothing applied (`write_applied: false`).
pub(crate) async fn begin(
    client: &mut Object,
) -> Result<deadpool_postgres::Transaction<'_>, StoreError> {
    in_transaction();
    client
        .transaction()
        .await
        .map_err(|e| classify(e, Sent::NoCommit))
}

/// Says that the call running on this task runs in an explicit transaction.
pub(crate) fn in_transaction() {
    let _ = PHASE.try_with(|phase| {
        let _ = phase.compare_exchange(
            Phase::Unknown as u8,
            Phase::InTransaction as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    });
}

/// A read of at most one row, outside any write: the statement prepared once per
/// connection (cached), run, and its errors classified as committing nothing.
pub(crate) async fn read_row(
    client: &Object,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<tokio_postgres::Row>, StoreError> {
    let statement = client
        .prepare_cached(sql)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    client
        .query_opt(&statement, params)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))
}

/// Every row `sql` answers, outside a transaction of the caller's.
pub(crate) async fn read_rows(
    client: &Object,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>, StoreError> {
    let statement = client
        .prepare_cached(sql)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    client
        .query(&statement, params)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))
}

/// Runs `statement` (a future of a statement on `client`, not yet polled) in a
/// transaction of its own: `BEGIN` and the statement are sent together, `COMMIT` once
/// the statement has answered ([`committing`] first). So a deadline that passes while
/// the statement runs — waiting for a lock — cancels it, and one that passes while the
/// commit waits for a synchronous standby leaves the commit alone; an autocommitted
/// statement could not tell the two apart.
pub(crate) async fn in_own_transaction<T>(
    client: &tokio_postgres::Client,
    statement: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StoreError> {
    in_transaction();
    let (begun, answer) =
        futures_util::future::join(client.batch_execute("BEGIN"), statement).await;
    let answer = begun.and(answer);
    match answer {
        Ok(value) => {
            committing();
            client
                .batch_execute("COMMIT")
                .await
                .map_err(|e| classify(e, Sent::Commit))?;
            Ok(value)
        }
        Err(error) => {
            // Nothing committed; the session must leave the transaction before it is
            // used again (a broken one is not).
            let _ = client.batch_execute("ROLLBACK").await;
            Err(classify(error, Sent::NoCommit))
        }
    }
}

/// Sends `COMMIT` ([`committing`] first).
pub(crate) async fn commit(tx: deadpool_postgres::Transaction<'_>) -> Result<(), StoreError> {
    committing();
    tx.commit().await.map_err(|e| classify(e, Sent::Commit))
}

/// Runs `op` on a connection from `pool`, all before `deadline`; see
/// [`super::PgStore::with_client`].
pub(crate) async fn with_client_until<T>(
    pool: &PgPool,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut Object) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut client = match timeout_at(deadline, pool.pool.get()).await {
        Ok(Ok(client)) => client,
        Ok(Err(error)) => {
            tracing::warn!(%error, "could not get a database connection");
            return Err(StoreError::Unavailable {
                reason: UnavailableReason::Connect,
                applied: Some(false),
            });
        }
        Err(_) => {
            return Err(StoreError::Unavailable {
                reason: UnavailableReason::Connect,
                applied: Some(false),
            })
        }
    };
    let cancel = client.cancel_token();
    let phase = Arc::new(AtomicU8::new(Phase::Unknown as u8));
    let run = PHASE.scope(Arc::clone(&phase), op(&mut client));
    match timeout_at(deadline, run).await {
        Ok(result) => result,
        Err(_) => {
            let phase = phase.load(Ordering::Acquire);
            if phase == Phase::Committing as u8 {
                tracing::warn!(
                    "a commit outlived its deadline (a synchronous standby away?): its \
                     connection is closed without cancelling it, so that it becomes \
                     visible only once a standby has it; the write is answered as unknown"
                );
            } else {
                cancel_running(&cancel, &pool.tls).await;
            }
            drop(Object::take(client));
            // Closing the connection rolls back a transaction whose COMMIT was not sent.
            let applied = (phase == Phase::InTransaction as u8).then_some(false);
            Err(StoreError::Unavailable {
                reason: UnavailableReason::Timeout,
                applied,
            })
        }
    }
}

/// Asks Postgres to stop the statement a connection we give up on is running, so that
/// it releases its locks now rather than when it finishes; bounded by
/// [`CANCEL_TIMEOUT`]. Closing the connection afterwards rolls back its transaction.
async fn cancel_running(cancel: &CancelToken, tls: &UpstreamTls) {
    let cancelled = cancel.cancel_query(tls.make_tls_connect());
    match tokio::time::timeout(CANCEL_TIMEOUT, cancelled).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "could not cancel a timed-out statement"),
        Err(_) => tracing::warn!("cancelling a timed-out statement timed out"),
    }
}

/// `host:port/dbname` and how TLS is done, without user or password. `used` is what a
/// connection found, when one was made: with `sslmode=prefer`, the server decides.
pub(crate) fn describe(
    config: &tokio_postgres::Config,
    tls: &UpstreamTls,
    used: Option<bool>,
) -> String {
    use tokio_postgres::config::Host;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(host)) => host.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "postgres at {host}:{port}/{} {}",
        config.get_dbname().unwrap_or("(default database)"),
        tls.describe(used)
    )
}
