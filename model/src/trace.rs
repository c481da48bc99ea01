//! Paths as a person reads them: one line per step, what it decided, and the state it
//! left behind.

use stateright::Path;

use crate::model::{Action, FencingModel, Kind};
use crate::state::{writer_name, Decider, Event, State};

/// One step, in words.
pub fn describe(action: &Action) -> String {
    match *action {
        Action::Expire { slept: false } => "the lease expires on the store's clock; its holder \
             had already stopped leading on its own clock"
            .to_string(),
        Action::Expire { slept: true } => "the lease expires on the store's clock while its \
             holder is paused: it will wake believing it still leads"
            .to_string(),
        Action::Acquire(w) => format!("writer {} acquires the lease", writer_name(w)),
        Action::StepDown(w) => format!(
            "writer {} steps down and releases the lease at its epoch",
            writer_name(w)
        ),
        Action::Send {
            writer,
            resource,
            what,
        } => {
            let what = match what {
                Kind::Put => "a put",
                Kind::PutIfMatch => "a put with If-Match",
                Kind::Advance => "a fence advance",
            };
            format!(
                "writer {} sends {what} on r{resource} with its token",
                writer_name(writer)
            )
        }
        Action::Duplicate(request) => format!("the network duplicates {request}"),
        Action::Deliver { request, gateway } => {
            format!("gateway {gateway} receives {request}")
        }
        Action::CommitGroup(g) => format!("gateway {g}'s lane commits its next group"),
        Action::RollBackGroup(g) => {
            format!("the database refuses a statement of gateway {g}'s next group: it rolls back")
        }
        Action::ApplySolo(g) => {
            format!("gateway {g}'s lane applies the next write of the rolled-back group alone")
        }
    }
}

/// What a step decided, in words.
pub fn describe_event(event: &Event) -> String {
    match *event {
        Event::Accepted {
            id,
            resource,
            token,
            acknowledged_before,
        } => format!(
            "#{id} committed and acknowledged on r{resource} with token {token} \
             (highest acknowledged before: {acknowledged_before})"
        ),
        Event::Rejected {
            id,
            presented,
            highest,
            durable,
            by,
            ..
        } => {
            let by = match by {
                Decider::Cache => "the fence cache",
                Decider::Database => "the database",
            };
            format!(
                "#{id} rejected stale by {by}: presented {presented}, answer names {highest}, \
                 durable fence {durable}"
            )
        }
        Event::PreconditionFailed { id, .. } => {
            format!("#{id}: If-Match failed; rolled back")
        }
        Event::GroupCommitted { size, applied } => {
            format!("a group of {size} committed, {applied} applied")
        }
        Event::GroupRolledBack { size } => {
            format!("a group of {size} rolled back; its writes will go one by one")
        }
        Event::SentAfterTakeover { id, token, epoch } => {
            format!("#{id} carries token {token} although the lease is at epoch {epoch}")
        }
    }
}

/// A path from the initial state: every step with its decisions and the state after
/// it, in one line, and the last state in full.
pub fn narrate(model: &FencingModel, path: &Path<State, Action>) -> String {
    let resources = usize::from(model.bounds.resources);
    let steps = path.clone().into_vec();
    let mut lines = Vec::new();
    for (n, window) in steps.windows(2).enumerate() {
        let (action, after) = (window[0].1.expect("a step has an action"), &window[1].0);
        lines.push(format!("{:>3}. {}", n + 1, describe(&action)));
        for event in &after.history.events {
            lines.push(format!("       -> {}", describe_event(event)));
        }
        lines.push(format!("       [{}]", compact(after, resources)));
    }
    let last = path.last_state();
    lines.push("final state:".to_string());
    for line in last.summary(resources).lines() {
        lines.push(format!("  {line}"));
    }
    lines.join("\n")
}

/// The state in one line: lease, terms, fences, caches, objects, requests in flight.
fn compact(state: &State, resources: usize) -> String {
    let terms: Vec<String> = state
        .writers
        .iter()
        .enumerate()
        .map(|(w, writer)| {
            let name = writer_name(w as u8);
            match writer.term {
                Some(epoch) => format!("{name}:e{epoch}"),
                None => format!("{name}:-"),
            }
        })
        .collect();
    let caches: Vec<String> = state
        .gateways
        .iter()
        .map(|gateway| format!("{:?}", &gateway.cache[..resources]))
        .collect();
    let objects: Vec<String> = state.database.objects[..resources]
        .iter()
        .map(|object| match object.value {
            0 => "empty".to_string(),
            id => format!("#{id}v{}", object.version),
        })
        .collect();
    let flight: Vec<String> = state
        .network
        .iter()
        .map(|request| format!("#{}", request.id))
        .collect();
    format!(
        "lease e{} {}{} | {} | fence {:?} | caches {} | objects {} | in flight {}",
        state.lease.epoch,
        state.lease.holder.map_or('-', writer_name),
        if state.lease.expired { " expired" } else { "" },
        terms.join(" "),
        &state.database.fence[..resources],
        caches.join(" "),
        objects.join(" "),
        if flight.is_empty() {
            "-".to_string()
        } else {
            flight.join(" ")
        }
    )
}
