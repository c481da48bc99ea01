//! What must always hold, and what must be reachable for the check to mean anything.
//!
//! The `always` properties judge the database and the caches against the [`History`]:
//! what the gateways answered, the highest fence seen so far, and what the last step
//! decided. A property that needs the moment of a decision ("at the time it was
//! rejected…") reads the events of the step that made it.
//!
//! The `sometimes` properties name the states that make the invariants worth checking:
//! a model in which no takeover happens, or no group of two commits, would pass every
//! invariant and prove nothing.
//!
//! [`History`]: crate::state::History

use stateright::Property;

use crate::model::FencingModel;
use crate::state::{Decider, Event, State};

pub const FENCES_NEVER_GO_DOWN: &str = "fences never go down";
pub const NO_WRITE_AFTER_HIGHER_ACK: &str =
    "no write is accepted after a higher token was acknowledged for its resource";
pub const ACKNOWLEDGED_WRITES_ARE_DURABLE: &str = "an acknowledged write is durable";
pub const CACHE_NEVER_ABOVE_DURABLE: &str = "a cache never holds more than the durable fence";
pub const STALE_REJECTIONS_ARE_JUSTIFIED: &str = "every stale rejection is justified";
pub const FENCE_MOVES_ONLY_WITH_ACCEPTED: &str =
    "the fence is the highest acknowledged token (a refused request changes nothing)";

pub const STALE_REJECTED_BY_DATABASE: &str = "a stale write is rejected by the database";
pub const STALE_REJECTED_BY_CACHE: &str = "a stale write is rejected by a fence cache";
pub const TAKEOVER: &str = "a rival takes over while the old holder still believes it leads";
pub const PAUSED_HOLDER_WRITES_LATE: &str = "a paused holder sends a write after a takeover";
pub const GROUP_OF_TWO_COMMITS: &str = "a group with two writes commits";
pub const GROUP_COMMITS_AROUND_STALE: &str = "a group commits with its stale member rejected";
pub const GROUP_ROLLED_BACK: &str = "a group is rolled back and its writes go solo";
pub const PRECONDITION_FAILS: &str = "an If-Match precondition fails";
pub const REQUEST_DUPLICATED: &str = "the network holds two copies of a request";

/// Every property, invariants first.
pub fn all() -> Vec<Property<FencingModel>> {
    vec![
        Property::always(FENCES_NEVER_GO_DOWN, fences_never_go_down),
        Property::always(NO_WRITE_AFTER_HIGHER_ACK, no_write_after_higher_ack),
        Property::always(
            ACKNOWLEDGED_WRITES_ARE_DURABLE,
            acknowledged_writes_are_durable,
        ),
        Property::always(CACHE_NEVER_ABOVE_DURABLE, cache_never_above_durable),
        Property::always(
            STALE_REJECTIONS_ARE_JUSTIFIED,
            stale_rejections_are_justified,
        ),
        Property::always(
            FENCE_MOVES_ONLY_WITH_ACCEPTED,
            fence_moves_only_with_accepted,
        ),
        Property::sometimes(STALE_REJECTED_BY_DATABASE, stale_rejected_by_database),
        Property::sometimes(STALE_REJECTED_BY_CACHE, stale_rejected_by_cache),
        Property::sometimes(TAKEOVER, takeover),
        Property::sometimes(PAUSED_HOLDER_WRITES_LATE, paused_holder_writes_late),
        Property::sometimes(GROUP_OF_TWO_COMMITS, group_of_two_commits),
        Property::sometimes(GROUP_COMMITS_AROUND_STALE, group_commits_around_stale),
        Property::sometimes(GROUP_ROLLED_BACK, group_rolled_back),
        Property::sometimes(PRECONDITION_FAILS, precondition_fails),
        Property::sometimes(REQUEST_DUPLICATED, request_duplicated),
    ]
}

/// Invariant 3 of the design: tokens never go down for a resource. The history keeps
/// the highest durable fence ever seen; the fence must still be it.
fn fences_never_go_down(_: &FencingModel, state: &State) -> bool {
    state.database.fence == state.history.highest_fence
}

/// Invariant 1, as a writer sees it: once a token was acknowledged for a resource, a
/// write (or advance) with a lower token is never accepted there — this is what a
/// paused leader or a delayed packet from an old term must not get past.
fn no_write_after_higher_ack(_: &FencingModel, state: &State) -> bool {
    state.history.events.iter().all(|event| match *event {
        Event::Accepted {
            token,
            acknowledged_before,
            ..
        } => token >= acknowledged_before,
        _ => true,
    })
}

/// The object holds exactly what the acknowledged puts made it: the last one's value,
/// one version per put. So an acknowledged write is in the store until a later
/// acknowledged write overwrites it, and nothing unacknowledged lands on top of it.
fn acknowledged_writes_are_durable(_: &FencingModel, state: &State) -> bool {
    state.database.objects == state.history.expected
}

/// Invariant 2: every cache entry is at most the durable fence of its resource, so a
/// rejection from the cache is always correct.
fn cache_never_above_durable(_: &FencingModel, state: &State) -> bool {
    state.gateways.iter().all(|gateway| {
        gateway
            .cache
            .iter()
            .zip(state.database.fence)
            .all(|(cached, durable)| *cached <= durable)
    })
}

/// A stale answer names a higher token that was committed when it was decided: the
/// presented token is below the highest named, and that is at most the durable fence.
fn stale_rejections_are_justified(_: &FencingModel, state: &State) -> bool {
    state.history.events.iter().all(|event| match *event {
        Event::Rejected {
            presented,
            highest,
            durable,
            ..
        } => presented < highest && highest <= durable,
        _ => true,
    })
}

/// Invariants 1 and 4: the fence rises only in the transaction of an accepted put or
/// advance, so it is always the highest token acknowledged; a refused, failed or
/// rolled-back request leaves it as it was.
fn fence_moves_only_with_accepted(_: &FencingModel, state: &State) -> bool {
    state.database.fence == state.history.acknowledged
}

fn happened(state: &State, what: impl Fn(&Event) -> bool) -> bool {
    state.history.events.iter().any(what)
}

fn rejected_by(state: &State, decider: Decider) -> bool {
    happened(
        state,
        |event| matches!(*event, Event::Rejected { by, .. } if by == decider),
    )
}

fn stale_rejected_by_database(_: &FencingModel, state: &State) -> bool {
    rejected_by(state, Decider::Database)
}

fn stale_rejected_by_cache(_: &FencingModel, state: &State) -> bool {
    rejected_by(state, Decider::Cache)
}

fn paused_holder_writes_late(_: &FencingModel, state: &State) -> bool {
    happened(state, |event| {
        matches!(event, Event::SentAfterTakeover { .. })
    })
}

fn group_of_two_commits(_: &FencingModel, state: &State) -> bool {
    happened(state, |event| {
        matches!(
            event,
            Event::GroupCommitted {
                size: 2,
                applied: 2
            }
        )
    })
}

fn group_commits_around_stale(_: &FencingModel, state: &State) -> bool {
    happened(state, |event| {
        matches!(
            event,
            Event::GroupCommitted {
                size: 2,
                applied: 1
            }
        )
    }) && rejected_by(state, Decider::Database)
}

fn group_rolled_back(_: &FencingModel, state: &State) -> bool {
    happened(state, |event| {
        matches!(event, Event::GroupRolledBack { .. })
    })
}

fn precondition_fails(_: &FencingModel, state: &State) -> bool {
    happened(state, |event| {
        matches!(event, Event::PreconditionFailed { .. })
    })
}

fn request_duplicated(_: &FencingModel, state: &State) -> bool {
    state.network.windows(2).any(|pair| pair[0] == pair[1])
}

/// One writer leads the lease's current epoch while the other still believes it leads
/// an older term: it was paused across its expiry.
fn takeover(_: &FencingModel, state: &State) -> bool {
    let epochs: Vec<u8> = state
        .writers
        .iter()
        .filter_map(|writer| writer.term)
        .collect();
    epochs.len() == 2
        && epochs.contains(&state.lease.epoch)
        && epochs.iter().any(|epoch| *epoch < state.lease.epoch)
}
