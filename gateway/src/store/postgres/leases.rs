//! Hosted leases and fence resets on Postgres, each in one transaction.
//!
//! Lock order: a lease step locks the lease row, then the fence row; writes lock only
//! fence rows. So a lease step waits for the writes of its resource in flight, and
//! nothing waits in a cycle.

use std::time::Duration;

use deadpool_postgres::{Object, Transaction};
use fencegate_proto::{ResourceName, Token};
use tokio_postgres::Row;

use super::connection;
use super::errors::{classify, Sent};
use super::statements;
use super::txn::{claim, AfterClaim};
use super::writes::token_from_db;
use crate::store::leases::{
    check_reset, decide, next_token, Claimant, Decision, Epoch, LeaseOp, LeaseOutcome, LeaseRecord,
    Reset, ResetOutcome, ResetRecord,
};
use crate::store::txn::{Answered, Keyed};
use crate::store::StoreError;

/// Applies one lease step; with a key, claims it first and stores the answer in the
/// same transaction ([`crate::store::txn`]). A refused step changes nothing but the
/// lease's empty row, so nothing needs rolling back before its answer is stored.
pub(super) async fn step(
    client: &mut Object,
    resource: &ResourceName,
    op: &LeaseOp,
    claimant: &Claimant,
    keyed: Option<&Keyed<LeaseOutcome>>,
) -> Result<Answered<LeaseOutcome>, StoreError> {
    let tx = connection::begin(client).await?;
    if let Some(keyed) = keyed {
        if let Some(earlier) = claim(&tx, keyed, AfterClaim::Nothing).await? {
            return Ok(earlier);
        }
    }
    let outcome = step_in(&tx, resource, op, claimant).await?;
    let stored = match keyed {
        Some(keyed) => Some(super::txn::record(&tx, keyed, &outcome).await?),
        None => None,
    };
    connection::commit(tx).await?;
    Ok(Answered::Ran { outcome, stored })
}

/// One lease step inside `tx`, which the caller commits.
async fn step_in(
    tx: &Transaction<'_>,
    resource: &ResourceName,
    op: &LeaseOp,
    claimant: &Claimant,
) -> Result<LeaseOutcome, StoreError> {
    let resource = resource.as_str();
    tx.execute(statements::LEASE_ENSURE, &[&resource])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let current = record(
        &tx.query_one(statements::LEASE_LOCK, &[&resource])
            .await
            .map_err(|e| classify(e, Sent::NoCommit))?,
    )?;
    let row = match decide(op, claimant, &current) {
        Decision::RefuseHeld => return Ok(LeaseOutcome::Held(current)),
        Decision::RefuseLost => return Ok(LeaseOutcome::Lost(current)),
        Decision::Mint { ttl } => {
            let locked = tx
                .query_one(statements::FENCE_LOCK, &[&resource])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            let (highest, timeline): (i64, i64) = (locked.get(0), locked.get(1));
            let highest = (highest > 0).then(|| token_from_db(highest)).transpose()?;
            let epoch = Epoch::of_timeline(timeline);
            if Epoch::past_the_last(timeline) {
                tracing::error!(
                    timeline,
                    "the fence database's timeline is past the last epoch a token can carry (2^23 timelines): tokens minted on it rise only above the fence and the lease's last token, no longer above every token older timelines could mint; see docs/failover.md"
                );
            }
            let Some(token) = next_token(current.token, highest, epoch) else {
                return Ok(LeaseOutcome::Exhausted);
            };
            tx.execute(statements::FENCE_SET_LEASE, &[&resource, &token.as_i64()])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            tx.query_one(
                statements::LEASE_MINT,
                &[
                    &resource,
                    &claimant.holder,
                    &claimant.identity,
                    &token.as_i64(),
                    &millis(ttl),
                ],
            )
            .await
        }
        Decision::Extend { ttl } => {
            tx.query_one(statements::LEASE_EXTEND, &[&resource, &millis(ttl)])
                .await
        }
        Decision::Free => tx.query_one(statements::LEASE_FREE, &[&resource]).await,
    }
    .map_err(|e| classify(e, Sent::NoCommit))?;
    let after = record(&row)?;
    Ok(match op {
        LeaseOp::Release { .. } => LeaseOutcome::Released(after),
        _ => LeaseOutcome::Granted(after),
    })
}

/// The lease as it stands; the default record if it was never taken.
pub(super) async fn read(
    client: &Object,
    resource: &ResourceName,
) -> Result<LeaseRecord, StoreError> {
    connection::read_row(client, statements::LEASE_READ, &[&resource.as_str()])
        .await?
        .map_or(Ok(LeaseRecord::default()), |row| record(&row))
}

/// Lowers a fence and records the reset, in one transaction.
pub(super) async fn reset(client: &mut Object, reset: &Reset) -> Result<ResetOutcome, StoreError> {
    let resource = reset.resource.as_str();
    let tx = connection::begin(client).await?;
    let highest = tx
        .query_opt(statements::FENCE_FOR_UPDATE, &[&resource])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?
        .map(|row| token_from_db(row.get(0)))
        .transpose()?;
    // The token a reset goes past is the fence's: the one it declares forged. Every
    // other token the resource accepted, on any path, is a floor.
    let forged = highest.map_or(0, Token::as_i64);
    let floors = tx
        .query_one(statements::RESET_FLOORS, &[&resource, &forged])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let floors = [
        positive(floors.get(0))?,
        positive(floors.get(1))?,
        positive(floors.get(2))?,
    ];
    let from = match check_reset(reset, highest, &floors) {
        Ok(from) => from,
        Err(refused) => return Ok(refused),
    };
    tx.execute(statements::FENCE_LOWER, &[&resource, &reset.to.as_i64()])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    tx.execute(
        statements::RESET_RETIRE_RAISES,
        &[&resource, &reset.to.as_i64()],
    )
    .await
    .map_err(|e| classify(e, Sent::NoCommit))?;
    let generation: i64 = tx
        .query_one(
            statements::RESET_RECORD,
            &[
                &resource,
                &from.as_i64(),
                &reset.to.as_i64(),
                &reset.identity,
                &reset.reason,
            ],
        )
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?
        .get(0);
    connection::commit(tx).await?;
    Ok(ResetOutcome::Applied {
        from,
        generation: generation as u64,
    })
}

/// The resets recorded after `generation`, in order.
pub(super) async fn resets_since(
    client: &Object,
    generation: u64,
) -> Result<Vec<ResetRecord>, StoreError> {
    let statement = client
        .prepare_cached(statements::RESETS_SINCE)
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    let since = i64::try_from(generation).unwrap_or(i64::MAX);
    client
        .query(&statement, &[&since])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?
        .iter()
        .map(|row| {
            let resource: String = row.get(1);
            Ok(ResetRecord {
                generation: row.get::<_, i64>(0) as u64,
                resource: ResourceName::new(resource).map_err(|_| {
                    StoreError::Internal("invalid resource in fencegate.fence_resets".into())
                })?,
                to: token_from_db(row.get(2))?,
            })
        })
        .collect()
}

fn record(row: &Row) -> Result<LeaseRecord, StoreError> {
    let remaining: i64 = row.get(3);
    Ok(LeaseRecord {
        holder: row.get(0),
        identity: row.get(1),
        token: positive(row.get(2))?,
        remaining: Duration::from_millis(u64::try_from(remaining).unwrap_or(0)),
    })
}

/// A token column where 0 means "none".
fn positive(value: i64) -> Result<Option<Token>, StoreError> {
    (value != 0).then(|| token_from_db(value)).transpose()
}

fn millis(ttl: Duration) -> i64 {
    i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX)
}
