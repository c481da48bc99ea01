//! Transactions over several resources, and keyed writes, on Postgres: the steps of
//! [`crate::store::txn`] in one database transaction on a connection of the pool (not
//! a write lane: a transaction's locks are held for several round trips).

use std::time::Duration;

use deadpool_postgres::{Object, Transaction};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;

use super::connection;
use super::errors::{classify, Sent};
use super::statements;
use super::writes::{applied, non_negative, token_from_db, Attempt};
use crate::store::txn::{
    found_answer, replay, Answered, Hold, Keyed, OpDone, StaleMember, StoredAnswer, Txn, TxnOp,
    TxnOutcome,
};
use crate::store::{precondition_holds, StoreError, WriteOp};

/// How long a keyed write waits for an earlier attempt with the same key to finish
/// before it is answered `idempotency_in_flight`.
pub const IN_FLIGHT_WAIT: Duration = Duration::from_millis(250);

/// Runs `txn`, with its key if it has one; see [`crate::store::txn`].
pub(super) async fn run(
    client: &mut Object,
    txn: &Txn,
    keyed: Option<&Keyed>,
) -> Result<Answered, StoreError> {
    let tx = connection::begin(client).await?;
    if let Some(keyed) = keyed {
        if let Some(earlier) = claim(&tx, keyed, AfterClaim::Savepoint).await? {
            return Ok(earlier);
        }
    }
    let outcome = apply(&tx, txn).await?;
    let refused = !matches!(outcome, TxnOutcome::Applied(_));
    let Some(keyed) = keyed else {
        if refused {
            // Dropped without a commit: rolled back, nothing applied.
            return Ok(Answered::Ran {
                outcome,
                stored: None,
            });
        }
        connection::commit(tx).await?;
        return Ok(Answered::Ran {
            outcome,
            stored: None,
        });
    };
    // A refusal changed no fence and no object (see `apply`), but may have made missing
    // fence rows: back to the claim, so that it leaves nothing but its answer.
    if refused {
        tx.batch_execute("ROLLBACK TO SAVEPOINT txn")
            .await
            .map_err(|e| classify(e, Sent::NoCommit))?;
    }
    let answer = record(&tx, keyed, &outcome).await?;
    connection::commit(tx).await?;
    Ok(Answered::Ran {
        outcome,
        stored: Some(answer),
    })
}

/// What follows a key's claim in its round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AfterClaim {
    /// A savepoint, for a refused operation of the transaction to roll back to.
    Savepoint,
    /// Nothing more.
    Nothing,
}

/// Claims the key for this attempt (`None`), or answers from the record an earlier
/// attempt left; `after`: what follows the claim. The claim and the statements around
/// it are pipelined: one round trip, and one more to read the record of a retry.
pub(super) async fn claim<O>(
    tx: &Transaction<'_>,
    keyed: &Keyed<O>,
    after: AfterClaim,
) -> Result<Option<Answered<O>>, StoreError> {
    let ttl_ms = i64::try_from(keyed.ttl_ms()).unwrap_or(i64::MAX);
    let claim = tx
        .prepare_cached(statements::IDEMPOTENCY_CLAIM)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let wait = format!("SET LOCAL lock_timeout = {}", IN_FLIGHT_WAIT.as_millis());
    let fingerprint = keyed.fingerprint.as_slice();
    let claim_params: [&(dyn ToSql + Sync); 4] =
        [&keyed.identity, &keyed.key, &fingerprint, &ttl_ms];
    let after = match after {
        AfterClaim::Savepoint => "SET LOCAL lock_timeout = 0; SAVEPOINT txn",
        AfterClaim::Nothing => "SET LOCAL lock_timeout = 0",
    };
    let (waiting, claimed, done) = tokio::join!(
        tx.batch_execute(&wait),
        tx.query_opt(&claim, &claim_params),
        tx.batch_execute(after),
    );
    waiting.map_err(|e| classify(e, Sent::NoCommit))?;
    let claimed = match claimed {
        Err(error) if error.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
            return Ok(Some(Answered::InFlight))
        }
        other => other.map_err(|e| classify(e, Sent::NoCommit))?,
    };
    done.map_err(|e| classify(e, Sent::NoCommit))?;
    if claimed.is_some() {
        return Ok(None);
    }
    let row = tx
        .query_one(statements::IDEMPOTENCY_READ, &[&keyed.identity, &keyed.key])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let (fingerprint, answer) = stored_answer(&row, 0)?;
    Ok(Some(replay(&fingerprint, keyed, answer)))
}

/// The fingerprint and answer of a record, from `row`'s columns `from..from + 4`:
/// fingerprint, status, headers, body.
pub(crate) fn stored_answer(
    row: &tokio_postgres::Row,
    from: usize,
) -> Result<(Vec<u8>, StoredAnswer), StoreError> {
    let fingerprint: Vec<u8> = row.get(from);
    let status: Option<i16> = row.get(from + 1);
    let headers: Option<String> = row.get(from + 2);
    let body: Option<Vec<u8>> = row.get(from + 3);
    let answer = found_answer(
        status.and_then(|s| u16::try_from(s).ok()),
        headers.as_deref().unwrap_or_default(),
        body.unwrap_or_default().into(),
    )?;
    Ok((fingerprint, answer))
}

/// Stores the answer to `outcome` under the key `claim` took, in the same transaction.
pub(super) async fn record<O>(
    tx: &Transaction<'_>,
    keyed: &Keyed<O>,
    outcome: &O,
) -> Result<StoredAnswer, StoreError> {
    let answer = (keyed.render)(outcome);
    let status = i16::try_from(answer.status)
        .map_err(|_| StoreError::Internal(format!("status {} out of range", answer.status)))?;
    tx.execute(
        statements::IDEMPOTENCY_RECORD,
        &[
            &keyed.identity,
            &keyed.key,
            &status,
            &answer.headers_text(),
            &answer.body.as_ref(),
        ],
    )
    .await
    .map_err(|e| classify(e, Sent::NoCommit))?;
    Ok(answer)
}

/// Locks, judges and applies `txn` inside `tx`. Every check comes before the first
/// change: a refused transaction raised no fence and wrote no object — at most it made
/// the missing fence rows of its resources, at 1, which the caller rolls back.
async fn apply(tx: &Transaction<'_>, txn: &Txn) -> Result<TxnOutcome, StoreError> {
    let (lock, ensure, share, fence, version, set) = tokio::try_join!(
        tx.prepare_cached(statements::TXN_FENCE_LOCK),
        tx.prepare_cached(statements::TXN_FENCE_ENSURE),
        tx.prepare_cached(statements::TXN_FENCE_SHARE),
        tx.prepare_cached(statements::GET_FENCE),
        tx.prepare_cached(statements::OBJECT_VERSION),
        tx.prepare_cached(statements::TXN_FENCE_SET),
    )
    .map_err(|e| classify(e, Sent::NoCommit))?;
    // 1. Every fence, locked in lock order and read. Statements on one connection run
    // one after the other, each lock taken before the next statement starts: pipelined
    // in that order, one round trip takes them all.
    let mut statements = Vec::with_capacity(2 * txn.involved().len());
    for involved in txn.involved() {
        let resource = involved.resource.as_str();
        let (take, read) = match involved.hold {
            Hold::Raise => (&lock, &fence),
            Hold::Check => (&ensure, &share),
        };
        statements.push(LockStep::Lock(take, resource));
        statements.push(LockStep::Read(read, resource));
    }
    let answers = futures_util::future::join_all(statements.iter().map(|step| async move {
        match step {
            LockStep::Lock(statement, resource) => {
                tx.execute(*statement, &[resource]).await.map(|_| None)
            }
            LockStep::Read(statement, resource) => {
                tx.query_one(*statement, &[resource]).await.map(Some)
            }
        }
    }))
    .await;
    let mut highest = Vec::with_capacity(txn.involved().len());
    for answer in answers {
        if let Some(row) = answer.map_err(|e| classify(e, Sent::NoCommit))? {
            highest.push(row.get::<_, i64>(0));
        }
    }
    let mut stale = Vec::new();
    for (involved, highest) in txn.involved().iter().zip(highest) {
        if highest > involved.token.as_i64() {
            stale.push(StaleMember {
                resource: involved.resource.clone(),
                presented: involved.token,
                highest: token_from_db(highest)?,
            });
        }
    }
    if !stale.is_empty() {
        return Ok(TxnOutcome::Stale(stale));
    }
    // 2. Every precondition, read under the fence locks (pipelined), judged in operation
    // order.
    let reads = futures_util::future::join_all(txn.ops().iter().map(|op| {
        let version = &version;
        async move {
            match op.object() {
                Some((key, precondition)) if needs_version(op, precondition) => tx
                    .query_opt(version, &[&op.resource().as_str(), &key.as_str()])
                    .await
                    .map(Some),
                _ => Ok(None),
            }
        }
    }))
    .await;
    let mut found = Vec::with_capacity(txn.ops().len());
    for (at, (op, read)) in txn.ops().iter().zip(reads).enumerate() {
        let current = match read.map_err(|e| classify(e, Sent::NoCommit))? {
            Some(row) => {
                let current = match row {
                    Some(row) if row.get::<_, bool>(1) => Some(non_negative(row.get(0))?),
                    _ => None,
                };
                let (_, precondition) = op.object().expect("only objects are read");
                if !precondition_holds(precondition, current) {
                    return Ok(TxnOutcome::PreconditionFailed { op: at, current });
                }
                current
            }
            None => None,
        };
        found.push(current);
    }
    // 3. The fences raised, then the writes in operation order, pipelined.
    let (put, delete) = tokio::try_join!(
        tx.prepare_cached(statements::OBJECT_PUT),
        tx.prepare_cached(statements::OBJECT_DELETE),
    )
    .map_err(|e| classify(e, Sent::NoCommit))?;
    let set = &set;
    let raises = futures_util::future::join_all(
        txn.involved()
            .iter()
            .filter(|involved| involved.hold == Hold::Raise)
            .map(|involved| async move {
                let token = involved.token.as_i64();
                tx.execute(set, &[&involved.resource.as_str(), &token])
                    .await
            }),
    );
    let rows = futures_util::future::join_all(txn.ops().iter().map(|op| {
        let (put, delete) = (&put, &delete);
        async move {
            match op {
                TxnOp::Put {
                    resource,
                    key,
                    token,
                    value,
                    ..
                } => tx
                    .query_one(
                        put,
                        &[
                            &resource.as_str(),
                            &token.as_i64(),
                            &key.as_str(),
                            &value.as_ref(),
                        ],
                    )
                    .await
                    .map(Some),
                TxnOp::Delete {
                    resource,
                    key,
                    token,
                    ..
                } => tx
                    .query_one(
                        delete,
                        &[&resource.as_str(), &token.as_i64(), &key.as_str()],
                    )
                    .await
                    .map(Some),
                TxnOp::Advance { .. } | TxnOp::Check { .. } => Ok(None),
            }
        }
    }));
    let (raises, rows) = tokio::join!(raises, rows);
    for raised in raises {
        raised.map_err(|e| classify(e, Sent::NoCommit))?;
    }
    let mut done = Vec::with_capacity(txn.ops().len());
    for ((op, current), row) in txn.ops().iter().zip(found).zip(rows) {
        let row = row.map_err(|e| classify(e, Sent::NoCommit))?;
        done.push(match (op, row) {
            (TxnOp::Put { value, .. }, Some(row)) => {
                written(&WriteOp::Put(value.clone()), row.get(0), row.get(1))?
            }
            (TxnOp::Delete { .. }, Some(row)) => written(&WriteOp::Delete, row.get(0), row.get(1))?,
            (TxnOp::Check { object, .. }, _) => OpDone {
                version: object.as_ref().map(|_| current.unwrap_or(0)),
                created: false,
            },
            _ => OpDone {
                version: None,
                created: false,
            },
        });
    }
    Ok(TxnOutcome::Applied(done))
}

/// One statement of the lock phase: a lock taken, or a fence read under its lock.
enum LockStep<'a> {
    Lock(&'a tokio_postgres::Statement, &'a str),
    Read(&'a tokio_postgres::Statement, &'a str),
}

/// Whether the operation must read its object's version: a check of an object, or a
/// write with a precondition.
fn needs_version(op: &TxnOp, precondition: fencegate_proto::headers::Precondition) -> bool {
    matches!(op, TxnOp::Check { .. })
        || precondition != fencegate_proto::headers::Precondition::None
}

fn written(op: &WriteOp, version: i64, born: i64) -> Result<OpDone, StoreError> {
    match applied(op, version, born)? {
        Attempt::Applied { version, created } => Ok(OpDone {
            version: Some(version),
            created,
        }),
        other => Err(StoreError::Internal(format!(
            "a written object read back as {other:?}"
        ))),
    }
}
