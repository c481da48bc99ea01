//! The Postgres backend.
//!
//! # Behavior
//!
//! - A write without a precondition is one statement ([`statements::FENCED_PUT`],
//!   [`statements::FENCED_DELETE`]): atomic by construction. Concurrent ones are committed in
//!   groups, one transaction and one round trip per group ([`group`]); a write that
//!   arrives alone is one autocommitted statement.
//! - A write with a precondition (`If-Match`) runs in an explicit transaction: raise the
//!   fence and read the object's version (pipelined), check the precondition, then write
//!   and commit — or roll back, so that a failed precondition leaves the fence as it was.
//! - A stale answer is followed by a read of the committed highest token, in a new
//!   statement: it sees the value that caused the rejection, or a later one.
//! - Every operation is bounded by the backend timeout. A connection that timed out is
//!   discarded, not returned to the pool — after a cancel request has stopped whatever
//!   it was still running in Postgres, so that nothing holds a lock on after the answer;
//!   a broken one is dropped by the pool's recycle check, and new connections are made
//!   as the database comes back.

mod group;
pub mod statements;

use std::time::Duration;

use deadpool_postgres::{
    Manager, ManagerConfig, Object, Pool, QueueMode, RecyclingMethod, Runtime,
};
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use tokio::time::{timeout_at, Instant};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{CancelToken, NoTls};

use super::{
    precondition_holds, AdvanceOutcome, StoreError, StoredObject, UnavailableReason, Write,
    WriteOp, WriteOutcome,
};

/// How the Postgres backend uses its connections.
pub struct PgOptions {
    /// Largest number of connections.
    pub pool_size: usize,
    /// Bound on every operation, including the wait for a connection.
    pub timeout: Duration,
    /// Write groups in flight at once (`--write-lanes`), at most `pool_size`.
    pub write_lanes: usize,
    /// Most writes in one group (`--group-commit-max`).
    pub group_commit_max: usize,
    /// How long a write lane waits for a fence lock (`--write-lock-timeout`).
    pub lane_lock_timeout: Duration,
    /// Observes the size of every group applied.
    pub group_size: prometheus::Histogram,
}

/// Fences and objects in a Postgres database, schema `fencegate`.
pub struct PgStore {
    pool: Pool,
    timeout: Duration,
    group: group::GroupCommit,
    description: String,
}

/// Why the backend could not start.
#[derive(Debug, thiserror::Error)]
pub enum PgStartError {
    #[error("the database URL is not valid: {0}")]
    InvalidUrl(tokio_postgres::Error),
    #[error("could not prepare the fencegate schema: {0}")]
    Migrate(StoreError),
    #[error("the database holds fencegate schema version {found}, newer than this gateway's {supported}; upgrade the gateway")]
    SchemaTooNew { found: i32, supported: i32 },
}

impl PgStore {
    /// Connects, creates or migrates the `fencegate` schema, and returns the store.
    pub async fn connect(url: &str, options: PgOptions) -> Result<PgStore, PgStartError> {
        let PgOptions {
            pool_size,
            timeout,
            write_lanes,
            group_commit_max,
            lane_lock_timeout,
            group_size,
        } = options;
        let mut pg_config: tokio_postgres::Config =
            url.parse().map_err(PgStartError::InvalidUrl)?;
        if pg_config.get_application_name().is_none() {
            pg_config.application_name("fencegate");
        }
        pg_config.connect_timeout(timeout);
        pg_config.keepalives_idle(Duration::from_secs(30));
        let description = describe(&pg_config);
        // The write lanes' own connections give up on a fence lock after a moment, so
        // that one locked resource cannot hold a lane (see `group`).
        let mut lane_config = pg_config.clone();
        let lock_timeout = format!("-c lock_timeout={}", lane_lock_timeout.as_millis().max(1));
        lane_config.options(&match pg_config.get_options() {
            Some(theirs) => format!("{theirs} {lock_timeout}"),
            None => lock_timeout,
        });
        let pool = new_pool(pg_config, pool_size);
        let store = PgStore {
            group: group::GroupCommit::start(
                new_pool(lane_config, write_lanes),
                pool.clone(),
                write_lanes,
                group_commit_max,
                timeout,
                group_size,
            ),
            pool,
            timeout,
            description,
        };
        store
            .with_client(async |client| Ok(migrate(client).await))
            .await
            .map_err(PgStartError::Migrate)??;
        Ok(store)
    }

    /// The name of the database the store is in.
    pub async fn database(&self) -> Result<String, StoreError> {
        self.with_client(async |client| {
            let row = client
                .query_one("SELECT current_database()::text", &[])
                .await
                .map_err(|e| classify(e, false))?;
            Ok(row.get(0))
        })
        .await
    }

    /// Lets `role` call `fencegate.fence()`: the privileges of a writer, and no more.
    pub async fn grant_fence(&self, role: &str) -> Result<(), StoreError> {
        self.with_client(async |client| {
            for grant in [
                "SELECT format('GRANT USAGE ON SCHEMA fencegate TO %I', $1::text)",
                "SELECT format('GRANT EXECUTE ON FUNCTION fencegate.fence(text, bigint) TO %I', $1::text)",
            ] {
                let statement: String = client
                    .query_one(grant, &[&role])
                    .await
                    .map_err(|e| classify(e, false))?
                    .get(0);
                client
                    .batch_execute(&statement)
                    .await
                    .map_err(|e| classify(e, false))?;
            }
            Ok(())
        })
        .await
    }

    pub fn describe(&self) -> String {
        self.description.clone()
    }

    pub async fn write(&self, write: &Write) -> Result<WriteOutcome, StoreError> {
        let outcome = if write.precondition == Precondition::None {
            self.group.write(write.clone()).await?
        } else {
            self.with_client(async |client| write_conditional(client, write).await)
                .await?
        };
        match outcome {
            Some(outcome) => Ok(outcome),
            None => Ok(WriteOutcome::Stale {
                highest: self.highest_above(&write.resource, write.token).await?,
            }),
        }
    }

    pub async fn advance(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<AdvanceOutcome, StoreError> {
        let raised = self
            .with_client(async |client| {
                let statement = client
                    .prepare_cached(statements::FENCE_RAISE)
                    .await
                    .map_err(|e| classify(e, false))?;
                let row = client
                    .query_opt(&statement, &[&resource.as_str(), &token.as_i64()])
                    .await
                    .map_err(|e| classify(e, true))?;
                Ok(row.is_some())
            })
            .await?;
        if raised {
            Ok(AdvanceOutcome::Applied)
        } else {
            Ok(AdvanceOutcome::Stale {
                highest: self.highest_above(resource, token).await?,
            })
        }
    }

    pub async fn get(
        &self,
        resource: &ResourceName,
        key: &ObjectKey,
    ) -> Result<Option<StoredObject>, StoreError> {
        self.with_client(async |client| {
            let statement = client
                .prepare_cached(statements::GET_OBJECT)
                .await
                .map_err(|e| classify(e, false))?;
            let row = client
                .query_opt(&statement, &[&resource.as_str(), &key.as_str()])
                .await
                .map_err(|e| classify(e, false))?;
            row.map(|row| {
                Ok(StoredObject {
                    value: bytes::Bytes::from(row.get::<_, Vec<u8>>(0)),
                    version: non_negative(row.get(1))?,
                    token: token_from_db(row.get(2))?,
                })
            })
            .transpose()
        })
        .await
    }

    pub async fn fence(&self, resource: &ResourceName) -> Result<Option<Token>, StoreError> {
        self.with_client(async |client| read_fence(client, resource).await)
            .await
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        self.with_client(async |client| {
            client
                .simple_query(statements::PING)
                .await
                .map_err(|e| classify(e, false))?;
            Ok(())
        })
        .await
    }

    /// The committed highest token of a resource that just rejected `token`.
    async fn highest_above(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<Token, StoreError> {
        match self.fence(resource).await? {
            Some(highest) if highest > token => Ok(highest),
            other => Err(StoreError::Internal(format!(
                "resource {resource} rejected token {token} but its committed highest is {other:?}"
            ))),
        }
    }

    /// Runs `op` on a pooled connection, all within the backend timeout.
    ///
    /// On timeout the connection is taken out of the pool and closed: it may still be
    /// waiting on a statement, and must not be handed to the next request.
    async fn with_client<T>(
        &self,
        op: impl AsyncFnOnce(&mut Object) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        with_client_until(&self.pool, Instant::now() + self.timeout, op).await
    }
}

/// A pool of at most `size` connections of `config`.
fn new_pool(config: tokio_postgres::Config, size: usize) -> Pool {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(size)
        // The most recently used connection first: its Postgres backend is awake and its
        // caches warm. First-in-first-out would rotate every write through every idle
        // connection.
        .queue_mode(QueueMode::Lifo)
        .runtime(Runtime::Tokio1)
        .build()
        .expect("a pool with a runtime always builds")
}

/// Creates or migrates the `fencegate` schema on `client`, in one transaction,
/// serialised with other gateways starting at the same time.
pub async fn migrate(client: &mut tokio_postgres::Client) -> Result<(), PgStartError> {
    let supported = statements::MIGRATIONS
        .last()
        .map_or(0, |(version, _)| *version);
    let failed = |e| PgStartError::Migrate(classify(e, false));
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
    tx.commit().await.map_err(failed)
}

/// How long a cancel request may take before the gateway answers anyway.
const CANCEL_TIMEOUT: Duration = Duration::from_secs(1);

/// Runs `op` on a connection from `pool`, all before `deadline`; see
/// [`PgStore::with_client`].
pub(crate) async fn with_client_until<T>(
    pool: &Pool,
    deadline: Instant,
    op: impl AsyncFnOnce(&mut Object) -> Result<T, StoreError>,
) -> Result<T, StoreError> {
    let mut client = match timeout_at(deadline, pool.get()).await {
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
    match timeout_at(deadline, op(&mut client)).await {
        Ok(result) => result,
        Err(_) => {
            cancel_running(&cancel).await;
            drop(Object::take(client));
            Err(StoreError::Unavailable {
                reason: UnavailableReason::Timeout,
                applied: None,
            })
        }
    }
}

/// Asks Postgres to stop the statement a connection we give up on is running, so that
/// it releases its locks now rather than when it finishes; bounded by
/// [`CANCEL_TIMEOUT`]. Closing the connection afterwards rolls back its transaction.
async fn cancel_running(cancel: &CancelToken) {
    match tokio::time::timeout(CANCEL_TIMEOUT, cancel.cancel_query(NoTls)).await {
        Ok(Ok(())) => {}
        Ok(Err(error)) => tracing::warn!(%error, "could not cancel a timed-out statement"),
        Err(_) => tracing::warn!("cancelling a timed-out statement timed out"),
    }
}

/// One statement; `None` if the token was stale (nothing was written).
async fn write_unconditional(
    client: &Object,
    write: &Write,
) -> Result<Option<WriteOutcome>, StoreError> {
    let resource = write.resource.as_str();
    let key = write.key.as_str();
    let token = write.token.as_i64();
    let row = match &write.op {
        WriteOp::Put(value) => {
            let statement = client
                .prepare_cached(statements::FENCED_PUT)
                .await
                .map_err(|e| classify(e, false))?;
            client
                .query_opt(&statement, &[&resource, &token, &key, &value.as_ref()])
                .await
        }
        WriteOp::Delete => {
            let statement = client
                .prepare_cached(statements::FENCED_DELETE)
                .await
                .map_err(|e| classify(e, false))?;
            client
                .query_opt(&statement, &[&resource, &token, &key])
                .await
        }
    }
    // Autocommit: once the statement is sent, it may have committed.
    .map_err(|e| classify(e, true))?;
    row.map(|row| applied(&write.op, row.get(0), row.get(1)))
        .transpose()
}

/// Fence, read, check, write, commit; `None` if the token was stale. Any early return
/// drops the transaction, which rolls it back: fence and object stay as they were.
async fn write_conditional(
    client: &mut Object,
    write: &Write,
) -> Result<Option<WriteOutcome>, StoreError> {
    let resource = write.resource.as_str();
    let key = write.key.as_str();
    let token = write.token.as_i64();
    let (fence_raise, object_version) = tokio::try_join!(
        client.prepare_cached(statements::FENCE_RAISE),
        client.prepare_cached(statements::OBJECT_VERSION)
    )
    .map_err(|e| classify(e, false))?;
    let tx = client.transaction().await.map_err(|e| classify(e, false))?;
    // Pipelined: the version read runs after the fence statement holds the lock.
    let (fence_params, version_params): ([&(dyn ToSql + Sync); 2], [&(dyn ToSql + Sync); 2]) =
        ([&resource, &token], [&resource, &key]);
    let (raised, current) = tokio::try_join!(
        tx.query_opt(&fence_raise, &fence_params),
        tx.query_opt(&object_version, &version_params),
    )
    .map_err(|e| classify(e, false))?;
    if raised.is_none() {
        return Ok(None);
    }
    let current = match current {
        Some(row) if row.get::<_, bool>(1) => Some(non_negative(row.get(0))?),
        _ => None,
    };
    if !precondition_holds(write.precondition, current) {
        return Ok(Some(WriteOutcome::PreconditionFailed { current }));
    }
    let row = match &write.op {
        WriteOp::Put(value) => {
            let statement = tx
                .prepare_cached(statements::OBJECT_PUT)
                .await
                .map_err(|e| classify(e, false))?;
            tx.query_one(&statement, &[&resource, &token, &key, &value.as_ref()])
                .await
        }
        WriteOp::Delete => {
            let statement = tx
                .prepare_cached(statements::OBJECT_DELETE)
                .await
                .map_err(|e| classify(e, false))?;
            tx.query_one(&statement, &[&resource, &token, &key]).await
        }
    }
    .map_err(|e| classify(e, false))?;
    let outcome = applied(&write.op, row.get(0), row.get(1))?;
    tx.commit().await.map_err(|e| classify(e, true))?;
    Ok(Some(outcome))
}

async fn read_fence(client: &Object, resource: &ResourceName) -> Result<Option<Token>, StoreError> {
    let statement = client
        .prepare_cached(statements::GET_FENCE)
        .await
        .map_err(|e| classify(e, false))?;
    let row = client
        .query_opt(&statement, &[&resource.as_str()])
        .await
        .map_err(|e| classify(e, false))?;
    row.map(|row| token_from_db(row.get(0))).transpose()
}

fn applied(op: &WriteOp, version: i64, born: i64) -> Result<WriteOutcome, StoreError> {
    let version = non_negative(version)?;
    let created = matches!(op, WriteOp::Put(_)) && i64::try_from(version).ok() == Some(born);
    Ok(WriteOutcome::Applied { version, created })
}

fn non_negative(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value)
        .map_err(|_| StoreError::Internal(format!("negative version {value} in fencegate.objects")))
}

fn token_from_db(value: i64) -> Result<Token, StoreError> {
    u64::try_from(value)
        .ok()
        .and_then(|v| Token::new(v).ok())
        .ok_or_else(|| StoreError::Internal(format!("invalid token {value} in the database")))
}

/// Sorts a Postgres error into "unavailable" (with what is known of the write) or
/// "internal". `may_have_committed` is true once a statement that commits by itself
/// (autocommit, or COMMIT) has been sent: losing the connection then leaves the
/// outcome unknown.
pub(crate) fn classify(error: tokio_postgres::Error, may_have_committed: bool) -> StoreError {
    if let Some(code) = error.code() {
        // The server answered with an error, so this statement did not commit.
        let aborted = [
            SqlState::QUERY_CANCELED,
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::IDLE_SESSION_TIMEOUT,
            SqlState::T_R_SERIALIZATION_FAILURE,
            SqlState::T_R_DEADLOCK_DETECTED,
        ];
        if *code == SqlState::LOCK_NOT_AVAILABLE {
            // Only the write lanes set a lock timeout (`group`): the statement waited too
            // long for a fence lock and did nothing.
            return StoreError::Unavailable {
                reason: UnavailableReason::LockTimeout,
                applied: Some(false),
            };
        }
        if aborted.contains(code) || code.code().starts_with("08") {
            tracing::warn!(code = code.code(), %error, "the database aborted a statement");
            return StoreError::Unavailable {
                reason: UnavailableReason::ServerAborted,
                applied: Some(false),
            };
        }
        return StoreError::Internal(format!("database error: {}", error_text(&error)));
    }
    if error.is_closed()
        || std::error::Error::source(&error).is_some_and(|s| s.is::<std::io::Error>())
    {
        tracing::warn!(%error, "lost the database connection");
        let applied = if may_have_committed {
            None
        } else {
            Some(false)
        };
        return StoreError::Unavailable {
            reason: UnavailableReason::ConnectionLost,
            applied,
        };
    }
    StoreError::Internal(error_text(&error))
}

/// What went wrong, for a log line or a start-up error: the server's message and
/// SQLSTATE for an error the server sent (tokio-postgres prints only "db error" for
/// those), the error and its causes otherwise.
pub(crate) fn error_text(error: &tokio_postgres::Error) -> String {
    if let Some(db) = error.as_db_error() {
        return format!("{} (SQLSTATE {})", db.message(), db.code().code());
    }
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// `host:port/dbname`, without user or password.
pub(crate) fn describe(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(host)) => host.clone(),
        Some(Host::Unix(path)) => path.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "postgres at {host}:{port}/{}",
        config.get_dbname().unwrap_or("(default database)")
    )
}
