//! Transactions across several fences, checked: as built (every call locks its
//! resource's row until the end of the transaction) they keep every invariant and reach
//! the states that make them worth checking; a resource only checked without its lock,
//! and writes applied before the commit, are each caught with a shortest trace.

use fencegate_model::multi::{
    MultiAction, MultiModel, MultiMutant, Status, ALL_OR_NOTHING, DEADLOCK_BROKEN, RAISE_WAITS,
    STALE_MEMBER_REFUSED, TERMS_HOLD_UNTIL_COMMIT, TWO_RESOURCES_COMMIT,
};
use stateright::{Checker, Model};

/// Unique states of the standard transactions are 321; the floor keeps a model that quietly
/// stopped exploring from passing.
const UNIQUE_STATES_FLOOR: usize = 320;

fn checked(model: MultiModel) -> impl Checker<MultiModel> {
    model.checker().spawn_bfs().join()
}

#[test]
fn transactions_across_fences_keep_every_invariant() {
    let checker = checked(MultiModel::standard(None));
    assert!(checker.is_done());
    for invariant in [TERMS_HOLD_UNTIL_COMMIT, ALL_OR_NOTHING] {
        assert!(
            checker.discovery(invariant).is_none(),
            "{invariant}: {:?}",
            checker.discovery(invariant).map(|path| path.into_actions())
        );
    }
    for reached in [
        TWO_RESOURCES_COMMIT,
        STALE_MEMBER_REFUSED,
        RAISE_WAITS,
        DEADLOCK_BROKEN,
    ] {
        assert!(
            checker.discovery(reached).is_some(),
            "never reached: {reached}"
        );
    }
    println!("{} unique states", checker.unique_state_count());
    assert!(
        checker.unique_state_count() >= UNIQUE_STATES_FLOOR,
        "only {} states explored",
        checker.unique_state_count()
    );
}

/// The Iceberg trap: the leader checks resource 1 without locking it, a new term raises
/// it, and the leader commits on a term that has passed.
#[test]
fn a_resource_checked_without_its_lock_is_caught() {
    let checker = checked(MultiModel::standard(Some(MultiMutant::CheckWithoutLock)));
    let path = checker
        .discovery(TERMS_HOLD_UNTIL_COMMIT)
        .expect("the mutant is caught");
    // The steps up to the first state that breaks the invariant.
    let mut actions = Vec::new();
    for (state, action) in path.clone().into_vec() {
        if state.commits_on_current_terms.contains(&false) {
            break;
        }
        actions.extend(action);
    }
    // The leader fences and writes 0, checks 1; the new term raises 1 and commits; the
    // leader commits.
    assert_eq!(
        actions,
        [
            MultiAction::Step { tx: 0 },
            MultiAction::Step { tx: 0 },
            MultiAction::Step { tx: 0 },
            MultiAction::Step { tx: 1 },
            MultiAction::Step { tx: 1 },
            MultiAction::Step { tx: 0 },
        ]
    );
    let last = path.last_state();
    assert_eq!(last.status[0], Status::Committed);
    assert!(last.fences[1] >= 2, "resource 1 was raised by a newer term");
    assert!(checker.discovery(ALL_OR_NOTHING).is_none());
}

/// Writes that reach the data as they are made are seen before their transaction
/// commits — and stay seen if a stale member then rolls it back.
#[test]
fn writes_before_the_commit_are_caught() {
    let checker = checked(MultiModel::standard(Some(MultiMutant::WritesBeforeCommit)));
    let path = checker
        .discovery(ALL_OR_NOTHING)
        .expect("the mutant is caught");
    let last = path.last_state();
    assert!(
        (0..last.status.len())
            .any(|tx| last.applied[tx].contains(&true) && last.status[tx] != Status::Committed),
        "a write of a transaction that has not committed is seen: {last:?}"
    );
    assert!(checker.discovery(TERMS_HOLD_UNTIL_COMMIT).is_none());
}
