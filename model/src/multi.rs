//! Transactions across several fences, as the in-database fence runs them: a
//! transaction calls `fencegate.fence(resource, token)` for each resource it writes or
//! only checks, writes, and commits. Each call locks its resource's fence row until
//! the end of the transaction, refuses a token below the fence (the transaction then
//! rolls back whole), and raises the fence to the token at the commit. Another term's
//! raise of one resource is a transaction of its own that locks the same row.
//!
//! The checker explores every interleaving of a few such transactions and tests, in
//! every state:
//!
//! - [`TERMS_HOLD_UNTIL_COMMIT`]: when a transaction commits, every resource it fenced
//!   — written or only checked — still stands at its token: no newer term began in
//!   between, so nothing commits on a term that has passed;
//! - [`ALL_OR_NOTHING`]: a transaction's writes are seen only if it committed, and then
//!   all of them.
//!
//! It also shows that a two-resource transaction commits, that one is refused for a
//! stale member, that a new term's raise waits for a transaction holding the row, and
//! — with two transactions fencing in opposite orders — that they can deadlock, which
//! Postgres breaks by ending one of them (nothing of it applied).
//!
//! [`MultiMutant::CheckWithoutLock`] puts back the bug of a resource that is only
//! checked, not locked (the Iceberg multi-table commit's: a table read but not written
//! is not validated again at commit), and [`TERMS_HOLD_UNTIL_COMMIT`] catches it;
//! [`MultiMutant::WritesBeforeCommit`] applies each write as it is made, as a client in
//! autocommit would, and [`ALL_OR_NOTHING`] catches it.

use stateright::{Model, Property};

/// How many resources the transactions touch.
pub const RESOURCES: usize = 2;

pub const TERMS_HOLD_UNTIL_COMMIT: &str =
    "a transaction commits only while every resource it fenced is at its token";
pub const ALL_OR_NOTHING: &str =
    "a transaction's writes are seen all or none, and only once it commits";
pub const TWO_RESOURCES_COMMIT: &str = "a transaction across two resources commits";
pub const STALE_MEMBER_REFUSED: &str = "a transaction is refused for one stale resource";
pub const RAISE_WAITS: &str = "a new term's raise waits for a transaction holding the row";
pub const DEADLOCK_BROKEN: &str =
    "two transactions fencing in opposite orders deadlock, and one is ended";

/// One call of a transaction, in its order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// `SELECT fencegate.fence(resource, token)`.
    Fence {
        resource: usize,
        token: u8,
    },
    /// A write of a table fenced for `resource`.
    Write {
        resource: usize,
    },
    Commit,
}

/// Where a transaction is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// At its step of this index.
    Running(usize),
    Committed,
    /// Rolled back: refused by a fence, or ended to break a deadlock.
    RolledBack,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    /// The durable fence of each resource.
    pub fences: [u8; RESOURCES],
    /// Which transaction holds each resource's fence row, if any.
    pub locks: [Option<usize>; RESOURCES],
    /// The transaction whose write each resource's data holds, if any.
    pub data: [Option<usize>; RESOURCES],
    pub status: Vec<Status>,
    /// What each running transaction will raise its resources to at commit.
    pub raising: Vec<[Option<u8>; RESOURCES]>,
    /// Writes each running transaction made, applied at commit.
    pub written: Vec<[bool; RESOURCES]>,
    /// The writes of each transaction that reached the data.
    pub applied: Vec<[bool; RESOURCES]>,
    /// Each transaction's commit: whether every resource it fenced stood at its token.
    pub commits_on_current_terms: Vec<bool>,
    /// Events the `sometimes` properties look for.
    pub refused_stale: bool,
    pub raise_waited: bool,
    pub deadlock_broken: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MultiAction {
    /// Transaction `tx` takes its next step.
    Step { tx: usize },
    /// Postgres's deadlock detector ends `tx`, which waits in a cycle.
    EndDeadlocked { tx: usize },
}

/// A bug the design guards against, put back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MultiMutant {
    /// A resource that is fenced but not written is compared with its fence and not
    /// locked: a new term may begin before the commit.
    CheckWithoutLock,
    /// Each write reaches the data as it is made, not at the commit.
    WritesBeforeCommit,
}

#[derive(Clone, Debug)]
pub struct MultiModel {
    /// Each transaction's calls, in order.
    pub transactions: Vec<Vec<Step>>,
    pub mutant: Option<MultiMutant>,
}

impl MultiModel {
    /// A leader of term 1 writes resource 0 and then checks resource 1, in one
    /// transaction; a new term (2) raises resource 1; and two transactions of term 3
    /// fence both resources, in opposite orders, and write both.
    pub fn standard(mutant: Option<MultiMutant>) -> MultiModel {
        use Step::*;
        MultiModel {
            transactions: vec![
                // The leader: writes 0, then checks 1.
                vec![
                    Fence {
                        resource: 0,
                        token: 1,
                    },
                    Write { resource: 0 },
                    Fence {
                        resource: 1,
                        token: 1,
                    },
                    Commit,
                ],
                // A new term of resource 1.
                vec![
                    Fence {
                        resource: 1,
                        token: 2,
                    },
                    Commit,
                ],
                // Two writers of term 3 on both resources, in opposite orders.
                vec![
                    Fence {
                        resource: 0,
                        token: 3,
                    },
                    Fence {
                        resource: 1,
                        token: 3,
                    },
                    Write { resource: 0 },
                    Write { resource: 1 },
                    Commit,
                ],
                vec![
                    Fence {
                        resource: 1,
                        token: 3,
                    },
                    Fence {
                        resource: 0,
                        token: 3,
                    },
                    Write { resource: 1 },
                    Write { resource: 0 },
                    Commit,
                ],
            ],
            mutant,
        }
    }

    /// The resource `tx` waits for, if its next step is a fence whose row another
    /// transaction holds.
    fn waits_for(&self, state: &State, tx: usize) -> Option<usize> {
        let Status::Running(at) = state.status[tx] else {
            return None;
        };
        match self.transactions[tx][at] {
            Step::Fence { resource, .. } if !self.unlocked_check(tx, resource) => state.locks
                [resource]
                .filter(|holder| *holder != tx)
                .map(|_| resource),
            _ => None,
        }
    }

    /// Whether `tx`'s fence of `resource` only compares, without the lock
    /// ([`MultiMutant::CheckWithoutLock`]): a resource a writing transaction checks
    /// but does not write. A new term's raise always locks.
    fn unlocked_check(&self, tx: usize, resource: usize) -> bool {
        self.mutant == Some(MultiMutant::CheckWithoutLock)
            && self.checks_only(tx, resource)
            && !self.is_raise(tx)
    }

    /// Whether `tx` writes nothing: a new term's raise.
    fn is_raise(&self, tx: usize) -> bool {
        !self.transactions[tx]
            .iter()
            .any(|step| matches!(step, Step::Write { .. }))
    }

    /// Whether `tx` fences `resource` without writing it.
    fn checks_only(&self, tx: usize, resource: usize) -> bool {
        !self.transactions[tx].contains(&Step::Write { resource })
    }

    /// The transaction `tx` waits on, through a lock.
    fn blocker(&self, state: &State, tx: usize) -> Option<usize> {
        self.waits_for(state, tx)
            .and_then(|resource| state.locks[resource])
    }

    /// Whether `tx` waits in a cycle of waits.
    fn deadlocked(&self, state: &State, tx: usize) -> bool {
        let mut at = tx;
        for _ in 0..self.transactions.len() {
            match self.blocker(state, at) {
                Some(next) if next == tx => return true,
                Some(next) => at = next,
                None => return false,
            }
        }
        false
    }

    fn end(&self, state: &mut State, tx: usize, status: Status) {
        for lock in &mut state.locks {
            if *lock == Some(tx) {
                *lock = None;
            }
        }
        if status == Status::Committed {
            let fenced = self.transactions[tx]
                .iter()
                .filter_map(|step| match step {
                    Step::Fence { resource, token } => Some((*resource, *token)),
                    _ => None,
                })
                .all(|(resource, token)| state.fences[resource] <= token);
            state.commits_on_current_terms[tx] = fenced;
            for resource in 0..RESOURCES {
                if let Some(token) = state.raising[tx][resource] {
                    state.fences[resource] = state.fences[resource].max(token);
                }
                if state.written[tx][resource] {
                    state.data[resource] = Some(tx);
                    state.applied[tx][resource] = true;
                }
            }
        }
        state.raising[tx] = [None; RESOURCES];
        state.written[tx] = [false; RESOURCES];
        state.status[tx] = status;
    }
}

impl Model for MultiModel {
    type State = State;
    type Action = MultiAction;

    fn init_states(&self) -> Vec<State> {
        let n = self.transactions.len();
        vec![State {
            fences: [0; RESOURCES],
            locks: [None; RESOURCES],
            data: [None; RESOURCES],
            status: vec![Status::Running(0); n],
            raising: vec![[None; RESOURCES]; n],
            written: vec![[false; RESOURCES]; n],
            applied: vec![[false; RESOURCES]; n],
            commits_on_current_terms: vec![true; n],
            refused_stale: false,
            raise_waited: false,
            deadlock_broken: false,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<MultiAction>) {
        for tx in 0..self.transactions.len() {
            if !matches!(state.status[tx], Status::Running(_)) {
                continue;
            }
            if self.waits_for(state, tx).is_none() {
                actions.push(MultiAction::Step { tx });
            } else if self.deadlocked(state, tx) {
                actions.push(MultiAction::EndDeadlocked { tx });
            }
        }
    }

    fn next_state(&self, last: &State, action: MultiAction) -> Option<State> {
        let mut state = last.clone();
        match action {
            MultiAction::EndDeadlocked { tx } => {
                self.end(&mut state, tx, Status::RolledBack);
                state.deadlock_broken = true;
            }
            MultiAction::Step { tx } => {
                let Status::Running(at) = state.status[tx] else {
                    return None;
                };
                // A raise of a resource some other transaction holds has waited for it
                // (it could step only once the row was free).
                match self.transactions[tx][at] {
                    Step::Fence { resource, token } => {
                        let fence = state.raising[tx][resource]
                            .unwrap_or(0)
                            .max(state.fences[resource]);
                        if token < fence {
                            state.refused_stale = true;
                            self.end(&mut state, tx, Status::RolledBack);
                            return Some(state);
                        }
                        if !self.unlocked_check(tx, resource) {
                            state.locks[resource] = Some(tx);
                            state.raising[tx][resource] = Some(token);
                        }
                        state.status[tx] = Status::Running(at + 1);
                    }
                    Step::Write { resource } => {
                        state.written[tx][resource] = true;
                        if self.mutant == Some(MultiMutant::WritesBeforeCommit) {
                            state.data[resource] = Some(tx);
                            state.applied[tx][resource] = true;
                        }
                        state.status[tx] = Status::Running(at + 1);
                    }
                    Step::Commit => self.end(&mut state, tx, Status::Committed),
                }
                if (0..self.transactions.len())
                    .any(|other| self.is_raise(other) && self.waits_for(&state, other).is_some())
                {
                    state.raise_waited = true;
                }
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(TERMS_HOLD_UNTIL_COMMIT, |_, state: &State| {
                state.commits_on_current_terms.iter().all(|held| *held)
            }),
            Property::always(ALL_OR_NOTHING, |model: &MultiModel, state: &State| {
                (0..model.transactions.len()).all(|tx| {
                    let none = state.applied[tx] == [false; RESOURCES];
                    let all = state.status[tx] == Status::Committed
                        && (0..RESOURCES).all(|resource| {
                            state.applied[tx][resource]
                                == model.transactions[tx].contains(&Step::Write { resource })
                        });
                    none || all
                })
            }),
            Property::sometimes(TWO_RESOURCES_COMMIT, |model: &MultiModel, state: &State| {
                state.status.iter().enumerate().any(|(tx, status)| {
                    *status == Status::Committed
                        && (0..RESOURCES).all(|resource| {
                            model.transactions[tx]
                                .iter()
                                .any(|step| matches!(step, Step::Fence { resource: r, .. } if *r == resource))
                        })
                })
            }),
            Property::sometimes(STALE_MEMBER_REFUSED, |_, state: &State| state.refused_stale),
            Property::sometimes(RAISE_WAITS, |_, state: &State| state.raise_waited),
            Property::sometimes(DEADLOCK_BROKEN, |_, state: &State| state.deadlock_broken),
        ]
    }
}
