//! Group commit for writes without a precondition.
//!
//! Concurrent writes queue here, and a few *lanes* take them in groups: each lane takes
//! every write queued when it becomes free (up to `--group-commit-max`), and applies the
//! group in ONE transaction on one pooled connection, in one round trip. The common
//! group — each resource's writes carry one token, no object is written twice — is one
//! autocommitted statement, [`statements::GROUP_WRITE`], its parameters as arrays. Any
//! other group is sent at once as `BEGIN`, [`statements::GROUP_LOCK`] (the fence rows
//! of the group's resources), one [`statements::GROUP_APPLY`] per run of writes (every
//! write, its parameters as arrays), `COMMIT`.
//! A write never waits for a group to fill: a lane that is free takes what is queued,
//! even a single write, which then runs as one autocommitted [`statements::FENCED_PUT`]
//! or [`statements::FENCED_DELETE`]. Groups form only while every lane is busy, which is
//! when they help: one commit, one WAL flush and one wake of a Postgres backend for many
//! writes, one statement for the whole group instead of one per write, and on a
//! contended resource one hold of its fence lock instead of one per write.
//!
//! # Why this is still one fence check per write
//!
//! `GROUP_WRITE` raises each fence to its resource's one token unless the token is
//! below it, exactly as each write's own statement would: the first write raises it,
//! the others meet it. `GROUP_APPLY`, for groups whose tokens differ on a resource,
//! checks each write against the fence as the writes before it left it:
//! its token must be at least the fence and every earlier token of its resource in the
//! group (an accepted write raised the fence to its token; a stale one was below a fence
//! already counted), so a write with token 4 after one with token 5 on the same resource
//! is stale. One statement cannot write a row twice, so a group that writes an object
//! twice is cut into runs without repeats, one `GROUP_APPLY` each, in order. The
//! statement or transaction commits all or nothing, and the answers are sent only after
//! it committed. If any statement fails, Postgres aborts the transaction (turning the
//! COMMIT into a ROLLBACK); nothing of the group remains, and each write is then retried
//! on its own, so one bad write cannot fail its neighbours. Tests apply random groups
//! both ways, set-based and one statement per write, and compare answers and tables.
//!
//! # Lock order
//!
//! A group locks the fence rows of several resources and holds them to COMMIT. Two groups
//! locking two resources in opposite orders would deadlock, so each group is sorted by
//! resource (stably: writes to one resource keep their arrival order; byte order, as
//! `COLLATE "C"` would sort) and takes its locks in that order. Every other writer — a
//! conditional write, an advance, a SQL transaction — locks a single fence row, so no
//! cycle can form.
//!
//! # Locked resources
//!
//! A resource's fence row can be held for long by someone else — a fenced SQL
//! transaction of that resource, a conditional write waiting on it, a writer of fenced
//! tables. A lane that waited for it would hold up every other resource's writes
//! queued behind it. So lanes run on connections of their own whose `lock_timeout` is
//! `--write-lock-timeout` (200 ms by default: far above the time a group holds its
//! locks, a commit, so that only a lock held by something slower sends writes off): a
//! group (or a lone write) that cannot get a fence lock in that time stops, and nothing
//! of it is applied. A set-based statement does not say whose lock it was, so the group
//! is tried again as one statement per write, whose refused statement names the resource
//! (one more wait of the lock timeout, once per locked resource: its later writes no
//! longer reach the lanes). The writes of the locked resource leave the lanes — they are
//! applied one by one, in their order, on the shared pool, where they wait for the lock
//! up to their deadline, and the resource's later writes queue behind them there instead
//! of trying the lanes, so that none overtakes another — and the rest of the group is
//! applied again at once. The wait costs only the writes of the locked resource.
//!
//! # Time
//!
//! Each write carries the deadline of `--backend-timeout` from when it was queued. A lane
//! answers writes whose deadline has passed with 503 (not applied: they were never sent),
//! and bounds the group by its earliest deadline: one timer per group, not per write.

use std::cmp::Ordering;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Object;
use fencegate_proto::ResourceName;
use futures_util::future::{maybe_done, MaybeDone};
use prometheus::{Histogram, IntGauge};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::time::Instant;

use crate::store::postgres::connection::{classify, with_client_until, PgPool};
use crate::store::postgres::statements;
use crate::store::postgres::writes::{applied, write_unconditional, Attempt};
use crate::store::{StoreError, UnavailableReason, Write, WriteOp};

/// What a queued write is answered with.
type Answer = Result<Attempt, StoreError>;

/// The queue in front of the lanes.
pub struct GroupCommit {
    queue: mpsc::Sender<Queued>,
    timeout: Duration,
}

/// What every lane shares.
struct Lanes {
    /// The lanes' connections, with `--write-lock-timeout`.
    pool: PgPool,
    /// The shared pool, where writes of a locked resource wait for it.
    slow: PgPool,
    /// The writes of locked resources waiting off the lanes.
    off_lanes: Arc<OffLanes>,
    receiver: Mutex<mpsc::Receiver<Queued>>,
    max_group: usize,
    group_size: Histogram,
}

struct Queued {
    write: Write,
    deadline: Instant,
    reply: oneshot::Sender<Answer>,
}

/// Queued writes beyond which writers wait to queue: far more than fit in flight.
const QUEUE_CAPACITY: usize = 16 * 1024;

impl GroupCommit {
    /// Starts `lanes` lanes on `pool`, each applying up to `max_group` writes at a time;
    /// writes of a locked resource wait on `slow`. They stop when the returned value is
    /// dropped.
    pub fn start(
        pool: PgPool,
        slow: PgPool,
        lanes: usize,
        max_group: usize,
        timeout: Duration,
        group_size: Histogram,
        off_lanes: IntGauge,
    ) -> GroupCommit {
        let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
        let shared = Arc::new(Lanes {
            pool,
            slow,
            off_lanes: Arc::new(OffLanes {
                queues: std::sync::Mutex::default(),
                waiting: off_lanes,
            }),
            receiver: Mutex::new(receiver),
            max_group,
            group_size,
        });
        for _ in 0..lanes {
            tokio::spawn(lane(Arc::clone(&shared)));
        }
        GroupCommit { queue, timeout }
    }

    /// Applies `write` in the next group a lane takes.
    pub async fn write(&self, write: Write) -> Answer {
        let (reply, answer) = oneshot::channel();
        let queued = Queued {
            write,
            deadline: Instant::now() + self.timeout,
            reply,
        };
        if self.queue.send(queued).await.is_err() {
            return Err(StoreError::Internal("the write lanes have stopped".into()));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(StoreError::Internal("a write lane stopped".into())))
    }
}

/// One lane: take what is queued, apply it, answer, repeat.
async fn lane(lanes: Arc<Lanes>) {
    loop {
        let mut group = Vec::new();
        {
            // One lane at a time waits for writes; the others are busy or queue behind it.
            let mut receiver = lanes.receiver.lock().await;
            if receiver.recv_many(&mut group, lanes.max_group).await == 0 {
                return; // the store was dropped
            }
        }
        lanes.group_size.observe(group.len() as f64);
        apply_group(&lanes, group).await;
    }
}

async fn apply_group(lanes: &Lanes, group: Vec<Queued>) {
    let group = answer_expired(group, Instant::now());
    // Writes of a resource whose earlier writes wait off the lanes wait behind them.
    let mut group = lanes.off_lanes.join(group);
    let Some(deadline) = group.iter().map(|queued| queued.deadline).min() else {
        return;
    };
    group.sort_by(|a, b| by_resource(&a.write, &b.write));
    let writes: Vec<&Write> = group.iter().map(|queued| &queued.write).collect();
    let answers = with_client_until(&lanes.pool, deadline, async |client| {
        Ok(apply_on(client, &writes).await)
    })
    .await;
    match answers {
        Ok(answers) => {
            let mut blocked = Vec::new();
            for (queued, answer) in group.into_iter().zip(answers) {
                match answer {
                    Err(StoreError::Unavailable {
                        reason: UnavailableReason::LockTimeout,
                        ..
                    }) => blocked.push(queued),
                    answer => {
                        let _ = queued.reply.send(answer);
                    }
                }
            }
            lanes.off_lanes.divert(&lanes.slow, blocked);
        }
        Err(error) => {
            for queued in group {
                let _ = queued.reply.send(Err(error.clone()));
            }
        }
    }
}

/// Answers the writes whose deadline has passed (503, not applied: they were never
/// sent) and returns the others.
fn answer_expired(group: Vec<Queued>, now: Instant) -> Vec<Queued> {
    let (live, expired): (Vec<Queued>, Vec<Queued>) =
        group.into_iter().partition(|queued| queued.deadline > now);
    for queued in expired {
        let _ = queued.reply.send(Err(StoreError::Unavailable {
            reason: UnavailableReason::Timeout,
            applied: Some(false),
        }));
    }
    live
}

/// The writes of locked resources, waiting off the lanes: per resource, a queue in the
/// order they left the lanes, applied one by one on the shared pool by one task, each
/// write waiting for the lock up to its own deadline. While a resource has a queue, its
/// later writes join it instead of trying the lanes, so that they cannot overtake it.
struct OffLanes {
    queues: std::sync::Mutex<HashMap<ResourceName, VecDeque<Queued>>>,
    /// Writes in the queues or being applied from them (`fencegate_writes_off_lanes`).
    waiting: IntGauge,
}

impl OffLanes {
    fn queues(&self) -> std::sync::MutexGuard<'_, HashMap<ResourceName, VecDeque<Queued>>> {
        self.queues
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sends `blocked`'s writes off the lanes, behind those of their resource already
    /// there.
    fn divert(self: &Arc<Self>, pool: &PgPool, blocked: Vec<Queued>) {
        let mut queues = self.queues();
        for writes in runs_by_resource(blocked) {
            let resource = writes[0].write.resource.clone();
            tracing::debug!(
                %resource,
                writes = writes.len(),
                "fence row locked; applying its writes off the lanes"
            );
            self.waiting.add(writes.len() as i64);
            match queues.get_mut(&resource) {
                Some(queue) => queue.extend(writes),
                None => {
                    queues.insert(resource.clone(), writes.into());
                    tokio::spawn(Arc::clone(self).drain(pool.clone(), resource));
                }
            }
        }
    }

    /// Moves the writes of `group` whose resource has writes off the lanes behind them,
    /// and returns the others.
    fn join(&self, group: Vec<Queued>) -> Vec<Queued> {
        let mut queues = self.queues();
        if queues.is_empty() {
            return group;
        }
        group
            .into_iter()
            .filter_map(|queued| match queues.get_mut(&queued.write.resource) {
                Some(queue) => {
                    self.waiting.inc();
                    queue.push_back(queued);
                    None
                }
                None => Some(queued),
            })
            .collect()
    }

    /// Applies `resource`'s queue in order until it is empty, then removes it.
    async fn drain(self: Arc<Self>, pool: PgPool, resource: ResourceName) {
        loop {
            let next = {
                let mut queues = self.queues();
                let queue = queues
                    .get_mut(&resource)
                    .expect("a queue is removed only by its own task");
                match queue.pop_front() {
                    Some(queued) => queued,
                    None => {
                        queues.remove(&resource);
                        return;
                    }
                }
            };
            let answer = with_client_until(&pool, next.deadline, async |client| {
                write_unconditional(client, &next.write).await
            })
            .await;
            self.waiting.dec();
            let _ = next.reply.send(answer);
        }
    }
}

/// The writes grouped by resource, each group in arrival order, the groups in the order
/// of their resources' first writes.
fn runs_by_resource(writes: Vec<Queued>) -> Vec<Vec<Queued>> {
    let mut runs: Vec<Vec<Queued>> = Vec::new();
    for queued in writes {
        match runs
            .iter_mut()
            .find(|run| run[0].write.resource == queued.write.resource)
        {
            Some(run) => run.push(queued),
            None => runs.push(vec![queued]),
        }
    }
    runs
}

/// Resource order for taking fence locks; `sort_by` is stable, so writes to one
/// resource keep their order.
fn by_resource(a: &Write, b: &Write) -> Ordering {
    a.resource.as_str().cmp(b.resource.as_str())
}

/// Applies `writes` (sorted) on `client`: one answer per write, in order.
async fn apply_on(client: &Object, writes: &[&Write]) -> Vec<Answer> {
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
fn rejoin(writes: &[&Write], locked: &ResourceName, rest: Vec<Answer>) -> Vec<Answer> {
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

enum GroupResult {
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

type Pipelined<'a, T> = Pin<Box<dyn Future<Output = Result<T, tokio_postgres::Error>> + Send + 'a>>;

/// The group as `BEGIN`, [`statements::GROUP_LOCK`], one [`statements::GROUP_APPLY`] per
/// run of writes without a repeated object, `COMMIT`, sent at once. `None` if a fence
/// lock timed out (nothing was applied, and the statement does not say whose lock).
async fn set_transaction(client: &Object, writes: &[&Write]) -> Option<GroupResult> {
    let statements = tokio::try_join!(
        client.prepare_cached(statements::GROUP_LOCK),
        client.prepare_cached(statements::GROUP_APPLY)
    );
    let (lock, apply) = match statements {
        Ok(statements) => statements,
        Err(error) => return Some(GroupResult::Failed(classify(error, false))),
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
            return Some(GroupResult::Failed(classify(error, false)));
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
        return Some(GroupResult::Failed(classify(error, true)));
    }
    let mut answers = Vec::with_capacity(writes.len());
    for (run, result) in runs.iter().zip(results.into_iter().skip(1)) {
        let rows = match result {
            Ok(rows) => rows,
            // A lost connection fails the COMMIT too, handled above.
            Err(error) => return Some(GroupResult::Failed(classify(error, true))),
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
fn one_token_per_resource<'a>(writes: &[&'a Write]) -> Option<Fences<'a>> {
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
struct Fences<'a> {
    resources: Vec<&'a str>,
    tokens: Vec<i64>,
}

/// The group as one autocommitted [`statements::GROUP_WRITE`]. `None` if a fence lock
/// timed out (nothing was applied, and the statement does not say whose lock).
async fn set_statement(
    client: &Object,
    writes: &[&Write],
    fences: &Fences<'_>,
) -> Option<GroupResult> {
    let statement = match client.prepare_cached(statements::GROUP_WRITE).await {
        Ok(statement) => statement,
        Err(error) => return Some(GroupResult::Failed(classify(error, false))),
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
                return Some(GroupResult::Failed(classify(error, true)));
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
fn answers_of(writes: &[&Write], rows: Vec<tokio_postgres::Row>) -> GroupResult {
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
struct RunParams<'a> {
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
const RUN_BYTES: usize = 32 << 20;

/// `writes` cut into consecutive runs in which no object (resource and key) appears
/// twice — one statement cannot write a row twice — and whose values, past the first,
/// stay within [`RUN_BYTES`]. Each write stays after every write that came before it,
/// so each run sees the fences the runs before it left.
fn runs_without_repeats<'a>(writes: &'a [&'a Write]) -> Vec<&'a [&'a Write]> {
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
fn unknown_outcome(error: tokio_postgres::Error) -> StoreError {
    match classify(error, false) {
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
async fn each_transaction(client: &Object, writes: &[&Write]) -> GroupResult {
    let statements = tokio::try_join!(
        client.prepare_cached(statements::FENCED_PUT),
        client.prepare_cached(statements::FENCED_DELETE)
    );
    let (put, delete) = match statements {
        Ok(statements) => statements,
        Err(error) => return GroupResult::Failed(classify(error, false)),
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
                Err(error) => GroupResult::Failed(classify(error, false)),
            };
        }
        tracing::warn!(
            code = refused.code(),
            writes = writes.len(),
            "write group rolled back; applying its writes one by one"
        );
        return match committed {
            Ok(()) => GroupResult::RolledBack,
            Err(error) => GroupResult::Failed(classify(error, false)),
        };
    }
    if let Err(error) = committed {
        return GroupResult::Failed(classify(error, true));
    }
    let mut answers = Vec::with_capacity(writes.len());
    for (write, row) in writes.iter().zip(rows) {
        answers.push(match row {
            Ok(Some(row)) => applied(&write.op, row.get(0), row.get(1)),
            Ok(None) => Ok(Attempt::Stale),
            // A lost connection fails the COMMIT too, handled above.
            Err(error) => Err(classify(error, true)),
        });
    }
    GroupResult::Committed(answers)
}

/// `BEGIN`, `statements`, `COMMIT`, sent at once: the answers of all three parts.
async fn in_transaction<'a, B>(
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
async fn pipeline<'a, A, B, C>(
    first: impl Future<Output = A>,
    middle: Vec<Pipelined<'a, B>>,
    last: impl Future<Output = C>,
) -> (A, Vec<Result<B, tokio_postgres::Error>>, C) {
    let mut first = std::pin::pin!(maybe_done(first));
    let mut middle: Vec<MaybeDone<Pipelined<'a, B>>> = middle.into_iter().map(maybe_done).collect();
    let mut last = std::pin::pin!(maybe_done(last));
    // tokio-postgres queues a request on the first poll of its future.
    std::future::poll_fn(|cx| {
        let _ = first.as_mut().poll(cx);
        for future in &mut middle {
            let _ = Pin::new(future).poll(cx);
        }
        let _ = last.as_mut().poll(cx);
        std::task::Poll::Ready(())
    })
    .await;
    first.as_mut().await;
    let mut answers = Vec::with_capacity(middle.len());
    for mut future in middle {
        (&mut future).await;
        answers.push(Pin::new(&mut future).take_output().expect("awaited above"));
    }
    // Every statement before it has answered: what the server runs now is `last`, the
    // COMMIT, which a deadline must not cancel (`committing`). Until now a deadline
    // cancels a statement still running — waiting for a lock — and the COMMIT queued
    // behind it then rolls back.
    crate::store::postgres::connection::committing();
    last.as_mut().await;
    (
        first.as_mut().take_output().expect("awaited above"),
        answers,
        last.as_mut().take_output().expect("awaited above"),
    )
}

#[cfg(test)]
mod set_tests;
#[cfg(test)]
mod tests;
