//! Fenced SQL transactions: a writer's own statements, committed together with the
//! fence check of their resource, or not at all.
//!
//! # Behavior
//!
//! One transaction on one pooled connection, in this order:
//!
//! 1. `BEGIN`.
//! 2. The fence step, [`sql::FENCE_RAISE`]: the same statement, and so the same row
//!    lock, as every `/v1/kv` write and fence advance of the resource. From here until
//!    commit no other write of the resource can commit in between. A stale token ends
//!    the transaction here: it is rolled back before any of the writer's statements
//!    ran.
//! 3. `SET LOCAL ROLE` (with `--sql-role`) and `SET LOCAL statement_timeout`.
//! 4. The writer's statements, in order: each is prepared (the database reports the
//!    types of its parameters and columns), its values are converted ([`values`]),
//!    it runs, and its rows are read until the answer's row budget is spent.
//! 5. `COMMIT`.
//!
//! Every early return drops the transaction, which rolls it back: the writer's tables
//! and the fence stay as they were (invariant 4). The whole transaction is bounded by
//! the backend timeout, each statement by the statement timeout.
//!
//! # Pipelining
//!
//! Steps 2 and 3 and the preparation of the statements are sent together, in that
//! order, in one round trip; preparing runs nothing. Results are judged in the same
//! order: a stale token is reported before any error of the writer's SQL. Statements
//! then run one by one, so a transaction takes `3 + statements` round trips.
//!
//! With `--sql-allow-ddl` only the first statement is prepared up front: a later one
//! may name a table an earlier one creates, so it is prepared just before it runs.

use deadpool_postgres::Transaction;
use fencegate_proto::body::{SqlColumn, SqlResult, SqlStatement};
use fencegate_proto::{ResourceName, Token};
use futures_util::{pin_mut, TryStreamExt};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::Statement;

use super::{classify, sql, values, PgStore};
use crate::sqlguard::SqlPolicy;
use crate::store::StoreError;

/// A writer's statements, to run under `token` on `resource`'s fence. The statements
/// have passed [`crate::sqlguard::check`].
#[derive(Debug, Clone)]
pub struct SqlTransaction {
    pub resource: ResourceName,
    pub token: Token,
    pub statements: Vec<SqlStatement>,
}

/// What happened to a SQL transaction. Both variants describe committed state.
#[derive(Debug, Clone, PartialEq)]
pub enum SqlOutcome {
    /// Committed, with the fence raised to the token; one result per statement.
    Committed(Vec<SqlResult>),
    /// Rejected: the resource's committed highest token is above the presented one.
    Stale { highest: Token },
}

/// Why a SQL transaction was not committed.
#[derive(Debug, thiserror::Error)]
pub enum SqlFailure {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Refused(#[from] SqlRefusal),
}

/// The writer's SQL could not run; nothing of the transaction was applied. Messages
/// are the writer's own business and safe to show it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SqlRefusal {
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
    #[error(
        "SQL transactions need the Postgres backend: start the gateway with --database-url \
         (or DATABASE_URL) and --sql"
    )]
    NotSupportedByBackend,
}

fn at(statement: Option<usize>) -> String {
    match statement {
        Some(index) => format!("statement {index}"),
        None => "the commit".to_owned(),
    }
}

impl PgStore {
    /// Enables SQL transactions with `policy` (`None` leaves them disabled).
    pub fn with_sql(mut self, policy: Option<SqlPolicy>) -> PgStore {
        self.sql = policy;
        self
    }

    pub fn sql_policy(&self) -> Option<&SqlPolicy> {
        self.sql.as_ref()
    }

    /// Runs a fenced SQL transaction; see the module doc.
    pub async fn sql(&self, tx: &SqlTransaction) -> Result<SqlOutcome, SqlFailure> {
        let policy = self.sql.as_ref().ok_or(SqlRefusal::NotSupportedByBackend)?;
        let committed = self
            .with_client(async |client| {
                let fence = client
                    .prepare_cached(sql::FENCE_RAISE)
                    .await
                    .map_err(|e| classify(e, false))?;
                let transaction = client.transaction().await.map_err(|e| classify(e, false))?;
                Ok(run(transaction, &fence, tx, policy).await)
            })
            .await??;
        match committed {
            Some(results) => Ok(SqlOutcome::Committed(results)),
            None => Ok(SqlOutcome::Stale {
                highest: self.highest_above(&tx.resource, tx.token).await?,
            }),
        }
    }
}

/// Steps 2–5 of the module doc; `None` if the token was stale.
async fn run(
    transaction: Transaction<'_>,
    fence: &Statement,
    tx: &SqlTransaction,
    policy: &SqlPolicy,
) -> Result<Option<Vec<SqlResult>>, SqlFailure> {
    let settings = settings(policy);
    let fence_params: [&(dyn ToSql + Sync); 2] = [&tx.resource.as_str(), &tx.token.as_i64()];
    let eager = if policy.allow_ddl {
        1
    } else {
        tx.statements.len()
    };
    let (raised, set, prepared) = tokio::join!(
        transaction.query_opt(fence, &fence_params),
        transaction.batch_execute(&settings),
        futures_util::future::join_all(
            tx.statements[..eager]
                .iter()
                .map(|statement| transaction.prepare(&statement.sql))
        ),
    );
    if raised.map_err(|e| classify(e, false))?.is_none() {
        return Ok(None);
    }
    set.map_err(|e| classify(e, false))?;
    let mut prepared = prepared.into_iter();
    let mut budget = policy.max_rows;
    let mut results = Vec::with_capacity(tx.statements.len());
    for (index, request) in tx.statements.iter().enumerate() {
        let statement = match prepared.next() {
            Some(statement) => statement,
            None => transaction.prepare(&request.sql).await,
        }
        .map_err(|e| failed(Some(index), e))?;
        results.push(
            execute(
                &transaction,
                index,
                &statement,
                &request.params,
                &mut budget,
            )
            .await?,
        );
    }
    transaction
        .commit()
        .await
        .map_err(|e| match server_refusal(None, &e) {
            Some(refusal) => SqlFailure::Refused(refusal),
            // COMMIT was sent: if the connection broke, it may have committed.
            None => SqlFailure::Store(classify(e, true)),
        })?;
    Ok(Some(results))
}

/// `SET LOCAL` for the role and the statement timeout, as one batch.
fn settings(policy: &SqlPolicy) -> String {
    let timeout = policy.statement_timeout.as_millis().max(1);
    let mut text = format!("SET LOCAL statement_timeout = {timeout}");
    if let Some(role) = &policy.role {
        // An identifier, quoted: the role name comes from the operator, not the writer,
        // but may still need quoting.
        text = format!("SET LOCAL ROLE \"{}\"; {text}", role.replace('"', "\"\""));
    }
    text
}

/// Binds, runs and reads one prepared statement.
async fn execute(
    transaction: &Transaction<'_>,
    index: usize,
    statement: &Statement,
    params: &[serde_json::Value],
    budget: &mut usize,
) -> Result<SqlResult, SqlFailure> {
    let types = statement.params();
    if params.len() != types.len() {
        return Err(SqlRefusal::InvalidParam {
            statement: index,
            parameter: params.len().min(types.len()) + 1,
            reason: format!(
                "the statement takes {} parameters, {} given",
                types.len(),
                params.len()
            ),
        }
        .into());
    }
    let mut bound = Vec::with_capacity(params.len());
    for (position, (value, ty)) in params.iter().zip(types).enumerate() {
        let parameter = position + 1;
        bound.push(values::to_param(value, ty).map_err(|error| match error {
            values::ParamError::Unsupported => SqlRefusal::UnsupportedType {
                statement: index,
                parameter: Some(parameter),
                reason: format!(
                    "parameter ${parameter} has type {}, which this gateway cannot convert; \
                     cast it, e.g. ${parameter}::text::{}",
                    values::type_name(ty),
                    values::type_name(ty)
                ),
            },
            values::ParamError::Invalid(reason) => SqlRefusal::InvalidParam {
                statement: index,
                parameter,
                reason: format!("expected {}: {reason}", values::type_name(ty)),
            },
        })?);
    }
    // Checked before running: an unconvertible result must not cost a statement.
    if let Some(column) = statement
        .columns()
        .iter()
        .find(|column| !values::supported(column.type_()))
    {
        return Err(SqlRefusal::UnsupportedType {
            statement: index,
            parameter: None,
            reason: format!(
                "column \"{}\" has type {}, which this gateway cannot convert; cast it, e.g. to text",
                column.name(),
                values::type_name(column.type_())
            ),
        }
        .into());
    }
    let columns: Vec<SqlColumn> = statement
        .columns()
        .iter()
        .map(|column| SqlColumn {
            name: column.name().to_owned(),
            type_name: values::type_name(column.type_()),
        })
        .collect();
    let rows = transaction
        .query_raw(statement, bound.iter().map(|p| p.as_ref() as &dyn ToSql))
        .await
        .map_err(|e| failed(Some(index), e))?;
    pin_mut!(rows);
    let mut result = SqlResult {
        rows_affected: 0,
        columns,
        rows: Vec::new(),
        truncated: false,
    };
    let mut seen = 0;
    // Rows past the budget are read and counted but not kept: the answer stays bounded
    // and `rows_affected` stays true.
    while let Some(row) = rows.try_next().await.map_err(|e| failed(Some(index), e))? {
        seen += 1;
        if *budget == 0 {
            result.truncated = true;
            continue;
        }
        *budget -= 1;
        let mut values = Vec::with_capacity(result.columns.len());
        for (position, column) in statement.columns().iter().enumerate() {
            values.push(
                values::column_value(&row, position, column.type_()).map_err(|reason| {
                    SqlRefusal::UnsupportedType {
                        statement: index,
                        parameter: None,
                        reason: format!("column \"{}\": {reason}", column.name()),
                    }
                })?,
            );
        }
        result.rows.push(values);
    }
    result.rows_affected = rows.rows_affected().unwrap_or(seen);
    Ok(result)
}

/// A writer's statement failed: its own error if the server refused it, else the
/// backend's.
fn failed(statement: Option<usize>, error: tokio_postgres::Error) -> SqlFailure {
    match server_refusal(statement, &error) {
        Some(refusal) => SqlFailure::Refused(refusal),
        None => SqlFailure::Store(classify(error, false)),
    }
}

/// The server's answer to a writer's statement, unless it says the server itself is
/// going away or refusing connections (then [`classify`] decides). Serialization
/// failures, deadlocks and statement timeouts are the writer's to handle: they come
/// with their SQLSTATE.
fn server_refusal(statement: Option<usize>, error: &tokio_postgres::Error) -> Option<SqlRefusal> {
    let db = error.as_db_error()?;
    let code = db.code();
    let unavailable = [
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
        SqlState::CANNOT_CONNECT_NOW,
        SqlState::TOO_MANY_CONNECTIONS,
        SqlState::IDLE_SESSION_TIMEOUT,
    ];
    if unavailable.contains(code) || code.code().starts_with("08") {
        return None;
    }
    Some(SqlRefusal::Failed {
        statement,
        sqlstate: code.code().to_owned(),
        message: db.message().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn settings_quote_the_role() {
        let mut policy = SqlPolicy {
            role: None,
            allow_ddl: false,
            max_statements: 10,
            statement_timeout: Duration::from_millis(1500),
            max_rows: 10,
        };
        assert_eq!(settings(&policy), "SET LOCAL statement_timeout = 1500");
        policy.role = Some("odd\"role".to_owned());
        assert_eq!(
            settings(&policy),
            "SET LOCAL ROLE \"odd\"\"role\"; SET LOCAL statement_timeout = 1500"
        );
    }
}
