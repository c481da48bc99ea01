//! The steps of the system: the model checker's `actions` and `next_state`.
//!
//! # Steps
//!
//! - **Lease store**: acquire (a new epoch, strictly higher, if the lease is free,
//!   expired or the writer's own), release (naming the epoch), and expiry — the store's
//!   clock passing the holder's expiry.
//! - **Writers**: acquire, step down (releasing at their epoch, as the elector does),
//!   and send a put, a conditional put or an advance with their term's epoch as token.
//!   A holder's own clock ends its term before the lease expires (the elector's renew
//!   deadline is shorter than the lease), so at expiry it has stopped — unless it was
//!   paused across the expiry: then it wakes believing it still leads.
//! - **Network**: deliver any request in flight to either gateway, or duplicate one.
//! - **Gateways**: on delivery, the fence cache's fast path; then a put without a
//!   precondition queues for the replica's write lane, while a conditional put or an
//!   advance runs in its own transaction. The lane commits a group, or — a fault — the
//!   database refuses one of its statements, the group rolls back and the lane retries
//!   its writes one by one. Answers are given after commit, and only committed results
//!   raise the cache.
//!
//! # Time
//!
//! The protocol reads time only through two facts: whether the lease has expired on the
//! store's clock, and whether the holder's own clock still says its term is live. So
//! time is one step, [`Action::Expire`], which sets the first and ends the term of a
//! holder that was running (its clock ran out first, by the elector's margin), or leaves
//! it to a holder that was paused across it. A writer's pause matters only there:
//! requests it sent before are in flight either way, and the network delays them as
//! long as a pause would.

use std::fmt;
use std::str::FromStr;

use stateright::{Model, Property};

use crate::database::Outcome;
use crate::state::{
    insert_sorted, remove_one, Budget, Database, Decider, Event, Gateway, History, Lease, Op,
    Request, State, GATEWAYS, MAX_RESOURCES,
};

/// A deliberate bug, to show that the properties catch it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mutant {
    /// The fence cache is raised from the presented token when the request arrives,
    /// before anything committed.
    CacheBeforeCommit,
    /// The gateway checks the token against the durable fence when the request arrives,
    /// and the write is applied later without checking again.
    CheckOutsideTransaction,
    /// A group whose member is refused by the fence commits that member's object write
    /// anyway: the stale member is not rolled back.
    StaleMemberKept,
    /// A conditional put whose `If-Match` fails commits its fence raise.
    PreconditionKeepsFence,
}

impl Mutant {
    pub const ALL: [Mutant; 4] = [
        Mutant::CacheBeforeCommit,
        Mutant::CheckOutsideTransaction,
        Mutant::StaleMemberKept,
        Mutant::PreconditionKeepsFence,
    ];

    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mutant::CacheBeforeCommit => "cache-before-commit",
            Mutant::CheckOutsideTransaction => "check-outside-transaction",
            Mutant::StaleMemberKept => "stale-member-kept",
            Mutant::PreconditionKeepsFence => "precondition-keeps-fence",
        }
    }
}

impl fmt::Display for Mutant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Mutant {
    type Err = String;

    fn from_str(name: &str) -> Result<Mutant, String> {
        Mutant::ALL
            .into_iter()
            .find(|mutant| mutant.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Mutant::ALL.iter().map(|m| m.name()).collect();
                format!("unknown mutant {name:?}; one of {}", names.join(", "))
            })
    }
}

/// The bounds that make the state space finite.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Resources, 1 or 2; each has one fence and one object.
    pub resources: u8,
    /// The most epochs the lease store mints (acquisitions in all).
    pub max_epoch: u8,
    /// The most requests the writers send in all.
    pub max_sends: u8,
    /// The most times the network duplicates a request.
    pub max_duplicates: u8,
    /// The most groups the database refuses (rolled back, writes retried solo).
    pub max_rollbacks: u8,
    /// The most writes a lane takes into one group (`--group-commit-max`).
    pub group_max: usize,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            resources: 1,
            max_epoch: 3,
            max_sends: 2,
            max_duplicates: 1,
            max_rollbacks: 1,
            group_max: 2,
        }
    }
}

/// The fencing protocol with two writers, two gateway replicas and one database.
#[derive(Clone, Debug)]
pub struct FencingModel {
    pub bounds: Bounds,
    pub mutant: Option<Mutant>,
}

impl FencingModel {
    pub fn new(bounds: Bounds, mutant: Option<Mutant>) -> FencingModel {
        assert!(
            (1..=MAX_RESOURCES as u8).contains(&bounds.resources),
            "resources must be 1 or 2"
        );
        assert!(bounds.group_max >= 1, "a group holds at least one write");
        FencingModel { bounds, mutant }
    }

    fn resources(&self) -> std::ops::Range<u8> {
        0..self.bounds.resources
    }
}

/// What a writer sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Put,
    /// A put with `If-Match` on the version the writer has just read.
    PutIfMatch,
    Advance,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// The store's clock passes the holder's expiry. A running holder stopped leading
    /// just before, on its own clock; one that `slept` (paused across it) still
    /// believes it leads.
    Expire {
        slept: bool,
    },
    Acquire(u8),
    StepDown(u8),
    Send {
        writer: u8,
        resource: u8,
        what: Kind,
    },
    Duplicate(Request),
    Deliver {
        request: Request,
        gateway: u8,
    },
    /// The gateway's lane applies the writes at the head of its queue as a group.
    CommitGroup(u8),
    /// The database refuses a statement of the lane's next group (a fault other than a
    /// stale token): the group rolls back, its writes go solo.
    RollBackGroup(u8),
    /// The lane applies the next write of a rolled-back group on its own.
    ApplySolo(u8),
}

impl Model for FencingModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            lease: Lease::default(),
            writers: Default::default(),
            network: Vec::new(),
            gateways: Default::default(),
            database: Database::default(),
            history: History::default(),
            budget: Budget::default(),
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.lease.holder.is_some() && !state.lease.expired {
            actions.push(Action::Expire { slept: false });
            actions.push(Action::Expire { slept: true });
        }
        for (w, writer) in state.writers.iter().enumerate() {
            let w = w as u8;
            match writer.term {
                None => {
                    if state.lease.epoch < self.bounds.max_epoch && state.lease.available_to(w) {
                        actions.push(Action::Acquire(w));
                    }
                }
                Some(_) => {
                    actions.push(Action::StepDown(w));
                    if state.budget.sent < self.bounds.max_sends {
                        for resource in self.resources() {
                            for what in [Kind::Put, Kind::PutIfMatch, Kind::Advance] {
                                actions.push(Action::Send {
                                    writer: w,
                                    resource,
                                    what,
                                });
                            }
                        }
                    }
                }
            }
        }
        let mut distinct = state.network.clone();
        distinct.dedup();
        for request in &distinct {
            for gateway in 0..GATEWAYS as u8 {
                actions.push(Action::Deliver {
                    request: *request,
                    gateway,
                });
            }
            if state.budget.duplicated < self.bounds.max_duplicates {
                actions.push(Action::Duplicate(*request));
            }
        }
        for (g, gateway) in state.gateways.iter().enumerate() {
            let g = g as u8;
            if !gateway.solo.is_empty() {
                actions.push(Action::ApplySolo(g));
            } else if !gateway.queue.is_empty() {
                actions.push(Action::CommitGroup(g));
                if self.group_len(gateway) > 1
                    && state.budget.rolled_back < self.bounds.max_rollbacks
                {
                    actions.push(Action::RollBackGroup(g));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        state.history.events.clear();
        match action {
            Action::Expire { slept } => expire(&mut state, slept),
            Action::Acquire(w) => acquire(&mut state, w),
            Action::StepDown(w) => step_down(&mut state, w),
            Action::Send {
                writer,
                resource,
                what,
            } => send(&mut state, writer, resource, what),
            Action::Duplicate(request) => {
                state.budget.duplicated += 1;
                insert_sorted(&mut state.network, request);
            }
            Action::Deliver { request, gateway } => {
                if !remove_one(&mut state.network, &request) {
                    return None;
                }
                self.deliver(&mut state, usize::from(gateway), request);
            }
            Action::CommitGroup(g) => self.commit_group(&mut state, usize::from(g)),
            Action::RollBackGroup(g) => self.roll_back_group(&mut state, usize::from(g)),
            Action::ApplySolo(g) => {
                let g = usize::from(g);
                let write = state.gateways[g].solo.remove(0);
                let outcome = state.database.apply_group(&[write], self.mutant)[0];
                answer(&mut state, g, write, outcome);
            }
        }
        for (seen, fence) in state
            .history
            .highest_fence
            .iter_mut()
            .zip(state.database.fence)
        {
            *seen = (*seen).max(fence);
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        crate::properties::all()
    }

    fn format_action(&self, action: &Action) -> String {
        crate::trace::describe(action)
    }
}

impl FencingModel {
    /// How many writes the lane takes into its next group.
    fn group_len(&self, gateway: &Gateway) -> usize {
        gateway.queue.len().min(self.bounds.group_max)
    }

    /// A request arrives at a gateway: the fence cache's fast path, then the backend.
    fn deliver(&self, state: &mut State, g: usize, request: Request) {
        let r = usize::from(request.resource);
        let cached = state.gateways[g].cache[r];
        // `check_cached`: the cache holds only committed tokens, so a rejection from it
        // is always correct; a pass means only "not known to be stale".
        if request.token < cached {
            reject(state, g, request, cached, Decider::Cache);
            return;
        }
        if self.mutant == Some(Mutant::CacheBeforeCommit) {
            raise(&mut state.gateways[g].cache[r], request.token);
        }
        if self.mutant == Some(Mutant::CheckOutsideTransaction) && request.op != Op::Advance {
            let durable = state.database.fence[r];
            if request.token < durable {
                reject(state, g, request, durable, Decider::Database);
                return;
            }
        }
        // A conditional put or an advance runs in its own transaction on a pooled
        // connection. It is taken at delivery: its outcome depends only on the database
        // when it runs, and the cache check before it can only reject what the database
        // would reject too, so a gap between the two adds no outcome.
        let outcome = match request.op {
            Op::Put => {
                state.gateways[g].queue.push(request);
                return;
            }
            Op::PutIfVersion(version) => {
                state
                    .database
                    .conditional_put(&request, version, self.mutant)
            }
            Op::Advance => state.database.advance(&request),
        };
        answer(state, g, request, outcome);
    }

    /// The lane takes what is queued (up to the group size), sorts it by resource
    /// (stably: one resource's writes keep their order), applies it in one transaction
    /// and answers every write after the commit.
    fn commit_group(&self, state: &mut State, g: usize) {
        let group = self.take_group(state, g);
        let outcomes = state.database.apply_group(&group, self.mutant);
        if group.len() > 1 {
            let applied = outcomes.iter().filter(|o| **o == Outcome::Applied).count();
            state.history.events.push(Event::GroupCommitted {
                size: group.len() as u8,
                applied: applied as u8,
            });
        }
        for (write, outcome) in group.into_iter().zip(outcomes) {
            answer(state, g, write, outcome);
        }
    }

    /// The database refuses one statement of the group: Postgres aborts the
    /// transaction, COMMIT becomes ROLLBACK and nothing of the group remains. The lane
    /// then gives every write its own statement, in the group's order.
    fn roll_back_group(&self, state: &mut State, g: usize) {
        let group = self.take_group(state, g);
        state.budget.rolled_back += 1;
        state.history.events.push(Event::GroupRolledBack {
            size: group.len() as u8,
        });
        state.gateways[g].solo = group;
    }

    fn take_group(&self, state: &mut State, g: usize) -> Vec<Request> {
        let gateway = &mut state.gateways[g];
        let len = self.group_len(gateway);
        let mut group: Vec<Request> = gateway.queue.drain(..len).collect();
        group.sort_by_key(|write| write.resource);
        group
    }
}

/// The store's clock passes the holder's expiry.
fn expire(state: &mut State, slept: bool) {
    state.lease.expired = true;
    if let (false, Some(holder)) = (slept, state.lease.holder) {
        // The elector's renew deadline: the holder stopped leading on its own clock,
        // before the lease expired. (Releasing now would change nothing: it expired.)
        state.writers[usize::from(holder)].term = None;
    }
}

/// The store's acquire: one atomic step on its clock; the epoch rises on every
/// acquisition, also when the holder is already the acquiring writer.
fn acquire(state: &mut State, w: u8) {
    let lease = &mut state.lease;
    lease.epoch += 1;
    lease.holder = Some(w);
    lease.expired = false;
    state.writers[usize::from(w)].term = Some(lease.epoch);
}

/// The writer stops leading and releases the lease, naming its epoch: a release from
/// a replaced holder frees nothing.
fn step_down(state: &mut State, w: u8) {
    let Some(epoch) = state.writers[usize::from(w)].term.take() else {
        return;
    };
    if state.lease.holder == Some(w) && state.lease.epoch == epoch {
        state.lease.holder = None;
        state.lease.expired = false;
    }
}

fn send(state: &mut State, w: u8, resource: u8, what: Kind) {
    let epoch = state.writers[usize::from(w)]
        .term
        .expect("only a writer with a term sends");
    state.budget.sent += 1;
    let op = match what {
        Kind::Put => Op::Put,
        // The version the writer has just read.
        Kind::PutIfMatch => Op::PutIfVersion(state.database.objects[usize::from(resource)].version),
        Kind::Advance => Op::Advance,
    };
    let request = Request {
        id: state.budget.sent,
        writer: w,
        token: epoch,
        resource,
        op,
    };
    if epoch < state.lease.epoch {
        state.history.events.push(Event::SentAfterTakeover {
            id: request.id,
            token: epoch,
            epoch: state.lease.epoch,
        });
    }
    insert_sorted(&mut state.network, request);
}

/// The gateway answers `request` with what its transaction committed.
fn answer(state: &mut State, g: usize, request: Request, outcome: Outcome) {
    let r = usize::from(request.resource);
    match outcome {
        Outcome::Applied => {
            // `Coordinator::committed`: the cache learns a committed token.
            raise(&mut state.gateways[g].cache[r], request.token);
            let history = &mut state.history;
            history.events.push(Event::Accepted {
                id: request.id,
                resource: request.resource,
                token: request.token,
                acknowledged_before: history.acknowledged[r],
            });
            raise(&mut history.acknowledged[r], request.token);
            if request.op != Op::Advance {
                history.expected[r].put(request.id);
            }
        }
        Outcome::Stale => {
            // `highest_above`: a statement of its own reads the committed highest.
            let highest = state.database.fence[r];
            reject(state, g, request, highest, Decider::Database);
        }
        Outcome::PreconditionFailed => state.history.events.push(Event::PreconditionFailed {
            id: request.id,
            resource: request.resource,
        }),
    }
}

/// `Coordinator::stale`: answers 409 naming `highest`, and raises the cache to it.
fn reject(state: &mut State, g: usize, request: Request, highest: u8, by: Decider) {
    let r = usize::from(request.resource);
    state.history.events.push(Event::Rejected {
        id: request.id,
        resource: request.resource,
        presented: request.token,
        highest,
        durable: state.database.fence[r],
        by,
    });
    raise(&mut state.gateways[g].cache[r], highest);
}

fn raise(value: &mut u8, to: u8) {
    *value = (*value).max(to);
}
