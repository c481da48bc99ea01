//! Checks the model of the fencing protocol and prints what it found.
//!
//! ```text
//! cargo run -p fencegate-model --release
//! cargo run -p fencegate-model --release -- --mutant cache-before-commit
//! cargo run -p fencegate-model --release -- --resources 2 --sends 3 --depth 20
//! ```

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Instant;

use clap::Parser;
use fencegate_model::check::shortest_counterexample;
use fencegate_model::{check, Bounds, FencingModel, Finish, Mutant, Options};

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
}

fn main() -> ExitCode {
    let args = Args::parse();
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
