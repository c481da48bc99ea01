//! `fencegate-faults`: fault runs with real processes, every history checked.
//!
//! ```sh
//! cargo build -p fencegate-gateway -p fencegate-tests --bins
//! target/debug/fencegate-faults                      # every fault, 8 s each
//! target/debug/fencegate-faults --fault pause --duration 20s
//! target/debug/fencegate-faults --lease-source etcd --ttl 2s --fault pause,source-kill
//! ```
//!
//! Exits 0 when no run but the control had a violation and the control had some.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fencegate_tests::faults::writer::{self, LeaseSource, WriterArgs};
use fencegate_tests::faults::{self, Fault, Leases, Settings};

/// Runs lease-holding writers as separate processes against two fencegate replicas on
/// one Postgres, injects a fault again and again, then checks every operation's
/// history for linearizability against a model of a fenced register.
///
/// The faults: `pause` (SIGSTOP the lease holder past its expiry, SIGCONT it),
/// `gateway-kill` (kill -9 a replica, restart it), `postgres-kill` (kill -9 the
/// postmaster of a throwaway cluster mid-commit, restart it), `partition` (blackhole
/// routes between a gateway in a network namespace and Postgres), `clock` (writers
/// whose step-down timers run slow and fast), `control` (the pause workload with
/// fencing off, which must show violations), and `source-kill` (kill -9 the etcd member
/// or ZooKeeper server of a run whose leases live there, restart it).
///
/// With `--lease-source etcd` or `zookeeper` the writers elect through the lease
/// client's etcd or ZooKeeper store, on a server the run starts (etcd's shortest lease
/// is 2 s: give `--ttl 2s`), and the gateways check tokens against the election.
///
/// Prints one line per fault: histories, operations, faults injected, indeterminate
/// operations, violations. Needs root (runuser, ip netns), PostgreSQL 15's server
/// programs, iproute2, the test Postgres server (`FENCEGATE_TEST_PG`, default
/// postgres://postgres@127.0.0.1:5432) for the leases, and the built `fencegate`
/// binary (`FENCEGATE_BIN`, or next to this one).
#[derive(Parser)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// Faults to run, in order (default: all).
    #[arg(long = "fault", value_enum, value_delimiter = ',')]
    faults: Vec<Fault>,
    /// How long each fault is injected.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "8s")]
    duration: Duration,
    /// Resources (each its own lease and history) per run.
    #[arg(long, default_value_t = 2)]
    resources: usize,
    /// Writer processes per resource.
    #[arg(long, default_value_t = 2)]
    writers: usize,
    /// Operations each writer sends at once (writes of one term commit together).
    #[arg(long, default_value_t = 3)]
    lanes: usize,
    /// The writers' lease duration.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "600ms")]
    ttl: Duration,
    /// Where the writers' leases live.
    #[arg(long, value_enum, default_value_t = LeaseSource::Postgres)]
    lease_source: LeaseSource,
    /// Print every violation's explanation.
    #[arg(long)]
    verbose: bool,
}

#[derive(Subcommand)]
enum Command {
    /// Internal: one writer process of a run.
    #[command(hide = true)]
    Writer(WriterArgs),
}

fn main() -> ExitCode {
    let args = Args::parse();
    let binary = match std::env::current_exe() {
        Ok(binary) => binary,
        Err(error) => {
            eprintln!("fencegate-faults: cannot find this program: {error}");
            return ExitCode::from(2);
        }
    };
    if args.command.is_none() && std::env::var_os("FENCEGATE_BIN").is_none() {
        // The harness finds the gateway through FENCEGATE_BIN outside of tests; set
        // before any thread starts.
        std::env::set_var("FENCEGATE_BIN", binary.with_file_name("fencegate"));
    }
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime starts");
    if let Some(Command::Writer(writer)) = args.command {
        return match runtime.block_on(writer::run(writer)) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => {
                eprintln!("fencegate-faults writer: {error}");
                ExitCode::FAILURE
            }
        };
    }
    match runtime.block_on(run(args, binary)) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("fencegate-faults: {error}");
            ExitCode::from(2)
        }
    }
}

async fn run(args: Args, binary: PathBuf) -> Result<bool, String> {
    let gateway = fencegate_tests::gateway::binary();
    if !gateway.exists() {
        return Err(format!(
            "{} is missing: build it with `cargo build -p fencegate-gateway`, or set FENCEGATE_BIN",
            gateway.display()
        ));
    }
    let settings = Settings {
        duration: args.duration,
        resources: args.resources,
        writers: args.writers,
        ttl: args.ttl,
        lanes: args.lanes,
        binary,
    };
    let faults = if args.faults.is_empty() {
        Fault::ALL.to_vec()
    } else {
        args.faults
    };
    let leases = match args.lease_source {
        LeaseSource::Postgres => Leases::create().await?,
        LeaseSource::Etcd => Leases::etcd().await?,
        LeaseSource::Zookeeper => Leases::zookeeper().await?,
    };
    let mut ok = true;
    for fault in faults {
        let report = faults::run(fault, &settings, &leases).await?;
        println!("{}", report.line());
        for violation in &report.violations {
            let text = violation.to_string();
            if args.verbose || !fault.expects_violations() {
                println!("    {text}");
            }
        }
        if !report.passed() {
            println!(
                "FAILED {}: {}",
                fault.name(),
                if fault.expects_violations() {
                    "the control run showed no violation"
                } else {
                    "the history has violations"
                }
            );
            ok = false;
        }
    }
    Ok(ok)
}
