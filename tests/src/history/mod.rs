//! Histories of runs, and the linearizability checker that judges them.
//!
//! A run records every operation a client made as an [`Entry`]: which client, what it
//! asked ([`Op`]: a write, a delete, a read, a fence advance), when it asked and when it
//! had its answer, and what the answer was ([`Outcome`]). [`check`] then decides whether
//! some order of the operations, each placed between its invocation and its completion,
//! is a run of the sequential model of a fenced register (see [`check`] for the model
//! and the search).
//!
//! # Time
//!
//! Instants are nanoseconds of the system's wall clock ([`now`]). Writers in other
//! processes record their own instants, and one clock of one machine orders them all;
//! the runs never step that clock (a writer's skewed clock is simulated in the writer's
//! own timer, see `crate::faults`).
//!
//! # What an answer tells
//!
//! [`Outcome::Indeterminate`] is an answer that does not say whether the operation took
//! effect: `503 backend_unavailable` with `write_applied: null`, `500 internal`, a
//! timeout, a broken connection, a writer killed before its answer. Such an operation
//! may take effect at any moment after its invocation, even after the client gave up
//! on it, or never. [`Outcome::NotApplied`] is an answer that says it certainly did not
//! (`write_applied: false`, `overloaded`, `shutting_down`, a read that failed): it is
//! left out of the check.

mod check;

pub use check::{check, check_resource, Violation, SEARCH_BUDGET};

use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The wall clock in nanoseconds since the Unix epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// What a client asked of a resource.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Op {
    /// `PUT /v1/kv/{resource}/{key}` with `Fencing-Token: token`; with `if_version`,
    /// `If-Match: "<version>"` (`0`: the object must not exist).
    Write {
        key: String,
        token: u64,
        value: String,
        if_version: Option<u64>,
    },
    /// `DELETE /v1/kv/{resource}/{key}`.
    Delete { key: String, token: u64 },
    /// `GET /v1/kv/{resource}/{key}`.
    Read { key: String },
    /// `POST /v1/fences/{resource}/advance`, or a hosted lease's acquire, which raises
    /// the fence to its new token in the same step.
    Advance { token: u64 },
}

/// What the client learned.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The write, delete or advance was applied; writes and deletes report the
    /// object's version after it.
    Applied { version: Option<u64> },
    /// `409 stale_token`, with the `highest` the answer named.
    Stale { highest: Option<u64> },
    /// `412 version_mismatch`: the fence let it through, the precondition did not hold.
    PreconditionFailed,
    /// A read: the value and version, or `None` for a missing or deleted object.
    Read {
        value: Option<String>,
        version: Option<u64>,
    },
    /// Unknown whether it took effect: it may have, at any time after its invocation.
    Indeterminate,
    /// Certainly without effect, and without information: left out of the check.
    NotApplied,
}

/// One operation of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    pub client: u32,
    pub resource: String,
    pub op: Op,
    /// When the request was about to be sent ([`now`]).
    pub invoked: u64,
    /// When the answer (or the error) arrived; ignored for indeterminate operations.
    pub completed: u64,
    pub outcome: Outcome,
}

impl Entry {
    /// One line for reports.
    pub fn describe(&self) -> String {
        let op = match &self.op {
            Op::Write {
                key,
                token,
                value,
                if_version,
            } => {
                let precondition = if_version.map_or(String::new(), |v| format!(" if {v}"));
                format!("write({key}, token {token}, {value:?}{precondition})")
            }
            Op::Delete { key, token } => format!("delete({key}, token {token})"),
            Op::Read { key } => format!("read({key})"),
            Op::Advance { token } => format!("advance(token {token})"),
        };
        format!(
            "client {} {op} -> {:?} [{:.3} ms .. {:.3} ms]",
            self.client,
            self.outcome,
            self.invoked as f64 / 1e6,
            self.completed as f64 / 1e6
        )
    }
}

/// A history being recorded by several tasks at once.
#[derive(Debug, Clone, Default)]
pub struct Recorder {
    entries: Arc<Mutex<Vec<Entry>>>,
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder::default()
    }

    pub fn record(&self, entry: Entry) {
        self.entries.lock().unwrap().push(entry);
    }

    pub fn extend(&self, entries: impl IntoIterator<Item = Entry>) {
        self.entries.lock().unwrap().extend(entries);
    }

    /// Everything recorded so far.
    pub fn entries(&self) -> Vec<Entry> {
        self.entries.lock().unwrap().clone()
    }
}

/// Counts of a history, for summaries.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub operations: usize,
    pub applied: usize,
    pub stale: usize,
    pub reads: usize,
    pub indeterminate: usize,
    pub not_applied: usize,
}

impl Counts {
    pub fn of(entries: &[Entry]) -> Counts {
        let mut counts = Counts {
            operations: entries.len(),
            ..Counts::default()
        };
        for entry in entries {
            match entry.outcome {
                Outcome::Applied { .. } => counts.applied += 1,
                Outcome::Stale { .. } => counts.stale += 1,
                Outcome::Read { .. } => counts.reads += 1,
                Outcome::Indeterminate => counts.indeterminate += 1,
                Outcome::NotApplied | Outcome::PreconditionFailed => counts.not_applied += 1,
            }
        }
        counts
    }
}

/// The outcome of `op` from the gateway's answer: `status`, the JSON `body` (the raw
/// value for reads) and, for reads, the `ETag`. `Err` for an answer the workloads
/// never expect (a client error is a bug of the harness, not a fault).
pub fn outcome_of(op: &Op, status: u16, body: &str, etag: Option<&str>) -> Result<Outcome, String> {
    let json = || serde_json::from_str::<Value>(body).unwrap_or(Value::Null);
    let unexpected = || Err(format!("unexpected answer {status} {body}"));
    if let Op::Read { .. } = op {
        return match status {
            200 => Ok(Outcome::Read {
                value: Some(body.to_owned()),
                version: etag.and_then(|tag| tag.trim_matches('"').parse().ok()),
            }),
            404 => Ok(Outcome::Read {
                value: None,
                version: None,
            }),
            503 => Ok(Outcome::NotApplied),
            _ => unexpected(),
        };
    }
    let body = json();
    match status {
        200 | 201 => Ok(Outcome::Applied {
            version: body.get("version").and_then(Value::as_u64),
        }),
        409 if body["error"] == "stale_token" => Ok(Outcome::Stale {
            highest: body.get("highest").and_then(Value::as_u64),
        }),
        412 => Ok(Outcome::PreconditionFailed),
        503 if body["error"] == "backend_unavailable" => Ok(match body.get("write_applied") {
            Some(Value::Bool(false)) => Outcome::NotApplied,
            _ => Outcome::Indeterminate,
        }),
        // Answered at once, before anything was tried.
        503 if body["error"] == "overloaded" || body["error"] == "shutting_down" => {
            Ok(Outcome::NotApplied)
        }
        500 => Ok(Outcome::Indeterminate),
        _ => unexpected(),
    }
}
