//! The statements of a group: how one group of writes is applied on one connection —
//! a lone write as its own statement, the common group as one set-based statement, any
//! other as one transaction of set-based runs, and, when a set-based attempt fails, one
//! statement per write — and the pipelining that sends a transaction's statements in
//! one round trip. The queue and the lanes that form the groups are in [`super`].

use std::future::Future;
use std::pin::Pin;

use deadpool_postgres::Object;
use fencegate_proto::ResourceName;
use futures_util::future::{maybe_done, MaybeDone};

use super::Answer;
use crate::store::postgres::errors::{classify, Sent};
use crate::store::postgres::statements;
use crate::store::postgres::writes::{applied, write_unconditional, Attempt};
use crate::store::{StoreError, UnavailableReason, Write, WriteOp};

/// Applies `writes` (sorted) on `client`: one answer per write, in order.
pub(super) async fn apply_on(client: &Object, writes: &[&Write]) -> Vec<Answer> {
    if let [write] = writes {
        return vec![write_unconditional(client, write).await];
    }
    let result = match one_token_per_resource(writes) {
        Some(fences) => set_statement(client, writes, &fences).await,
        None => set_transaction(client, writes).await,
    };
    let result = match result {
        Some(result) => result,
        // A fence lock timed out, but a set-based statement does not say whose: the
        // statement-per-write transaction finds it.
        None => each_transaction(client, writes).await,
    };
    match result {
        GroupResult::Committed(answers) => answers,
        GroupResult::Failed(error) => vec![Err(error); writes.len()],
        GroupResult::Blocked(resource) => {
            // Nothing was applied. The locked resource's writes leave the lanes; the
            // others are applied again at once, as a group.
            let rest: Vec<&Write> = writes
                .iter()
                .copied()
                .filter(|write| write.resource != resource)
                .collect();
            let rest_answers = Box::pin(apply_on(client, &rest)).await;
            rejoin(writes, &resource, rest_answers)
        }
        GroupResult::RolledBack => {
            // A statement failed, so nothing of the group remains; give every write its
            // own statement and its own answer.
            let mut answers = Vec::with_capacity(writes.len());
            for write in writes {
                answers.push(write_unconditional(client, write).await);
            }
            answers
        }
    }
}

/// The answers of a group whose `locked` resource left the lanes: its writes are
/// answered `LockTimeout` (not applied), the others take `rest`'s answers in order.
pub(super) fn rejoin(writes: &[&Write], locked: &ResourceName, rest: Vec<Answer>) -> Vec<Answer> {
    let mut rest = rest.into_iter();
    writes
        .iter()
        .map(|write| match write.resource == *locked {
            true => Err(StoreError::Unavailable {
                reason: UnavailableReason::LockTimeout,
                applied: Some(false),
            }),
            false => rest.next().expect("one answer per write"),
        })
        .collect()
}

pub(super) enum GroupResult {
    /// COMMIT succeeded: every answer is committed state.
    Committed(Vec<Answer>),
    /// The server refused a statement; the transaction was rolled back.
    RolledBack,
    /// A statement waited longer than the lane's lock timeout for this resource's fence
    /// row; the transaction was rolled back.
    Blocked(ResourceName),
    /// The connection failed; whether the group committed may be unknown (`applied`).
    Failed(StoreError),
}

pub(super) type Pipelined<'a, T> =
    Pin<Box<dyn Future<Output = Result<T, tokio_postgres::Error>> + Send + 'a>>;

/// The group as `BEGIN`, [`statements::GROUP_LOCK`], one [`statements::GROUP_APPLY`] per
/// run of writes without a repeated object, `COMMIT`, sent at once. `None` if a fence
/// lock timed out (nothing was applied, and the statement does not say whose lock).
pub(super) async fn set_transaction(client: &Object, writes: &[&Write]) -> Option<GroupResult> {
    let statements = tokio::try_join!(
        client.prepare_cached(statements::GROUP_LOCK),
        client.prepare_cached(statements::GROUP_APPLY)
    );
    let (lock, apply) = match statements {
        Ok(statements) => statements,
        Err(error) => return Some(GroupResult::Failed(classify(error, Sent::NoCommit))),
    };
    let (lock, apply) = (&lock, &apply);
    let mut resources: Vec<&str> = writes.iter().map(|write| write.resource.as_str()).collect();
    resources.dedup(); // sorted: the locks are taken in this order
    let runs: Vec<RunParams<'_>> = runs_without_repeats(writes)
        .into_iter()
        .map(RunParams::new)
        .collect();
    let mut statements: Vec<Pipelined<'_, Vec<tokio_postgres::Row>>> =
        Vec::with_capacity(1 + runs.len());
    let resources = &resources;
    statements.push(Box::pin(
        async move { client.query(lock, &[resources]).await },
    ));
    for run in &runs {
        statements.push(Box::pin(async move {
            client
                .query(
                    apply,
                    &[&run.resources, &run.tokens, &run.keys, &run.values],
                )
                .await
        }));
    }
    let (begun, results, committed) = in_transaction(client, statements).await;
    if let Err(error) = begun {
        return Some(GroupResult::Failed(unknown_outcome(error)));
    }
    if let Some(refused) = results
        .iter()
        .find_map(|result| result.as_ref().err()?.code())
    {
        // Postgres aborted the transaction at that statement: the COMMIT rolled back.
        if let Err(error) = committed {
            return Some(GroupResult::Failed(classify(error, Sent::NoCommit)));
        }
        if *refused == tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE {
            return None;
        }
        tracing::warn!(
            code = refused.code(),
            writes = writes.len(),
            "write group rolled back; applying its writes one by one"
        );
        return Some(GroupResult::RolledBack);
    }
    if let Err(error) = committed {
        return Some(GroupResult::Failed(classify(error, Sent::Commit)));
    }
    let mut answers = Vec::with_capacity(writes.len());
    for (run, result) in runs.iter().zip(results.into_iter().skip(1)) {
        let rows = match result {
            Ok(rows) => rows,
            // A lost connection fails the COMMIT too, handled above.
            Err(error) => return Some(GroupResult::Failed(classify(error, Sent::Commit))),
        };
        match answers_of(run.writes, rows) {
            GroupResult::Committed(run_answers) => answers.extend(run_answers),
            failed => return Some(failed),
        }
    }
    Some(GroupResult::Committed(answers))
}

/// A group's fences as [`statements::GROUP_WRITE`] takes them: each resource once, in
/// lock order, with its token. `None` if the group needs a transaction instead: a
/// resource's writes carry different tokens (the statement accepts or refuses a
/// resource's writes together), or the group writes an object twice or its values do
/// not fit one statement (it is more than one run).
pub(super) fn one_token_per_resource<'a>(writes: &[&'a Write]) -> Option<Fences<'a>> {
    let mut fences = Fences {
        resources: Vec::new(),
        tokens: Vec::new(),
    };
    for write in writes {
        let (resource, token) = (write.resource.as_str(), write.token.as_i64());
        // Sorted by resource: a resource's writes are together.
        if fences.resources.last() == Some(&resource) {
            if fences.tokens.last() != Some(&token) {
                return None;
            }
        } else {
            fences.resources.push(resource);
            fences.tokens.push(token);
        }
    }
    (runs_without_repeats(writes).len() == 1).then_some(fences)
}

/// The fence parameters of [`statements::GROUP_WRITE`].
pub(super) struct Fences<'a> {
    pub(super) resources: Vec<&'a str>,
    pub(super) tokens: Vec<i64>,
}

/// The group as one autocommitted [`statements::GROUP_WRITE`]. `None` if a fence lock
/// timed out (nothing was applied, and the statement does not say whose lock).
pub(super) async fn set_statement(
    client: &Object,
    writes: &[&Write],
    fences: &Fences<'_>,
) -> Option<GroupResult> {
    let statement = match client.prepare_cached(statements::GROUP_WRITE).await {
        Ok(statement) => statement,
        Err(error) => return Some(GroupResult::Failed(classify(error, Sent::NoCommit))),
    };
    let run = RunParams::new(writes);
    let rows = client
        .query(
            &statement,
            &[
                &fences.resources,
                &fences.tokens,
                &run.resources,
                &run.keys,
                &run.values,
            ],
        )
        .await;
    let rows = match rows {
        Ok(rows) => rows,
        Err(error) => {
            let Some(refused) = error.code() else {
                // Autocommit: once the statement is sent, it may have committed.
                return Some(GroupResult::Failed(classify(error, Sent::Commit)));
            };
            // The server refused the statement: nothing of it was applied.
            if *refused == tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE {
                return None;
            }
            tracing::warn!(
                code = refused.code(),
                writes = writes.len(),
                "write group refused; applying its writes one by one"
            );
            return Some(GroupResult::RolledBack);
        }
    };
    Some(answers_of(writes, rows))
}

/// The answers of a committed group statement: one row per write, in order.
pub(super) fn answers_of(writes: &[&Write], rows: Vec<tokio_postgres::Row>) -> GroupResult {
    if rows.len() != writes.len() {
        return GroupResult::Failed(StoreError::Internal(format!(
            "a group statement answered {} rows for {} writes",
            rows.len(),
            writes.len()
        )));
    }
    let answers = writes
        .iter()
        .zip(rows)
        .map(|(write, row)| match (row.get(0), row.get(1)) {
            (Some(version), Some(born)) => applied(&write.op, version, born),
            _ => Ok(Attempt::Stale),
        })
        .collect();
    GroupResult::Committed(answers)
}

/// The parameters of one [`statements::GROUP_APPLY`]: its writes' columns.
pub(super) struct RunParams<'a> {
    writes: &'a [&'a Write],
    resources: Vec<&'a str>,
    tokens: Vec<i64>,
    keys: Vec<&'a str>,
    /// `None` for a delete.
    values: Vec<Option<&'a [u8]>>,
}

impl<'a> RunParams<'a> {
    fn new(writes: &'a [&'a Write]) -> RunParams<'a> {
        RunParams {
            writes,
            resources: writes.iter().map(|w| w.resource.as_str()).collect(),
            tokens: writes.iter().map(|w| w.token.as_i64()).collect(),
            keys: writes.iter().map(|w| w.key.as_str()).collect(),
            values: writes
                .iter()
                .map(|w| match &w.op {
                    WriteOp::Put(value) => Some(value.as_ref()),
                    WriteOp::Delete => None,
                })
                .collect(),
        }
    }
}

/// Value bytes beyond which a run ends: one statement's parameters stay far below
/// Postgres's 1 GiB limit on a message, whatever `--max-body` and the group size allow.
pub(super) const RUN_BYTES: usize = 32 << 20;

/// `writes` cut into consecutive runs in which no object (resource and key) appears
/// twice — one statement cannot write a row twice — and whose values, past the first,
/// stay within [`RUN_BYTES`]. Each write stays after every write that came before it,
/// so each run sees the fences the runs before it left.
pub(super) fn runs_without_repeats<'a>(writes: &'a [&'a Write]) -> Vec<&'a [&'a Write]> {
    let mut runs = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for (index, write) in writes.iter().enumerate() {
        let size = match &write.op {
            WriteOp::Put(value) => value.len(),
            WriteOp::Delete => 0,
        };
        let object = (write.resource.as_str(), write.key.as_str());
        if index > start && (seen.contains(&object) || bytes + size > RUN_BYTES) {
            runs.push(&writes[start..index]);
            (start, bytes) = (index, 0);
            seen.clear();
        }
        seen.insert(object);
        bytes += size;
    }
    runs.push(&writes[start..]);
    runs
}

/// A failed `BEGIN` while the connection lives: the statements after it ran on their
/// own, so what was applied is unknown.
pub(super) fn unknown_outcome(error: tokio_postgres::Error) -> StoreError {
    match classify(error, Sent::NoCommit) {
        StoreError::Unavailable { reason, .. } => StoreError::Unavailable {
            reason,
            applied: None,
        },
        other => other,
    }
}

/// The group as `BEGIN`, one [`statements::FENCED_PUT`] or [`statements::FENCED_DELETE`]
/// per write, `COMMIT`, sent at once: a refused statement names the write, and so the
/// resource whose lock timed out.
pub(super) async fn each_transaction(client: &Object, writes: &[&Write]) -> GroupResult {
    let statements = tokio::try_join!(
        client.prepare_cached(statements::FENCED_PUT),
        client.prepare_cached(statements::FENCED_DELETE)
    );
    let (put, delete) = match statements {
        Ok(statements) => statements,
        Err(error) => return GroupResult::Failed(classify(error, Sent::NoCommit)),
    };
    let (put, delete) = (&put, &delete);
    let rows: Vec<Pipelined<'_, Option<tokio_postgres::Row>>> =
        writes
            .iter()
            .map(|write| -> Pipelined<'_, _> {
                let (resource, key, token) = (
                    write.resource.as_str(),
                    write.key.as_str(),
                    write.token.as_i64(),
                );
                match &write.op {
                    WriteOp::Put(value) => Box::pin(async move {
                        client
                            .query_opt(put, &[&resource, &token, &key, &value.as_ref()])
                            .await
                    }),
                    WriteOp::Delete => Box::pin(async move {
                        client.query_opt(delete, &[&resource, &token, &key]).await
                    }),
                }
            })
            .collect();
    let (begun, rows, committed) = in_transaction(client, rows).await;
    if let Err(error) = begun {
        return GroupResult::Failed(unknown_outcome(error));
    }
    let first_refused = rows
        .iter()
        .enumerate()
        .find_map(|(index, row)| Some((index, row.as_ref().err()?.code()?)));
    if let Some((index, refused)) = first_refused {
        // Postgres aborted the transaction at that statement: the COMMIT rolled back.
        if *refused == tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE {
            return match committed {
                Ok(()) => GroupResult::Blocked(writes[index].resource.clone()),
                Err(error) => GroupResult::Failed(classify(error, Sent::NoCommit)),
            };
        }
        tracing::warn!(
            code = refused.code(),
            writes = writes.len(),
            "write group rolled back; applying its writes one by one"
        );
        return match committed {
            Ok(()) => GroupResult::RolledBack,
            Err(error) => GroupResult::Failed(classify(error, Sent::NoCommit)),
        };
    }
    if let Err(error) = committed {
        return GroupResult::Failed(classify(error, Sent::Commit));
    }
    let mut answers = Vec::with_capacity(writes.len());
    for (write, row) in writes.iter().zip(rows) {
        answers.push(match row {
            Ok(Some(row)) => applied(&write.op, row.get(0), row.get(1)),
            Ok(None) => Ok(Attempt::Stale),
            // A lost connection fails the COMMIT too, handled above.
            Err(error) => Err(classify(error, Sent::Commit)),
        });
    }
    GroupResult::Committed(answers)
}

/// `BEGIN`, `statements`, `COMMIT`, sent at once: the answers of all three parts.
pub(super) async fn in_transaction<'a, B>(
    client: &'a Object,
    statements: Vec<Pipelined<'a, B>>,
) -> (
    Result<(), tokio_postgres::Error>,
    Vec<Result<B, tokio_postgres::Error>>,
    Result<(), tokio_postgres::Error>,
) {
    let (begin, commit) = (
        client.batch_execute("BEGIN"),
        client.batch_execute("COMMIT"),
    );
    pipeline(begin, statements, commit).await
}

/// Sends `first`, every one of `middle`, then `last` — each on its first poll, in this
/// order, before waiting for any answer — and returns their answers.
pub(super) async fn pipeline<'a, A, B, C>(
    first: impl Future<Output = A>,
    middle: Vec<Pipelined<'a, B>>,
    last: impl Future<Output = C>,
) -> (A, Vec<Result<B, tokio_postgres::Error>>, C) {
    let mut last = std::pin::pin!(maybe_done(last));
    let (first, answers) = sent_with(first, middle, |cx| {
        let _ = last.as_mut().poll(cx);
    })
    .await;
    // Every statement before it has answered: what the server runs now is `last`, the
    // COMMIT, which a deadline must not cancel (`committing`). Until now a deadline
    // cancels a statement still running — waiting for a lock — and the COMMIT queued
    // behind it then rolls back.
    crate::store::postgres::connection::committing();
    last.as_mut().await;
    (
        first,
        answers,
        last.as_mut().take_output().expect("awaited above"),
    )
}

/// As [`pipeline`], without a last part: a transaction that goes on after its answers.
pub(super) async fn send_together<'a, A, B>(
    first: impl Future<Output = A>,
    middle: Vec<Pipelined<'a, B>>,
) -> (A, Vec<Result<B, tokio_postgres::Error>>) {
    sent_with(first, middle, |_| {}).await
}

/// Sends `first` and every one of `middle` (and what `also` polls), each on its first
/// poll, in this order, before waiting for any answer; returns the answers of `first`
/// and `middle`.
async fn sent_with<'a, A, B>(
    first: impl Future<Output = A>,
    middle: Vec<Pipelined<'a, B>>,
    mut also: impl FnMut(&mut std::task::Context<'_>),
) -> (A, Vec<Result<B, tokio_postgres::Error>>) {
    let mut first = std::pin::pin!(maybe_done(first));
    let mut middle: Vec<MaybeDone<Pipelined<'a, B>>> = middle.into_iter().map(maybe_done).collect();
    // tokio-postgres queues a request on the first poll of its future.
    std::future::poll_fn(|cx| {
        let _ = first.as_mut().poll(cx);
        for future in &mut middle {
            let _ = Pin::new(future).poll(cx);
        }
        also(cx);
        std::task::Poll::Ready(())
    })
    .await;
    first.as_mut().await;
    let mut answers = Vec::with_capacity(middle.len());
    for mut future in middle {
        (&mut future).await;
        answers.push(Pin::new(&mut future).take_output().expect("awaited above"));
    }
    (
        first.as_mut().take_output().expect("awaited above"),
        answers,
    )
}
