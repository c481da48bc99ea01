//! The statements of one fenced write: the single autocommitted statement of a write
//! without a precondition (also what each write of a group runs), the transaction of a
//! conditional write, and reading rows back into the store's types.

use deadpool_postgres::Object;
use fencegate_proto::{ResourceName, Token};
use tokio_postgres::types::ToSql;

use super::connection;
use super::errors::{classify, Sent};
use super::statements;
use crate::store::{precondition_holds, StoreError, Write, WriteOp};

/// What a fenced write did. `Stale` carries no highest token: the statement that saw
/// the fence could not report its committed value, so the caller reads it in a
/// statement of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Attempt {
    Applied { version: u64, created: bool },
    Stale,
    PreconditionFailed { current: Option<u64> },
}

/// One statement, in a transaction of its own ([`connection::in_own_transaction`]).
pub(super) async fn write_unconditional(
    client: &Object,
    write: &Write,
) -> Result<Attempt, StoreError> {
    let resource = write.resource.as_str();
    let key = write.key.as_str();
    let token = write.token.as_i64();
    let row = match &write.op {
        WriteOp::Put(value) => {
            let statement = client
                .prepare_cached(statements::FENCED_PUT)
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            let params: [&(dyn ToSql + Sync); 4] = [&resource, &token, &key, &value.as_ref()];
            connection::in_own_transaction(client, client.query_opt(&statement, &params)).await
        }
        WriteOp::Delete => {
            let statement = client
                .prepare_cached(statements::FENCED_DELETE)
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            connection::in_own_transaction(
                client,
                client.query_opt(&statement, &[&resource, &token, &key]),
            )
            .await
        }
    }?;
    match row {
        Some(row) => applied(&write.op, row.get(0), row.get(1)),
        None => Ok(Attempt::Stale),
    }
}

/// Fence, read, check, write, commit. Any early return drops the transaction, which
/// rolls it back: fence and object stay as they were.
pub(super) async fn write_conditional(
    client: &mut Object,
    write: &Write,
) -> Result<Attempt, StoreError> {
    let resource = write.resource.as_str();
    let key = write.key.as_str();
    let token = write.token.as_i64();
    let (fence_raise, object_version) = tokio::try_join!(
        client.prepare_cached(statements::FENCE_RAISE),
        client.prepare_cached(statements::OBJECT_VERSION)
    )
    .map_err(|e| classify(e, Sent::NoCommit))?;
    let tx = connection::begin(client).await?;
    // Pipelined: the version read runs after the fence statement holds the lock.
    let (fence_params, version_params): ([&(dyn ToSql + Sync); 2], [&(dyn ToSql + Sync); 2]) =
        ([&resource, &token], [&resource, &key]);
    let (raised, current) = tokio::try_join!(
        tx.query_opt(&fence_raise, &fence_params),
        tx.query_opt(&object_version, &version_params),
    )
    .map_err(|e| classify(e, Sent::NoCommit))?;
    if raised.is_none() {
        return Ok(Attempt::Stale);
    }
    let current = match current {
        Some(row) if row.get::<_, bool>(1) => Some(non_negative(row.get(0))?),
        _ => None,
    };
    if !precondition_holds(write.precondition, current) {
        return Ok(Attempt::PreconditionFailed { current });
    }
    let row = match &write.op {
        WriteOp::Put(value) => {
            let statement = tx
                .prepare_cached(statements::OBJECT_PUT)
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            tx.query_one(&statement, &[&resource, &token, &key, &value.as_ref()])
                .await
        }
        WriteOp::Delete => {
            let statement = tx
                .prepare_cached(statements::OBJECT_DELETE)
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            tx.query_one(&statement, &[&resource, &token, &key]).await
        }
    }
    .map_err(|e| classify(e, Sent::NoCommit))?;
    let outcome = applied(&write.op, row.get(0), row.get(1))?;
    connection::commit(tx).await?;
    Ok(outcome)
}

pub(super) async fn read_fence(
    client: &Object,
    resource: &ResourceName,
) -> Result<Option<Token>, StoreError> {
    let row = connection::read_row(client, statements::GET_FENCE, &[&resource.as_str()]).await?;
    row.map(|row| token_from_db(row.get(0))).transpose()
}

/// An applied write, from its row's version and the version its object was born at.
pub(super) fn applied(op: &WriteOp, version: i64, born: i64) -> Result<Attempt, StoreError> {
    let version = non_negative(version)?;
    let created = matches!(op, WriteOp::Put(_)) && i64::try_from(version).ok() == Some(born);
    Ok(Attempt::Applied { version, created })
}

pub(super) fn non_negative(value: i64) -> Result<u64, StoreError> {
    u64::try_from(value)
        .map_err(|_| StoreError::Internal(format!("negative version {value} in fencegate.objects")))
}

pub(super) fn token_from_db(value: i64) -> Result<Token, StoreError> {
    u64::try_from(value)
        .ok()
        .and_then(|v| Token::new(v).ok())
        .ok_or_else(|| StoreError::Internal(format!("invalid token {value} in the database")))
}
