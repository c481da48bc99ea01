//! A model of fencegate's fencing protocol, checked with [stateright].
//!
//! Two writers compete for one lease and write through two gateway replicas into one
//! database, over a network that delays, reorders and duplicates requests. The checker
//! explores every interleaving within small bounds and tests, in every state, the
//! invariants of `shared/DESIGN.md`: fences never go down; no write is accepted after a
//! higher token was acknowledged; acknowledged writes are durable; a fence cache never
//! holds more than the durable fence; every stale rejection is justified; a refused
//! request changes nothing. It also shows that the states worth checking are reached: a
//! takeover while the old holder still believes it leads, stale rejections by cache and
//! by database, a group of two writes committing, a group rolled back.
//!
//! The protocol is modelled as the gateway implements it (the store contract, the fence
//! cache, the coordinator's fast path and commit-then-raise, the Postgres backend's
//! statements and group commit, the lease store and the elector). [`Mutant`]s put back,
//! one at a time, the bugs that design guards against, and the tests show each is
//! caught.
//!
//! # Why `Model` and not the actor model
//!
//! Stateright's actor model fits systems of peers that only exchange messages. Here the
//! database and the lease store are shared state changed in atomic transactions, the
//! network's duplication must be bounded (the actor model's duplicating network keeps
//! every message deliverable forever), and the properties judge a history of answers
//! alongside the state. A plain [`stateright::Model`] over one state struct says all of
//! this directly, with fewer states than actors wrapping a database would need.
//!
//! # Layout
//!
//! - `state`: the state — lease store, writers, network, gateways, database — and the
//!   history the properties judge.
//! - `model`: the steps (the checker's actions and their effects), the [`Bounds`] and
//!   the [`Mutant`]s.
//! - `database`: the Postgres backend's transactions: the fenced put, a write lane's
//!   group, the conditional put, the advance.
//! - `multi`: a model of its own, of one transaction fencing several resources in the
//!   database, with its invariants and mutants.
//! - `s3`: a model of its own, of the S3 door's mapped layout: intents, late uploads,
//!   the fenced mapping commit and the collector, with its invariants and mutants.
//! - `properties`: the invariants (`always`) and the states that must be reachable
//!   (`sometimes`).
//! - `check`: running the checker and reporting; `trace`: paths in words.

#![forbid(unsafe_code)]

pub mod check;
pub mod database;
pub mod model;
pub mod multi;
pub mod properties;
pub mod s3;
pub mod state;
pub mod trace;

pub use check::{check, Finish, Options, Report};
pub use model::{Action, Bounds, FencingModel, Mutant};
pub use state::State;
