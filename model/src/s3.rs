//! The S3 door's mapped layout, as a model of its own: a put uploads a fresh physical
//! object and then, in one database transaction, checks the fence, locks its intent and
//! points the resource's mapping at the object. A reader sees the object the mapping
//! names, so what is visible changes only at a commit that passed the fence, however
//! late an upload lands.
//!
//! Two writers put one key of one resource, with tokens 1 and 2; a new term (an advance
//! to token 2) may raise the fence at any point. Each put takes three steps, each its
//! own action so the checker interleaves them with everything else:
//!
//! - `RecordIntent`: the gateway inserts the intent (physical key, token) and starts
//!   the upload;
//! - `Upload`: the physical object lands in the bucket, with `If-None-Match: *` — at
//!   any later point, even after the gateway gave up or the term passed;
//! - `CommitMapping`: once the upload landed, the fence check, the intent lock and the
//!   mapping upsert in one atomic step (the intent is deleted with it); refused if the
//!   fence is higher or the intent is gone.
//!
//! The gateway may also give up on a put whose upload has not answered (a crash or a
//! timeout), and the collector removes, at any time, an intent with its physical
//! object, or a physical object that neither a mapping nor an intent names.
//!
//! The checker tests, in every state:
//!
//! - [`NO_OLDER_TERM_VISIBLE`]: whenever what the key shows changes, the object now
//!   shown has a token at least every token acknowledged for the resource before;
//! - [`MAPPINGS_LIVE`]: the mapping names a physical object still in the bucket;
//! - [`ACKNOWLEDGED_VISIBLE`]: the last acknowledged write is what the key shows;
//! - [`WRITE_ONCE`]: no upload replaces a physical object.
//!
//! and shows that an upload lands after its term passed and is never mapped, that a
//! refused commit's object is collected, and that the object a mapping named before is
//! still in the bucket while the new one is read.
//!
//! Each [`S3Mutant`] puts back one bug the layout guards against.

use stateright::{Model, Property};

/// Puts in all: put `p` is writer `p`'s, with token `p + 1`.
pub const PUTS: usize = 2;
/// Physical keys: one fresh key per put (`p`), or key 0 shared by all in the mutants
/// that share it.
pub const KEYS: usize = PUTS;
/// The token of the new term's advance.
pub const ADVANCE_TOKEN: u8 = 2;

pub const NO_OLDER_TERM_VISIBLE: &str =
    "no older term becomes visible: what the key shows changes only to a token at least every token acknowledged before";
pub const MAPPINGS_LIVE: &str = "the mapping names a physical object still in the bucket";
pub const ACKNOWLEDGED_VISIBLE: &str =
    "an acknowledged write stays visible until a later acknowledged write replaces it";
pub const WRITE_ONCE: &str = "physical objects are write-once: no upload replaces one";
pub const LATE_UPLOAD_UNMAPPED: &str = "an upload lands after its term passed and is never mapped";
pub const REFUSED_COMMIT_COLLECTED: &str = "a refused commit's object is collected";
pub const PREVIOUS_OBJECT_KEPT: &str =
    "a mapping is read while the object it named before is still in the bucket";

/// A physical object: the put that wrote it and that put's token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Object {
    pub put: usize,
    pub token: u8,
}

/// Where a put's gateway is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Not begun.
    Idle,
    /// The intent is recorded and the upload sent; the commit is to come.
    Started,
    /// The mapping names the put's object; the write is acknowledged.
    Committed,
    /// The commit (or, in [`S3Mutant::CheckThenPut`], the check) was refused.
    Refused,
    /// The gateway gave up before the upload answered (a crash or a timeout).
    GaveUp,
}

/// Where a put's upload is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Upload {
    Unsent,
    InFlight,
    Landed,
    /// `If-None-Match: *` failed: the key was taken.
    Rejected,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Put {
    pub phase: Phase,
    pub upload: Upload,
    /// The upload landed when the fence was already above the put's token.
    pub landed_late: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct S3State {
    /// The resource's fence: the highest token acknowledged (a write or an advance).
    pub fence: u8,
    /// Whether the new term's advance was made.
    pub advanced: bool,
    /// The bucket: each physical key's object, if any.
    pub bucket: [Option<Object>; KEYS],
    /// The physical key the resource's key maps to, if any.
    pub mapping: Option<usize>,
    /// The intents recorded and not yet committed or collected, by put.
    pub intents: [bool; PUTS],
    pub puts: [Put; PUTS],
    /// The put of the last acknowledged write, if any.
    pub acknowledged: Option<usize>,
    /// What the key showed changed to a token below one acknowledged before.
    pub older_term_visible: bool,
    /// An upload replaced an object in the bucket.
    pub overwritten: bool,
}

impl S3State {
    /// The object the key shows: the one the mapping names, if it is in the bucket.
    pub fn visible(&self) -> Option<Object> {
        self.mapping.and_then(|key| self.bucket[key])
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum S3Action {
    RecordIntent {
        put: usize,
    },
    Upload {
        put: usize,
    },
    CommitMapping {
        put: usize,
    },
    /// The gateway of `put` gives up while its upload is in flight.
    GiveUp {
        put: usize,
    },
    /// A new term: the fence is raised to [`ADVANCE_TOKEN`] and acknowledged.
    Advance,
    /// The collector deletes `put`'s intent and its physical key.
    CollectIntent {
        put: usize,
    },
    /// The collector deletes a physical object that no mapping or intent names.
    CollectOrphan {
        key: usize,
    },
}

/// A bug the mapped layout guards against, put back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum S3Mutant {
    /// Check the fence, then PUT the object under the key readers read: the upload
    /// itself makes the object visible, and the mapping follows the check.
    CheckThenPut,
    /// The commit neither locks nor checks the intent: the collector may have deleted
    /// the object it maps.
    NoIntentLock,
    /// Uploads without `If-None-Match: *`, to a physical key the puts share.
    NoIfNoneMatch,
}

impl S3Mutant {
    pub const ALL: [S3Mutant; 3] = [
        S3Mutant::CheckThenPut,
        S3Mutant::NoIntentLock,
        S3Mutant::NoIfNoneMatch,
    ];

    pub fn name(self) -> &'static str {
        match self {
            S3Mutant::CheckThenPut => "check-then-put",
            S3Mutant::NoIntentLock => "no-intent-lock",
            S3Mutant::NoIfNoneMatch => "no-if-none-match",
        }
    }

    /// The invariant that catches the mutant.
    pub fn caught_by(self) -> &'static str {
        match self {
            S3Mutant::CheckThenPut => NO_OLDER_TERM_VISIBLE,
            S3Mutant::NoIntentLock => MAPPINGS_LIVE,
            S3Mutant::NoIfNoneMatch => ACKNOWLEDGED_VISIBLE,
        }
    }
}

impl std::str::FromStr for S3Mutant {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        S3Mutant::ALL
            .into_iter()
            .find(|mutant| mutant.name() == name)
            .ok_or_else(|| {
                format!("unknown mutant {name}: check-then-put, no-intent-lock or no-if-none-match")
            })
    }
}

impl std::fmt::Display for S3Mutant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Debug)]
pub struct S3Model {
    pub mutant: Option<S3Mutant>,
}

impl S3Model {
    pub fn new(mutant: Option<S3Mutant>) -> S3Model {
        S3Model { mutant }
    }

    fn token(put: usize) -> u8 {
        put as u8 + 1
    }

    /// The physical key `put` uploads to.
    fn key(&self, put: usize) -> usize {
        match self.mutant {
            Some(S3Mutant::CheckThenPut | S3Mutant::NoIfNoneMatch) => 0,
            _ => put,
        }
    }
}

impl Model for S3Model {
    type State = S3State;
    type Action = S3Action;

    fn init_states(&self) -> Vec<S3State> {
        vec![S3State {
            fence: 0,
            advanced: false,
            bucket: [None; KEYS],
            mapping: None,
            intents: [false; PUTS],
            puts: [Put {
                phase: Phase::Idle,
                upload: Upload::Unsent,
                landed_late: false,
            }; PUTS],
            acknowledged: None,
            older_term_visible: false,
            overwritten: false,
        }]
    }

    fn actions(&self, state: &S3State, actions: &mut Vec<S3Action>) {
        for (put, p) in state.puts.iter().enumerate() {
            match (p.phase, p.upload) {
                (Phase::Idle, _) => actions.push(S3Action::RecordIntent { put }),
                (Phase::Started, Upload::Landed) => actions.push(S3Action::CommitMapping { put }),
                (Phase::Started, Upload::InFlight) => actions.push(S3Action::GiveUp { put }),
                _ => {}
            }
            if p.upload == Upload::InFlight {
                actions.push(S3Action::Upload { put });
            }
            if state.intents[put] {
                actions.push(S3Action::CollectIntent { put });
            }
        }
        if !state.advanced {
            actions.push(S3Action::Advance);
        }
        for key in 0..KEYS {
            let named = state.mapping == Some(key)
                || (0..PUTS).any(|put| state.intents[put] && self.key(put) == key);
            if state.bucket[key].is_some() && !named {
                actions.push(S3Action::CollectOrphan { key });
            }
        }
    }

    fn next_state(&self, last: &S3State, action: S3Action) -> Option<S3State> {
        let mut state = last.clone();
        match action {
            S3Action::RecordIntent { put } => {
                if self.mutant == Some(S3Mutant::CheckThenPut) {
                    // The check, with no intent: the collector knows nothing of the put.
                    if Self::token(put) < state.fence {
                        state.puts[put].phase = Phase::Refused;
                        return Some(state);
                    }
                } else {
                    state.intents[put] = true;
                }
                state.puts[put].phase = Phase::Started;
                state.puts[put].upload = Upload::InFlight;
            }
            S3Action::Upload { put } => {
                let key = self.key(put);
                let object = Object {
                    put,
                    token: Self::token(put),
                };
                state.puts[put].landed_late = object.token < state.fence;
                let conditional = !matches!(
                    self.mutant,
                    Some(S3Mutant::CheckThenPut | S3Mutant::NoIfNoneMatch)
                );
                if state.bucket[key].is_some() && conditional {
                    state.puts[put].upload = Upload::Rejected;
                    return Some(state);
                }
                if state.bucket[key].is_some() {
                    state.overwritten = true;
                }
                state.bucket[key] = Some(object);
                state.puts[put].upload = Upload::Landed;
                if self.mutant == Some(S3Mutant::CheckThenPut) {
                    // The object lands under the key readers read.
                    state.mapping = Some(key);
                }
            }
            S3Action::CommitMapping { put } => {
                let token = Self::token(put);
                let checked = match self.mutant {
                    // The check was made before the upload; the mapping follows it.
                    Some(S3Mutant::CheckThenPut) => true,
                    Some(S3Mutant::NoIntentLock) => token >= state.fence,
                    _ => token >= state.fence && state.intents[put],
                };
                if !checked {
                    state.puts[put].phase = Phase::Refused;
                    return Some(state);
                }
                state.mapping = Some(self.key(put));
                state.intents[put] = false;
                state.fence = state.fence.max(token);
                state.acknowledged = Some(put);
                state.puts[put].phase = Phase::Committed;
            }
            S3Action::GiveUp { put } => state.puts[put].phase = Phase::GaveUp,
            S3Action::Advance => {
                state.advanced = true;
                state.fence = state.fence.max(ADVANCE_TOKEN);
            }
            S3Action::CollectIntent { put } => {
                state.intents[put] = false;
                state.bucket[self.key(put)] = None;
            }
            S3Action::CollectOrphan { key } => state.bucket[key] = None,
        }
        // What the key shows, judged against what was acknowledged before the step.
        if let Some(shown) = state.visible() {
            if last.visible() != Some(shown) && shown.token < last.fence {
                state.older_term_visible = true;
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_OLDER_TERM_VISIBLE, |_, state: &S3State| {
                !state.older_term_visible
            }),
            Property::always(MAPPINGS_LIVE, |_, state: &S3State| {
                state.mapping.is_none_or(|key| state.bucket[key].is_some())
            }),
            Property::always(ACKNOWLEDGED_VISIBLE, |_, state: &S3State| {
                state
                    .acknowledged
                    .is_none_or(|put| state.visible().map(|object| object.put) == Some(put))
            }),
            Property::always(WRITE_ONCE, |_, state: &S3State| !state.overwritten),
            Property::sometimes(LATE_UPLOAD_UNMAPPED, |_, state: &S3State| {
                state.puts.iter().any(|p| {
                    p.landed_late
                        && p.upload == Upload::Landed
                        && matches!(p.phase, Phase::Refused | Phase::GaveUp)
                })
            }),
            Property::sometimes(REFUSED_COMMIT_COLLECTED, |_, state: &S3State| {
                (0..PUTS).any(|put| {
                    let p = state.puts[put];
                    p.phase == Phase::Refused
                        && p.upload == Upload::Landed
                        && !state.intents[put]
                        && !state
                            .bucket
                            .iter()
                            .flatten()
                            .any(|object| object.put == put)
                })
            }),
            Property::sometimes(PREVIOUS_OBJECT_KEPT, |_, state: &S3State| {
                let Some(shown) = state.visible() else {
                    return false;
                };
                state.bucket.iter().flatten().any(|object| {
                    object.put != shown.put && state.puts[object.put].phase == Phase::Committed
                })
            }),
        ]
    }
}
