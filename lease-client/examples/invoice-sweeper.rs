//! The seed's invoice sweeper: several processes compete for the `invoice-sweeper`
//! lease; only the leader sweeps, writing one reminder per unpaid invoice through the
//! gateway under its term's fencing token. See lease-client/README.md for the
//! two-terminal walkthrough.
//!
//! ```text
//! cargo run --example invoice-sweeper -p fencegate-lease --features etcd,zookeeper -- --node node-a
//! cargo run --example invoice-sweeper -p fencegate-lease --features etcd,zookeeper -- \
//!     --node node-a --store etcd --etcd-endpoints 127.0.0.1:2379
//! cargo run --example invoice-sweeper -p fencegate-lease --features etcd,zookeeper -- \
//!     --node node-a --store zookeeper --zookeeper-connect 127.0.0.1:2181
//! ```
//!
//! With etcd or ZooKeeper, run the gateway with `--issued-by etcd:invoices` (and
//! `--etcd-endpoints`) or `--issued-by zookeeper:invoices` (and `--zookeeper-connect`),
//! and `--lease invoices`, so that the gateway checks each new term's token against the
//! election it came from (docs/lease-sources.md).

use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use fencegate_lease::{
    Elector, EtcdStore, FencedClient, LeaseConfig, LeaseStore, PostgresStore, RedisStore, Term,
    WriteError, ZooKeeperStore,
};
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName};
use tokio_util::sync::CancellationToken;

/// Sweeps unpaid invoices, but only while this process leads the lease.
#[derive(Debug, Parser)]
#[command(name = "invoice-sweeper")]
struct Args {
    /// This process's holder identity; unique among running sweepers.
    #[arg(long, env = "SWEEPER_NODE")]
    node: String,
    /// The gateway writes go through.
    #[arg(long, env = "SWEEPER_GATEWAY", default_value = "http://127.0.0.1:7070")]
    gateway: String,
    /// Where the lease lives.
    #[arg(long, env = "SWEEPER_STORE", value_enum, default_value_t = Store::Postgres)]
    store: Store,
    /// The Postgres database of the `leader_lease` table (store `postgres`).
    #[arg(
        long,
        env = "SWEEPER_DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/postgres"
    )]
    database_url: String,
    /// The lease table; created if missing.
    #[arg(long, env = "SWEEPER_TABLE", default_value = "leader_lease")]
    table: String,
    /// The Redis server (store `redis`).
    #[arg(
        long,
        env = "SWEEPER_REDIS_URL",
        default_value = "redis://127.0.0.1:6379"
    )]
    redis_url: String,
    /// The prefix of the Redis lease keys.
    #[arg(long, env = "SWEEPER_REDIS_PREFIX", default_value = "fencegate:lease:")]
    redis_prefix: String,
    /// The etcd cluster (store `etcd`), comma-separated `host:port`.
    #[arg(
        long,
        env = "SWEEPER_ETCD_ENDPOINTS",
        value_delimiter = ',',
        default_value = "127.0.0.1:2379"
    )]
    etcd_endpoints: Vec<String>,
    /// The ZooKeeper ensemble (store `zookeeper`).
    #[arg(
        long,
        env = "SWEEPER_ZOOKEEPER_CONNECT",
        default_value = "127.0.0.1:2181"
    )]
    zookeeper_connect: String,
    /// The lease's name.
    #[arg(long, env = "SWEEPER_LEASE", default_value = "invoice-sweeper")]
    lease: String,
    /// The gateway resource the reminders are written to (its fence is advanced on
    /// every acquisition).
    #[arg(long, env = "SWEEPER_RESOURCE", default_value = "invoices")]
    resource: String,
    /// How many unpaid invoices there are.
    #[arg(long, env = "SWEEPER_INVOICES", default_value_t = 3)]
    invoices: u32,
    /// The pause between sweeps.
    #[arg(long, env = "SWEEPER_SWEEP_INTERVAL", value_parser = humantime::parse_duration, default_value = "1s")]
    sweep_interval: Duration,
    /// The lease duration; the other timings default to fractions of it.
    #[arg(long, env = "SWEEPER_LEASE_DURATION", value_parser = humantime::parse_duration, default_value = "15s")]
    lease_duration: Duration,
    /// How often the leader renews (default: a third of the lease).
    #[arg(long, env = "SWEEPER_RENEW_INTERVAL", value_parser = humantime::parse_duration)]
    renew_interval: Option<Duration>,
    /// Step down after this long without a successful renewal (default: 13/15 of the
    /// lease).
    #[arg(long, env = "SWEEPER_RENEW_DEADLINE", value_parser = humantime::parse_duration)]
    renew_deadline: Option<Duration>,
    /// How often a follower tries to acquire (default: 2/15 of the lease).
    #[arg(long, env = "SWEEPER_RETRY_PERIOD", value_parser = humantime::parse_duration)]
    retry_period: Option<Duration>,
    /// How soon the leader retries a failed renewal (default: 1/30 of the lease).
    #[arg(long, env = "SWEEPER_RENEW_RETRY_PERIOD", value_parser = humantime::parse_duration)]
    renew_retry_period: Option<Duration>,
    /// The longest a lease store or gateway call may take (default: 1/15 of the lease).
    #[arg(long, env = "SWEEPER_MAX_ROUND_TRIP", value_parser = humantime::parse_duration)]
    max_round_trip: Option<Duration>,
    /// `text` for people, `json` for machines.
    #[arg(long, env = "SWEEPER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Store {
    /// The seed's `leader_lease` table.
    Postgres,
    /// `SET NX PX` with a minted counter.
    Redis,
    /// An etcd election; the token is the leading key's create revision.
    Etcd,
    /// A ZooKeeper election; the token is the leading node's czxid. The session
    /// timeout is the lease duration.
    Zookeeper,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

impl Args {
    fn lease_config(&self) -> LeaseConfig {
        let defaults = LeaseConfig::with_lease(self.lease_duration);
        LeaseConfig {
            lease_duration: self.lease_duration,
            renew_interval: self.renew_interval.unwrap_or(defaults.renew_interval),
            renew_deadline: self.renew_deadline.unwrap_or(defaults.renew_deadline),
            retry_period: self.retry_period.unwrap_or(defaults.retry_period),
            renew_retry_period: self
                .renew_retry_period
                .unwrap_or(defaults.renew_retry_period),
            max_round_trip: self.max_round_trip.unwrap_or(defaults.max_round_trip),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let filter =
        tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    match args.store {
        Store::Postgres => {
            let store = PostgresStore::new(&args.database_url, &args.table, true)?;
            run(&args, store, shutdown).await
        }
        Store::Redis => {
            let store = RedisStore::new(&args.redis_url, &args.redis_prefix)?;
            run(&args, store, shutdown).await
        }
        Store::Etcd => {
            let prefix = fencegate_lease::store::etcd::DEFAULT_PREFIX;
            let store = EtcdStore::connect(&args.etcd_endpoints, prefix).await?;
            run(&args, store, shutdown).await
        }
        Store::Zookeeper => {
            let prefix = fencegate_lease::store::zookeeper::DEFAULT_PREFIX;
            let store = ZooKeeperStore::new(&args.zookeeper_connect, prefix, args.lease_duration)?;
            run(&args, store, shutdown).await
        }
    }
}

async fn run<S: LeaseStore>(
    args: &Args,
    store: S,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let config = args.lease_config();
    let gateway = FencedClient::new(&args.gateway)?;
    let resource = ResourceName::new(args.resource.clone()).context("--resource")?;
    let elector = Elector::new(store, &args.lease, &args.node, config)
        .context("invalid lease settings")?
        .advance_fences(gateway.clone(), vec![resource.clone()]);
    tracing::info!(
        node = args.node,
        lease = args.lease,
        ?config,
        "sweeper started"
    );
    elector
        .run(shutdown, |term| {
            sweep_while_leading(term, gateway.clone(), resource.clone(), args)
        })
        .await;
    tracing::info!(node = args.node, "sweeper stopped");
    Ok(())
}

/// The leading code: sweep, pause, sweep again, until the term ends.
async fn sweep_while_leading(
    term: Term,
    gateway: FencedClient,
    resource: ResourceName,
    args: &Args,
) {
    let epoch = term.epoch().get();
    for sweep in 1.. {
        for invoice in 1..=args.invoices {
            let key = ObjectKey::new(format!("invoice-{invoice:03}/reminder"))
                .expect("a short ASCII key is valid");
            let reminder = format!(
                "reminder sent by {} (epoch {epoch}, sweep {sweep})",
                args.node
            );
            match gateway
                .put(&term, &resource, &key, reminder, Precondition::None)
                .await
            {
                Ok(accepted) => tracing::info!(
                    key = key.as_str(),
                    epoch,
                    version = accepted.version,
                    "reminder written"
                ),
                Err(WriteError::Stale {
                    presented, highest, ..
                }) => {
                    tracing::warn!(
                        key = key.as_str(),
                        presented = presented.get(),
                        highest = highest.map(|h| h.get()),
                        "reminder rejected: a newer leader has written; stopping"
                    );
                    return;
                }
                Err(WriteError::TermOver { .. }) => return,
                Err(error) => {
                    // Not sent or not applied; the next sweep tries again.
                    tracing::warn!(key = key.as_str(), %error, "reminder not written");
                }
            }
        }
        tracing::info!(epoch, sweep, "sweep done");
        if term
            .run_until_lost(tokio::time::sleep(args.sweep_interval))
            .await
            .is_err()
        {
            return;
        }
    }
}

async fn stop_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("stopping: releasing the lease");
    shutdown.cancel();
}
