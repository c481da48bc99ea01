//! Slots for values of the `resource` label: at most `cap`, following recent use.
//!
//! A resource takes a free slot the first time it is labelled. Once all are taken, a
//! new resource takes the slot of the resource used least recently — if that one has
//! been idle for [`IDLE`] — and is otherwise counted under `_other`. So a burst of
//! junk names (any a caller's grants allow) can take the free slots and the idle
//! ones, but never the slot of a resource in use; and the junk's own slots free up
//! once it stops. A resource that loses its slot loses its series: when it comes back
//! its counter starts again from zero, which `rate()` and `increase()` read as a
//! counter reset.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a resource must go unlabelled before its slot may go to another.
pub const IDLE: Duration = Duration::from_secs(10 * 60);

/// How often a full set of slots is searched for an idle one: a flood of new names
/// costs one search per interval, not one per name.
const SEARCH_INTERVAL: Duration = Duration::from_millis(100);

pub(super) struct ResourceLabels {
    state: Mutex<State>,
    cap: usize,
    idle: Duration,
}

struct State {
    /// Resource -> when it was last labelled.
    slots: HashMap<Box<str>, Instant>,
    last_search: Option<Instant>,
}

/// What label a resource gets.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Label {
    /// Its own, as before.
    Known,
    /// Its own, for the first time; `evicted` lost its slot to it.
    New { evicted: Option<Box<str>> },
    /// `_other`.
    Other,
}

impl ResourceLabels {
    pub(super) fn new(cap: usize, idle: Duration) -> ResourceLabels {
        ResourceLabels {
            state: Mutex::new(State {
                slots: HashMap::new(),
                last_search: None,
            }),
            cap,
            idle,
        }
    }

    pub(super) fn label(&self, resource: &str) -> Label {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(used) = state.slots.get_mut(resource) {
            *used = now;
            return Label::Known;
        }
        if state.slots.len() < self.cap {
            state.slots.insert(resource.into(), now);
            return Label::New { evicted: None };
        }
        if state
            .last_search
            .is_some_and(|searched| now.duration_since(searched) < SEARCH_INTERVAL)
        {
            return Label::Other;
        }
        state.last_search = Some(now);
        let idlest = state
            .slots
            .iter()
            .min_by_key(|(_, used)| **used)
            .filter(|(_, used)| now.duration_since(**used) >= self.idle)
            .map(|(name, _)| name.clone());
        match idlest {
            Some(evicted) => {
                state.slots.remove(&evicted);
                state.slots.insert(resource.into(), now);
                Label::New {
                    evicted: Some(evicted),
                }
            }
            None => Label::Other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_in_use_are_kept_and_idle_ones_reused() {
        let labels = ResourceLabels::new(2, Duration::from_millis(200));
        assert_eq!(labels.label("a"), Label::New { evicted: None });
        assert_eq!(labels.label("b"), Label::New { evicted: None });
        assert_eq!(labels.label("a"), Label::Known);
        // Full, and nobody idle: junk gets `_other`, however much of it comes.
        for junk in 0..100 {
            assert_eq!(labels.label(&format!("junk{junk}")), Label::Other);
        }
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(labels.label("b"), Label::Known);
        // `a` has been idle longest and long enough: its slot goes to `c`.
        assert_eq!(
            labels.label("c"),
            Label::New {
                evicted: Some("a".into())
            }
        );
        assert_eq!(labels.label("b"), Label::Known);
        assert_eq!(labels.label("c"), Label::Known);
        // The next search waits its interval.
        assert_eq!(labels.label("d"), Label::Other);
    }
}
