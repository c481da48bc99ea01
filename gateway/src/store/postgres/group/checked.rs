//! A group with conditional or keyed writes, in one transaction of the lane:
//!
//! 1. `BEGIN`, [`statements::GROUP_CLAIM`] (the keys, in byte order), then
//!    [`statements::GROUP_LOCK`] (the fences, in byte order) — the order a keyed
//!    transaction takes its locks in too, so the two never wait on each other in a
//!    cycle — and one [`statements::GROUP_APPLY_CHECKED`] per run of writes without a
//!    repeated object: one round trip.
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
use super::{answer_plain, Lanes, Queued, Reply, Settled};
use crate::store::postgres::connection::{in_transaction, with_client_until};
use crate::store::postgres::errors::classify;
use crate::store::postgres::statements;
use crate::store::postgres::writes::{applied, non_negative, token_from_db, Attempt};
use crate::store::txn::{
    found_answer, replay, Answered, Keyed, OpDone, StaleMember, StoredAnswer, TxnOutcome,
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
                let writes: Vec<&Write> = plain.iter().map(|queued| &queued.write).collect();
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
    found: Option<(Vec<u8>, Option<i16>, Option<String>, Option<Vec<u8>>)>,
}

impl Judged {
    fn of(row: &tokio_postgres::Row) -> Judged {
        let written = match (row.get::<_, Option<i64>>(4), row.get::<_, Option<i64>>(5)) {
            (Some(version), Some(born)) => Some((version, born)),
            _ => None,
        };
        let found = row
            .get::<_, Option<Vec<u8>>>(6)
            .map(|fingerprint| (fingerprint, row.get(7), row.get(8), row.get(9)));
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
struct RunParams<'a> {
    resources: Vec<&'a str>,
    tokens: Vec<i64>,
    keys: Vec<&'a str>,
    values: Vec<Option<&'a [u8]>>,
    expect: Vec<Option<i64>>,
    identities: Vec<Option<&'a str>>,
    idems: Vec<Option<&'a str>>,
}

impl<'a> RunParams<'a> {
    fn new(run: &[&'a Queued]) -> RunParams<'a> {
        let keyed = |queued: &'a Queued| queued.keyed.as_deref();
        RunParams {
            resources: run.iter().map(|q| q.write.resource.as_str()).collect(),
            tokens: run.iter().map(|q| q.write.token.as_i64()).collect(),
            keys: run.iter().map(|q| q.write.key.as_str()).collect(),
            values: run
                .iter()
                .map(|q| match &q.write.op {
                    WriteOp::Put(value) => Some(value.as_ref()),
                    WriteOp::Delete => None,
                })
                .collect(),
            expect: run.iter().map(|q| expected(q.write.precondition)).collect(),
            identities: run
                .iter()
                .map(|q| keyed(q).map(|k| k.identity.as_str()))
                .collect(),
            idems: run
                .iter()
                .map(|q| keyed(q).map(|k| k.key.as_str()))
                .collect(),
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
    let prepared = tokio::try_join!(
        client.prepare_cached(statements::GROUP_CLAIM),
        client.prepare_cached(statements::GROUP_LOCK),
        client.prepare_cached(statements::GROUP_APPLY_CHECKED),
        client.prepare_cached(statements::GROUP_ANSWER),
    );
    let (claim, lock, apply, answer) = match prepared {
        Ok(prepared) => prepared,
        Err(error) => return everyone(group, classify(error, false)),
    };
    // Until its COMMIT, a deadline rolls the group back: nothing applied.
    in_transaction();
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
    let mut resources: Vec<&str> = group.iter().map(|q| q.write.resource.as_str()).collect();
    resources.dedup(); // sorted: the locks are taken in this order
                       // The runs: consecutive writes, no object twice in one.
    let writes: Vec<&Write> = group.iter().map(|q| &q.write).collect();
    let queued: Vec<&Queued> = group.iter().collect();
    let mut runs = Vec::new();
    let mut at = 0;
    for run in runs_without_repeats(&writes) {
        runs.push(RunParams::new(&queued[at..at + run.len()]));
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
    let applied_at = steps.len() - runs.len();
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
        if let Some(settled) = refused(group, &results, true) {
            return settled;
        }
        if let Err(error) = committed {
            return everyone(group, classify(error, true));
        }
        (Ok(()), results)
    };
    if let Err(error) = begun {
        return everyone(group, unknown_outcome(error));
    }
    if keyed {
        if let Some(settled) = refused(group, &results, false) {
            let _ = client.batch_execute("ROLLBACK").await;
            return settled;
        }
    }
    // Every statement answered: judge each write.
    let mut judged = Vec::with_capacity(group.len());
    for result in results.into_iter().skip(applied_at) {
        match result {
            Ok(rows) => judged.extend(rows.iter().map(Judged::of)),
            Err(error) => return everyone(group, classify(error, true)),
        }
    }
    if judged.len() != group.len() {
        return everyone(
            group,
            StoreError::Internal(format!(
                "a checked group answered {} rows for {} writes",
                judged.len(),
                group.len()
            )),
        );
    }
    let mut settled: Vec<Reply> = Vec::with_capacity(group.len());
    let mut answers = Answers::default();
    for (queued, judged) in group.iter().zip(&judged) {
        settled.push(settle(queued, judged, &mut answers));
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
        (_, Err(error)) | (Err(error), _) => everyone(group, classify(error, true)),
    }
}

/// The answers to store, as [`statements::GROUP_ANSWER`] takes them.
#[derive(Default)]
struct Answers<'a> {
    identities: Vec<&'a str>,
    keys: Vec<&'a str>,
    statuses: Vec<i16>,
    headers: Vec<String>,
    bodies: Vec<Vec<u8>>,
}

/// One write's answer from its row; a keyed write that ran has its answer rendered and
/// added to `answers`.
fn settle<'a>(queued: &'a Queued, judged: &Judged, answers: &mut Answers<'a>) -> Reply {
    let Some(keyed) = queued.keyed.as_deref() else {
        return judged.attempt(&queued.write).map(Settled::Attempt);
    };
    if !judged.ran {
        let Some((fingerprint, status, headers, body)) = judged.found.clone() else {
            return Err(StoreError::Internal(
                "a keyed write that did not run has no record".into(),
            ));
        };
        let answer = found_answer(
            status.and_then(|s| u16::try_from(s).ok()),
            headers.as_deref().unwrap_or_default(),
            body.unwrap_or_default().into(),
        )?;
        return Ok(Settled::Keyed(replay(&fingerprint, keyed, answer)));
    }
    let outcome = judged.outcome(&queued.write)?;
    let answer: StoredAnswer = (keyed.render)(&outcome);
    let status = i16::try_from(answer.status)
        .map_err(|_| StoreError::Internal(format!("status {} out of range", answer.status)))?;
    answers.identities.push(&keyed.identity);
    answers.keys.push(&keyed.key);
    answers.statuses.push(status);
    answers.headers.push(answer.headers_text());
    answers.bodies.push(answer.body.to_vec());
    Ok(Settled::Keyed(Answered::Ran {
        outcome,
        stored: Some(answer),
    }))
}

/// If a statement of the first round trip failed: the group did not apply as a set
/// (`NotAsASet`: the server refused a statement, so the transaction — and a COMMIT sent
/// with it — rolled back), or the connection broke, the one error every write gets:
/// unknown whether it applied if `commit_sent`, else not applied.
fn refused(
    group: &[Queued],
    results: &[Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>],
    commit_sent: bool,
) -> Option<Checked> {
    let error = results.iter().find_map(|result| result.as_ref().err())?;
    if error.code().is_some() {
        return Some(Checked::NotAsASet);
    }
    Some(everyone(
        group,
        StoreError::Unavailable {
            reason: crate::store::UnavailableReason::ConnectionLost,
            applied: (!commit_sent).then_some(false),
        },
    ))
}

/// `error` for every write of `group`.
fn everyone(group: &[Queued], error: StoreError) -> Checked {
    Checked::Settled(group.iter().map(|_| Err(error.clone())).collect())
}
