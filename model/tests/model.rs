//! The model checked: the protocol as built keeps every invariant and reaches every
//! state that makes them worth checking; each mutant is caught by the invariant it
//! breaks, with the shortest trace that shows it; and the seed articles' timelines are
//! paths of the model with the outcomes they describe.

use fencegate_model::check::shortest_counterexample;
use fencegate_model::model::Kind;
use fencegate_model::properties::{
    ACKNOWLEDGED_WRITES_ARE_DURABLE, CACHE_NEVER_ABOVE_DURABLE, FENCE_MOVES_ONLY_WITH_ACCEPTED,
    NO_WRITE_AFTER_HIGHER_ACK, REQUEST_DUPLICATED, STALE_REJECTIONS_ARE_JUSTIFIED,
};
use fencegate_model::state::{Decider, Event, Op, Request};
use fencegate_model::{check, trace, Action, Bounds, FencingModel, Mutant, Options, State};
use stateright::{Model, Path};

/// Unique states of the default bounds are 506,233; the floors keep a model that
/// quietly stopped exploring from passing.
const DEFAULT_STATES_FLOOR: usize = 500_000;
/// Unique states with three requests (and no duplication) are 357,220.
const THREE_REQUESTS_STATES_FLOOR: usize = 350_000;
/// Unique states with two resources are 494,631.
const TWO_RESOURCES_STATES_FLOOR: usize = 490_000;
/// Every mutant's shortest counterexample is shorter than this.
const MUTANT_STEPS: usize = 12;

const A: u8 = 0;
const B: u8 = 1;

/// Checks every state of `model` and asserts that it passed, with at least `floor`
/// unique states.
fn passes(model: FencingModel, floor: usize) {
    let report = check(model.clone(), &Options::default());
    println!("{:?}: {}", model.bounds, report.render(&model));
    assert!(report.violations.is_empty(), "{}", report.render(&model));
    assert!(
        report.complete,
        "the checker stopped before it had seen every state"
    );
    assert!(
        report.unreached.is_empty(),
        "states that must be reachable were not reached: {:?}",
        report.unreached
    );
    assert!(
        report.unique_states >= floor,
        "only {} unique states explored (floor {floor})",
        report.unique_states
    );
}

#[test]
fn the_protocol_keeps_every_invariant() {
    passes(
        FencingModel::new(Bounds::default(), None),
        DEFAULT_STATES_FLOOR,
    );
}

#[test]
fn three_requests_keep_every_invariant() {
    let bounds = Bounds {
        max_sends: 3,
        max_epoch: 2,
        // A duplicate is one more request; three and a copy take minutes to check.
        max_duplicates: 0,
        ..Bounds::default()
    };
    let model = FencingModel::new(bounds, None);
    let report = check(model.clone(), &Options::default());
    println!("{:?}: {}", model.bounds, report.render(&model));
    assert!(report.complete && report.violations.is_empty());
    // Without duplication, no state holds two copies; everything else is reached.
    assert_eq!(report.unreached, [REQUEST_DUPLICATED]);
    assert!(report.unique_states >= THREE_REQUESTS_STATES_FLOOR);
}

#[test]
fn two_resources_keep_every_invariant() {
    let bounds = Bounds {
        resources: 2,
        max_epoch: 2,
        ..Bounds::default()
    };
    passes(FencingModel::new(bounds, None), TWO_RESOURCES_STATES_FLOOR);
}

/// Finds the shortest path on which `mutant` breaks `invariant`, prints it, checks that
/// its last state does break it, and that the same steps on the protocol as built keep
/// it.
fn caught(mutant: Mutant, invariant: &'static str) -> Path<State, Action> {
    let model = FencingModel::new(Bounds::default(), Some(mutant));
    let (_, report) = shortest_counterexample(&model, Some(invariant), MUTANT_STEPS)
        .unwrap_or_else(|| panic!("{mutant} keeps \"{invariant}\" for {MUTANT_STEPS} steps"));
    let path = report.violations[invariant].clone();
    println!(
        "{mutant} breaks \"{invariant}\" in {} steps:\n{}\n",
        path.clone().into_actions().len(),
        trace::narrate(&model, &path)
    );
    let property = model.property(invariant);
    assert!(!(property.condition)(&model, path.last_state()));

    let correct = FencingModel::new(Bounds::default(), None);
    let actions = path.clone().into_actions();
    let replayed = Path::from_actions(&correct, correct.init_states().remove(0), &actions)
        .expect("the protocol as built can take the same steps");
    assert!(
        (property.condition)(&correct, replayed.last_state()),
        "the protocol as built breaks \"{invariant}\" on the same steps"
    );
    path
}

#[test]
fn raising_the_cache_before_commit_is_caught() {
    caught(Mutant::CacheBeforeCommit, CACHE_NEVER_ABOVE_DURABLE);
    // And what that costs: a rejection naming a token nothing committed.
    caught(Mutant::CacheBeforeCommit, STALE_REJECTIONS_ARE_JUSTIFIED);
}

#[test]
fn checking_the_fence_outside_the_transaction_is_caught() {
    caught(Mutant::CheckOutsideTransaction, NO_WRITE_AFTER_HIGHER_ACK);
}

#[test]
fn keeping_a_stale_group_member_is_caught() {
    caught(Mutant::StaleMemberKept, ACKNOWLEDGED_WRITES_ARE_DURABLE);
}

#[test]
fn a_failed_precondition_keeping_its_fence_raise_is_caught() {
    caught(
        Mutant::PreconditionKeepsFence,
        FENCE_MOVES_ONLY_WITH_ACCEPTED,
    );
}

fn put(id: u8, writer: u8, token: u8) -> Request {
    Request {
        id,
        writer,
        token,
        resource: 0,
        op: Op::Put,
    }
}

fn send_put(writer: u8) -> Action {
    Action::Send {
        writer,
        resource: 0,
        what: Kind::Put,
    }
}

/// Runs `steps` from the initial state; every one must be possible.
fn run(steps: &[Action]) -> State {
    let model = FencingModel::new(Bounds::default(), None);
    let path = Path::from_actions(&model, model.init_states().remove(0), steps)
        .expect("every step is possible");
    println!("{}\n", trace::narrate(&model, &path));
    assert_eq!(path.clone().into_actions().len(), steps.len());
    path.last_state().clone()
}

#[test]
fn the_seed_delayed_request_is_rejected_by_the_database() {
    let state = run(&[
        // t0: A holds epoch 1.
        Action::Acquire(A),
        // t1: A sends write(1); the network holds it.
        send_put(A),
        // t2: A's lease expires (A stopped leading on its own clock first).
        Action::Expire { slept: false },
        // t3: B acquires epoch 2.
        Action::Acquire(B),
        // t4: B's write(2) is accepted.
        send_put(B),
        Action::Deliver {
            request: put(2, B, 2),
            gateway: 0,
        },
        Action::CommitGroup(0),
        // t5: the delayed write(1) arrives, at the other replica, whose cache knows
        // nothing: the database rejects it.
        Action::Deliver {
            request: put(1, A, 1),
            gateway: 1,
        },
        Action::CommitGroup(1),
    ]);
    assert_eq!(
        state.history.events,
        [Event::Rejected {
            id: 1,
            resource: 0,
            presented: 1,
            highest: 2,
            durable: 2,
            by: Decider::Database,
        }]
    );
    assert_eq!(state.database.objects[0].value, 2);
    assert_eq!(
        state.gateways[1].cache[0], 2,
        "the rejection taught the cache"
    );
}

#[test]
fn the_seed_paused_leader_is_rejected_by_the_cache() {
    let state = run(&[
        // t=0: A holds epoch 1.
        Action::Acquire(A),
        // t=1..21: A is frozen across its expiry at t=15.
        Action::Expire { slept: true },
        // t=15: B takes over with epoch 2 and writes.
        Action::Acquire(B),
        send_put(B),
        Action::Deliver {
            request: put(1, B, 2),
            gateway: 0,
        },
        Action::CommitGroup(0),
        // t=21: A wakes, still believing it leads, and writes with epoch 1.
        send_put(A),
        Action::Deliver {
            request: put(2, A, 1),
            gateway: 0,
        },
    ]);
    assert_eq!(
        state.history.events,
        [Event::Rejected {
            id: 2,
            resource: 0,
            presented: 1,
            highest: 2,
            durable: 2,
            by: Decider::Cache,
        }]
    );
    assert_eq!(state.database.objects[0].value, 1);
}
