//! The writer thread of the embedded store: jobs applied in batches, one write
//! transaction and one fsync per batch, each job answered only after its batch commits.

use std::sync::atomic::{AtomicBool, Ordering};

use fencegate_proto::{ResourceName, Token};
use redb::{Database, ReadableTable, Table};
use tokio::sync::{mpsc, oneshot};

use crate::store::embedded::{
    lease_record, now_ms, LeaseRow, ObjectRow, ResetRow, FENCES, LEASES, OBJECTS, RAISES,
    RAISES_KEPT, RESETS,
};
use crate::store::leases::{
    check_reset, decide, next_token, Claimant, Decision, LeaseOp, LeaseOutcome, Reset, ResetOutcome,
};
use crate::store::{
    precondition_holds, AdvanceOutcome, StoreError, UnavailableReason, Write, WriteOp, WriteOutcome,
};

pub(super) type Reply<T> = oneshot::Sender<Result<T, StoreError>>;

/// A request queued for the writer thread, with the channel its answer goes back on.
pub(super) enum Job {
    Write {
        write: Write,
        reply: Reply<WriteOutcome>,
    },
    Advance {
        resource: ResourceName,
        token: Token,
        reply: Reply<AdvanceOutcome>,
    },
    Lease {
        resource: ResourceName,
        op: LeaseOp,
        claimant: Claimant,
        reply: Reply<LeaseOutcome>,
    },
    Reset {
        reset: Reset,
        reply: Reply<ResetOutcome>,
    },
}

/// A job applied inside the batch transaction, waiting for the commit to answer it.
enum Applied {
    Write(Reply<WriteOutcome>, WriteOutcome),
    Advance(Reply<AdvanceOutcome>, AdvanceOutcome),
    Lease(Reply<LeaseOutcome>, LeaseOutcome),
    Reset(Reply<ResetOutcome>, ResetOutcome),
}

impl Job {
    /// Applies the job inside the batch transaction. If storage fails, the job is
    /// answered at once (nothing of the batch will commit) and the error returned.
    fn apply(self, tables: &mut Tables<'_>) -> Result<Applied, redb::Error> {
        match self {
            Job::Write { write, reply } => match apply_write(tables, &write) {
                Ok(outcome) => Ok(Applied::Write(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Advance {
                resource,
                token,
                reply,
            } => match apply_advance(tables, &resource, token) {
                Ok(outcome) => Ok(Applied::Advance(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Lease {
                resource,
                op,
                claimant,
                reply,
            } => match apply_lease(tables, &resource, &op, &claimant) {
                Ok(outcome) => Ok(Applied::Lease(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Reset { reset, reply } => match apply_reset(tables, &reset) {
                Ok(outcome) => Ok(Applied::Reset(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
        }
    }

    /// Answers the job with `error`. A caller that gave up has dropped its receiver,
    /// and then nobody is left to tell.
    fn fail(self, error: StoreError) {
        match self {
            Job::Write { reply, .. } => drop(reply.send(Err(error))),
            Job::Advance { reply, .. } => drop(reply.send(Err(error))),
            Job::Lease { reply, .. } => drop(reply.send(Err(error))),
            Job::Reset { reply, .. } => drop(reply.send(Err(error))),
        }
    }
}

impl Applied {
    /// Answers the job with its outcome if the batch committed, or with `error`.
    fn answer(self, committed: Result<(), StoreError>) {
        match self {
            Applied::Write(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            Applied::Advance(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            Applied::Lease(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            Applied::Reset(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
        }
    }

    fn fail(self, error: StoreError) {
        self.answer(Err(error));
    }
}

/// The writer thread: batches waiting jobs into one transaction each.
/// Sets `write_failed` when a batch fails in storage.
pub(super) fn writer(
    db: &Database,
    mut jobs: mpsc::Receiver<Job>,
    group_max: usize,
    group_size: &prometheus::Histogram,
    write_failed: &AtomicBool,
) {
    while let Some(first) = jobs.blocking_recv() {
        let mut batch = Vec::with_capacity(group_max);
        batch.push(first);
        while batch.len() < group_max {
            match jobs.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        group_size.observe(batch.len() as f64);
        if !commit_batch(db, batch) {
            write_failed.store(true, Ordering::Release);
        }
    }
}

/// The tables a batch transaction writes.
struct Tables<'txn> {
    fences: Table<'txn, &'static str, u64>,
    objects: Table<'txn, (&'static str, &'static str), ObjectRow>,
    leases: Table<'txn, &'static str, LeaseRow>,
    resets: Table<'txn, u64, ResetRow>,
    raises: Table<'txn, (&'static str, u64), (&'static str, u64)>,
}

impl Tables<'_> {
    /// Sets `resource`'s fence to `token`, recording a raise (by `path`) if it rises.
    fn set_fence(&mut self, resource: &str, token: u64, path: &str) -> Result<(), redb::Error> {
        let previous = self.fences.insert(resource, token)?.map(|old| old.value());
        if previous.is_none_or(|previous| previous < token) {
            self.raises.insert((resource, token), (path, now_ms()))?;
            let kept: Vec<u64> = self
                .raises
                .range((resource, 0)..=(resource, u64::MAX))?
                .rev()
                .skip(RAISES_KEPT)
                .map(|entry| entry.map(|(key, _)| key.value().1))
                .collect::<Result<_, _>>()?;
            for old in kept {
                self.raises.remove((resource, old))?;
            }
        }
        Ok(())
    }
}

/// Applies the jobs in order in one write transaction, commits it, and only then
/// answers them: every job with its outcome, or every job with the same error.
/// Returns whether it committed.
fn commit_batch(db: &Database, batch: Vec<Job>) -> bool {
    let size = batch.len();
    let mut jobs = batch.into_iter();
    let mut applied = Vec::with_capacity(size);
    let (error, outcome_known) = match apply_batch(db, &mut jobs, &mut applied) {
        Ok(txn) => match txn.commit() {
            Ok(()) => {
                for job in applied {
                    job.answer(Ok(()));
                }
                return true;
            }
            // The commit may or may not have reached the disk.
            Err(error) => (redb::Error::from(error), None),
        },
        Err(error) => (error, Some(false)),
    };
    tracing::error!(%error, writes = size, "embedded store transaction failed");
    for job in applied {
        job.fail(storage_failed(outcome_known));
    }
    for job in jobs {
        job.fail(storage_failed(outcome_known));
    }
    false
}

/// The answer to every write of a batch whose transaction failed; `applied` as in
/// [`StoreError::Unavailable`].
fn storage_failed(applied: Option<bool>) -> StoreError {
    StoreError::Unavailable {
        reason: UnavailableReason::Storage,
        applied,
    }
}

/// Opens the batch transaction and applies jobs from `jobs` into `applied` until they
/// run out or one fails (that one is answered; the ones after it stay in `jobs`).
fn apply_batch(
    db: &Database,
    jobs: &mut impl Iterator<Item = Job>,
    applied: &mut Vec<Applied>,
) -> Result<redb::WriteTransaction, redb::Error> {
    let txn = db.begin_write()?;
    {
        let mut tables = Tables {
            fences: txn.open_table(FENCES)?,
            objects: txn.open_table(OBJECTS)?,
            leases: txn.open_table(LEASES)?,
            resets: txn.open_table(RESETS)?,
            raises: txn.open_table(RAISES)?,
        };
        for job in jobs {
            applied.push(job.apply(&mut tables)?);
        }
    }
    Ok(txn)
}

/// The highest token of `resource` if it is above `token`: the job is stale.
fn stale_against(
    tables: &Tables<'_>,
    resource: &ResourceName,
    token: Token,
) -> Result<Option<Token>, redb::Error> {
    let highest = tables
        .fences
        .get(resource.as_str())?
        .map(|entry| entry.value());
    Ok(highest
        .filter(|&h| h > token.get())
        .map(|h| Token::new(h).expect("stored tokens are valid")))
}

/// An advance inside the batch transaction.
fn apply_advance(
    tables: &mut Tables<'_>,
    resource: &ResourceName,
    token: Token,
) -> Result<AdvanceOutcome, redb::Error> {
    if let Some(highest) = stale_against(tables, resource, token)? {
        return Ok(AdvanceOutcome::Stale { highest });
    }
    tables.set_fence(resource.as_str(), token.get(), "advance")?;
    Ok(AdvanceOutcome::Applied)
}

/// A lease step inside the batch transaction, on the gateway's wall clock.
fn apply_lease(
    tables: &mut Tables<'_>,
    resource: &ResourceName,
    op: &LeaseOp,
    claimant: &Claimant,
) -> Result<LeaseOutcome, redb::Error> {
    let now = now_ms();
    let row = tables.leases.get(resource.as_str())?.map(|entry| {
        let (holder, identity, token, expires) = entry.value();
        (
            holder.map(str::to_owned),
            identity.map(str::to_owned),
            token,
            expires,
        )
    });
    let current = row.as_ref().map_or_else(Default::default, |(h, i, t, e)| {
        lease_record(h.as_deref(), i.as_deref(), *t, *e, now)
    });
    let token = row.as_ref().map_or(0, |row| row.2);
    let (holder, identity) = (Some(claimant.holder.as_str()), claimant.identity.as_deref());
    let written = match decide(op, claimant, &current) {
        Decision::RefuseHeld => return Ok(LeaseOutcome::Held(current)),
        Decision::RefuseLost => return Ok(LeaseOutcome::Lost(current)),
        Decision::Mint { ttl } => {
            let highest = tables
                .fences
                .get(resource.as_str())?
                .and_then(|entry| Token::new(entry.value()).ok());
            let Some(minted) = next_token(current.token, highest) else {
                return Ok(LeaseOutcome::Exhausted);
            };
            tables.set_fence(resource.as_str(), minted.get(), "lease")?;
            (
                holder,
                identity,
                minted.get(),
                now.saturating_add(millis(ttl)),
            )
        }
        Decision::Extend { ttl } => (holder, identity, token, now.saturating_add(millis(ttl))),
        // The identity stays: the last term's token remains bound to it.
        Decision::Free => (None, current.identity.as_deref(), token, 0),
    };
    tables.leases.insert(resource.as_str(), written)?;
    let after = lease_record(written.0, written.1, written.2, written.3, now);
    Ok(match op {
        LeaseOp::Release { .. } => LeaseOutcome::Released(after),
        _ => LeaseOutcome::Granted(after),
    })
}

fn millis(ttl: std::time::Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

/// A fence reset inside the batch transaction: checked against its floors, applied,
/// and recorded.
fn apply_reset(tables: &mut Tables<'_>, reset: &Reset) -> Result<ResetOutcome, redb::Error> {
    let resource = reset.resource.as_str();
    let highest = tables
        .fences
        .get(resource)?
        .and_then(|entry| Token::new(entry.value()).ok());
    let leased = tables
        .leases
        .get(resource)?
        .and_then(|entry| Token::new(entry.value().2).ok());
    // The token a reset goes past is the fence's: the one it declares forged. Every
    // other token the resource accepted, on any path, is a floor.
    let forged = highest.map_or(0, Token::get);
    let mut written = 0;
    for entry in tables.objects.range((resource, "")..)? {
        let (key, row) = entry?;
        if key.value().0 != resource {
            break;
        }
        let token = row.value().0;
        if token != forged {
            written = written.max(token);
        }
    }
    let mut raised = 0;
    for entry in tables.raises.range((resource, 0)..=(resource, u64::MAX))? {
        let token = entry?.0.value().1;
        if token != forged {
            raised = raised.max(token);
        }
    }
    let floors = [leased, Token::new(written).ok(), Token::new(raised).ok()];
    let from = match check_reset(reset, highest, &floors) {
        Ok(from) => from,
        Err(refused) => return Ok(refused),
    };
    tables.fences.insert(resource, reset.to.get())?;
    let retired: Vec<u64> = tables
        .raises
        .range((resource, reset.to.get() + 1)..=(resource, u64::MAX))?
        .map(|entry| entry.map(|(key, _)| key.value().1))
        .collect::<Result<_, _>>()?;
    for token in retired {
        tables.raises.remove((resource, token))?;
    }
    let generation = tables
        .resets
        .last()?
        .map_or(0, |(generation, _)| generation.value())
        + 1;
    tables.resets.insert(
        generation,
        (
            resource,
            from.get(),
            reset.to.get(),
            reset.identity.as_deref(),
            reset.reason.as_str(),
            now_ms(),
        ),
    )?;
    Ok(ResetOutcome::Applied { from, generation })
}

/// A write inside the batch transaction. Every check precedes every change, so a
/// rejected write changes nothing (invariant 4); the fence rises in the same
/// transaction as the object (invariant 1).
fn apply_write(tables: &mut Tables<'_>, write: &Write) -> Result<WriteOutcome, redb::Error> {
    if let Some(highest) = stale_against(tables, &write.resource, write.token)? {
        return Ok(WriteOutcome::Stale { highest });
    }
    let object_key = (write.resource.as_str(), write.key.as_str());
    let existing = tables.objects.get(object_key)?.map(|entry| {
        let (_, version, born, value) = entry.value();
        (version, born, value.is_some())
    });
    let (version, born, live) = existing.unwrap_or((0, 0, false));
    let current = live.then_some(version);
    if !precondition_holds(write.precondition, current) {
        return Ok(WriteOutcome::PreconditionFailed { current });
    }
    let token = write.token.get();
    tables.set_fence(write.resource.as_str(), token, "kv")?;
    Ok(match &write.op {
        WriteOp::Put(value) => {
            let new_version = version + 1;
            let born = if live { born } else { new_version };
            tables
                .objects
                .insert(object_key, (token, new_version, born, Some(value.as_ref())))?;
            WriteOutcome::Applied {
                version: new_version,
                created: !live,
            }
        }
        WriteOp::Delete if live => {
            tables
                .objects
                .insert(object_key, (token, version + 1, born, None))?;
            WriteOutcome::Applied {
                version: version + 1,
                created: false,
            }
        }
        // Nothing to delete: the fence is raised, the object stays as it is.
        WriteOp::Delete => WriteOutcome::Applied {
            version,
            created: false,
        },
    })
}

#[cfg(test)]
mod tests;
