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

pub(super) struct ResourceLabels<T> {
    state: Mutex<State<T>>,
    cap: usize,
    idle: Duration,
}

struct State<T> {
    slots: HashMap<Box<str>, Slot<T>>,
    last_search: Option<Instant>,
}

/// A resource's slot: when it was last labelled, and its series, made when it took the
/// slot and dropped with it.
struct Slot<T> {
    used: Instant,
    series: T,
}

/// What label a resource gets.
#[derive(Debug)]
pub(super) enum Label<'a, T> {
    /// Its own: these series. `evicted` lost its slot to it just now.
    Own {
        series: &'a T,
        evicted: Option<Box<str>>,
    },
    /// `_other`.
    Other,
}

impl<T> ResourceLabels<T> {
    pub(super) fn new(cap: usize, idle: Duration) -> ResourceLabels<T> {
        ResourceLabels {
            state: Mutex::new(State {
                slots: HashMap::new(),
                last_search: None,
            }),
            cap,
            idle,
        }
    }

    /// Calls `with` on the label of `resource`, giving it a slot — and series made by
    /// `make` — if it has none and one is free or idle. `with` runs under the lock.
    pub(super) fn with<R>(
        &self,
        resource: &str,
        make: impl FnOnce() -> T,
        with: impl FnOnce(Label<'_, T>) -> R,
    ) -> R {
        let now = Instant::now();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = state.slots.get_mut(resource) {
            slot.used = now;
            return with(Label::Own {
                series: &slot.series,
                evicted: None,
            });
        }
        let evicted = if state.slots.len() < self.cap {
            None
        } else if state
            .last_search
            .is_some_and(|searched| now.duration_since(searched) < SEARCH_INTERVAL)
        {
            return with(Label::Other);
        } else {
            state.last_search = Some(now);
            let idlest = state
                .slots
                .iter()
                .min_by_key(|(_, slot)| slot.used)
                .filter(|(_, slot)| now.duration_since(slot.used) >= self.idle)
                .map(|(name, _)| name.clone());
            let Some(idlest) = idlest else {
                return with(Label::Other);
            };
            state.slots.remove(&idlest);
            Some(idlest)
        };
        let slot = state.slots.entry(resource.into()).or_insert(Slot {
            used: now,
            series: make(),
        });
        with(Label::Own {
            series: &slot.series,
            evicted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The label `resource` gets: `Some(evicted)` for its own, `None` for `_other`.
    fn label(labels: &ResourceLabels<String>, resource: &str) -> Option<Option<Box<str>>> {
        labels.with(
            resource,
            || resource.to_owned(),
            |label| match label {
                Label::Own { series, evicted } => {
                    assert_eq!(series, resource, "its own series");
                    Some(evicted)
                }
                Label::Other => None,
            },
        )
    }

    #[test]
    fn slots_in_use_are_kept_and_idle_ones_reused() {
        let labels = ResourceLabels::new(2, Duration::from_millis(200));
        assert_eq!(label(&labels, "a"), Some(None));
        assert_eq!(label(&labels, "b"), Some(None));
        assert_eq!(label(&labels, "a"), Some(None));
        // Full, and nobody idle: junk gets `_other`, however much of it comes.
        for junk in 0..100 {
            assert_eq!(label(&labels, &format!("junk{junk}")), None);
        }
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(label(&labels, "b"), Some(None));
        // `a` has been idle longest and long enough: its slot goes to `c`.
        assert_eq!(label(&labels, "c"), Some(Some("a".into())));
        assert_eq!(label(&labels, "b"), Some(None));
        assert_eq!(label(&labels, "c"), Some(None));
        // The next search waits its interval.
        assert_eq!(label(&labels, "d"), None);
    }

    #[test]
    fn series_are_made_once_per_slot() {
        let labels = ResourceLabels::new(1, Duration::ZERO);
        let made = std::cell::Cell::new(0);
        let count = |resource: &str| {
            labels.with(
                resource,
                || {
                    made.set(made.get() + 1);
                    made.get()
                },
                |label| match label {
                    Label::Own { series, .. } => *series,
                    Label::Other => 0,
                },
            )
        };
        assert_eq!(count("a"), 1);
        assert_eq!(count("a"), 1, "kept with the slot");
        assert_eq!(count("b"), 2, "a's slot, idle at once here, goes to b");
        assert_eq!(count("a"), 0, "the next search waits its interval");
    }
}
