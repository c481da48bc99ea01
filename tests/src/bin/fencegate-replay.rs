//! `fencegate-replay`: runs scenario files against a running fencegate deployment.
//!
//! ```sh
//! cargo run -p fencegate-tests --bin fencegate-replay -- tests/scenarios/ --gateway http://127.0.0.1:7070
//! ```
//!
//! Exits 0 when every scenario passed, 1 on any mismatch or refusal. See
//! docs/replay.md for the scenario format and what an external run can stage.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use fencegate_tests::replay::leases::Leases;
use fencegate_tests::replay::target::Database;
use fencegate_tests::replay::{self, RunError, Scenario, Target};

/// Replays failure timelines (delayed requests, paused leaders, duplicates) against a
/// fencegate deployment, through a delaying proxy in this process, and checks every
/// step's outcome.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Scenario files, or directories of `*.toml` scenario files.
    #[arg(required_unless_present = "writer_process")]
    scenarios: Vec<PathBuf>,
    /// Gateway base URL; repeat for replicas (scenarios with `replicas = 2` need two).
    #[arg(
        long = "gateway",
        env = "FENCEGATE_REPLAY_GATEWAY",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:7070"
    )]
    gateways: Vec<String>,
    /// Postgres for the actors' leases (the seed's `leader_lease` table, created if
    /// missing). Without it, leases follow the same rules in this process's memory.
    #[arg(long, env = "FENCEGATE_REPLAY_LEASE_DATABASE_URL")]
    lease_database_url: Option<String>,
    /// Postgres for control runs (writes straight into `replay_control.objects`,
    /// unfenced). Without it, control runs are not made.
    #[arg(long, env = "FENCEGATE_REPLAY_CONTROL_DATABASE_URL")]
    control_database_url: Option<String>,
    /// Report scenarios this deployment cannot stage (restarts, database cuts) but do
    /// not fail because of them.
    #[arg(long)]
    allow_refused: bool,
    /// Internal: act as a writer process (reads requests on stdin).
    #[arg(long, hide = true)]
    writer_process: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if args.writer_process {
        return match replay::writer::serve().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(_) => ExitCode::FAILURE,
        };
    }
    match run(args).await {
        Ok(code) => code,
        Err(message) => {
            eprintln!("fencegate-replay: {message}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, String> {
    let mut scenarios = Vec::new();
    for path in &args.scenarios {
        scenarios.extend(Scenario::load_all(path).map_err(|e| e.to_string())?);
    }
    let mut gateways: Vec<SocketAddr> = Vec::new();
    for url in &args.gateways {
        let host = url.trim_start_matches("http://").trim_end_matches('/');
        let addr = tokio::net::lookup_host(host)
            .await
            .ok()
            .and_then(|mut addrs| addrs.next())
            .ok_or_else(|| format!("cannot resolve gateway {url} (expected http://host:port)"))?;
        gateways.push(addr);
    }
    let leases = match &args.lease_database_url {
        Some(url) => Leases::postgres(url).await?,
        None => Leases::memory(),
    };
    let control = match &args.control_database_url {
        Some(url) => Some(Database::connect(url).await?),
        None => None,
    };
    let writer = std::env::current_exe().ok();
    let target = Target::external(&gateways, leases, control, writer).await;
    let (mut passed, mut failed, mut refused) = (0, 0, 0);
    for scenario in &scenarios {
        let mut result = replay::run(scenario, &target).await;
        if result.is_ok() && target.control.is_some() {
            result = replay::run_control(scenario, &target).await;
        }
        match result {
            Ok(_) => passed += 1,
            Err(error @ RunError::Refused { .. }) => {
                println!("REFUSED {error}");
                refused += 1;
            }
            Err(error) => {
                println!("FAILED {error}");
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed, {refused} refused");
    let ok = failed == 0 && (refused == 0 || args.allow_refused);
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
