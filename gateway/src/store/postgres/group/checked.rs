//! A group with conditional or keyed writes, in one transaction of the lane:
//!
//! 1. `BEGIN`, [`statements::GROUP_CLAIM`] (the keys, in byte order), then
//!    [`statements::GROUP_LOCK`] (the fences, in byte order) — the order a keyed
//!    transaction takes its locks in too, so the two never wait on each other in a
//!    cycle — one [`statements::TXN_APPLY`] per transaction of several operations, and
//!    one [`statements::GROUP_APPLY_CHECKED`] per run of writes without a repeated
//!    object, and [`statements::GROUP_TIDY`] (the placeholder fences no accepted write
//!    claimed, so that a refused write leaves none behind): one round trip.
//! 2. The gateway renders the answer of every keyed write that ran, from what its
//!    statement returned, with the write's own renderer (the bytes a retry gets), and
//!    sends [`statements::GROUP_ANSWER`] and `COMMIT` together: a second round trip.
//!    A group without keys commits in the first.
//!
//! A write refused in the group — stale, a failed precondition, a key already
//! answered — is answered (and a keyed one's answer stored) without undoing the
//! others: every check comes before the write it guards, in one statement. A key twice
//! in one group runs once; its repeats, and every conditional or keyed write of a group
//! that fails as a set (a lock or a claim it waited too long for, a statement the
//! server refused, a lost connection before the first answer), are answered
//! [`Settled::Alone`] and run each in a transaction of its own, off the lanes, which
//! finds the record of the first. The plain writes of a failed group are applied as a
//! plain group.

use std::collections::HashSet;

use deadpool_postgres::Object;
use fencegate_proto::headers::Precondition;
use tokio::time::Instant;

use super::apply::{
    apply_on, pipeline, runs_without_repeats, send_together, unknown_outcome, Pipelined,
};
use super::{answer_plain, Item, Lanes, Queued, Reply, Settled};
use crate::store::postgres::connection::{in_transaction, with_client_until};
use crate::store::postgres::errors::{classify, Sent};
use crate::store::postgres::statements;
use crate::store::postgres::writes::{applied, non_negative, token_from_db, Attempt};
use crate::store::txn::{
    found_answer, replay, Answered, Keyed, OpDone, StaleMember, StoredAnswer, Txn, TxnOp,
    TxnOutcome,
};
use crate::store::{StoreError, Write, WriteOp};

/// Applies `group` (sorted by resource), all before `deadline`, and answers each write.
pub(super) async fn apply_group(lanes: &Lanes, group: Vec<Queued>, deadline: Instant) {
    // A key that comes twice runs once, with its first write.
    let mut seen = HashSet::new();
    let (group, repeats): (Vec<Queued>, Vec<Queued>) = group.into_iter().partition(|queued| {
        queued
            .keyed
            .as_ref()
            .is_none_or(|keyed| seen.insert((keyed.identity.clone(), keyed.key.clone())))
    });
    let settled = with_client_until(&lanes.pool, deadline, async |client| {
        Ok(apply_checked(client, &group).await)
    })
    .await;
    match settled {
        Ok(Checked::Settled(settled)) => {
            for (queued, settled) in group.into_iter().zip(settled) {
                let _ = queued.reply.send(settled);
            }
        }
        Ok(Checked::NotAsASet) => {
            let (plain, alone): (Vec<Queued>, Vec<Queued>) =
                group.into_iter().partition(|queued| !queued.checked());
            for queued in alone {
                let _ = queued.reply.send(Ok(Settled::Alone));
            }
            if let Some(deadline) = plain.iter().map(|queued| queued.deadline).min() {
                let writes: Vec<&Write> = plain.iter().filter_map(Queued::write).collect();
                let answers = with_client_until(&lanes.pool, deadline, async |client| {
                    Ok(apply_on(client, &writes).await)
                })
                .await;
                answer_plain(lanes, plain, answers);
            }
        }
        Err(error) => {
            for queued in group {
                let _ = queued.reply.send(Err(error.clone()));
            }
        }
    }
    for queued in repeats {
        let _ = queued.reply.send(Ok(Settled::Alone));
    }
}

/// What a checked group came to.
pub(super) enum Checked {
    /// Committed, or failed where the outcome of every write is the one error: an
    /// answer per write, in order.
    Settled(Vec<Reply>),
    /// Rolled back before anything committed; see the module doc.
    NotAsASet,
}

/// One write's row of [`statements::GROUP_APPLY_CHECKED`].
struct Judged {
    ran: bool,
    stale: bool,
    fence: i64,
    current: Option<i64>,
    written: Option<(i64, i64)>,
    found: Option<Record>,
}

/// The idempotency record of a keyed item that did not run, as its statement returns it.
#[derive(Clone)]
struct Record {
    fingerprint: Vec<u8>,
    status: Option<i16>,
    headers: Option<String>,
    body: Option<Vec<u8>>,
}

impl Record {
    /// The record in `row`'s four columns from `at`, if there is one.
    fn at(row: &tokio_postgres::Row, at: usize) -> Option<Record> {
        Some(Record {
            fingerprint: row.get::<_, Option<Vec<u8>>>(at)?,
            status: row.get(at + 1),
            headers: row.get(at + 2),
            body: row.get(at + 3),
        })
    }
}

impl Judged {
    fn of(row: &tokio_postgres::Row) -> Judged {
        let written = match (row.get::<_, Option<i64>>(4), row.get::<_, Option<i64>>(5)) {
            (Some(version), Some(born)) => Some((version, born)),
            _ => None,
        };
        let found = Record::at(row, 6);
        Judged {
            ran: row.get(0),
            stale: row.get(1),
            fence: row.get(2),
            current: row.get(3),
            written,
            found,
        }
    }

    /// What the write came to, if it ran.
    fn attempt(&self, write: &Write) -> Result<Attempt, StoreError> {
        if self.stale {
            return Ok(Attempt::Stale);
        }
        match self.written {
            Some((version, born)) => applied(&write.op, version, born),
            None => Ok(Attempt::PreconditionFailed {
                current: self.current.map(non_negative).transpose()?,
            }),
        }
    }

    /// The outcome of a keyed write that ran, as its renderer takes it: a transaction of
    /// one operation.
    fn outcome(&self, write: &Write) -> Result<TxnOutcome, StoreError> {
        Ok(match self.attempt(write)? {
            Attempt::Applied { version, created } => TxnOutcome::Applied(vec![OpDone {
                version: Some(version),
                created,
            }]),
            Attempt::Stale => TxnOutcome::Stale(vec![StaleMember {
                resource: write.resource.clone(),
                presented: write.token,
                highest: token_from_db(self.fence)?,
            }]),
            Attempt::PreconditionFailed { current } => {
                TxnOutcome::PreconditionFailed { op: 0, current }
            }
        })
    }
}

/// The columns of one [`statements::GROUP_APPLY_CHECKED`].
struct CheckedRunParams<'a> {
    resources: Vec<&'a str>,
    tokens: Vec<i64>,
    keys: Vec<&'a str>,
    values: Vec<Option<&'a [u8]>>,
    expect: Vec<Option<i64>>,
    identities: Vec<Option<&'a str>>,
    idems: Vec<Option<&'a str>>,
}

impl<'a> CheckedRunParams<'a> {
    fn new(run: &[(&'a Write, Option<&'a Keyed>)]) -> CheckedRunParams<'a> {
        CheckedRunParams {
            resources: run.iter().map(|(w, _)| w.resource.as_str()).collect(),
            tokens: run.iter().map(|(w, _)| w.token.as_i64()).collect(),
            keys: run.iter().map(|(w, _)| w.key.as_str()).collect(),
            values: run
                .iter()
                .map(|(w, _)| match &w.op {
                    WriteOp::Put(value) => Some(value.as_ref()),
                    WriteOp::Delete => None,
                })
                .collect(),
            expect: run.iter().map(|(w, _)| expected(w.precondition)).collect(),
            identities: run
                .iter()
                .map(|(_, k)| k.map(|k| k.identity.as_str()))
                .collect(),
            idems: run.iter().map(|(_, k)| k.map(|k| k.key.as_str())).collect(),
        }
    }
}

/// The columns of one [`statements::TXN_APPLY`].
struct TxnParams<'a> {
    kinds: Vec<i16>,
    resources: Vec<&'a str>,
    keys: Vec<Option<&'a str>>,
    tokens: Vec<i64>,
    values: Vec<Option<&'a [u8]>>,
    expect: Vec<Option<i64>>,
    identity: Option<&'a str>,
    idem: Option<&'a str>,
}

impl<'a> TxnParams<'a> {
    fn new(txn: &'a Txn, keyed: Option<&'a Keyed>) -> TxnParams<'a> {
        let ops = txn.ops();
        TxnParams {
            kinds: ops
                .iter()
                .map(|op| match op {
                    TxnOp::Put { .. } => 0,
                    TxnOp::Delete { .. } => 1,
                    TxnOp::Advance { .. } => 2,
                    TxnOp::Check { .. } => 3,
                })
                .collect(),
            resources: ops.iter().map(|op| op.resource().as_str()).collect(),
            keys: ops
                .iter()
                .map(|op| op.object().map(|(key, _)| key.as_str()))
                .collect(),
            tokens: ops.iter().map(|op| op.token().as_i64()).collect(),
            values: ops
                .iter()
                .map(|op| match op {
                    TxnOp::Put { value, .. } => Some(value.as_ref()),
                    _ => None,
                })
                .collect(),
            expect: ops
                .iter()
                .map(|op| {
                    op.object()
                        .and_then(|(_, precondition)| expected(precondition))
                })
                .collect(),
            identity: keyed.map(|k| k.identity.as_str()),
            idem: keyed.map(|k| k.key.as_str()),
        }
    }
}

/// A precondition as [`statements::GROUP_APPLY_CHECKED`] takes it.
fn expected(precondition: Precondition) -> Option<i64> {
    match precondition {
        Precondition::None => None,
        Precondition::MustNotExist => Some(0),
        Precondition::MustExist => Some(-1),
        Precondition::Version(version) => Some(i64::try_from(version).unwrap_or(i64::MAX)),
    }
}

/// The group's statements on `client`; see the module doc.
pub(super) async fn apply_checked(client: &Object, group: &[Queued]) -> Checked {
    // Until its COMMIT, a deadline rolls the group back: nothing applied. So too while
    // its statements are prepared, which applies nothing either.
    in_transaction();
    let prepared = tokio::try_join!(
        client.prepare_cached(statements::GROUP_CLAIM),
        client.prepare_cached(statements::GROUP_LOCK),
        client.prepare_cached(statements::GROUP_APPLY_CHECKED),
        client.prepare_cached(statements::GROUP_ANSWER),
        client.prepare_cached(statements::TXN_APPLY),
        client.prepare_cached(statements::GROUP_TIDY),
    );
    let (claim, lock, apply, answer, txn_apply, tidy) = match prepared {
        Ok(prepared) => prepared,
        Err(error) => return everyone(group, classify(error, Sent::NoCommit)),
    };
    // The claims, in byte order of (identity, key).
    let mut claims: Vec<&Keyed> = group.iter().filter_map(|q| q.keyed.as_deref()).collect();
    claims.sort_by(|a, b| (&a.identity, &a.key).cmp(&(&b.identity, &b.key)));
    let claim_columns = (
        claims
            .iter()
            .map(|k| k.identity.as_str())
            .collect::<Vec<_>>(),
        claims.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(),
        claims
            .iter()
            .map(|k| k.fingerprint.as_slice())
            .collect::<Vec<_>>(),
        claims
            .iter()
            .map(|k| i64::try_from(k.ttl_ms()).unwrap_or(i64::MAX))
            .collect::<Vec<_>>(),
    );
    // Every fence the group involves, in byte order: the locks are taken in this order.
    let mut resources: Vec<&str> = group
        .iter()
        .flat_map(|q| match &q.item {
            Item::Write(write) => vec![write.resource.as_str()],
            Item::Txn(txn) => txn.involved().iter().map(|i| i.resource.as_str()).collect(),
        })
        .collect();
    resources.sort_unstable();
    resources.dedup();
    // Its transactions (first in the group), then runs of its writes: consecutive
    // writes, no object twice in one.
    let txns: Vec<TxnParams<'_>> = group
        .iter()
        .filter_map(|q| match &q.item {
            Item::Txn(txn) => Some(TxnParams::new(txn, q.keyed.as_deref())),
            Item::Write(_) => None,
        })
        .collect();
    let writes: Vec<&Write> = group.iter().filter_map(Queued::write).collect();
    let items: Vec<(&Write, Option<&Keyed>)> = group
        .iter()
        .filter_map(|q| Some((q.write()?, q.keyed.as_deref())))
        .collect();
    let mut runs = Vec::new();
    let mut at = 0;
    for run in runs_without_repeats(&writes) {
        runs.push(CheckedRunParams::new(&items[at..at + run.len()]));
        at += run.len();
    }

    let mut steps: Vec<Pipelined<'_, Vec<tokio_postgres::Row>>> = Vec::new();
    let (claim, lock, apply) = (&claim, &lock, &apply);
    if !claims.is_empty() {
        let columns = &claim_columns;
        steps.push(Box::pin(async move {
            client
                .query(claim, &[&columns.0, &columns.1, &columns.2, &columns.3])
                .await
        }));
    }
    let resources = &resources;
    steps.push(Box::pin(
        async move { client.query(lock, &[resources]).await },
    ));
    let txn_apply = &txn_apply;
    for txn in &txns {
        steps.push(Box::pin(async move {
            client
                .query(
                    txn_apply,
                    &[
                        &txn.kinds,
                        &txn.resources,
                        &txn.keys,
                        &txn.tokens,
                        &txn.values,
                        &txn.expect,
                        &txn.identity,
                        &txn.idem,
                    ],
                )
                .await
        }));
    }
    for run in &runs {
        steps.push(Box::pin(async move {
            client
                .query(
                    apply,
                    &[
                        &run.resources,
                        &run.tokens,
                        &run.keys,
                        &run.values,
                        &run.expect,
                        &run.identities,
                        &run.idems,
                    ],
                )
                .await
        }));
    }
    let applied_at = steps.len() - runs.len() - txns.len();
    // The placeholders no write claimed, gone before the commit.
    let tidy = &tidy;
    steps.push(Box::pin(
        async move { client.query(tidy, &[resources]).await },
    ));
    let keyed = !claims.is_empty();
    let (begun, results) = if keyed {
        send_together(client.batch_execute("BEGIN"), steps).await
    } else {
        // Nothing to store: the first round trip commits.
        let (begun, results, committed) = pipeline(
            client.batch_execute("BEGIN"),
            steps,
            client.batch_execute("COMMIT"),
        )
        .await;
        if let Err(error) = begun {
            return everyone(group, unknown_outcome(error));
        }
        if let Some(settled) = refused(group, &results, Sent::Commit) {
            return settled;
        }
        if let Err(error) = committed {
            return everyone(group, classify(error, Sent::Commit));
        }
        (Ok(()), results)
    };
    if let Err(error) = begun {
        return everyone(group, unknown_outcome(error));
    }
    if keyed {
        if let Some(settled) = refused(group, &results, Sent::NoCommit) {
            let _ = client.batch_execute("ROLLBACK").await;
            return settled;
        }
    }
    // Every statement answered: the transactions' rows, a statement each, then the
    // writes', a row each.
    let mut results = results.into_iter().skip(applied_at);
    let mut txn_rows = Vec::with_capacity(txns.len());
    for result in results.by_ref().take(txns.len()) {
        match result {
            Ok(rows) => txn_rows.push(rows),
            Err(error) => return everyone(group, classify(error, Sent::Commit)),
        }
    }
    let mut judged = Vec::with_capacity(writes.len());
    for result in results.by_ref().take(runs.len()) {
        match result {
            Ok(rows) => judged.extend(rows.iter().map(Judged::of)),
            Err(error) => return everyone(group, classify(error, Sent::Commit)),
        }
    }
    if let Some(Err(error)) = results.next() {
        return everyone(group, classify(error, Sent::Commit));
    }
    if judged.len() != writes.len() {
        return everyone(
            group,
            StoreError::Internal(format!(
                "a checked group answered {} rows for {} writes",
                judged.len(),
                writes.len()
            )),
        );
    }
    let mut settled: Vec<Reply> = Vec::with_capacity(group.len());
    let mut answers = AnswersToStore::default();
    let (mut txn_rows, mut judged) = (txn_rows.into_iter(), judged.iter());
    for queued in group {
        settled.push(match &queued.item {
            Item::Txn(txn) => {
                let rows = txn_rows.next().expect("a statement per transaction");
                settle_txn(txn, queued.keyed.as_deref(), &rows, &mut answers)
            }
            Item::Write(write) => {
                let judged = judged.next().expect("a row per write");
                settle(write, queued.keyed.as_deref(), judged, &mut answers)
            }
        });
    }
    if !keyed {
        return Checked::Settled(settled);
    }
    // The answers of the keyed writes that ran, stored with the commit.
    let (stored, _, committed) = pipeline(
        client.execute(
            &answer,
            &[
                &answers.identities,
                &answers.keys,
                &answers.statuses,
                &answers.headers,
                &answers.bodies,
            ],
        ),
        Vec::<Pipelined<'_, ()>>::new(),
        client.batch_execute("COMMIT"),
    )
    .await;
    match (stored, committed) {
        (Ok(_), Ok(())) => Checked::Settled(settled),
        // The answers statement was refused: the COMMIT rolled back.
        (Err(error), Ok(())) if error.code().is_some() => Checked::NotAsASet,
        (_, Err(error)) | (Err(error), _) => everyone(group, classify(error, Sent::Commit)),
    }
}

/// The answers to store, as [`statements::GROUP_ANSWER`] takes them.
#[derive(Default)]
struct AnswersToStore<'a> {
    identities: Vec<&'a str>,
    keys: Vec<&'a str>,
    statuses: Vec<i16>,
    headers: Vec<String>,
    bodies: Vec<Vec<u8>>,
}

/// One write's answer from its row; a keyed write that ran has its answer rendered and
/// added to `answers`.
fn settle<'a>(
    write: &Write,
    keyed: Option<&'a Keyed>,
    judged: &Judged,
    answers: &mut AnswersToStore<'a>,
) -> Reply {
    let Some(keyed) = keyed else {
        return judged.attempt(write).map(Settled::Attempt);
    };
    match &judged.found {
        Some(found) if !judged.ran => replayed(keyed, found.clone()),
        _ => ran(keyed, judged.outcome(write)?, answers),
    }
}

/// A transaction's answer from its rows (one per operation); a keyed one that ran has
/// its answer rendered and added to `answers`.
fn settle_txn<'a>(
    txn: &Txn,
    keyed: Option<&'a Keyed>,
    rows: &[tokio_postgres::Row],
    answers: &mut AnswersToStore<'a>,
) -> Reply {
    let Some(first) = rows.first() else {
        return Err(StoreError::Internal("a transaction answered no row".into()));
    };
    let (runs, applies): (bool, bool) = (first.get(0), first.get(1));
    if let (Some(keyed), false) = (keyed, runs) {
        return match Record::at(first, 8) {
            Some(found) => replayed(keyed, found),
            None => Err(StoreError::Internal(
                "a keyed transaction that did not run has no record".into(),
            )),
        };
    }
    let outcome = txn_outcome(txn, rows, applies)?;
    match keyed {
        Some(keyed) => ran(keyed, outcome, answers),
        None => Ok(Settled::Answered(Answered::Ran {
            outcome,
            stored: None,
        })),
    }
}

/// What a transaction came to, from its rows: stale (every stale resource, in lock
/// order), a failed precondition (the first, in operation order), or applied.
fn txn_outcome(
    txn: &Txn,
    rows: &[tokio_postgres::Row],
    applies: bool,
) -> Result<TxnOutcome, StoreError> {
    let ops = txn.ops();
    if rows.len() != ops.len() {
        return Err(StoreError::Internal(format!(
            "a transaction of {} operations answered {} rows",
            ops.len(),
            rows.len()
        )));
    }
    let mut stale = Vec::new();
    for involved in txn.involved() {
        let Some(row) = ops
            .iter()
            .position(|op| op.resource() == &involved.resource)
            .map(|at| &rows[at])
        else {
            continue;
        };
        if row.get::<_, bool>(3) {
            stale.push(StaleMember {
                resource: involved.resource.clone(),
                presented: involved.token,
                highest: token_from_db(row.get(2))?,
            });
        }
    }
    if !stale.is_empty() {
        return Ok(TxnOutcome::Stale(stale));
    }
    if !applies {
        let Some(at) = rows.iter().position(|row| !row.get::<_, bool>(4)) else {
            return Err(StoreError::Internal(
                "a transaction was refused for no reason".into(),
            ));
        };
        let current: Option<i64> = rows[at].get(5);
        return Ok(TxnOutcome::PreconditionFailed {
            op: at,
            current: current.map(non_negative).transpose()?,
        });
    }
    let mut done = Vec::with_capacity(ops.len());
    for (op, row) in ops.iter().zip(rows) {
        let written: (Option<i64>, Option<i64>) = (row.get(6), row.get(7));
        let current: Option<i64> = row.get(5);
        done.push(match (op, written) {
            (TxnOp::Put { value, .. }, (Some(version), Some(born))) => {
                op_done(applied(&WriteOp::Put(value.clone()), version, born)?)
            }
            (TxnOp::Delete { .. }, (Some(version), Some(born))) => {
                op_done(applied(&WriteOp::Delete, version, born)?)
            }
            (TxnOp::Check { object, .. }, _) => OpDone {
                version: match object {
                    Some(_) => Some(current.map(non_negative).transpose()?.unwrap_or(0)),
                    None => None,
                },
                created: false,
            },
            (TxnOp::Advance { .. }, _) => OpDone {
                version: None,
                created: false,
            },
            _ => {
                return Err(StoreError::Internal(
                    "an applied transaction did not write its object".into(),
                ))
            }
        });
    }
    Ok(TxnOutcome::Applied(done))
}

/// An applied operation's part of a transaction's answer.
fn op_done(attempt: Attempt) -> OpDone {
    match attempt {
        Attempt::Applied { version, created } => OpDone {
            version: Some(version),
            created,
        },
        Attempt::Stale | Attempt::PreconditionFailed { .. } => OpDone {
            version: None,
            created: false,
        },
    }
}

/// The answer of a keyed item that did not run: its record's, replayed if the request
/// is the same.
fn replayed(keyed: &Keyed, record: Record) -> Reply {
    let answer = found_answer(
        record.status.and_then(|s| u16::try_from(s).ok()),
        record.headers.as_deref().unwrap_or_default(),
        record.body.unwrap_or_default().into(),
    )?;
    Ok(Settled::Answered(replay(
        &record.fingerprint,
        keyed,
        answer,
    )))
}

/// The answer of a keyed item that ran: rendered from `outcome`, and added to
/// `answers` to be stored with the commit.
fn ran<'a>(keyed: &'a Keyed, outcome: TxnOutcome, answers: &mut AnswersToStore<'a>) -> Reply {
    let answer: StoredAnswer = (keyed.render)(&outcome);
    let status = i16::try_from(answer.status)
        .map_err(|_| StoreError::Internal(format!("status {} out of range", answer.status)))?;
    answers.identities.push(&keyed.identity);
    answers.keys.push(&keyed.key);
    answers.statuses.push(status);
    answers.headers.push(answer.headers_text());
    answers.bodies.push(answer.body.to_vec());
    Ok(Settled::Answered(Answered::Ran {
        outcome,
        stored: Some(answer),
    }))
}

/// If a statement of the first round trip failed: the group did not apply as a set
/// (`NotAsASet`: the server refused a statement, so the transaction — and a COMMIT sent
/// with it — rolled back), or the connection broke, the one error every write gets:
/// unknown whether it applied if a COMMIT was `sent` with it, else not applied.
fn refused(
    group: &[Queued],
    results: &[Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>],
    sent: Sent,
) -> Option<Checked> {
    let error = results.iter().find_map(|result| result.as_ref().err())?;
    if error.code().is_some() {
        return Some(Checked::NotAsASet);
    }
    Some(everyone(
        group,
        StoreError::Unavailable {
            reason: crate::store::UnavailableReason::ConnectionLost,
            applied: sent.applied_if_lost(),
        },
    ))
}

/// `error` for every write of `group`.
fn everyone(group: &[Queued], error: StoreError) -> Checked {
    Checked::Settled(group.iter().map(|_| Err(error.clone())).collect())
}
