//! Randomised replay: random timelines against one gateway pair and one database,
//! each run on its own resource, checked for the fencing invariants.
//!
//! - `FENCEGATE_REPLAY_RUNS=5000`: more runs (default 500).
//! - `FENCEGATE_REPLAY_SEED=<seed>`: replays exactly that run (printed on failure).

use std::path::PathBuf;
use std::time::Instant;

use fencegate_tests::replay::random::{run_one, Stats};
use fencegate_tests::replay::Target;

const DEFAULT_RUNS: u64 = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_timelines_keep_the_fencing_invariants() {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let seeds: Vec<u64> = match env("FENCEGATE_REPLAY_SEED") {
        Some(seed) => vec![seed],
        None => {
            let base = rand::random::<u32>() as u64 * 1_000_000;
            (0..env("FENCEGATE_REPLAY_RUNS").unwrap_or(DEFAULT_RUNS))
                .map(|i| base + i)
                .collect()
        }
    };
    let target = Target::local(
        2,
        Some(PathBuf::from(env!("CARGO_BIN_EXE_fencegate-replay"))),
    )
    .await;
    let started = Instant::now();
    let mut total = Stats::default();
    for seed in &seeds {
        match run_one(&target, *seed).await {
            Ok(stats) => {
                total.requests += stats.requests;
                total.accepted += stats.accepted;
                total.rejected += stats.rejected;
                total.restarts += stats.restarts;
            }
            Err(failure) => panic!("{failure}\nreplay it with FENCEGATE_REPLAY_SEED={seed}"),
        }
    }
    println!(
        "{} runs from seed {} in {:.1?}: {} requests, {} accepted, {} rejected, {} gateway restarts",
        seeds.len(),
        seeds[0],
        started.elapsed(),
        total.requests,
        total.accepted,
        total.rejected,
        total.restarts
    );
    assert!(
        total.rejected > 0 && total.accepted > 0,
        "the timelines exercised both verdicts"
    );
}
