//! Fenced SQL transactions (`POST /v1/sql/{resource}`): a writer's own statements,
//! committed together with the fence check of their resource, or not at all.
//!
//! # The boundary
//!
//! What keeps a hostile writer in is Postgres, not this module's parser:
//!
//! - Writers' SQL runs on its own pool, logged in as a writer-only role
//!   (`--sql-database-url`). At start the gateway grants it EXECUTE on
//!   `fencegate.sql_fence()` only, and refuses to start if it — or any role it can
//!   become — is a superuser, can create roles, owns schema `fencegate`, has any
//!   privilege on its tables, or holds resources of its own (`fencegate grant`)
//!   ([`SqlService::connect`]).
//! - The fence step is `fencegate.sql_fence(resource, token, key)`
//!   ([`crate::dbfence`]), which only the gateway can take (the key is the schema's), and
//!   which grants the rest of the transaction that one resource: a statement that
//!   writes a table fenced for another resource, or calls the fence, is refused by
//!   Postgres.
//! - Every request starts from a clean session: each connection is reset when it is
//!   taken from the pool (`RESET ALL`, role and session authorisation, temporary
//!   tables, advisory locks, cursors, `LISTEN`, sequence state), and the settings the
//!   guarantees rest on are pinned in its start-up packet, so that `RESET ALL` returns
//!   them there: `synchronous_commit`, `standard_conforming_strings`,
//!   `statement_timeout`, `lock_timeout`, `idle_in_transaction_session_timeout`,
//!   `default_transaction_isolation`.
//! - A transaction the gateway gives up on (backend timeout) is cancelled in Postgres
//!   before the answer, so nothing runs on or holds a lock after a 503.
//!
//! [`guard`] still refuses transaction control, settings, catalog writes and
//! functions that reach outside the transaction before anything runs, and bounds the
//! size and depth of statements before they are parsed: defence in depth.
//!
//! # Layout
//!
//! - this module: the service (pool, start-up checks) and its errors;
//! - [`guard`]: what a statement may be, checked before anything runs;
//! - [`tx`]: one transaction, step by step;
//! - [`values`]: JSON <-> Postgres values.

mod checker;
pub mod guard;
mod tx;
pub mod values;

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::RecyclingMethod;
use fencegate_proto::body::{ErrorBody, SqlResult, SqlStatement};
use fencegate_proto::{ErrorCode, ResourceName, Token};

use crate::config::Config;
use crate::dbfence::{FenceRejection, ProofKey};
use crate::error::ApiError;
use crate::pgtls::PgUrlError;
use crate::store::postgres::session::Pins;
use crate::store::postgres::{
    describe, error_text, with_client_until, OnNewServer, PgPool, PgStore,
};
use crate::store::{Store, StoreError};

pub use guard::SqlPolicy;

/// What `/v1/sql` does on this gateway.
pub enum SqlEndpoint {
    Enabled(std::sync::Arc<SqlService>),
    /// Postgres backend, started without `--sql`.
    Disabled,
    /// The embedded store: there is no database to run SQL in.
    NotSupported,
}

impl SqlEndpoint {
    /// What `/v1/sql` does with `store`: runs, with `--sql` and the Postgres backend.
    pub async fn start(config: &Config, store: &Store) -> Result<SqlEndpoint, SqlStartError> {
        Ok(match store {
            Store::Postgres(pg) if config.sql.enabled => {
                SqlEndpoint::Enabled(Arc::new(SqlService::connect(config, pg).await?))
            }
            Store::Postgres(_) => SqlEndpoint::Disabled,
            Store::Embedded(_) => SqlEndpoint::NotSupported,
        })
    }
}

/// Runs fenced SQL transactions on the writer-only pool.
pub struct SqlService {
    pool: PgPool,
    policy: SqlPolicy,
    checker: checker::Checker,
    timeout: Duration,
    /// Opens `fencegate.sql_fence()`: the gateway's alone.
    fence_key: Vec<u8>,
    /// Checks the proofs of the fence's refusals.
    proof: ProofKey,
}

/// A writer's statements, to run under `token` on `resource`'s fence. The statements
/// have passed [`guard::check`].
#[derive(Debug, Clone)]
pub struct SqlTransaction {
    pub resource: ResourceName,
    pub token: Token,
    pub statements: Vec<SqlStatement>,
}

/// What a transaction came to: each statement's result, committed, or why not.
pub type SqlOutcome = Result<Vec<SqlResult>, SqlFailure>;

/// Why `/v1/sql` could not start.
#[derive(Debug, thiserror::Error)]
pub enum SqlStartError {
    #[error("--sql-database-url: {0}")]
    InvalidUrl(PgUrlError),
    #[error("could not connect with --sql-database-url: {0}")]
    Connect(String),
    #[error("could not reach the database: {0}")]
    Unavailable(StoreError),
    #[error("could not start the SQL checking threads: {0}")]
    Threads(std::io::Error),
    #[error(
        "--sql-database-url logs in as \"{login}\", which {reason}; writers' SQL must run \
         as a role that cannot reach the gateway's own tables. Create one for it, e.g.\n  \
         CREATE ROLE fencegate_sql LOGIN PASSWORD '...';\n  \
         GRANT SELECT, INSERT, UPDATE, DELETE ON <the writers' tables> TO fencegate_sql;\n\
         (the gateway grants it the fence step of /v1/sql itself; never fencegate grant it \
         resources; see docs/sql.md)"
    )]
    UnsafeLogin { login: String, reason: String },
    #[error(
        "--sql-database-url names database \"{sql}\" but --database-url names \"{gateway}\": \
         they must be the same database, where the fences are"
    )]
    OtherDatabase { sql: String, gateway: String },
}

/// Everything `/v1/sql` can refuse with, besides the errors every endpoint has.
/// Messages are the writer's own business and safe to show it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SqlError {
    #[error("SQL transactions are not enabled on this gateway (--sql, Postgres backend)")]
    Disabled,
    #[error(
        "SQL transactions need the Postgres backend: start the gateway with --database-url \
         (or DATABASE_URL) and --sql"
    )]
    NotSupportedByBackend,
    #[error("invalid SQL request: {0}")]
    InvalidRequest(String),
    #[error("{given} statements in one transaction; the limit is {limit}")]
    TooManyStatements { given: usize, limit: usize },
    #[error("statement {statement} is not allowed: {reason}")]
    NotAllowed { statement: usize, reason: String },
    /// The database refused a statement (`statement: None`: the commit, e.g. a
    /// deferred constraint).
    #[error("{} failed with SQLSTATE {sqlstate}: {message}", at(*.statement))]
    Failed {
        statement: Option<usize>,
        sqlstate: String,
        message: String,
    },
    /// A value does not fit its parameter's type; `parameter` counts from 1 (`$1`).
    #[error("statement {statement}, parameter ${parameter}: {reason}")]
    InvalidParam {
        statement: usize,
        parameter: usize,
        reason: String,
    },
    /// A parameter (`Some`) or result column (`None`) of a type the gateway cannot convert.
    #[error("statement {statement}: {reason}")]
    UnsupportedType {
        statement: usize,
        parameter: Option<usize>,
        reason: String,
    },
}

fn at(statement: Option<usize>) -> String {
    match statement {
        Some(index) => format!("statement {index}"),
        None => "the commit".to_owned(),
    }
}

impl SqlError {
    pub fn code(&self) -> ErrorCode {
        match self {
            SqlError::Disabled => ErrorCode::SqlDisabled,
            SqlError::NotSupportedByBackend => ErrorCode::NotSupportedByBackend,
            SqlError::InvalidRequest(_) => ErrorCode::InvalidBody,
            SqlError::TooManyStatements { .. } => ErrorCode::TooManyStatements,
            SqlError::NotAllowed { .. } => ErrorCode::StatementNotAllowed,
            SqlError::Failed { .. } => ErrorCode::SqlError,
            SqlError::InvalidParam { .. } => ErrorCode::InvalidParam,
            SqlError::UnsupportedType { .. } => ErrorCode::UnsupportedType,
        }
    }

    fn body(&self) -> ErrorBody {
        let mut body = ErrorBody::new(self.code(), self.to_string());
        match self {
            SqlError::NotAllowed { statement, .. } => body.statement = Some(*statement),
            SqlError::Failed {
                statement,
                sqlstate,
                ..
            } => {
                body.statement = *statement;
                body.sqlstate = Some(sqlstate.clone());
            }
            SqlError::InvalidParam {
                statement,
                parameter,
                ..
            } => {
                body.statement = Some(*statement);
                body.parameter = Some(*parameter);
            }
            SqlError::UnsupportedType {
                statement,
                parameter,
                ..
            } => {
                body.statement = Some(*statement);
                body.parameter = *parameter;
            }
            _ => {}
        }
        body
    }
}

impl From<SqlError> for ApiError {
    fn from(error: SqlError) -> ApiError {
        ApiError::Refused(Box::new(error.body()))
    }
}

/// Why a transaction was not committed; nothing of it was applied.
#[derive(Debug, thiserror::Error)]
pub enum SqlFailure {
    /// The in-database fence refused the token (its proof holds): the transaction's
    /// fence step, stale or not issued.
    #[error("the fence refused the token: {0:?}")]
    Fence(FenceRejection),
    /// A writer's statement raised a fence SQLSTATE (`code`) that the fence did not
    /// raise: answered as the writer's own SQL error, and counted apart.
    #[error("{failed}")]
    Forged {
        code: &'static str,
        failed: SqlError,
    },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Refused(#[from] SqlError),
}

/// The session as every request finds it: what `RESET ALL` and the rest of the reset
/// return it to. Start-up options outrank role and database defaults, which the
/// writer's login could change for itself (`ALTER ROLE ... SET`).
fn pinned_options(config: &Config) -> Pins {
    let at_least_1ms = |d: Duration| d.max(Duration::from_millis(1));
    Pins::new()
        .set("synchronous_commit", "on")
        .set("standard_conforming_strings", "on")
        .duration(
            "statement_timeout",
            at_least_1ms(config.sql.sql_statement_timeout),
        )
        .duration(
            "lock_timeout",
            at_least_1ms(config.sql.sql_statement_timeout),
        )
        .duration(
            "idle_in_transaction_session_timeout",
            at_least_1ms(config.store.backend_timeout),
        )
        .set("default_transaction_isolation", "read committed")
}

/// Facts about the SQL login and every role it can become (`MEMBER`: by inheritance
/// or `SET ROLE`), for the start-up check.
const LOGIN_FACTS: &str = "
    WITH reach AS (
        SELECT r.* FROM pg_roles r WHERE pg_has_role(session_user, r.oid, 'MEMBER')
    )
    SELECT (SELECT string_agg(rolname, ', ') FROM reach WHERE rolsuper),
           (SELECT string_agg(rolname, ', ') FROM reach WHERE rolcreaterole),
           (SELECT string_agg(reach.rolname, ', ') FROM reach
               JOIN pg_namespace n ON n.nspowner = reach.oid WHERE n.nspname = 'fencegate'),
           (SELECT string_agg(DISTINCT reach.rolname, ', ') FROM reach
               CROSS JOIN pg_class c
               WHERE c.relnamespace = 'fencegate'::regnamespace AND c.relkind IN ('r', 'p')
                 AND (c.relowner = reach.oid OR has_table_privilege(reach.oid, c.oid,
                      'SELECT, INSERT, UPDATE, DELETE, TRUNCATE, REFERENCES, TRIGGER'))),
           (SELECT string_agg(rolname, ', ') FROM reach
               WHERE has_schema_privilege(reach.oid, 'fencegate', 'CREATE'))";

impl SqlService {
    /// Connects the writer-only pool, grants its login EXECUTE on
    /// `fencegate.sql_fence()` (through `gateway`, the schema's owner) and checks that
    /// the login can reach nothing more of fencegate's; see the module doc.
    pub async fn connect(config: &Config, gateway: &PgStore) -> Result<SqlService, SqlStartError> {
        let url = config
            .sql
            .sql_database_url
            .as_deref()
            .expect("validated: --sql comes with --sql-database-url");
        let crate::pgtls::PgUrl {
            config: mut pg_config,
            tls,
        } = crate::pgtls::parse(url).map_err(SqlStartError::InvalidUrl)?;
        if pg_config.get_application_name().is_none() {
            pg_config.application_name("fencegate-sql");
        }
        pinned_options(config).apply(&mut pg_config);
        pg_config.connect_timeout(config.store.backend_timeout);
        pg_config.keepalives_idle(Duration::from_secs(30));
        // One connection of its own for the checks, so that a login that cannot connect
        // says why.
        let (client, connection) = pg_config
            .connect(tls.make_tls_connect())
            .await
            .map_err(|e| SqlStartError::Connect(error_text(&e)))?;
        let connection = tokio::spawn(connection);
        let login: String = client
            .query_one("SELECT session_user::text", &[])
            .await
            .map_err(|e| SqlStartError::Connect(error_text(&e)))?
            .get(0);
        gateway
            .grant_sql_fence(&login)
            .await
            .map_err(SqlStartError::Unavailable)?;
        let checked = check_login(&client, gateway).await;
        drop(client);
        let _ = connection.await;
        checked?;
        tracing::debug!(database = %describe(&pg_config, &tls, None), %login, "writers' SQL runs as this login");
        // CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; UNLISTEN *; SELECT
        // pg_advisory_unlock_all(); DISCARD TEMP; DISCARD SEQUENCES — on every checkout.
        // Prepared statements are kept: writers cannot create any.
        // A connection to a server the gateway has not audited waits for the audit,
        // which this login may not run (`ServerWatch`).
        let pool = PgPool::watched(
            pg_config,
            &tls,
            config.sql.sql_pool_size,
            RecyclingMethod::Clean,
            (Arc::clone(gateway.watch()), OnNewServer::Waits),
        );
        // Opened now and kept, as the gateway's own pools are: see `PgStore::connect`.
        pool.warm(config.sql.sql_pool_size, "--sql-pool-size")
            .await
            .map_err(SqlStartError::Connect)?;
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
        Ok(SqlService {
            pool,
            policy: SqlPolicy::from_config(config),
            checker: checker::Checker::start(threads).map_err(SqlStartError::Threads)?,
            timeout: config.store.backend_timeout,
            fence_key: gateway.keys().sql.clone(),
            proof: gateway.keys().proof.clone(),
        })
    }

    pub fn policy(&self) -> &SqlPolicy {
        &self.policy
    }

    /// Checks a request's statements with [`guard::check`] before anything runs; the
    /// statements come back, and on a refusal the index of the first one refused.
    pub async fn check(
        &self,
        statements: Vec<SqlStatement>,
    ) -> (Vec<SqlStatement>, Result<(), SqlError>) {
        let (statements, verdict) = self.checker.check_all(statements, &self.policy).await;
        let verdict = verdict.map_err(|(statement, refused)| SqlError::NotAllowed {
            statement,
            reason: refused.0,
        });
        (statements, verdict)
    }

    /// Runs a fenced SQL transaction; one result per statement; see [`tx`].
    pub async fn run(&self, tx: &SqlTransaction) -> SqlOutcome {
        tx::run(self, tx).await
    }

    /// Runs a transaction sent with an `Idempotency-Key`, storing its answer in it; see
    /// [`crate::store::txn`].
    pub async fn run_keyed(
        &self,
        tx: &SqlTransaction,
        keyed: &crate::store::txn::Keyed<SqlOutcome>,
    ) -> crate::store::txn::Answered<SqlOutcome> {
        tx::run_keyed(self, tx, keyed).await
    }

    /// Runs `op` on a connection of the writer-only pool within the backend timeout.
    async fn with_client<T>(
        &self,
        op: impl AsyncFnOnce(&mut deadpool_postgres::Object) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        with_client_until(&self.pool, tokio::time::Instant::now() + self.timeout, op).await
    }
}

/// Refuses a login that is, or can become, more than a writer; see the module doc.
async fn check_login(
    client: &tokio_postgres::Client,
    gateway: &PgStore,
) -> Result<(), SqlStartError> {
    let failed = |e: tokio_postgres::Error| SqlStartError::Connect(error_text(&e));
    let row = client
        .query_one("SELECT session_user::text, current_database()::text", &[])
        .await
        .map_err(failed)?;
    let (login, database): (String, String) = (row.get(0), row.get(1));
    let gateway_database = gateway
        .database()
        .await
        .map_err(SqlStartError::Unavailable)?;
    if database != gateway_database {
        return Err(SqlStartError::OtherDatabase {
            sql: database,
            gateway: gateway_database,
        });
    }
    let row = client.query_one(LOGIN_FACTS, &[]).await.map_err(failed)?;
    let what = [
        "is a superuser",
        "may create roles",
        "owns schema fencegate",
        "has privileges on fencegate's tables",
        "may create objects in schema fencegate",
    ];
    let mut found: Vec<(Option<String>, &str)> = what
        .into_iter()
        .enumerate()
        .map(|(column, what)| (row.get::<_, Option<String>>(column), what))
        .collect();
    // Authority is read as the schema's owner: the login may not read it.
    found.push((
        gateway
            .authority_reached_by(&login)
            .await
            .map_err(SqlStartError::Unavailable)?,
        "holds resources of its own (fencegate grant): writers' statements could present or raise their fences",
    ));
    for (roles, what) in found {
        let Some(roles) = roles else {
            continue;
        };
        let reason = if roles.split(", ").any(|role| role == login) {
            what.to_owned()
        } else {
            format!("can act as {roles}, which {what}")
        };
        return Err(SqlStartError::UnsafeLogin { login, reason });
    }
    Ok(())
}
