//! The S3 door's mapped layout, checked: as built (a fresh physical key per put with
//! `If-None-Match: *`, and a commit that checks the fence and locks the intent before
//! it moves the mapping) it keeps every invariant and reaches the states that make them
//! worth checking; each mutant is caught by the invariant that guards against it.

use fencegate_model::s3::{
    Phase, S3Action, S3Model, S3Mutant, S3State, ACKNOWLEDGED_VISIBLE, LATE_UPLOAD_UNMAPPED,
    MAPPINGS_LIVE, NO_OLDER_TERM_VISIBLE, PREVIOUS_OBJECT_KEPT, REFUSED_COMMIT_COLLECTED,
    WRITE_ONCE,
};
use stateright::{Checker, Model};

/// Unique states of the layout as built are 544; the floor keeps a model that quietly
/// stopped exploring from passing.
const UNIQUE_STATES_FLOOR: usize = 540;

const INVARIANTS: [&str; 4] = [
    NO_OLDER_TERM_VISIBLE,
    MAPPINGS_LIVE,
    ACKNOWLEDGED_VISIBLE,
    WRITE_ONCE,
];

fn checked(model: S3Model) -> impl Checker<S3Model> {
    model.checker().spawn_bfs().join()
}

#[test]
fn the_mapped_layout_keeps_every_invariant() {
    let checker = checked(S3Model::new(None));
    assert!(checker.is_done());
    for invariant in INVARIANTS {
        assert!(
            checker.discovery(invariant).is_none(),
            "{invariant}: {:?}",
            checker.discovery(invariant).map(|path| path.into_actions())
        );
    }
    for reached in [
        LATE_UPLOAD_UNMAPPED,
        REFUSED_COMMIT_COLLECTED,
        PREVIOUS_OBJECT_KEPT,
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

/// The actions up to the first state that breaks `invariant`, and that state.
fn counterexample(mutant: S3Mutant) -> (Vec<S3Action>, S3State) {
    let model = S3Model::new(Some(mutant));
    let checker = checked(model.clone());
    let invariant = mutant.caught_by();
    let path = checker
        .discovery(invariant)
        .unwrap_or_else(|| panic!("{mutant} is not caught by {invariant}"));
    let holds = model
        .properties()
        .into_iter()
        .find(|property| property.name == invariant)
        .expect("the invariant is a property of the model")
        .condition;
    let mut actions = Vec::new();
    for (state, action) in path.into_vec() {
        if !holds(&model, &state) {
            return (actions, state);
        }
        actions.extend(action);
    }
    panic!("{mutant}: the path breaks nothing");
}

/// Whether `steps` occur in `actions` in this order, other actions between them.
fn in_order(actions: &[S3Action], steps: &[S3Action]) -> bool {
    let mut rest = actions.iter();
    steps.iter().all(|step| rest.any(|action| action == step))
}

/// Checked, then PUT under the key readers read: the old term's upload lands after the
/// new term was acknowledged, and readers see it.
#[test]
fn check_then_put_is_caught() {
    let (actions, state) = counterexample(S3Mutant::CheckThenPut);
    assert!(
        in_order(
            &actions,
            &[
                S3Action::RecordIntent { put: 0 },
                S3Action::Advance,
                S3Action::Upload { put: 0 },
            ]
        ),
        "{actions:?}"
    );
    assert_eq!(state.visible().map(|object| object.token), Some(1));
    assert_eq!(state.fence, 2);
}

/// A commit that does not lock its intent maps an object the collector took.
#[test]
fn a_commit_without_the_intent_lock_is_caught() {
    let (actions, state) = counterexample(S3Mutant::NoIntentLock);
    let put = state.acknowledged.expect("a write was acknowledged");
    assert!(
        in_order(
            &actions,
            &[
                S3Action::RecordIntent { put },
                S3Action::Upload { put },
                S3Action::CollectIntent { put },
                S3Action::CommitMapping { put },
            ]
        ),
        "{actions:?}"
    );
    assert_eq!(state.puts[put].phase, Phase::Committed);
    assert_eq!(state.bucket[put], None);
}

/// Two puts on one physical key without `If-None-Match`: the second upload replaces
/// the bytes under the first's acknowledged mapping.
#[test]
fn an_upload_without_if_none_match_is_caught() {
    let (actions, state) = counterexample(S3Mutant::NoIfNoneMatch);
    assert_eq!(actions.last(), Some(&S3Action::Upload { put: 1 }));
    assert_eq!(state.acknowledged, Some(0));
    assert_eq!(state.visible().map(|object| object.put), Some(1));
    let checker = checked(S3Model::new(Some(S3Mutant::NoIfNoneMatch)));
    assert!(checker.discovery(WRITE_ONCE).is_some());
}
