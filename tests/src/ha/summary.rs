//! What one fault's run found ([`Summary`]), measured from its history: counts,
//! violations, writes lost, tokens granted twice, and how long writes were unavailable.

use std::collections::BTreeSet;
use std::time::Duration;

use super::run::Fault;
use super::{Held, Outage};
use crate::history::{self, Counts, Entry, Op, Outcome};

/// What one fault's run found.
pub struct Summary {
    pub fault: Fault,
    pub counts: Counts,
    pub violations: Vec<history::Violation>,
    pub late_applied: usize,
    /// Answers `500 internal` (to acquires and writes): the gateway did not classify
    /// the database's error as unavailability. (A write that reached a node still in
    /// recovery was one, until `25006` was counted as an aborted statement.)
    pub internal: usize,
    /// Acknowledged writes whose key's final version is below theirs.
    pub lost: Vec<String>,
    /// Lease grants whose token an earlier grant of the same resource had too.
    pub tokens_twice: usize,
    /// The longest time without an acknowledged write, from the fault on.
    pub unavailable: Duration,
    /// From the fault, and from the moment the harness saw a primary again (negative:
    /// writes resumed before it did), to the end of the longest gap — when it was an
    /// outage (`OUTAGE`).
    pub fault_to_write: Option<f64>,
    pub recovery_to_write: Option<f64>,
    /// Each gateway's outage as its probe saw it, by the probe's label.
    pub outages: Vec<(String, Outage)>,
    /// How each gateway's lease holder fared.
    pub holders: Vec<Held>,
}

/// A gap between acknowledged writes at least this long is an outage; shorter ones are
/// the writers' own pace (lease turns, pauses).
pub(super) const OUTAGE: Duration = Duration::from_millis(500);

impl Summary {
    pub(super) fn line(&self, mode: &str) -> String {
        format!(
            "{mode:<12} {:<16} {:>5} operations {:>5} acknowledged {:>4} stale {:>4} indeterminate \
             ({:>3} of them 500) {:>2} violations {:>2} late applied {:>2} lost {:>2} tokens twice  \
             unavailable {:>5.2} s (fault -> write {}, primary seen -> write {})",
            self.fault.name(),
            self.counts.operations,
            self.counts.applied,
            self.counts.stale,
            self.counts.indeterminate,
            self.internal,
            self.violations.len(),
            self.late_applied,
            self.lost.len(),
            self.tokens_twice,
            self.unavailable.as_secs_f64(),
            seconds(self.fault_to_write),
            seconds(self.recovery_to_write),
        )
    }

    /// Each gateway's outage: from the fault to its first accepted write after the
    /// longest gap, or the longest gap alone when it was too short to be one.
    pub(super) fn outages_line(&self, mode: &str) -> String {
        let outages: Vec<String> = self
            .outages
            .iter()
            .map(|(label, outage)| {
                if outage.longest_gap >= OUTAGE {
                    format!("{label} {:.2} s", outage.fault_to_write.as_secs_f64())
                } else {
                    format!(
                        "{label} none (longest gap {:.2} s)",
                        outage.longest_gap.as_secs_f64()
                    )
                }
            })
            .collect();
        format!(
            "{mode:<12} {:<16} fault -> first accepted write: {}",
            self.fault.name(),
            outages.join(", ")
        )
    }

    /// How each gateway's lease holder fared, and whether that is checked.
    pub(super) fn holders_line(&self, mode: &str) -> String {
        let (ttl, checked) = self.fault.holder_ttl();
        let holders: Vec<String> = self.holders.iter().map(Held::describe).collect();
        format!(
            "{mode:<12} {:<16} lease holders, ttl {ttl:?} ({}): {}",
            self.fault.name(),
            if checked {
                "must keep their terms"
            } else {
                "not checked"
            },
            holders.join(", ")
        )
    }

    /// Where the README promises it, every holder kept its term.
    pub fn assert_holders_kept(&self) {
        let (ttl, checked) = self.fault.holder_ttl();
        if !checked {
            return;
        }
        for held in &self.holders {
            assert!(
                held.kept(),
                "{}: a holder of a {ttl:?} lease did not keep its term: {}\n{}",
                self.fault.name(),
                held.describe(),
                self.outages_line("outages")
            );
        }
    }
}

/// Grants (acquires answered with a token) of a resource whose token was granted
/// before: a token issued twice.
pub(super) fn tokens_twice(entries: &[Entry]) -> usize {
    let mut granted = BTreeSet::new();
    entries
        .iter()
        .filter_map(|entry| match (&entry.op, &entry.outcome) {
            (Op::Advance { token }, Outcome::Applied { .. }) => Some((&entry.resource, *token)),
            _ => None,
        })
        .filter(|grant| !granted.insert(*grant))
        .count()
}

fn is_acknowledged_write(entry: &Entry) -> bool {
    matches!(entry.op, Op::Write { .. }) && matches!(entry.outcome, Outcome::Applied { .. })
}

pub(super) fn acknowledged_after(entries: &[Entry], instant: u64) -> bool {
    entries
        .iter()
        .any(|entry| is_acknowledged_write(entry) && entry.invoked >= instant)
}

/// Acknowledged writes whose version is above the final read of their key: writes the
/// cluster lost. (The checker finds these too; this names them plainly.)
pub(super) fn lost(entries: &[Entry]) -> Vec<String> {
    let final_version = |key: &str| {
        entries
            .iter()
            .rev()
            .find_map(|entry| match (&entry.op, &entry.outcome) {
                (Op::Read { key: read }, Outcome::Read { version, .. }) if read == key => {
                    Some(version.unwrap_or(0))
                }
                _ => None,
            })
    };
    entries
        .iter()
        .filter(|entry| is_acknowledged_write(entry))
        .filter(|entry| {
            let (Op::Write { key, .. }, Outcome::Applied { version }) = (&entry.op, &entry.outcome)
            else {
                return false;
            };
            version.unwrap_or(0) > final_version(key).unwrap_or(0)
        })
        .map(Entry::describe)
        .collect()
}

/// The longest time between two acknowledged writes' answers, counted from `fault_at`
/// (the last answer before it opens the first gap), and when that gap closed.
pub(super) fn longest_gap(entries: &[Entry], fault_at: u64) -> (Duration, u64) {
    let answers = entries
        .iter()
        .filter(|entry| is_acknowledged_write(entry))
        .map(|entry| entry.completed)
        .collect();
    super::longest_gap(answers, fault_at)
}

pub(super) fn seconds_between(from: u64, to: u64) -> f64 {
    (to as f64 - from as f64) / 1e9
}

fn seconds(value: Option<f64>) -> String {
    value.map_or_else(|| "-".to_owned(), |s| format!("{s:.2} s"))
}
