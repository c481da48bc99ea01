//! Measures failover: how long after a leader crashes (stops renewing, releases
//! nothing) a follower holds the lease. Runs the election in-process against a real
//! Postgres, Redis, etcd or ZooKeeper, several times, and prints each figure and the
//! median.
//!
//! ```text
//! cargo run --release --example failover-timing -p fencegate-lease --features etcd,zookeeper -- --lease 15s --runs 5
//! cargo run --release --example failover-timing -p fencegate-lease --features etcd,zookeeper -- --lease 600ms --runs 21
//! cargo run --release --example failover-timing -p fencegate-lease --features etcd,zookeeper -- \
//!     --store etcd --etcd-endpoints 127.0.0.1:2379 --lease 2s --runs 11
//! ```
//!
//! The crashed leader's store is dropped with it: its Postgres row and Redis key stay
//! until they expire, its etcd lease is not revoked, and its ZooKeeper session is left
//! to expire on the server (the store's sessions are detached), as a killed process's
//! would be. etcd grants whole seconds of 2 or more, and ZooKeeper's session timeout is
//! the lease duration.
//!
//! The crash happens at a random point of the leader's renewal cycle, so the figures
//! spread between `lease - renew_interval` and `lease + retry_period` (plus jitter).

use std::time::Duration;

use clap::{Parser, ValueEnum};
use fencegate_lease::{
    Elector, EtcdStore, LeaseConfig, LeaseStore, PostgresStore, RedisStore, Transition,
    ZooKeeperStore,
};
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
    /// Where the lease lives.
    #[arg(long, env = "FAILOVER_STORE", value_enum, default_value_t = Store::Postgres)]
    store: Store,
    /// The Redis server (store `redis`).
    #[arg(
        long,
        env = "FAILOVER_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// The etcd cluster (store `etcd`), comma-separated `host:port`.
    #[arg(
        long,
        env = "FAILOVER_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:2379"
    )]
    etcd_endpoints: Vec<String>,
    /// The ZooKeeper ensemble (store `zookeeper`).
    #[arg(
        long,
        env = "FAILOVER_ZOOKEEPER_CONNECT",
        default_value = "127.0.0.1:2181"
    )]
    zookeeper_connect: String,
    /// The lease duration; every other timing takes its default fraction.
    #[arg(long, env = "FAILOVER_LEASE", value_parser = humantime::parse_duration, default_value = "15s")]
    lease: Duration,
    /// How many crashes to time.
    #[arg(long, env = "FAILOVER_RUNS", default_value_t = 5)]
    runs: u32,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Store {
    Postgres,
    Redis,
    Etcd,
    Zookeeper,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = LeaseConfig::with_lease(args.lease);
    println!("store: {:?}, timing: {config:?}", args.store);
    let mut figures = Vec::new();
    for run in 0..args.runs {
        let lease = format!("failover-timing-{}-{run}", std::process::id());
        let figure = match args.store {
            Store::Postgres => {
                let store = || PostgresStore::new(&args.database_url, &args.table, true);
                one_failover(store()?, store()?, &lease, config).await?
            }
            Store::Redis => {
                let store = || RedisStore::new(&args.redis_url, "fencegate:failover:");
                one_failover(store()?, store()?, &lease, config).await?
            }
            Store::Etcd => {
                let prefix = fencegate_lease::store::etcd::DEFAULT_PREFIX;
                let store = || EtcdStore::connect(&args.etcd_endpoints, prefix);
                one_failover(store().await?, store().await?, &lease, config).await?
            }
            Store::Zookeeper => {
                let prefix = fencegate_lease::store::zookeeper::DEFAULT_PREFIX;
                let store = || {
                    ZooKeeperStore::new(&args.zookeeper_connect, prefix, args.lease)
                        .map(ZooKeeperStore::with_detached_sessions)
                };
                one_failover(store()?, store()?, &lease, config).await?
            }
        };
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

async fn one_failover<S: LeaseStore>(
    leader_store: S,
    follower_store: S,
    lease: &str,
    config: LeaseConfig,
) -> anyhow::Result<Duration> {
    let shutdown = CancellationToken::new();
    let leader = Elector::new(leader_store, lease, "leader", config)?;
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

    let follower = Elector::new(follower_store, lease, "follower", config)?;
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
