//! The replay harness: failure timelines (a delayed request from an old term, a
//! paused leader, duplicates, restarts, outages) written as data and staged against
//! real processes, with a real delaying network hop in front of every gateway.
//!
//! # Layout
//!
//! - [`scenario`]: the TOML scenario format and its validation.
//! - [`target`]: what a run talks to — gateway replicas behind labelled proxies, and
//!   for local runs the gateway processes and the gateway-to-database link.
//! - [`runner`]: runs a scenario step by step, prints one line per step, checks each
//!   `expect`.
//! - `observed`: a step's outcome and its comparison with `expect`.
//! - [`control`]: the same timeline without fencing, straight into Postgres, to show
//!   the harm.
//! - [`flood`]: the stale-flood step.
//! - [`leases`]: tokens from the lease client's Postgres store (or the same rules in
//!   memory).
//! - [`writer`]: a writer as a separate process, for SIGSTOP/SIGCONT.
//! - [`wire`]: raw HTTP/1.1 exchanges (one connection per labelled request).
//! - [`random`]: randomised timelines and the invariants checked after each.
//!
//! # Invariants
//!
//! - Every step of a scenario runs or the run fails: a refused step (one the target
//!   cannot stage) refuses the whole scenario before its first step.
//! - A run's resources, lease and labels carry the run's id, so runs never see each
//!   other's fences, also against a long-lived deployment.

pub mod control;
pub mod flood;
pub mod leases;
mod observed;
pub mod random;
pub mod runner;
pub mod scenario;
pub mod target;
pub mod wire;
pub mod writer;

pub use scenario::Scenario;
pub use target::Target;

/// Why a run did not pass.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("{scenario}: step {step} differs\n  step:     {line}\n  expected: {expected}\n  observed: {observed}")]
    Mismatch {
        scenario: String,
        step: usize,
        line: String,
        expected: String,
        observed: String,
    },
    #[error("{scenario}: refused at step {step}: {reason}")]
    Refused {
        scenario: String,
        step: usize,
        reason: String,
    },
    #[error("{scenario}: step {step} could not run: {message}")]
    Harness {
        scenario: String,
        step: usize,
        message: String,
    },
}

/// Runs a scenario through the gateway, printing its timeline.
pub async fn run(scenario: &Scenario, target: &Target) -> Result<Vec<String>, RunError> {
    println!("== {} (through the gateway)", scenario.name);
    runner::Run::new(scenario, target, true).run().await
}

/// Runs a scenario's control run, printing its timeline.
pub async fn run_control(scenario: &Scenario, target: &Target) -> Result<Vec<String>, RunError> {
    println!(
        "== {} (control: no fencing, straight to Postgres)",
        scenario.name
    );
    control::run(scenario, target, true).await
}
