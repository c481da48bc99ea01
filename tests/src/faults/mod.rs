//! Fault runs: lease-holding writers as real processes, writing through two gateway
//! replicas on one Postgres, while a fault is injected again and again; then every
//! operation's history is checked for linearizability ([`crate::history`]).
//!
//! # Layout
//!
//! - [`writer`]: the writer process (`fencegate-faults writer`) and its handle.
//! - [`inject`]: kill -9 of a postmaster and its restart; a network namespace whose
//!   link to Postgres can be blackholed.
//!
//! # A run
//!
//! For each of `resources` resources, `writers` writer processes compete for the
//! resource's lease (the seed's `leader_lease` table, on the test Postgres server, out
//! of the faults' way) and write through the gateways in turn. The fault is injected
//! for `duration`; then everything is healed, the writers are stopped, every key is
//! read once more, and each resource's history is checked. [`Fault`] says what each
//! fault does. The control run is the pause workload with fencing off: the checker
//! must find violations there, or it proves nothing.

pub mod inject;
pub mod writer;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::db::TestDb;
use crate::gateway::{Gateway, GatewayBuilder};
use crate::history::{self, Counts, Entry, Op, Outcome, Violation};
use crate::replay::wire::{self, Request};
use crate::sources::{Etcd, ZooKeeper};
use inject::Netns;
use writer::{LeaseSource, WriterArgs, WriterProcess, LEASE_TABLE};

/// What a run does to the writers and the processes below them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fault {
    /// Stop the lease holder past its lease's expiry, until a rival has taken over,
    /// then SIGCONT it. Every other round the holder stops itself once its next batch
    /// is decided, so that a write decided under the old term surely goes out late; in
    /// the others SIGSTOP lands wherever it is.
    Pause,
    /// kill -9 a gateway replica (in turn), and start it again on its address.
    GatewayKill,
    /// kill -9 the postmaster of the gateways' throwaway Postgres cluster while writes
    /// commit — alone, and in turn with all its backends — and start it again (crash
    /// recovery from the WAL).
    PostgresKill,
    /// Blackhole the link between one gateway (in a network namespace) and Postgres,
    /// then heal it.
    Partition,
    /// Writers whose step-down timers run slow (believing they lead after their lease
    /// expired) and fast, beside one with a true clock.
    Clock,
    /// The pause workload with fencing off: writers present token 1 and never advance
    /// the fence. The history records their terms' tokens, so the checker must report
    /// the stale writes that got in.
    Control,
    /// kill -9 the lease source — the etcd member or the ZooKeeper server of a run with
    /// leases there — and start it again on its data, while the writers lead and write.
    SourceKill,
}

impl Fault {
    pub const ALL: [Fault; 6] = [
        Fault::Pause,
        Fault::GatewayKill,
        Fault::PostgresKill,
        Fault::Partition,
        Fault::Clock,
        Fault::Control,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::Pause => "pause",
            Fault::GatewayKill => "gateway-kill",
            Fault::PostgresKill => "postgres-kill",
            Fault::Partition => "partition",
            Fault::Clock => "clock",
            Fault::Control => "control",
            Fault::SourceKill => "source-kill",
        }
    }

    /// Whether the run's history should have violations.
    pub fn expects_violations(self) -> bool {
        self == Fault::Control
    }
}

/// How a run is shaped.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How long faults are injected.
    pub duration: Duration,
    pub resources: usize,
    /// Writer processes per resource (the clock run has at least three).
    pub writers: usize,
    pub ttl: Duration,
    /// Operations each writer sends at once.
    pub lanes: usize,
    /// The `fencegate-faults` binary, whose `writer` command the writers run.
    pub binary: PathBuf,
}

/// What a run found.
#[derive(Debug, Clone)]
pub struct Report {
    pub fault: Fault,
    pub histories: usize,
    pub counts: Counts,
    /// Faults injected: pauses, kills, partitions, skewed writers.
    pub injected: usize,
    pub violations: Vec<Violation>,
    /// Writes applied although a write of a higher token had been acknowledged before
    /// they were sent: the harm a control run shows.
    pub late_applied: usize,
    pub elapsed: Duration,
}

impl Report {
    /// Whether the run found what it should: nothing, or for the control, something.
    pub fn passed(&self) -> bool {
        self.violations.is_empty() != self.fault.expects_violations()
    }

    pub fn line(&self) -> String {
        format!(
            "{:<14} {:>3} histories {:>6} operations {:>5} applied {:>5} stale {:>4} indeterminate \
             {:>4} faults injected {:>3} violations {:>3} late writes applied  {:>5.1} s",
            self.fault.name(),
            self.histories,
            self.counts.operations,
            self.counts.applied,
            self.counts.stale,
            self.counts.indeterminate,
            self.injected,
            self.violations.len(),
            self.late_applied,
            self.elapsed.as_secs_f64()
        )
    }
}

/// Where the writers' leases live: a fresh database on the test Postgres server (the
/// seed's `leader_lease` table), or an etcd member or ZooKeeper server of the run's own.
pub struct Leases {
    source: Source,
}

enum Source {
    Postgres {
        db: TestDb,
        client: tokio_postgres::Client,
    },
    Etcd {
        server: tokio::sync::Mutex<Etcd>,
        endpoint: String,
        client: Box<etcd_client::Client>,
    },
    ZooKeeper {
        server: tokio::sync::Mutex<ZooKeeper>,
        connect: String,
        client: zookeeper_client::Client,
    },
}

impl Leases {
    /// Leases in a fresh database's `leader_lease` table.
    pub async fn create() -> Result<Leases, String> {
        let db = TestDb::create().await;
        let (client, connection) = tokio_postgres::connect(&db.url(), tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("the lease database: {e}"))?;
        tokio::spawn(connection);
        Ok(Leases {
            source: Source::Postgres { db, client },
        })
    }

    /// Leases in etcd elections, on a member of the run's own.
    pub async fn etcd() -> Result<Leases, String> {
        let server = Etcd::start().await;
        let endpoint = server.endpoint();
        let client = fencegate_lease::store::etcd::connect(&server.endpoints())
            .await
            .map_err(|e| e.to_string())?;
        Ok(Leases {
            source: Source::Etcd {
                server: tokio::sync::Mutex::new(server),
                endpoint,
                client: Box::new(client),
            },
        })
    }

    /// Leases in ZooKeeper elections, on a server of the run's own.
    pub async fn zookeeper() -> Result<Leases, String> {
        let server = ZooKeeper::start().await;
        let connect = server.connect();
        let client = fencegate_lease::store::zookeeper::connect(&connect, Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string())?;
        Ok(Leases {
            source: Source::ZooKeeper {
                server: tokio::sync::Mutex::new(server),
                connect,
                client,
            },
        })
    }

    pub fn source(&self) -> LeaseSource {
        match self.source {
            Source::Postgres { .. } => LeaseSource::Postgres,
            Source::Etcd { .. } => LeaseSource::Etcd,
            Source::ZooKeeper { .. } => LeaseSource::Zookeeper,
        }
    }

    /// Points a writer at this source.
    fn direct(&self, args: &mut WriterArgs) {
        args.lease_source = self.source();
        match &self.source {
            Source::Postgres { db, .. } => args.lease_database_url = db.url(),
            Source::Etcd { endpoint, .. } => args.etcd_endpoint = endpoint.clone(),
            Source::ZooKeeper { connect, .. } => args.zookeeper_connect = connect.clone(),
        }
    }

    /// The gateway flags that bind the run's resources to this source.
    fn gateway_flags(&self) -> Vec<String> {
        match &self.source {
            Source::Postgres { .. } => Vec::new(),
            Source::Etcd { endpoint, .. } => vec![
                "--issued-by".into(),
                "etcd:faults-*".into(),
                "--etcd-endpoints".into(),
                endpoint.clone(),
            ],
            Source::ZooKeeper { connect, .. } => vec![
                "--issued-by".into(),
                "zookeeper:faults-*".into(),
                "--zookeeper-connect".into(),
                connect.clone(),
            ],
        }
    }

    async fn prepare(&self, lease: &str) -> Result<(), String> {
        let Source::Postgres { db, .. } = &self.source else {
            return Ok(());
        };
        let store = fencegate_lease::PostgresStore::new(&db.url(), LEASE_TABLE, true)
            .map_err(|e| e.to_string())?;
        store.ensure_lease(lease).await.map_err(|e| e.to_string())
    }

    /// kill -9 the etcd member or ZooKeeper server, and start it again on its data.
    async fn kill_source(&self) -> Result<(), String> {
        match &self.source {
            Source::Postgres { .. } => {
                Err("source-kill needs leases in etcd or ZooKeeper (--lease-source)".into())
            }
            Source::Etcd { server, .. } => {
                server.lock().await.restart().await;
                Ok(())
            }
            Source::ZooKeeper { server, .. } => {
                server.lock().await.restart().await;
                Ok(())
            }
        }
    }

    /// Waits until `holder` holds `lease` (10 s at most).
    async fn wait_for_holder(&self, lease: &str, holder: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.holder(lease).await.as_deref() != Some(holder) {
            if Instant::now() > deadline {
                return Err(format!("{holder} never took lease {lease}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Waits until someone other than `holder` holds `lease` (10 s at most).
    async fn wait_for_other_holder(&self, lease: &str, holder: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match self.holder(lease).await {
                Some(other) if other != holder => return Ok(()),
                _ if Instant::now() > deadline => {
                    return Err(format!("no rival of {holder} took lease {lease}"))
                }
                _ => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// The lease's holder if its term is live.
    async fn holder(&self, lease: &str) -> Option<String> {
        match &self.source {
            Source::Postgres { client, .. } => {
                let sql = format!(
                    "SELECT holder FROM {LEASE_TABLE} WHERE name = $1 AND expires_at > now()"
                );
                let row = client.query_opt(&sql, &[&lease]).await.ok()??;
                row.get(0)
            }
            Source::Etcd { client, .. } => {
                let election = format!("{}{lease}/", fencegate_lease::store::etcd::DEFAULT_PREFIX);
                let read = fencegate_lease::store::etcd::read_election(client, &election)
                    .await
                    .ok()?;
                String::from_utf8(read.leader?.holder).ok()
            }
            Source::ZooKeeper { client, .. } => {
                let election = format!(
                    "{}/{lease}",
                    fencegate_lease::store::zookeeper::DEFAULT_PREFIX
                );
                let first = fencegate_lease::store::zookeeper::first_candidate(client, &election)
                    .await
                    .ok()??;
                String::from_utf8(first.holder).ok()
            }
        }
    }
}

/// A gateway replica the run may kill and start again.
struct Replica {
    gateway: Gateway,
    builder: GatewayBuilder,
}

impl Replica {
    async fn start(builder: GatewayBuilder) -> Replica {
        let gateway = builder.clone().spawn().await;
        let builder = builder.listen(gateway.addr());
        Replica { gateway, builder }
    }

    async fn kill_and_restart(&mut self) {
        self.gateway.kill().await;
        self.gateway = self.builder.clone().spawn().await;
    }
}

/// The gateways and their database.
struct Deployment {
    replicas: Vec<Replica>,
    cluster: Option<Cluster>,
    netns: Option<Netns>,
    _db: Option<TestDb>,
}

/// Flags every replica gets: a backend deadline well below the writers' patience.
const GATEWAY_FLAGS: [&str; 2] = ["--backend-timeout", "1s"];

impl Deployment {
    async fn start(fault: Fault, flags: &[String]) -> Result<Deployment, String> {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let base = Gateway::builder().args(&GATEWAY_FLAGS).args(&flags);
        match fault {
            Fault::PostgresKill => {
                let cluster = Cluster::builder().start().await;
                let url = cluster.url();
                let mut replicas = Vec::new();
                for _ in 0..2 {
                    replicas.push(Replica::start(base.clone().database(&url)).await);
                }
                Ok(Deployment {
                    replicas,
                    cluster: Some(cluster),
                    netns: None,
                    _db: None,
                })
            }
            Fault::Partition => {
                let netns = Netns::create().await?;
                let cluster = Cluster::builder()
                    .setting(
                        "listen_addresses",
                        &format!("127.0.0.1,{}", netns.database_addr()),
                    )
                    .hba("host all all 127.0.0.1/32 scram-sha-256")
                    .hba(&format!(
                        "host all all {}/32 scram-sha-256",
                        netns.database_client_addr()
                    ))
                    .start()
                    .await;
                let inside = crate::db::via(
                    &cluster.url(),
                    SocketAddr::from((netns.database_addr(), cluster.port())),
                );
                let prefix = netns.exec_prefix();
                let prefix: Vec<&str> = prefix.iter().map(String::as_str).collect();
                let partitioned = base
                    .clone()
                    .database(&inside)
                    .run_under(&prefix)
                    .listen(SocketAddr::from((netns.gateway_addr(), 0)))
                    .arg("--insecure-no-auth");
                let replicas = vec![
                    Replica::start(partitioned).await,
                    Replica::start(base.database(&cluster.url())).await,
                ];
                Ok(Deployment {
                    replicas,
                    cluster: Some(cluster),
                    netns: Some(netns),
                    _db: None,
                })
            }
            _ => {
                let db = TestDb::create().await;
                let mut replicas = Vec::new();
                for _ in 0..2 {
                    replicas.push(Replica::start(base.clone().database(&db.url())).await);
                }
                Ok(Deployment {
                    replicas,
                    cluster: None,
                    netns: None,
                    _db: Some(db),
                })
            }
        }
    }

    fn addrs(&self) -> Vec<SocketAddr> {
        self.replicas.iter().map(|r| r.gateway.addr()).collect()
    }
}

/// Runs `fault` once and checks its history.
pub async fn run(fault: Fault, settings: &Settings, leases: &Leases) -> Result<Report, String> {
    let started = Instant::now();
    let mut deployment = Deployment::start(fault, &leases.gateway_flags()).await?;
    let run_id = format!("{:08x}", rand::random::<u32>());
    let writers_per_resource = if fault == Fault::Clock {
        settings.writers.max(3)
    } else {
        settings.writers
    };
    let mut resources = Vec::new();
    let mut writers = Vec::new();
    let mut injected = 0;
    for r in 0..settings.resources {
        let resource = format!("faults-{}-{run_id}-r{r}", fault.name());
        leases.prepare(&resource).await?;
        for w in 0..writers_per_resource {
            let clock_rate = match (fault, w) {
                (Fault::Clock, 0) => 0.2,
                (Fault::Clock, 1) => 3.0,
                _ => 1.0,
            };
            injected += usize::from(clock_rate != 1.0);
            let mut args = WriterArgs {
                gateways: deployment.addrs(),
                lease_source: LeaseSource::Postgres,
                lease_database_url: String::new(),
                etcd_endpoint: String::new(),
                zookeeper_connect: String::new(),
                resource: resource.clone(),
                holder: format!("{resource}-w{w}"),
                client: (r * writers_per_resource + w) as u32,
                ttl: settings.ttl,
                clock_rate,
                keys: 2,
                lanes: settings.lanes,
                unfenced: fault == Fault::Control,
                unkeyed: false,
            };
            leases.direct(&mut args);
            let holder = args.holder.clone();
            writers.push(WriterProcess::spawn(&settings.binary, &args)?);
            if fault == Fault::Clock && w == 0 {
                // The slow-clock writer leads first, before its rivals compete: its
                // term then outlives its lease, a rival takes over, and its writes
                // meet the rival's fence — every run, not only when it wins a race.
                leases.wait_for_holder(&resource, &holder).await?;
            }
        }
        resources.push(resource);
    }

    let injection = inject(
        fault,
        settings,
        leases,
        &mut deployment,
        &resources,
        &writers,
    )
    .await;
    // Heal whatever the injection left broken, also when it failed.
    for writer in &writers {
        writer.signal("CONT");
    }
    if let Some(netns) = &mut deployment.netns {
        netns.heal().await?;
    }
    injected += injection?;

    let mut entries = Vec::new();
    for writer in writers {
        entries.extend(writer.stop().await?);
    }
    let reader = (writers_per_resource * settings.resources) as u32;
    for resource in &resources {
        for key in ["k0", "k1"] {
            entries.push(final_read(&deployment, reader, resource, key).await?);
        }
    }
    let violations = history::check(&entries);
    Ok(Report {
        fault,
        histories: resources.len(),
        counts: Counts::of(&entries),
        injected,
        violations,
        late_applied: late_applied(&entries),
        elapsed: started.elapsed(),
    })
}

/// How long a holder asked to pause once its batch is decided may take to do so.
const PAUSE_PATIENCE: Duration = Duration::from_secs(2);

/// Injects `fault` until the run's duration is over; the number of faults injected.
async fn inject(
    fault: Fault,
    settings: &Settings,
    leases: &Leases,
    deployment: &mut Deployment,
    resources: &[String],
    writers: &[WriterProcess],
) -> Result<usize, String> {
    let end = Instant::now() + settings.duration;
    let ttl = settings.ttl;
    let mut injected = 0;
    let mut round = 0;
    // Let the first terms begin.
    tokio::time::sleep(ttl).await;
    while Instant::now() < end {
        match fault {
            Fault::Pause | Fault::Control => {
                // Every resource's holder at once, past its lease's expiry. Every other
                // round, the holder stops itself once its next batch is decided, so that
                // a decided write surely goes out late; in the others, SIGSTOP lands
                // wherever the holder is.
                let decided = round % 2 == 0;
                round += 1;
                let mut paused = Vec::new();
                for resource in resources {
                    let holder = leases.holder(resource).await;
                    let Some(writer) = writers.iter().find(|w| Some(&w.holder) == holder.as_ref())
                    else {
                        continue;
                    };
                    if decided {
                        if !writer.pause_when_decided(PAUSE_PATIENCE).await {
                            continue;
                        }
                    } else {
                        writer.signal("STOP");
                    }
                    paused.push((resource, writer));
                }
                if paused.is_empty() {
                    tokio::time::sleep(ttl / 4).await;
                    continue;
                }
                tokio::time::sleep(ttl * 2).await;
                // A rival takes over and raises the fence before the holder wakes.
                for (resource, writer) in &paused {
                    leases
                        .wait_for_other_holder(resource, &writer.holder)
                        .await?;
                }
                tokio::time::sleep(ttl / 2).await;
                for (_, writer) in &paused {
                    writer.signal("CONT");
                }
                injected += paused.len();
                tokio::time::sleep(ttl).await;
            }
            Fault::GatewayKill => {
                let replica = injected % deployment.replicas.len();
                deployment.replicas[replica].kill_and_restart().await;
                injected += 1;
                tokio::time::sleep(ttl).await;
            }
            Fault::PostgresKill => {
                let cluster = deployment
                    .cluster
                    .as_ref()
                    .expect("a cluster of the run's own");
                // In turn the postmaster alone, and the whole server.
                inject::crash_postmaster(cluster.port(), injected % 2 == 1).await?;
                injected += 1;
                tokio::time::sleep(ttl * 2).await;
            }
            Fault::Partition => {
                let netns = deployment.netns.as_mut().expect("a network namespace");
                netns.partition().await?;
                injected += 1;
                tokio::time::sleep(ttl * 2).await;
                netns.heal().await?;
                tokio::time::sleep(ttl * 2).await;
            }
            Fault::Clock => tokio::time::sleep(end - Instant::now()).await,
            Fault::SourceKill => {
                leases.kill_source().await?;
                injected += 1;
                tokio::time::sleep(ttl * 2).await;
            }
        }
    }
    Ok(injected)
}

/// A read of `key` once the faults are over, retried until a gateway answers it.
async fn final_read(
    deployment: &Deployment,
    client: u32,
    resource: &str,
    key: &str,
) -> Result<Entry, String> {
    let op = Op::Read {
        key: key.to_owned(),
    };
    let request = Request::get(&crate::http::kv_path(resource, key));
    let deadline = Instant::now() + wire::PATIENCE;
    let mut last = String::new();
    while Instant::now() < deadline {
        for addr in deployment.addrs() {
            let invoked = history::now();
            match wire::send_one(addr, &request).await {
                Ok(reply) => {
                    let completed = history::now();
                    let outcome =
                        history::outcome_of(&op, reply.status, &reply.body, reply.etag.as_deref())?;
                    if let Outcome::Read { .. } = outcome {
                        return Ok(Entry {
                            client,
                            resource: resource.to_owned(),
                            op,
                            invoked,
                            completed,
                            outcome,
                        });
                    }
                    last = format!("{} {}", reply.status, reply.body);
                }
                Err(error) => last = error,
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(format!(
        "no gateway answered a read after the faults: {last}"
    ))
}

/// Applied writes sent after a write of a higher token of the same resource had been
/// acknowledged.
pub fn late_applied(entries: &[Entry]) -> usize {
    let applied_write = |entry: &&Entry| {
        matches!(entry.op, Op::Write { .. }) && matches!(entry.outcome, Outcome::Applied { .. })
    };
    let token = |entry: &Entry| match entry.op {
        Op::Write { token, .. } => token,
        _ => 0,
    };
    let writes: Vec<&Entry> = entries.iter().filter(applied_write).collect();
    writes
        .iter()
        .filter(|late| {
            writes.iter().any(|earlier| {
                earlier.resource == late.resource
                    && token(earlier) > token(late)
                    && earlier.completed < late.invoked
            })
        })
        .count()
}
