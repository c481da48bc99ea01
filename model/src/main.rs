//! Checks the model of the fencing protocol and prints what it found.
//!
//! ```text
//! cargo run -p fencegate-model --release
//! cargo run -p fencegate-model --release -- --mutant cache-before-commit
//! cargo run -p fencegate-model --release -- --resources 2 --sends 3 --depth 20
//! cargo run -p fencegate-model -- --s3
//! cargo run -p fencegate-model -- --s3 --s3-mutant no-intent-lock
//! ```

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use fencegate_model::check::shortest_counterexample;
use fencegate_model::s3::{S3Model, S3Mutant};
use fencegate_model::{check, Bounds, FencingModel, Finish, Mutant, Options};
use stateright::{Checker, Expectation, Model};

/// How deep a mutant's counterexample is looked for unless `--depth` says otherwise.
const DEFAULT_MUTANT_STEPS: usize = 30;

/// Explores every interleaving of the fencing protocol within small bounds and checks
/// its invariants. Exits 1 if an invariant is broken or a state that must be reachable
/// was not reached.
#[derive(Parser, Debug)]
#[command(name = "fencegate-model")]
struct Args {
    /// Check states only up to this many steps from the start (default: all of them;
    /// with --mutant, 30).
    #[arg(long)]
    depth: Option<usize>,
    /// Check the model with this deliberate bug: cache-before-commit,
    /// check-outside-transaction, stale-member-kept or precondition-keeps-fence.
    #[arg(long)]
    mutant: Option<Mutant>,
    /// Resources (1 or 2), each with one fence and one object.
    #[arg(long, default_value_t = Bounds::default().resources)]
    resources: u8,
    /// Most requests the writers send in all.
    #[arg(long, default_value_t = Bounds::default().max_sends)]
    sends: u8,
    /// Most lease acquisitions (epochs) in all.
    #[arg(long, default_value_t = Bounds::default().max_epoch)]
    epochs: u8,
    /// Most times the network duplicates a request.
    #[arg(long, default_value_t = Bounds::default().max_duplicates)]
    duplicates: u8,
    /// Most write groups the database refuses (rolled back, writes retried one by one).
    #[arg(long, default_value_t = Bounds::default().max_rollbacks)]
    rollbacks: u8,
    /// Checker threads (a mutant's search for its shortest counterexample uses one).
    #[arg(long, default_value_t = Options::default().threads)]
    threads: usize,
    /// Check the model of the S3 door's mapped layout instead, to its full depth (the
    /// other flags do not apply).
    #[arg(long)]
    s3: bool,
    /// With --s3, put back this bug: check-then-put, no-intent-lock or
    /// no-if-none-match.
    #[arg(long, requires = "s3")]
    s3_mutant: Option<S3Mutant>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.s3 {
        return check_s3(args.s3_mutant);
    }
    if !(1..=2).contains(&args.resources) {
        eprintln!("--resources must be 1 or 2");
        return ExitCode::from(2);
    }
    let bounds = Bounds {
        resources: args.resources,
        max_sends: args.sends,
        max_epoch: args.epochs,
        max_duplicates: args.duplicates,
        max_rollbacks: args.rollbacks,
        ..Bounds::default()
    };
    let model = FencingModel::new(bounds, args.mutant);
    let report = match args.mutant {
        Some(mutant) => {
            println!("checking the model with mutant {mutant}, {bounds:?}");
            println!("searching for the shortest counterexample, one depth at a time");
            let started = Instant::now();
            let max_steps = args.depth.unwrap_or(DEFAULT_MUTANT_STEPS);
            match shortest_counterexample(&model, None, max_steps) {
                Some((_, report)) => {
                    println!(
                        "found after {:.2} s in all",
                        started.elapsed().as_secs_f64()
                    );
                    report
                }
                None => {
                    println!(
                        "no violation within {max_steps} steps ({:.2} s)",
                        started.elapsed().as_secs_f64()
                    );
                    return ExitCode::SUCCESS;
                }
            }
        }
        None => {
            println!("checking the model, {bounds:?}");
            let options = Options {
                depth: args.depth,
                threads: args.threads,
                finish: Finish::Everything,
            };
            check(model.clone(), &options)
        }
    };
    print!("{}", report.render(&model));
    if report.violations.is_empty() && report.unreached.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Checks the model of the S3 door's mapped layout to its full depth and prints each
/// property's outcome. Exits 1 if an invariant is broken or a state that must be
/// reachable was not reached.
fn check_s3(mutant: Option<S3Mutant>) -> ExitCode {
    let model = S3Model::new(mutant);
    match mutant {
        Some(mutant) => println!("checking the S3 mapped layout with mutant {mutant}"),
        None => println!("checking the S3 mapped layout"),
    }
    let started = Instant::now();
    let checker = model.clone().checker().spawn_bfs().join();
    println!(
        "{} states, {} unique, depth {}, {:.2} s",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed().as_secs_f64()
    );
    let mut failed = false;
    for property in model.properties() {
        let found = checker.discovery(property.name);
        match (property.expectation, found) {
            (Expectation::Sometimes, Some(_)) => println!("reached: {}", property.name),
            (Expectation::Sometimes, None) => {
                failed = true;
                println!("NEVER REACHED: {}", property.name);
            }
            (_, None) => println!("holds: {}", property.name),
            (_, Some(path)) => {
                failed = true;
                println!("BROKEN: {}", property.name);
                // The steps up to the first state that breaks it.
                let steps = path
                    .into_vec()
                    .into_iter()
                    .take_while(|(state, _)| (property.condition)(&model, state))
                    .filter_map(|(_, action)| action);
                for (step, action) in steps.enumerate() {
                    println!("  {}. {action:?}", step + 1);
                }
            }
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
