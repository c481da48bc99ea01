//! The writer thread of the embedded store: jobs applied in batches, one write
//! transaction and one fsync per batch, each job answered only after its batch commits.

use std::sync::atomic::{AtomicBool, Ordering};

use fencegate_proto::{ObjectKey, ResourceName, Token};
use redb::{Database, ReadableTable, Table};
use tokio::sync::{mpsc, oneshot};

use crate::store::embedded::{
    lease_record, now_ms, IdempotencyRow, LeaseRow, ObjectRow, ResetRow, FENCES, IDEMPOTENCY,
    IDEMPOTENCY_EXPIRY, IDEMPOTENCY_USAGE, LEASES, OBJECTS, RAISES, RAISES_KEPT, RAISE_FLOORS,
    RESETS,
};
use crate::store::leases::{
    check_reset, decide, next_token, Claimant, Decision, Epoch, LeaseOp, LeaseOutcome, Reset,
    ResetOutcome,
};
use crate::store::txn::{
    record_bytes, replay, Answered, Hold, Keyed, OpDone, StaleMember, StoredAnswer, Txn, TxnOp,
    TxnOutcome,
};
use crate::store::{
    precondition_holds, AdvanceOutcome, StoreError, UnavailableReason, Write, WriteOp, WriteOutcome,
};

/// Where a job's answer goes.
pub(super) type Responder<T> = oneshot::Sender<Result<T, StoreError>>;

/// A request queued for the writer thread, with the channel its answer goes back on.
pub(super) enum Job {
    Write {
        write: Write,
        reply: Responder<WriteOutcome>,
    },
    Advance {
        resource: ResourceName,
        token: Token,
        reply: Responder<AdvanceOutcome>,
    },
    Lease {
        resource: ResourceName,
        op: LeaseOp,
        claimant: Claimant,
        keyed: Option<Keyed<LeaseOutcome>>,
        reply: Responder<Answered<LeaseOutcome>>,
    },
    Reset {
        reset: Reset,
        reply: Responder<ResetOutcome>,
    },
    Txn {
        txn: Txn,
        keyed: Option<Keyed>,
        reply: Responder<Answered>,
    },
    /// Removes up to `limit` expired idempotency records.
    Expire { limit: u32, reply: Responder<u64> },
}

/// A job applied inside the batch transaction, waiting for the commit to answer it.
enum AwaitingCommit {
    Write(Responder<WriteOutcome>, WriteOutcome),
    Advance(Responder<AdvanceOutcome>, AdvanceOutcome),
    Lease(Responder<Answered<LeaseOutcome>>, Answered<LeaseOutcome>),
    Reset(Responder<ResetOutcome>, ResetOutcome),
    Txn(Responder<Answered>, Answered),
    Expire(Responder<u64>, u64),
}

impl Job {
    /// Applies the job inside the batch transaction. If storage fails, the job is
    /// answered at once (nothing of the batch will commit) and the error returned.
    fn apply(self, tables: &mut Tables<'_>) -> Result<AwaitingCommit, redb::Error> {
        match self {
            Job::Write { write, reply } => match apply_write(tables, &write) {
                Ok(outcome) => Ok(AwaitingCommit::Write(reply, outcome)),
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
                Ok(outcome) => Ok(AwaitingCommit::Advance(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Lease {
                resource,
                op,
                claimant,
                keyed,
                reply,
            } => match apply_keyed_lease(tables, &resource, &op, &claimant, keyed.as_ref()) {
                Ok(outcome) => Ok(AwaitingCommit::Lease(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Reset { reset, reply } => match apply_reset(tables, &reset) {
                Ok(outcome) => Ok(AwaitingCommit::Reset(reply, outcome)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Txn { txn, keyed, reply } => match apply_keyed(tables, &txn, keyed.as_ref()) {
                Ok(answered) => Ok(AwaitingCommit::Txn(reply, answered)),
                Err(error) => {
                    drop(reply.send(Err(storage_failed(Some(false)))));
                    Err(error)
                }
            },
            Job::Expire { limit, reply } => match expire(tables, limit) {
                Ok(removed) => Ok(AwaitingCommit::Expire(reply, removed)),
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
            Job::Txn { reply, .. } => drop(reply.send(Err(error))),
            Job::Expire { reply, .. } => drop(reply.send(Err(error))),
        }
    }
}

impl AwaitingCommit {
    /// Answers the job with its outcome if the batch committed, or with `error`.
    fn answer(self, committed: Result<(), StoreError>) {
        match self {
            AwaitingCommit::Write(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            AwaitingCommit::Advance(reply, outcome) => {
                drop(reply.send(committed.map(|()| outcome)))
            }
            AwaitingCommit::Lease(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            AwaitingCommit::Reset(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            AwaitingCommit::Txn(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
            AwaitingCommit::Expire(reply, outcome) => drop(reply.send(committed.map(|()| outcome))),
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
    raise_floors: Table<'txn, &'static str, u64>,
    idempotency: Table<'txn, (&'static str, &'static str), IdempotencyRow>,
    idempotency_expiry: Table<'txn, (u64, &'static str, &'static str), ()>,
    idempotency_usage: Table<'txn, &'static str, (u64, u64)>,
}

impl Tables<'_> {
    /// Sets `resource`'s fence to `token`, recording a raise (by `path`) if it rises;
    /// the highest raise the log lets go of becomes the resource's floor.
    fn set_fence(&mut self, resource: &str, token: u64, path: &str) -> Result<(), redb::Error> {
        let previous = self.fences.insert(resource, token)?.map(|old| old.value());
        if previous.is_none_or(|previous| previous < token) {
            self.raises.insert((resource, token), (path, now_ms()))?;
            let evicted: Vec<u64> = self
                .raises
                .range((resource, 0)..=(resource, u64::MAX))?
                .rev()
                .skip(RAISES_KEPT)
                .map(|entry| entry.map(|(key, _)| key.value().1))
                .collect::<Result<_, _>>()?;
            if let Some(&highest) = evicted.first() {
                let floor = self.raise_floors.get(resource)?.map_or(0, |f| f.value());
                self.raise_floors.insert(resource, floor.max(highest))?;
            }
            for old in evicted {
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
    applied: &mut Vec<AwaitingCommit>,
) -> Result<redb::WriteTransaction, redb::Error> {
    let txn = db.begin_write()?;
    {
        let mut tables = Tables {
            fences: txn.open_table(FENCES)?,
            objects: txn.open_table(OBJECTS)?,
            leases: txn.open_table(LEASES)?,
            resets: txn.open_table(RESETS)?,
            raises: txn.open_table(RAISES)?,
            raise_floors: txn.open_table(RAISE_FLOORS)?,
            idempotency: txn.open_table(IDEMPOTENCY)?,
            idempotency_expiry: txn.open_table(IDEMPOTENCY_EXPIRY)?,
            idempotency_usage: txn.open_table(IDEMPOTENCY_USAGE)?,
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

/// A lease step inside the batch transaction, with its key: the answer an earlier
/// attempt stored, or the step applied now and its answer stored with it.
fn apply_keyed_lease(
    tables: &mut Tables<'_>,
    resource: &ResourceName,
    op: &LeaseOp,
    claimant: &Claimant,
    keyed: Option<&Keyed<LeaseOutcome>>,
) -> Result<Answered<LeaseOutcome>, redb::Error> {
    if let Some(keyed) = keyed {
        if let Some(earlier) = tables.earlier_answer(keyed)? {
            return Ok(earlier);
        }
    }
    let outcome = apply_lease(tables, resource, op, claimant)?;
    let stored = keyed
        .map(|keyed| tables.record_answer(keyed, &outcome))
        .transpose()?;
    Ok(Answered::Ran { outcome, stored })
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
            let Some(minted) = next_token(current.token, highest, Epoch::default()) else {
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
    // other token the resource accepted, on any path, is a floor — but the tokens
    // earlier resets declared forged, which objects may still carry.
    let forged = highest.map_or(0, Token::get);
    let mut declared = vec![forged];
    for entry in tables.resets.iter()? {
        let (_, row) = entry?;
        let (reset_resource, from, ..) = row.value();
        if reset_resource == resource {
            declared.push(from);
        }
    }
    let mut written = 0;
    for entry in tables.objects.range((resource, "")..)? {
        let (key, row) = entry?;
        if key.value().0 != resource {
            break;
        }
        let token = row.value().0;
        if !declared.contains(&token) {
            written = written.max(token);
        }
    }
    let mut raised = tables.raise_floors.get(resource)?.map_or(0, |f| f.value());
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
    let current = live_version(tables, &write.resource, write.key.as_str())?;
    if !precondition_holds(write.precondition, current) {
        return Ok(WriteOutcome::PreconditionFailed { current });
    }
    tables.set_fence(write.resource.as_str(), write.token.get(), "kv")?;
    let done = write_object(tables, &write.resource, &write.key, write.token, &write.op)?;
    Ok(WriteOutcome::Applied {
        version: done.version.unwrap_or_default(),
        created: done.created,
    })
}

/// The version of a live object; `None` if it does not exist or was deleted.
fn live_version(
    tables: &Tables<'_>,
    resource: &ResourceName,
    key: &str,
) -> Result<Option<u64>, redb::Error> {
    Ok(tables
        .objects
        .get((resource.as_str(), key))?
        .and_then(|entry| {
            let (_, version, _, value) = entry.value();
            value.is_some().then_some(version)
        }))
}

/// Writes an object, once its fence is checked and raised: a put writes (or revives)
/// it, a delete leaves a tombstone; a delete of nothing changes nothing.
fn write_object(
    tables: &mut Tables<'_>,
    resource: &ResourceName,
    key: &ObjectKey,
    token: Token,
    op: &WriteOp,
) -> Result<OpDone, redb::Error> {
    let object_key = (resource.as_str(), key.as_str());
    let existing = tables.objects.get(object_key)?.map(|entry| {
        let (_, version, born, value) = entry.value();
        (version, born, value.is_some())
    });
    let (version, born, live) = existing.unwrap_or((0, 0, false));
    let token = token.get();
    Ok(match op {
        WriteOp::Put(value) => {
            let new_version = version + 1;
            let born = if live { born } else { new_version };
            tables
                .objects
                .insert(object_key, (token, new_version, born, Some(value.as_ref())))?;
            OpDone {
                version: Some(new_version),
                created: !live,
            }
        }
        WriteOp::Delete if live => {
            tables
                .objects
                .insert(object_key, (token, version + 1, born, None))?;
            OpDone {
                version: Some(version + 1),
                created: false,
            }
        }
        // Nothing to delete: the object stays as it is.
        WriteOp::Delete => OpDone {
            version: Some(version),
            created: false,
        },
    })
}

/// A transaction inside the batch transaction, with its key: the answer an earlier
/// attempt stored, or the transaction applied now and its answer stored with it.
fn apply_keyed(
    tables: &mut Tables<'_>,
    txn: &Txn,
    keyed: Option<&Keyed>,
) -> Result<Answered, redb::Error> {
    let Some(keyed) = keyed else {
        return Ok(Answered::Ran {
            outcome: apply_txn(tables, txn)?,
            stored: None,
        });
    };
    if let Some(earlier) = tables.earlier_answer(keyed)? {
        return Ok(earlier);
    }
    let outcome = apply_txn(tables, txn)?;
    let answer = tables.record_answer(keyed, &outcome)?;
    Ok(Answered::Ran {
        outcome,
        stored: Some(answer),
    })
}

impl Tables<'_> {
    /// The answer an earlier attempt stored under `keyed`'s key, if it is still live;
    /// an expired one is forgotten.
    fn earlier_answer<O>(&mut self, keyed: &Keyed<O>) -> Result<Option<Answered<O>>, redb::Error> {
        let id = (keyed.identity.as_str(), keyed.key.as_str());
        let earlier = self.idempotency.get(id)?.map(|entry| {
            let (fingerprint, expires, status, headers, body) = entry.value();
            let answer = StoredAnswer {
                status,
                headers: StoredAnswer::parse_headers(headers),
                body: bytes::Bytes::copy_from_slice(body),
            };
            (fingerprint.to_vec(), expires, answer)
        });
        let Some((fingerprint, expires, answer)) = earlier else {
            return Ok(None);
        };
        if expires > now_ms() {
            return Ok(Some(replay(&fingerprint, keyed, answer)));
        }
        self.remove_answer(expires, id.0, id.1)?;
        Ok(None)
    }

    /// Removes the record of (`identity`, `key`), which expires at `expires`, and takes
    /// it off its identity's usage.
    fn remove_answer(
        &mut self,
        expires: u64,
        identity: &str,
        key: &str,
    ) -> Result<(), redb::Error> {
        self.idempotency_expiry.remove((expires, identity, key))?;
        let removed = self.idempotency.remove((identity, key))?.map(|entry| {
            let (_, _, status, headers, body) = entry.value();
            let answer = StoredAnswer {
                status,
                headers: StoredAnswer::parse_headers(headers),
                body: bytes::Bytes::copy_from_slice(body),
            };
            record_bytes(identity, key, &answer)
        });
        if let Some(bytes) = removed {
            self.count_usage(identity, -1, -(bytes as i128))?;
        }
        Ok(())
    }

    /// Changes `identity`'s usage by `records` and `bytes`, never below zero.
    fn count_usage(
        &mut self,
        identity: &str,
        records: i64,
        bytes: i128,
    ) -> Result<(), redb::Error> {
        let (had_records, had_bytes) = self
            .idempotency_usage
            .get(identity)?
            .map_or((0, 0), |entry| entry.value());
        let records = (i128::from(had_records) + i128::from(records)).max(0) as u64;
        let bytes = (i128::from(had_bytes) + bytes).max(0) as u64;
        if records == 0 && bytes == 0 {
            self.idempotency_usage.remove(identity)?;
        } else {
            self.idempotency_usage.insert(identity, (records, bytes))?;
        }
        Ok(())
    }

    /// Stores the answer to `outcome` under `keyed`'s key, in the batch transaction.
    fn record_answer<O>(
        &mut self,
        keyed: &Keyed<O>,
        outcome: &O,
    ) -> Result<StoredAnswer, redb::Error> {
        let id = (keyed.identity.as_str(), keyed.key.as_str());
        let answer = (keyed.render)(outcome);
        let expires = now_ms().saturating_add(keyed.ttl_ms());
        let headers = answer.headers_text();
        self.idempotency.insert(
            id,
            (
                keyed.fingerprint.as_slice(),
                expires,
                answer.status,
                headers.as_str(),
                answer.body.as_ref(),
            ),
        )?;
        self.idempotency_expiry.insert((expires, id.0, id.1), ())?;
        let bytes = record_bytes(id.0, id.1, &answer);
        self.count_usage(id.0, 1, i128::from(bytes))?;
        Ok(answer)
    }
}

/// A transaction inside the batch transaction: every fence and every precondition is
/// checked before the first change, so a refused transaction changes nothing.
fn apply_txn(tables: &mut Tables<'_>, txn: &Txn) -> Result<TxnOutcome, redb::Error> {
    let mut stale = Vec::new();
    for involved in txn.involved() {
        if let Some(highest) = stale_against(tables, &involved.resource, involved.token)? {
            stale.push(StaleMember {
                resource: involved.resource.clone(),
                presented: involved.token,
                highest,
            });
        }
    }
    if !stale.is_empty() {
        return Ok(TxnOutcome::Stale(stale));
    }
    let mut found = Vec::with_capacity(txn.ops().len());
    for (at, op) in txn.ops().iter().enumerate() {
        let current = match op.object() {
            Some((key, precondition)) => {
                let current = live_version(tables, op.resource(), key.as_str())?;
                if !precondition_holds(precondition, current) {
                    return Ok(TxnOutcome::PreconditionFailed { op: at, current });
                }
                current
            }
            None => None,
        };
        found.push(current);
    }
    for involved in txn.involved() {
        if involved.hold == Hold::Raise {
            tables.set_fence(involved.resource.as_str(), involved.token.get(), "txn")?;
        }
    }
    let mut done = Vec::with_capacity(txn.ops().len());
    for (op, current) in txn.ops().iter().zip(found) {
        done.push(match op {
            TxnOp::Put {
                resource,
                key,
                token,
                value,
                ..
            } => write_object(tables, resource, key, *token, &WriteOp::Put(value.clone()))?,
            TxnOp::Delete {
                resource,
                key,
                token,
                ..
            } => write_object(tables, resource, key, *token, &WriteOp::Delete)?,
            TxnOp::Advance { .. } => OpDone {
                version: None,
                created: false,
            },
            TxnOp::Check { object, .. } => OpDone {
                version: object.as_ref().map(|_| current.unwrap_or(0)),
                created: false,
            },
        });
    }
    Ok(TxnOutcome::Applied(done))
}

/// Removes up to `limit` idempotency records whose time ran out.
fn expire(tables: &mut Tables<'_>, limit: u32) -> Result<u64, redb::Error> {
    let now = now_ms();
    let due: Vec<(u64, String, String)> = tables
        .idempotency_expiry
        .range(..(now, "", ""))?
        .take(limit as usize)
        .map(|entry| {
            entry.map(|(key, _)| {
                let (expires, identity, key) = key.value();
                (expires, identity.to_owned(), key.to_owned())
            })
        })
        .collect::<Result<_, _>>()?;
    for (expires, identity, key) in &due {
        tables.remove_answer(*expires, identity, key)?;
    }
    Ok(due.len() as u64)
}

#[cfg(test)]
mod tests;
