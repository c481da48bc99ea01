//! The history checker on hand-written histories: it accepts what a fenced register
//! may do, and rejects each kind of violation a broken gateway could produce.

use std::time::Instant;

use fencegate_tests::history::{check, Entry, Op, Outcome};

/// A history under construction: times in milliseconds.
#[derive(Default)]
struct History(Vec<Entry>);

impl History {
    fn op(mut self, client: u32, op: Op, from_ms: u64, to_ms: u64, outcome: Outcome) -> Self {
        self.0.push(Entry {
            client,
            resource: "r".into(),
            op,
            invoked: from_ms * 1_000_000,
            completed: to_ms * 1_000_000,
            outcome,
        });
        self
    }

    fn write(self, client: u32, token: u64, value: &str, span: (u64, u64), out: Outcome) -> Self {
        let op = Op::Write {
            key: "k".into(),
            token,
            value: value.into(),
            if_version: None,
        };
        self.op(client, op, span.0, span.1, out)
    }

    fn read(self, client: u32, span: (u64, u64), value: Option<&str>, version: u64) -> Self {
        let op = Op::Read { key: "k".into() };
        let outcome = Outcome::Read {
            value: value.map(str::to_owned),
            version: value.map(|_| version),
        };
        self.op(client, op, span.0, span.1, outcome)
    }

    fn advance(self, client: u32, token: u64, span: (u64, u64), out: Outcome) -> Self {
        self.op(client, Op::Advance { token }, span.0, span.1, out)
    }

    fn violations(&self) -> Vec<String> {
        check(&self.0).iter().map(ToString::to_string).collect()
    }

    fn assert_linearizable(&self) {
        let violations = self.violations();
        assert!(violations.is_empty(), "{violations:#?}");
    }

    fn assert_violation(&self, expected: &str) {
        let violations = self.violations();
        assert!(
            violations.iter().any(|v| v.contains(expected)),
            "expected a violation with {expected:?}, got {violations:#?}"
        );
    }
}

fn applied(version: u64) -> Outcome {
    Outcome::Applied {
        version: Some(version),
    }
}

fn stale(highest: u64) -> Outcome {
    Outcome::Stale {
        highest: Some(highest),
    }
}

/// The seed's timeline: write(8) accepted, the delayed write(7) rejected with 8.
#[test]
fn the_seed_timeline_is_linearizable() {
    History::default()
        .write(1, 7, "a", (0, 2), applied(1))
        .advance(2, 8, (3, 4), Outcome::Applied { version: None })
        .write(2, 8, "b", (5, 6), applied(2))
        .write(1, 7, "late", (1, 9), stale(8))
        .read(3, (10, 11), Some("b"), 2)
        .assert_linearizable();
}

/// Concurrent writes may land in either order; the versions tell which.
#[test]
fn concurrent_writes_in_either_order_are_linearizable() {
    History::default()
        .write(1, 5, "a", (0, 10), applied(2))
        .write(2, 5, "b", (0, 10), applied(1))
        .read(3, (11, 12), Some("a"), 2)
        .assert_linearizable();
    // A lower token that overlaps the higher one may be applied first.
    History::default()
        .write(1, 8, "new", (0, 10), applied(2))
        .write(2, 7, "old", (1, 9), applied(1))
        .assert_linearizable();
}

/// A stale write acknowledged after a higher token's acknowledgement: the bug
/// fencing exists to prevent.
#[test]
fn a_stale_write_acknowledged_after_a_higher_token_is_a_violation() {
    History::default()
        .write(2, 8, "new", (0, 5), applied(1))
        .write(1, 7, "old", (10, 12), applied(2))
        .assert_violation("not linearizable");
}

/// An acknowledged write that a later read does not see.
#[test]
fn a_lost_acknowledged_write_is_a_violation() {
    History::default()
        .write(1, 5, "a", (0, 2), applied(1))
        .write(1, 5, "b", (3, 4), applied(2))
        .read(2, (10, 11), Some("a"), 1)
        .assert_violation("not linearizable");
    History::default()
        .write(1, 5, "a", (0, 2), applied(1))
        .read(2, (10, 11), None, 0)
        .assert_violation("not linearizable");
}

/// Two acknowledged writes with one version: one of them was lost.
#[test]
fn a_repeated_version_is_a_violation() {
    History::default()
        .write(1, 5, "a", (0, 2), applied(1))
        .write(2, 5, "b", (3, 4), applied(1))
        .assert_violation("not linearizable");
}

/// A rejection naming a highest token nobody applied, or one that was applied only
/// after the rejection was answered.
#[test]
fn an_unjustified_rejection_is_a_violation() {
    History::default()
        .write(1, 5, "a", (0, 2), applied(1))
        .write(1, 5, "b", (3, 4), stale(9))
        .assert_violation("not linearizable");
    History::default()
        .write(1, 5, "a", (0, 2), stale(6))
        .write(2, 6, "b", (3, 4), applied(1))
        .assert_violation("not linearizable");
    // Without a highest, the rejection still needs a higher token applied before it.
    History::default()
        .write(1, 5, "a", (0, 2), Outcome::Stale { highest: None })
        .assert_violation("not linearizable");
    // A write accepted with a token the fence had already passed is not justified either.
    History::default()
        .advance(1, 9, (0, 1), Outcome::Applied { version: None })
        .write(1, 5, "b", (3, 4), applied(1))
        .assert_violation("not linearizable");
}

/// A rejection may name a highest that a lagging cache held, lower than the true
/// highest, but not one above it.
#[test]
fn a_rejection_may_name_a_lagging_highest() {
    History::default()
        .advance(1, 6, (0, 1), Outcome::Applied { version: None })
        .advance(2, 9, (2, 3), Outcome::Applied { version: None })
        .write(3, 5, "x", (4, 5), stale(6))
        .assert_linearizable();
}

/// A rejection justified by a raise that was still in flight: linearizable if the
/// raise's call came before the rejection's answer.
#[test]
fn a_rejection_justified_by_a_concurrent_raise_is_linearizable() {
    History::default()
        .write(2, 8, "b", (0, 10), applied(1))
        .write(1, 7, "a", (2, 3), stale(8))
        .assert_linearizable();
}

/// An indeterminate write may take effect later, or never.
#[test]
fn indeterminate_writes_take_effect_later_or_never() {
    // Never: nothing saw it.
    History::default()
        .write(1, 5, "lost?", (0, 1), Outcome::Indeterminate)
        .write(2, 5, "b", (2, 3), applied(1))
        .assert_linearizable();
    // Later: after the client gave up, it raised the fence and took version 2.
    History::default()
        .write(1, 9, "late", (0, 1), Outcome::Indeterminate)
        .write(2, 5, "b", (2, 3), applied(1))
        .write(2, 5, "c", (4, 5), stale(9))
        .read(3, (6, 7), Some("late"), 2)
        .assert_linearizable();
    // But not before it was sent.
    History::default()
        .write(2, 5, "b", (0, 1), stale(9))
        .write(1, 9, "late", (2, 3), Outcome::Indeterminate)
        .assert_violation("not linearizable");
}

/// Writes that certainly did not apply are left out; a precondition failure changes
/// nothing, not even the fence.
#[test]
fn not_applied_and_precondition_failures_change_nothing() {
    History::default()
        .write(1, 9, "x", (0, 1), Outcome::NotApplied)
        .op(
            1,
            Op::Write {
                key: "k".into(),
                token: 8,
                value: "y".into(),
                if_version: Some(3),
            },
            2,
            3,
            Outcome::PreconditionFailed,
        )
        .write(2, 5, "b", (4, 5), applied(1))
        .read(3, (6, 7), Some("b"), 1)
        .assert_linearizable();
}

/// Deletes leave a tombstone whose version only a value's deletion raises.
#[test]
fn deletes_follow_the_tombstone_rules() {
    let delete = |token| Op::Delete {
        key: "k".into(),
        token,
    };
    History::default()
        .op(1, delete(3), 0, 1, applied(0))
        .write(1, 3, "a", (2, 3), applied(1))
        .op(1, delete(3), 4, 5, applied(2))
        .op(1, delete(3), 6, 7, applied(2))
        .read(2, (8, 9), None, 0)
        .write(1, 3, "b", (10, 11), applied(3))
        .assert_linearizable();
}

/// Resources are checked apart: one resource's fence never justifies another's
/// rejection.
#[test]
fn resources_are_independent() {
    let mut history = History::default()
        .advance(1, 9, (0, 1), Outcome::Applied { version: None })
        .0;
    history.push(Entry {
        client: 2,
        resource: "other".into(),
        op: Op::Advance { token: 5 },
        invoked: 2_000_000,
        completed: 3_000_000,
        outcome: stale(9),
    });
    let violations = check(&history);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert_eq!(violations[0].resource, "other");
}

/// A few hundred operations of four overlapping clients, with some indeterminate,
/// check in well under a second.
#[test]
fn a_long_concurrent_history_checks_quickly() {
    let mut history = History::default();
    let mut version = 0;
    let mut token = 1;
    let mut t = 0;
    for round in 0..100u64 {
        if round % 10 == 0 {
            token += 1;
            history = history.advance(0, token, (t, t + 3), Outcome::Applied { version: None });
        }
        // Three writes that overlap each other; their versions in the order applied.
        for client in 1..=3 {
            version += 1;
            let value = format!("v{round}-{client}");
            history = history.write(client, token, &value, (t, t + 4), applied(version));
        }
        // A stale one from the previous term, and an indeterminate one.
        history = history.write(4, token - 1, "old", (t + 1, t + 2), stale(token));
        if round % 7 == 0 {
            history = history.write(5, token - 1, "gone", (t, t + 1), Outcome::Indeterminate);
        }
        t += 5;
    }
    let started = Instant::now();
    history.assert_linearizable();
    println!(
        "{} operations checked in {:?}",
        history.0.len(),
        started.elapsed()
    );
}
