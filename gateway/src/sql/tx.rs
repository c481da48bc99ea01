//! One fenced SQL transaction, on one connection of the writer-only pool.
//!
//! # Behavior
//!
//! 1. `BEGIN`.
//! 2. The fence step, `SELECT fencegate.sql_fence(resource, token, key)`
//!    ([`crate::dbfence`]): the same fence row as every `/v1/kv` write and fence advance
//!    of the resource, locked from here to the end of the transaction — shared with the
//!    open transactions of the same token, exclusively to raise it. A stale token ends
//!    the transaction here, before any of the writer's statements ran. The step grants
//!    the rest of the transaction this one resource at this token: the triggers of the
//!    resource's protected tables honour it, and nothing else. Only the gateway can take
//!    the step (the key is the schema's, never sent to writers); the SQL login holds no
//!    resource of its own, so no statement of the writer can present or raise a fence.
//! 3. `SET LOCAL ROLE` (with `--sql-role`).
//! 4. The writer's statements, in order: each is prepared (the database reports the
//!    types of its parameters and columns), its values are converted ([`super::values`]),
//!    it runs, and its rows are read until the answer's row budget is spent. A
//!    statement's `ZF001` or `ZF005` is the fence's refusal only if its proof holds;
//!    anything else a statement raises is the writer's own SQL error.
//! 5. `COMMIT`.
//!
//! Every early return drops the transaction, which rolls it back: the writer's tables
//! and the fence stay as they were (invariant 4). The whole transaction is bounded by
//! the backend timeout — after which Postgres is asked to cancel what runs, and the
//! answer says the write was not applied unless `COMMIT` had been sent — and each
//! statement by the pinned `statement_timeout` and `lock_timeout`.
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

use std::sync::atomic::{AtomicBool, Ordering};

use deadpool_postgres::Transaction;
use fencegate_proto::body::{SqlBound, SqlColumn, SqlResult};
use futures_util::{pin_mut, TryStreamExt};
use tokio_postgres::types::ToSql;
use tokio_postgres::Statement;

use super::{values, SqlError, SqlFailure, SqlOutcome, SqlPolicy, SqlService, SqlTransaction};
use crate::dbfence::{ProofKey, Reported};
use crate::store::postgres::{classify, server_unavailable, Sent};
use crate::store::postgres::{stored_answer, IN_FLIGHT_WAIT};
use crate::store::txn::{replay, Answered, Keyed};
use crate::store::StoreError;
use tokio_postgres::error::SqlState;

/// The fence step.
const FENCE: &str = "SELECT fencegate.sql_fence($1::text, $2::bigint, $3::bytea)";
/// The claim of a keyed transaction's key; see [`run_keyed`].
const CLAIM: &str = "SELECT * FROM fencegate.sql_idempotency_claim($1::text, $2::text, $3::bytea, $4::bigint, $5::bigint, $6::bytea)";
/// The answer of a keyed transaction, stored.
const RECORD: &str = "SELECT fencegate.sql_idempotency_record($1::text, $2::text, $3::smallint, $4::text, $5::bytea, $6::bytea)";

/// Runs `tx`; see the module doc.
pub(super) async fn run(
    service: &SqlService,
    tx: &SqlTransaction,
) -> Result<Vec<SqlResult>, SqlFailure> {
    let commit_sent = AtomicBool::new(false);
    let outcome = service
        .with_client(async |client| {
            let transaction = client
                .transaction()
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            let bound = service.policy().max_response;
            let results = match steps(&transaction, tx, service, bound).await {
                Ok(results) => results,
                Err(failure) => return Ok(Err(failure)),
            };
            Ok(commit(transaction, &commit_sent, &service.proof)
                .await
                .map(|()| results))
        })
        .await;
    match outcome {
        Ok(outcome) => outcome,
        Err(error) => Err(given_up(error, &commit_sent).into()),
    }
}

/// A keyed transaction: the key claimed first (through the gateway's key: the SQL login
/// may not touch `fencegate.idempotency`), the steps, and the answer stored in the same
/// transaction — also a refusal, after rolling back what the writer's statements did.
/// The database's own failures store nothing: the transaction rolls back, and a retry
/// runs it afresh.
pub(super) async fn run_keyed(
    service: &SqlService,
    tx: &SqlTransaction,
    keyed: &Keyed<SqlOutcome>,
) -> Answered<SqlOutcome> {
    let commit_sent = AtomicBool::new(false);
    let answered = service
        .with_client(async |client| {
            let transaction = client
                .transaction()
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            if let Some(earlier) = claim(&transaction, service, keyed).await? {
                return Ok(earlier);
            }
            transaction
                .batch_execute("SAVEPOINT keyed")
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            // Cut where a stored answer must end: it is kept for every retry.
            let bound = service.policy().max_keyed_response;
            let outcome = steps(&transaction, tx, service, bound).await;
            match &outcome {
                Err(SqlFailure::Store(_)) => {
                    return Ok(Answered::Ran {
                        outcome,
                        stored: None,
                    })
                }
                Err(_) => transaction
                    .batch_execute("ROLLBACK TO SAVEPOINT keyed")
                    .await
                    .map_err(|e| classify(e, Sent::NoCommit))?,
                Ok(_) => {}
            }
            let answer = (keyed.render)(&outcome);
            let status = i16::try_from(answer.status)
                .map_err(|_| StoreError::Internal(format!("status {}", answer.status)))?;
            // Back to the login, which may store the answer, from --sql-role.
            transaction
                .batch_execute("SET LOCAL ROLE NONE")
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            transaction
                .execute(
                    RECORD,
                    &[
                        &keyed.identity,
                        &keyed.key,
                        &status,
                        &answer.headers_text(),
                        &answer.body.as_ref(),
                        &service.fence_key.as_slice(),
                    ],
                )
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            Ok(
                match commit(transaction, &commit_sent, &service.proof).await {
                    Ok(()) => Answered::Ran {
                        outcome,
                        stored: Some(answer),
                    },
                    Err(failure) => Answered::Ran {
                        outcome: Err(failure),
                        stored: None,
                    },
                },
            )
        })
        .await;
    answered.unwrap_or_else(|error| Answered::Ran {
        outcome: Err(given_up(error, &commit_sent).into()),
        stored: None,
    })
}

/// Claims the key of a keyed transaction (`None`), or answers from the record an
/// earlier attempt left.
async fn claim(
    transaction: &Transaction<'_>,
    service: &SqlService,
    keyed: &Keyed<SqlOutcome>,
) -> Result<Option<Answered<SqlOutcome>>, StoreError> {
    let ttl_ms = i64::try_from(keyed.ttl_ms()).unwrap_or(i64::MAX);
    let in_flight_ms = i64::try_from(IN_FLIGHT_WAIT.as_millis()).unwrap_or(i64::MAX);
    let claimed = transaction
        .query_one(
            CLAIM,
            &[
                &keyed.identity,
                &keyed.key,
                &keyed.fingerprint.as_slice(),
                &ttl_ms,
                &in_flight_ms,
                &service.fence_key.as_slice(),
            ],
        )
        .await;
    let row = match claimed {
        Err(error) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            return Ok(Some(Answered::InFlight))
        }
        other => other.map_err(|e| classify(e, Sent::NoCommit))?,
    };
    if row.get::<_, bool>(0) {
        return Ok(None);
    }
    let (fingerprint, answer) = stored_answer(&row, 1)?;
    Ok(Some(replay(&fingerprint, keyed, answer)))
}

/// Step 5: `COMMIT`.
async fn commit(
    transaction: Transaction<'_>,
    commit_sent: &AtomicBool,
    proof: &ProofKey,
) -> Result<(), SqlFailure> {
    commit_sent.store(true, Ordering::Release);
    crate::store::postgres::committing();
    transaction
        .commit()
        .await
        .map_err(|e| match server_refusal(None, &e, proof) {
            Some(refusal) => refusal,
            // COMMIT was sent: if the connection broke, it may have committed.
            None => SqlFailure::Store(classify(e, Sent::Commit)),
        })
}

/// The error of a transaction given up on: before COMMIT was sent, the cancel and the
/// closed connection roll the transaction back, so it certainly did not apply.
fn given_up(error: StoreError, commit_sent: &AtomicBool) -> StoreError {
    match error {
        StoreError::Unavailable {
            reason,
            applied: None,
        } if !commit_sent.load(Ordering::Acquire) => StoreError::Unavailable {
            reason,
            applied: Some(false),
        },
        error => error,
    }
}

/// Steps 2–4 of the module doc, with answers cut at `bound` bytes; the caller commits.
async fn steps(
    transaction: &Transaction<'_>,
    tx: &SqlTransaction,
    service: &SqlService,
    bound: usize,
) -> Result<Vec<SqlResult>, SqlFailure> {
    // Prepared once per connection, then taken from its cache.
    let fence = transaction
        .prepare_cached(FENCE)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let policy: &SqlPolicy = service.policy();
    let proof = &service.proof;
    let fence_params: [&(dyn ToSql + Sync); 3] = [
        &tx.resource.as_str(),
        &tx.token.as_i64(),
        &service.fence_key.as_slice(),
    ];
    let eager = if policy.allow_ddl {
        1
    } else {
        tx.statements.len()
    };
    let role = policy.role.as_deref().map(set_role).unwrap_or_default();
    let (fenced, set, prepared) = tokio::join!(
        transaction.query_one(&fence, &fence_params),
        async {
            match role.is_empty() {
                true => Ok(()),
                false => transaction.batch_execute(&role).await,
            }
        },
        futures_util::future::join_all(
            tx.statements[..eager]
                .iter()
                .map(|statement| transaction.prepare(&statement.sql))
        ),
    );
    if let Err(error) = fenced {
        return Err(match refusal(&error, proof) {
            Some(Reported::Proven(refusal)) => SqlFailure::Fence(refusal),
            // The gateway's own step cannot raise anything but the fence's refusals.
            _ => SqlFailure::Store(classify(error, Sent::NoCommit)),
        });
    }
    set.map_err(|e| classify(e, Sent::NoCommit))?;
    let mut prepared = prepared.into_iter();
    let mut budget = AnswerBudget {
        rows: policy.max_rows,
        bytes: bound,
    };
    let mut results = Vec::with_capacity(tx.statements.len());
    for (index, request) in tx.statements.iter().enumerate() {
        let statement = match prepared.next() {
            Some(statement) => statement,
            None => transaction.prepare(&request.sql).await,
        }
        .map_err(|e| failed(Some(index), e, proof))?;
        results.push(
            execute(
                transaction,
                index,
                &statement,
                &request.params,
                &mut budget,
                proof,
            )
            .await?,
        );
    }
    Ok(results)
}

/// `SET LOCAL ROLE`, the role quoted as an identifier: it comes from the operator, not
/// the writer, but may still need quoting.
fn set_role(role: &str) -> String {
    format!("SET LOCAL ROLE \"{}\"", role.replace('"', "\"\""))
}

/// What `error` says of the fence: its own refusal, or a `ZF001`/`ZF005` anyone raised.
fn refusal(error: &tokio_postgres::Error, proof: &ProofKey) -> Option<Reported> {
    Reported::from_db_error(error.as_db_error()?, proof)
}

/// Binds, runs and reads one prepared statement.
async fn execute(
    transaction: &Transaction<'_>,
    index: usize,
    statement: &Statement,
    params: &[serde_json::Value],
    budget: &mut AnswerBudget,
    proof: &ProofKey,
) -> Result<SqlResult, SqlFailure> {
    let types = statement.params();
    if params.len() != types.len() {
        return Err(SqlError::InvalidParam {
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
            values::ParamError::Unsupported => SqlError::UnsupportedType {
                statement: index,
                parameter: Some(parameter),
                reason: format!(
                    "parameter ${parameter} has type {}, which this gateway cannot convert; \
                     cast it, e.g. ${parameter}::text::{}",
                    values::type_name(ty),
                    values::type_name(ty)
                ),
            },
            values::ParamError::Invalid(reason) => SqlError::InvalidParam {
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
        return Err(SqlError::UnsupportedType {
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
        .map_err(|e| failed(Some(index), e, proof))?;
    pin_mut!(rows);
    let mut result = SqlResult {
        rows_affected: 0,
        columns,
        rows: Vec::new(),
        truncated: false,
        truncated_by: None,
    };
    let mut seen = 0;
    // Rows past the budget are read and counted but not kept: the answer stays bounded
    // and `rows_affected` stays true.
    while let Some(row) = rows
        .try_next()
        .await
        .map_err(|e| failed(Some(index), e, proof))?
    {
        seen += 1;
        if let Some(bound) = budget.spent() {
            result.truncated = true;
            result.truncated_by.get_or_insert(bound);
            continue;
        }
        let mut values = Vec::with_capacity(result.columns.len());
        for (position, column) in statement.columns().iter().enumerate() {
            values.push(
                values::column_value(&row, position, column.type_()).map_err(|reason| {
                    SqlError::UnsupportedType {
                        statement: index,
                        parameter: None,
                        reason: format!("column \"{}\": {reason}", column.name()),
                    }
                })?,
            );
        }
        if !budget.take(&values) {
            result.truncated = true;
            result.truncated_by = Some(SqlBound::Bytes);
            continue;
        }
        result.rows.push(values);
    }
    result.rows_affected = rows.rows_affected().unwrap_or(seen);
    Ok(result)
}

/// What is left of an answer's bounds (`--sql-max-rows`, `--sql-max-response`), over
/// all its statements.
struct AnswerBudget {
    rows: usize,
    /// Bytes of JSON the kept rows may still take.
    bytes: usize,
}

impl AnswerBudget {
    /// The bound already reached, if one is: no further row is kept.
    fn spent(&self) -> Option<SqlBound> {
        match (self.rows, self.bytes) {
            (0, _) => Some(SqlBound::Rows),
            (_, 0) => Some(SqlBound::Bytes),
            _ => None,
        }
    }

    /// Keeps `row` if its JSON fits in the bytes left; once one does not, no later
    /// row is kept either (the answer is cut, not sampled).
    fn take(&mut self, row: &[serde_json::Value]) -> bool {
        let mut size = JsonSize(0);
        serde_json::to_writer(&mut size, row).expect("JSON values serialize");
        match self.bytes.checked_sub(size.0) {
            Some(left) => {
                self.bytes = left;
                self.rows -= 1;
                true
            }
            None => {
                self.bytes = 0;
                false
            }
        }
    }
}

/// Counts the bytes written to it.
struct JsonSize(usize);

impl std::io::Write for JsonSize {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0 += buf.len();
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A writer's statement failed: the fence's refusal if it proves to be one, the
/// writer's own error if the server refused it otherwise, else the backend's.
fn failed(statement: Option<usize>, error: tokio_postgres::Error, proof: &ProofKey) -> SqlFailure {
    match server_refusal(statement, &error, proof) {
        Some(refusal) => refusal,
        None => SqlFailure::Store(classify(error, Sent::NoCommit)),
    }
}

/// The server's answer to a writer's statement (or the commit), unless it says the
/// server itself is going away or refusing connections (then [`classify`] decides).
/// Serialization failures, deadlocks, statement and lock timeouts are the writer's to
/// handle: they come with their SQLSTATE. So does a `ZF001`/`ZF005` without the fence's
/// proof, which the writer's SQL raised itself ([`SqlFailure::Forged`]).
fn server_refusal(
    statement: Option<usize>,
    error: &tokio_postgres::Error,
    proof: &ProofKey,
) -> Option<SqlFailure> {
    let db = error.as_db_error()?;
    let code = db.code();
    if server_unavailable(code) {
        return None;
    }
    let failed = SqlError::Failed {
        statement,
        sqlstate: code.code().to_owned(),
        message: db.message().to_owned(),
    };
    Some(match Reported::from_db_error(db, proof) {
        Some(Reported::Proven(refusal)) => SqlFailure::Fence(refusal),
        Some(Reported::Unproven { code }) => SqlFailure::Forged { code, failed },
        None => SqlFailure::Refused(failed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_quoted() {
        assert_eq!(set_role("writer"), "SET LOCAL ROLE \"writer\"");
        assert_eq!(set_role("odd\"role"), "SET LOCAL ROLE \"odd\"\"role\"");
    }
}
