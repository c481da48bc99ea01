//! Running the checker and reporting what it found.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use stateright::{Checker, Expectation, HasDiscoveries, Model, Path};

use crate::model::{Action, FencingModel};
use crate::state::State;
use crate::trace;

/// When the checker may stop before it has seen every state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// Visit every state within the depth.
    Everything,
    /// Stop at the first counterexample of any invariant.
    FirstViolation,
    /// Stop once this property has a discovery.
    Found(&'static str),
}

#[derive(Clone, Debug)]
pub struct Options {
    /// The most steps from the initial state to explore (all states within it are
    /// checked).
    pub depth: Option<usize>,
    pub threads: usize,
    pub finish: Finish,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            depth: None,
            threads: std::thread::available_parallelism().map_or(1, usize::from),
            finish: Finish::Everything,
        }
    }
}

/// What a check found.
pub struct Report {
    pub unique_states: usize,
    pub generated_states: usize,
    /// The most steps from the initial state of any state checked.
    pub max_depth: usize,
    pub elapsed: Duration,
    /// Every state within the depth was visited (false if the run stopped at a
    /// discovery).
    pub complete: bool,
    /// Counterexamples: invariants and the path that breaks them.
    pub violations: BTreeMap<&'static str, Path<State, Action>>,
    /// Examples: reachability properties and a path that reaches them.
    pub examples: BTreeMap<&'static str, Path<State, Action>>,
    /// Reachability properties never reached.
    pub unreached: Vec<&'static str>,
}

/// Explores `model` breadth-first, so that each path found is among the shortest.
pub fn check(model: FencingModel, options: &Options) -> Report {
    let properties = model.properties();
    // A run that stops at a discovery runs on one thread: a worker that stops early
    // does not wake the others waiting for work, which can leave them waiting forever.
    let threads = match options.finish {
        Finish::Everything => options.threads.max(1),
        Finish::FirstViolation | Finish::Found(_) => 1,
    };
    let mut builder = model.checker().threads(threads);
    if let Some(depth) = options.depth {
        // The checker counts the initial state as depth 1 and does not check a state
        // at the target depth: `depth` steps need a target two beyond.
        builder = builder.target_max_depth(depth + 2);
    }
    builder = builder.finish_when(match &options.finish {
        Finish::Everything => HasDiscoveries::All,
        Finish::FirstViolation => HasDiscoveries::AnyFailures,
        Finish::Found(name) => HasDiscoveries::AnyOf(BTreeSet::from([*name])),
    });
    let started = Instant::now();
    let checker = builder.spawn_bfs().join();
    let elapsed = started.elapsed();

    let mut discoveries = checker.discoveries();
    let mut violations = BTreeMap::new();
    let mut examples = BTreeMap::new();
    let mut unreached = Vec::new();
    for property in &properties {
        match (
            property.expectation.clone(),
            discoveries.remove(property.name),
        ) {
            (Expectation::Sometimes, Some(path)) => {
                examples.insert(property.name, path);
            }
            (Expectation::Sometimes, None) => unreached.push(property.name),
            (_, Some(path)) => {
                violations.insert(property.name, path);
            }
            (_, None) => {}
        }
    }
    Report {
        unique_states: checker.unique_state_count(),
        generated_states: checker.state_count(),
        max_depth: {
            let steps = checker.max_depth().saturating_sub(1);
            options.depth.map_or(steps, |depth| steps.min(depth))
        },
        elapsed,
        complete: checker.is_done(),
        violations,
        examples,
        unreached,
    }
}

/// The shortest counterexample of `invariant` (of any invariant if `None`) within
/// `max_steps`, found by searching every depth in turn.
///
/// A plain run reports a counterexample, not the shortest: the checker keeps the last
/// one it met in a batch of states. Searching depth by depth, the first depth with a
/// counterexample has only shortest ones. Shallow depths cost little, so this costs
/// about as much as the last depth alone.
pub fn shortest_counterexample(
    model: &FencingModel,
    invariant: Option<&'static str>,
    max_steps: usize,
) -> Option<(&'static str, Report)> {
    (1..=max_steps).find_map(|steps| {
        let options = Options {
            depth: Some(steps),
            threads: 1,
            finish: invariant.map_or(Finish::FirstViolation, Finish::Found),
        };
        let mut report = check(model.clone(), &options);
        // Reachability within a few steps says nothing about the model.
        report.examples.clear();
        report.unreached.clear();
        let name = match invariant {
            Some(name) => report.violations.contains_key(name).then_some(name),
            None => report.violations.keys().next().copied(),
        };
        name.map(|name| (name, report))
    })
}

impl Report {
    /// No invariant broken, every reachability property reached, every state visited.
    pub fn passed(&self) -> bool {
        self.complete && self.violations.is_empty() && self.unreached.is_empty()
    }

    /// The figures, then every counterexample as a readable trace.
    pub fn render(&self, model: &FencingModel) -> String {
        let mut out = format!(
            "{} unique states ({} generated), {} steps deep, {:.2} s{}\n",
            self.unique_states,
            self.generated_states,
            self.max_depth,
            self.elapsed.as_secs_f64(),
            if self.complete { "" } else { ", stopped early" },
        );
        if self.violations.is_empty() {
            out.push_str("no violation\n");
        }
        for (name, path) in &self.violations {
            out.push_str(&format!(
                "\nVIOLATED: {name}\ncounterexample ({} steps):\n{}\n",
                path.clone().into_actions().len(),
                trace::narrate(model, path)
            ));
        }
        for (name, path) in &self.examples {
            let steps = path.clone().into_actions().len();
            out.push_str(&format!("reached: {name} (an example in {steps} steps)\n"));
        }
        // A run stopped at a counterexample has not looked everywhere.
        if self.complete {
            for name in &self.unreached {
                out.push_str(&format!("never reached: {name}\n"));
            }
        }
        out
    }
}
