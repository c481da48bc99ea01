//! `fencegate-bench`: the gateway against direct Postgres and bare HTTP, as ratios in
//! one run. See `BENCHMARKS.md`; the work is in `tests/src/bench/`.
#![forbid(unsafe_code)]

#[path = "../bench/mod.rs"]
mod bench;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = bench::Args::parse();
    let runtime = tokio::runtime::Runtime::new().expect("the async runtime starts");
    match runtime.block_on(bench::main(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("fencegate-bench: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}
