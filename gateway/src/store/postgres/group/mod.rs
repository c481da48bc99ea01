//! Group commit for writes: plain, conditional (`If-Match`) and keyed
//! (`Idempotency-Key`) alike, and for transactions of several operations (`/v1/txn`).
//!
//! Concurrent writes queue here, and a few *lanes* take them in groups: each lane takes
//! every write queued when it becomes free (up to `--group-commit-max`), and applies the
//! group in ONE transaction on one pooled connection, in one round trip. The common
//! group — each resource's writes carry one token, no object is written twice — is one
//! autocommitted statement, [`statements::GROUP_WRITE`](crate::store::postgres::statements::GROUP_WRITE), its parameters as arrays. Any
//! other group is sent at once as `BEGIN`, [`statements::GROUP_LOCK`](crate::store::postgres::statements::GROUP_LOCK) (the fence rows
//! of the group's resources), one [`statements::GROUP_APPLY`](crate::store::postgres::statements::GROUP_APPLY) per run of writes (every
//! write, its parameters as arrays), `COMMIT`.
//! A write never waits for a group to fill: a lane that is free takes what is queued,
//! even a single write, which then runs as one autocommitted [`statements::FENCED_PUT`](crate::store::postgres::statements::FENCED_PUT)
//! or [`statements::FENCED_DELETE`](crate::store::postgres::statements::FENCED_DELETE). Groups form only while every lane is busy, which is
//! when they help: one commit, one WAL flush and one wake of a Postgres backend for many
//! writes, one statement for the whole group instead of one per write, and on a
//! contended resource one hold of its fence lock instead of one per write.
//!
//! A group with conditional or keyed writes or transactions is always a transaction
//! ([`checked`]): `BEGIN`, the claims of its keys, its fence locks, one statement per
//! transaction — which judges every operation before it changes anything — then one
//! checked statement per run of writes — which judges each write's token, then its
//! precondition, and runs a keyed write only on its own claim — the removal of the
//! placeholder fences no accepted write claimed, and, once those answered, the answers
//! of its keyed requests, rendered by the gateway, stored with `COMMIT`: two round trips
//! (one without keys), one commit for the whole group, no savepoint. If such a group
//! fails as a set, its plain writes are applied as a plain group, and the rest are
//! answered [`Settled::Alone`]: each runs then in a transaction of its own, off the
//! lanes. Whatever its items, a group takes all its locks up front, in one order: its
//! keys, then its fences in byte order.
//!
//! This module holds the queue and the lanes; [`apply`] holds how one group is applied
//! on one connection (its statements, and the pipelining of a transaction), [`checked`]
//! how a group with conditional or keyed writes is.
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
use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::ResourceName;
use prometheus::{Histogram, IntGauge};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio::time::Instant;

use crate::store::postgres::connection::{with_client_until, PgPool};
#[cfg(test)]
use crate::store::postgres::statements;
use crate::store::postgres::writes::{write_unconditional, Attempt};
use crate::store::txn::{Answered, Keyed, Txn};
use crate::store::{StoreError, UnavailableReason, Write};

mod apply;
mod checked;

use apply::apply_on;
#[cfg(test)]
use apply::{
    one_token_per_resource, pipeline, rejoin, runs_without_repeats, set_statement, set_transaction,
    GroupResult, Pipelined, RUN_BYTES,
};

/// What a plain write of a group is answered with.
type Answer = Result<Attempt, StoreError>;

/// What a lane answers a queued write with.
#[derive(Debug)]
pub(crate) enum Settled {
    /// A write without a key, as the group judged it.
    Attempt(Attempt),
    /// A keyed write or a transaction: run in the group (a keyed one with its answer
    /// stored), or answered from the record of an earlier attempt.
    Answered(Answered),
    /// A conditional or keyed write that the group could not apply as a set, and left
    /// unapplied: the caller applies it alone, in a transaction of its own.
    Alone,
}

type Reply = Result<Settled, StoreError>;

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
    item: Item,
    /// The item's Idempotency-Key, if it has one.
    keyed: Option<Arc<Keyed>>,
    deadline: Instant,
    reply: oneshot::Sender<Reply>,
}

/// What a group carries.
enum Item {
    /// A write of one object.
    Write(Write),
    /// A transaction of several operations ([`crate::store::txn`]).
    Txn(Arc<Txn>),
}

impl Queued {
    /// The write, if the item is one.
    fn write(&self) -> Option<&Write> {
        match &self.item {
            Item::Write(write) => Some(write),
            Item::Txn(_) => None,
        }
    }

    /// The resource a write is sorted and locked by; `None` for a transaction.
    fn resource(&self) -> Option<&ResourceName> {
        self.write().map(|write| &write.resource)
    }

    /// Whether the item needs a checked group: a transaction, a precondition or a key.
    fn checked(&self) -> bool {
        self.keyed.is_some()
            || self.write().is_none_or(|write| {
                write.precondition != fencegate_proto::headers::Precondition::None
            })
    }

    fn answer(self, answer: Answer) {
        let _ = self.reply.send(answer.map(Settled::Attempt));
    }
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

    /// Applies `write`, with its Idempotency-Key if it has one, in the next group a lane
    /// takes.
    pub async fn write(&self, write: Write, keyed: Option<Arc<Keyed>>) -> Reply {
        self.queue(Item::Write(write), keyed).await
    }

    /// Applies `txn`, with its Idempotency-Key if it has one, in the next group a lane
    /// takes.
    pub async fn txn(&self, txn: Arc<Txn>, keyed: Option<Arc<Keyed>>) -> Reply {
        self.queue(Item::Txn(txn), keyed).await
    }

    async fn queue(&self, item: Item, keyed: Option<Arc<Keyed>>) -> Reply {
        let (reply, answer) = oneshot::channel();
        let queued = Queued {
            item,
            keyed,
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
    group.sort_by(lock_order);
    if group.iter().any(Queued::checked) {
        return checked::apply_group(lanes, group, deadline).await;
    }
    let writes: Vec<&Write> = group.iter().filter_map(Queued::write).collect();
    let answers = with_client_until(&lanes.pool, deadline, async |client| {
        Ok(apply_on(client, &writes).await)
    })
    .await;
    answer_plain(lanes, group, answers);
}

/// Answers a plain group's writes, and sends those of a locked resource off the lanes.
fn answer_plain(lanes: &Lanes, group: Vec<Queued>, answers: Result<Vec<Answer>, StoreError>) {
    match answers {
        Ok(answers) => {
            let mut blocked = Vec::new();
            for (queued, answer) in group.into_iter().zip(answers) {
                match answer {
                    Err(StoreError::Unavailable {
                        reason: UnavailableReason::LockTimeout,
                        ..
                    }) => blocked.push(queued),
                    answer => queued.answer(answer),
                }
            }
            lanes.off_lanes.divert(&lanes.slow, blocked);
        }
        Err(error) => {
            for queued in group {
                queued.answer(Err(error.clone()));
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
        queued.answer(Err(StoreError::Unavailable {
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
            let Some(resource) = writes[0].resource().cloned() else {
                continue;
            };
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
            .filter_map(
                |queued| match queued.resource().and_then(|r| queues.get_mut(r)) {
                    Some(queue) => {
                        self.waiting.inc();
                        queue.push_back(queued);
                        None
                    }
                    None => Some(queued),
                },
            )
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
            let Some(write) = next.write().filter(|_| !next.checked()) else {
                // Its caller applies it alone on the shared pool, where it waits for
                // the lock as this queue would.
                self.waiting.dec();
                let _ = next.reply.send(Ok(Settled::Alone));
                continue;
            };
            let answer = with_client_until(&pool, next.deadline, async |client| {
                write_unconditional(client, write).await
            })
            .await;
            self.waiting.dec();
            next.answer(answer);
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
            .find(|run| run[0].resource() == queued.resource())
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

/// The order of a group's items: its transactions first, in their order, then its
/// writes in resource order ([`by_resource`]).
fn lock_order(a: &Queued, b: &Queued) -> Ordering {
    match (a.write(), b.write()) {
        (Some(a), Some(b)) => by_resource(a, b),
        (None, Some(_)) => Ordering::Less,
        (Some(_), None) => Ordering::Greater,
        (None, None) => Ordering::Equal,
    }
}

#[cfg(test)]
mod checked_tests;
#[cfg(test)]
mod set_tests;
#[cfg(test)]
mod tests;
