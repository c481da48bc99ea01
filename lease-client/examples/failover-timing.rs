//! Measures failover: how long after a leader crashes (stops renewing, releases
//! nothing) a follower holds the lease. Runs the election in-process against a real
//! Postgres, several times, and prints each figure and the median.
//!
//! ```text
//! cargo run --release --example failover-timing -p fencegate-lease -- --lease 15s --runs 5
//! cargo run --release --example failover-timing -p fencegate-lease -- --lease 600ms --runs 21
//! ```
//!
//! The crash happens at a random point of the leader's renewal cycle, so the figures
//! spread between `lease - renew_interval` and `lease + retry_period` (plus jitter).

use std::time::Duration;

use clap::Parser;
use fencegate_lease::{Elector, LeaseConfig, PostgresStore, Transition};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Crash a leader, time the takeover, repeat.
#[derive(Debug, Parser)]
struct Args {
    /// The Postgres database to keep the lease table in.
    #[arg(
        long,
        env = "FAILOVER_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// The lease table (created if missing; kept apart from the seed's `leader_lease`).
    #[arg(long, env = "FAILOVER_TABLE", default_value = "failover_timing_lease")]
    table: String,
    /// The lease duration; every other timing takes its default fraction.
    #[arg(long, env = "FAILOVER_LEASE", value_parser = humantime::parse_duration, default_value = "15s")]
    lease: Duration,
    /// How many crashes to time.
    #[arg(long, env = "FAILOVER_RUNS", default_value_t = 5)]
    runs: u32,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = LeaseConfig::with_lease(args.lease);
    println!("timing: {config:?}");
    let mut figures = Vec::new();
    for run in 0..args.runs {
        let lease = format!("failover-timing-{}-{run}", std::process::id());
        let figure = one_failover(&args, &lease, config).await?;
        println!("run {run}: failover {:.3} s", figure.as_secs_f64());
        figures.push(figure);
    }
    figures.sort();
    let median = figures[figures.len() / 2];
    println!(
        "median {:.3} s, min {:.3} s, max {:.3} s over {} runs",
        median.as_secs_f64(),
        figures[0].as_secs_f64(),
        figures[figures.len() - 1].as_secs_f64(),
        figures.len()
    );
    Ok(())
}

async fn one_failover(args: &Args, lease: &str, config: LeaseConfig) -> anyhow::Result<Duration> {
    let shutdown = CancellationToken::new();
    let elector = |holder: &str| -> anyhow::Result<Elector<PostgresStore>> {
        let store = PostgresStore::new(&args.database_url, &args.table, true)?;
        Ok(Elector::new(store, lease, holder, config)?)
    };
    let leader = elector("leader")?;
    let mut leader_events = leader.subscribe();
    let leader_shutdown = shutdown.clone();
    let leader_task = tokio::spawn(async move {
        leader
            .run(
                leader_shutdown,
                |term| async move { term.cancelled().await },
            )
            .await;
    });
    wait_for(&mut leader_events, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await?;

    let follower = elector("follower")?;
    let mut follower_events = follower.subscribe();
    let follower_shutdown = shutdown.clone();
    let follower_task = tokio::spawn(async move {
        follower
            .run(
                follower_shutdown,
                |term| async move { term.cancelled().await },
            )
            .await;
    });
    // Crash somewhere in the renewal cycle.
    tokio::time::sleep(config.renew_interval.mul_f64(1.0 + rand::random::<f64>())).await;
    leader_task.abort();
    let crashed = Instant::now();
    let acquired = wait_for(&mut follower_events, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await?;
    shutdown.cancel();
    let _ = follower_task.await;
    Ok(acquired.at().duration_since(crashed))
}

async fn wait_for(
    events: &mut tokio::sync::broadcast::Receiver<Transition>,
    wanted: impl Fn(&Transition) -> bool,
) -> anyhow::Result<Transition> {
    loop {
        let event = events.recv().await?;
        if wanted(&event) {
            return Ok(event);
        }
    }
}
