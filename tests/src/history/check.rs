//! The linearizability check of a history against a fenced register.
//!
//! # The model
//!
//! Per resource, the highest applied token `H` (0 before the first), and per key a
//! value (or none: missing or deleted) and a version. Sequentially:
//!
//! - `write(key, t, v)`: if `t < H`, stale, nothing changes. Otherwise, with a
//!   precondition that does not hold, precondition failed, nothing changes — not even
//!   the fence. Otherwise `H = t`, the key's version rises by one and its value is `v`.
//! - `delete(key, t)`: the same fence rule; the value goes, and the version rises by
//!   one if there was a value (a tombstone keeps its version).
//! - `advance(t)`: stale if `t < H`, else `H = t`.
//! - `read(key)`: the key's value and version; nothing changes.
//!
//! An applied answer must report the version the model reaches; a read must see the
//! model's value and version.
//!
//! # Stale answers must be justified
//!
//! A stale answer names a `highest`. The gateway takes it from its fence cache (which
//! only ever holds values that were committed, invariant 2) or from the database's
//! fence row in the rejecting transaction: either way a value the resource's fence
//! really held before the answer. So a stale answer `Stale { highest: h }` is
//! consistent at a point of the order only if `t < h <= H` there: some operation
//! carrying a token of at least `h` was applied before it — acknowledged, or in flight
//! and applied (an indeterminate one). Requiring `h == H` would be wrong, since a
//! replica's cache may lag behind a raise made through another replica; requiring only
//! `t < H` would let a gateway that invents a highest pass. A stale answer without a
//! `highest` needs `t < H`.
//!
//! # The search
//!
//! Wing and Gong's search with Lowe's memoisation, on the event list of Porcupine:
//! calls and returns sorted by time (a call before a return at the same instant, so
//! that touching operations count as concurrent); the search linearizes any call whose
//! model step matches its answer, and backtracks when it meets the return of an
//! operation it has not linearized. A pair (set of linearized operations, model state)
//! seen before is not explored again.
//!
//! An indeterminate operation returns at infinity, so it may be linearized anywhere
//! after its call, taking effect; and when the search reaches the first infinite
//! return, every operation with an answer is linearized and the rest never took
//! effect. Linearizing one where it would have no effect (stale, precondition failed)
//! is the same as never, so the search does not try it: that keeps a run with many
//! indeterminate operations from multiplying its states by each of their subsets.
//!
//! Resources are independent (a token of one never fences another), so each resource
//! is its own history.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use super::{Entry, Op, Outcome};

/// Model steps one resource's history may take before the check gives up. A history
/// that needs more is reported as undecided, which fails a run like a violation.
pub const SEARCH_BUDGET: u64 = 5_000_000;

/// A resource whose history is not linearizable (or could not be decided).
#[derive(Debug, Clone)]
pub struct Violation {
    pub resource: String,
    pub operations: usize,
    pub message: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "resource {} ({} operations): {}",
            self.resource, self.operations, self.message
        )
    }
}

/// Checks every resource of `entries`; the violations, one per failing resource.
pub fn check(entries: &[Entry]) -> Vec<Violation> {
    let mut by_resource: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    for entry in entries {
        by_resource.entry(&entry.resource).or_default().push(entry);
    }
    by_resource
        .into_iter()
        .filter_map(|(resource, entries)| check_resource(resource, &entries).err())
        .collect()
}

/// Checks one resource's operations.
pub fn check_resource(resource: &str, entries: &[&Entry]) -> Result<(), Violation> {
    let history = Prepared::new(entries);
    let violation = |message: String| Violation {
        resource: resource.to_owned(),
        operations: history.ops.len(),
        message,
    };
    match Search::new(&history).run() {
        Verdict::Linearizable => Ok(()),
        Verdict::Undecided => Err(violation(format!(
            "undecided: more than {SEARCH_BUDGET} model steps"
        ))),
        Verdict::Not { deepest, state } => {
            let placed = deepest.iter().filter(|&&l| l).count();
            // The operation that could not be placed: of those left out of the
            // deepest order, the first to have its answer.
            let stuck = (0..history.ops.len())
                .filter(|&i| !deepest[i] && history.ops[i].ret != INFINITY)
                .min_by_key(|&i| history.ops[i].ret);
            let mut message = format!(
                "not linearizable: at most {placed} of {} operations can be ordered; \
                 then highest {}, objects {}",
                history.ops.len(),
                state.highest,
                history.describe_objects(&state)
            );
            if let Some(stuck) = stuck {
                message.push_str(&format!(
                    ", and this cannot come next: {}",
                    history.ops[stuck].entry.describe()
                ));
            }
            Err(violation(message))
        }
    }
}

/// The return time of an operation that may take effect at any time after its call.
const INFINITY: u64 = u64::MAX;

/// A history in the form the search uses: keys and values as small numbers.
struct Prepared<'a> {
    ops: Vec<Operation<'a>>,
    keys: Vec<&'a str>,
    values: Vec<&'a str>,
}

struct Operation<'a> {
    entry: &'a Entry,
    kind: Kind,
    call: u64,
    ret: u64,
}

enum Kind {
    Write {
        key: usize,
        token: u64,
        value: u32,
        if_version: Option<u64>,
    },
    Delete {
        key: usize,
        token: u64,
    },
    Read {
        key: usize,
        value: Option<u32>,
        version: Option<u64>,
    },
    Advance {
        token: u64,
    },
}

impl<'a> Prepared<'a> {
    fn new(entries: &[&'a Entry]) -> Prepared<'a> {
        let mut keys: Vec<&str> = Vec::new();
        let mut values: Vec<&str> = Vec::new();
        let mut key_ids: HashMap<&str, usize> = HashMap::new();
        let mut value_ids: HashMap<&str, u32> = HashMap::new();
        let mut ops = Vec::new();
        for &entry in entries {
            let mut key_id = |key: &'a str| {
                *key_ids.entry(key).or_insert_with(|| {
                    keys.push(key);
                    keys.len() - 1
                })
            };
            let mut value_id = |value: &'a str| {
                *value_ids.entry(value).or_insert_with(|| {
                    values.push(value);
                    (values.len() - 1) as u32
                })
            };
            let indeterminate = match entry.outcome {
                Outcome::NotApplied => continue,
                Outcome::Indeterminate => true,
                _ => false,
            };
            let kind = match &entry.op {
                Op::Write {
                    key,
                    token,
                    value,
                    if_version,
                } => Kind::Write {
                    key: key_id(key),
                    token: *token,
                    value: value_id(value),
                    if_version: *if_version,
                },
                Op::Delete { key, token } => Kind::Delete {
                    key: key_id(key),
                    token: *token,
                },
                Op::Read { key } => {
                    let Outcome::Read { value, version } = &entry.outcome else {
                        // A read without an answer tells nothing.
                        continue;
                    };
                    Kind::Read {
                        key: key_id(key),
                        value: value.as_deref().map(&mut value_id),
                        version: *version,
                    }
                }
                Op::Advance { token } => Kind::Advance { token: *token },
            };
            ops.push(Operation {
                entry,
                kind,
                call: entry.invoked,
                ret: if indeterminate {
                    INFINITY
                } else {
                    entry.completed.max(entry.invoked)
                },
            });
        }
        Prepared { ops, keys, values }
    }

    fn describe_objects(&self, state: &State) -> String {
        let objects: Vec<String> = self
            .keys
            .iter()
            .zip(&state.objects)
            .map(|(key, object)| match object.value {
                Some(value) => {
                    format!("{key}={:?}@{}", self.values[value as usize], object.version)
                }
                None => format!("{key}=none@{}", object.version),
            })
            .collect();
        format!("[{}]", objects.join(", "))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Object {
    value: Option<u32>,
    version: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    highest: u64,
    objects: Vec<Object>,
}

/// The model's step for `op` at `state`: the next state if the operation's answer is
/// what the model answers there; `None` if not. Indeterminate operations step only
/// where they take effect (see the module doc).
fn step(state: &State, op: &Operation) -> Option<State> {
    let outcome = &op.entry.outcome;
    let indeterminate = matches!(outcome, Outcome::Indeterminate);
    let fenced = |token: u64| -> Result<(), Option<State>> {
        if token >= state.highest {
            return Ok(());
        }
        let justified = match outcome {
            Outcome::Stale { highest: Some(h) } => token < *h && *h <= state.highest,
            Outcome::Stale { highest: None } => true,
            _ => false,
        };
        Err(justified.then(|| state.clone()))
    };
    let applied = |version: u64| match outcome {
        Outcome::Applied { version: reported } => reported.is_none_or(|r| r == version),
        other => matches!(other, Outcome::Indeterminate),
    };
    match op.kind {
        Kind::Write {
            key,
            token,
            value,
            if_version,
        } => {
            if let Err(next) = fenced(token) {
                return next;
            }
            let object = state.objects[key];
            let current = object.value.map(|_| object.version);
            let holds = match if_version {
                None => true,
                Some(0) => current.is_none(),
                Some(v) => current == Some(v),
            };
            if !holds {
                return matches!(outcome, Outcome::PreconditionFailed).then(|| state.clone());
            }
            let version = object.version + 1;
            applied(version).then(|| {
                let mut next = state.clone();
                next.highest = token;
                next.objects[key] = Object {
                    value: Some(value),
                    version,
                };
                next
            })
        }
        Kind::Delete { key, token } => {
            if let Err(next) = fenced(token) {
                return next;
            }
            let object = state.objects[key];
            let version = object.version + u64::from(object.value.is_some());
            applied(version).then(|| {
                let mut next = state.clone();
                next.highest = token;
                next.objects[key] = Object {
                    value: None,
                    version,
                };
                next
            })
        }
        Kind::Advance { token } => {
            if let Err(next) = fenced(token) {
                return next;
            }
            (indeterminate || matches!(outcome, Outcome::Applied { .. })).then(|| {
                let mut next = state.clone();
                next.highest = token;
                next
            })
        }
        Kind::Read {
            key,
            value,
            version,
        } => {
            let object = state.objects[key];
            let same = object.value == value
                && (value.is_none() || version.is_none_or(|v| v == object.version));
            same.then(|| state.clone())
        }
    }
}

enum Verdict {
    Linearizable,
    Not { deepest: Vec<bool>, state: State },
    Undecided,
}

/// One call or return in the doubly linked event list.
#[derive(Clone, Copy)]
struct Event {
    op: usize,
    call: bool,
}

struct Search<'h, 'a> {
    history: &'h Prepared<'a>,
    events: Vec<Event>,
    /// For each operation, the index of its return event.
    returns: Vec<usize>,
    /// Links; index `events.len()` is the head sentinel and the end.
    next: Vec<usize>,
    prev: Vec<usize>,
}

impl<'h, 'a> Search<'h, 'a> {
    fn new(history: &'h Prepared<'a>) -> Search<'h, 'a> {
        let mut order: Vec<(u64, bool, usize)> = Vec::new();
        for (i, op) in history.ops.iter().enumerate() {
            order.push((op.call, true, i));
            order.push((op.ret, false, i));
        }
        // Calls first at equal times (`!call` sorts false before true).
        order.sort_by_key(|&(time, call, i)| (time, !call, i));
        let events: Vec<Event> = order
            .iter()
            .map(|&(_, call, op)| Event { op, call })
            .collect();
        let mut returns = vec![0; history.ops.len()];
        for (index, event) in events.iter().enumerate() {
            if !event.call {
                returns[event.op] = index;
            }
        }
        let n = events.len();
        let next = (0..=n).map(|i| if i == n { 0 } else { i + 1 }).collect();
        let prev = (0..=n).map(|i| if i == 0 { n } else { i - 1 }).collect();
        Search {
            history,
            events,
            returns,
            next,
            prev,
        }
    }

    fn head(&self) -> usize {
        self.events.len()
    }

    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.prev[i], self.next[i]);
        self.next[p] = n;
        self.prev[n] = p;
    }

    fn relink(&mut self, i: usize) {
        let (p, n) = (self.prev[i], self.next[i]);
        self.next[p] = i;
        self.prev[n] = i;
    }

    /// Takes an operation's call and return out of the list.
    fn lift(&mut self, call: usize) {
        let ret = self.returns[self.events[call].op];
        self.unlink(call);
        self.unlink(ret);
    }

    /// Puts them back, in the reverse order of [`Search::lift`].
    fn unlift(&mut self, call: usize) {
        let ret = self.returns[self.events[call].op];
        self.relink(ret);
        self.relink(call);
    }

    fn run(mut self) -> Verdict {
        let ops = &self.history.ops;
        let mut state = State {
            highest: 0,
            objects: vec![
                Object {
                    value: None,
                    version: 0,
                };
                self.history.keys.len()
            ],
        };
        let words = ops.len().div_ceil(64);
        let mut linearized = vec![0u64; words];
        let mut seen: HashSet<(Vec<u64>, State)> = HashSet::new();
        let mut stack: Vec<(usize, State)> = Vec::new();
        let mut deepest = (0, vec![false; ops.len()], state.clone());
        let head = self.head();
        let mut entry = self.next[head];
        let mut steps: u64 = 0;
        loop {
            if self.next[head] == head {
                return Verdict::Linearizable;
            }
            steps += 1;
            if steps > SEARCH_BUDGET {
                return Verdict::Undecided;
            }
            let event = self.events[entry];
            if event.call {
                let op = event.op;
                if let Some(next_state) = step(&state, &ops[op]) {
                    linearized[op / 64] |= 1 << (op % 64);
                    if seen.insert((linearized.clone(), next_state.clone())) {
                        stack.push((entry, std::mem::replace(&mut state, next_state)));
                        self.lift(entry);
                        if stack.len() > deepest.0 {
                            let placed = (0..ops.len())
                                .map(|i| linearized[i / 64] & (1 << (i % 64)) != 0)
                                .collect();
                            deepest = (stack.len(), placed, state.clone());
                        }
                        entry = self.next[head];
                        continue;
                    }
                    linearized[op / 64] &= !(1 << (op % 64));
                }
                entry = self.next[entry];
            } else {
                if ops[event.op].ret == INFINITY {
                    // Every answered operation is placed; the rest never took effect.
                    return Verdict::Linearizable;
                }
                let Some((call, previous)) = stack.pop() else {
                    let (_, deepest, state) = deepest;
                    return Verdict::Not { deepest, state };
                };
                state = previous;
                let op = self.events[call].op;
                linearized[op / 64] &= !(1 << (op % 64));
                self.unlift(call);
                entry = self.next[call];
            }
        }
    }
}
