//! What a scenario runs against: gateway replicas, each behind a labelled proxy (the
//! delaying hop), and — for local runs only — the processes and the database link the
//! harness controls.

use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::sync::Mutex;

use crate::db::TestDb;
use crate::faults::writer::LeaseSource;
use crate::gateway::Gateway;
use crate::proxy::Proxy;
use crate::replay::leases::Leases;

/// One gateway replica.
pub struct Replica {
    /// The gateway's own address (reads, metrics, restarts).
    pub addr: SocketAddr,
    /// The delaying hop in front of it; every write goes through it.
    pub hop: Proxy,
    /// The process, when the harness started it.
    pub process: Option<Mutex<Gateway>>,
}

/// A database the harness reads and writes directly (control runs, final checks).
pub struct Database {
    pub url: String,
    pub client: tokio_postgres::Client,
}

impl Database {
    pub async fn connect(url: &str) -> Result<Database, String> {
        let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot reach {}: {e}", redact(url)))?;
        tokio::spawn(connection);
        Ok(Database {
            url: url.to_owned(),
            client,
        })
    }
}

/// A URL without its password, for messages.
fn redact(url: &str) -> String {
    match url.split_once('@') {
        Some((_, host)) => format!("postgres://…@{host}"),
        None => url.to_owned(),
    }
}

pub struct Target {
    pub replicas: Vec<Replica>,
    pub leases: Leases,
    /// The proxy between the gateways and their database, when local.
    pub database_link: Mutex<Option<Proxy>>,
    /// Where control runs write straight, unfenced.
    pub control: Option<Database>,
    /// The writer binary for process actors (`fencegate-replay writer`).
    pub writer: Option<PathBuf>,
    /// Keeps a local test database alive for the target's lifetime.
    _db: Option<TestDb>,
}

impl Target {
    /// An external deployment: gateways at `gateways`, each behind a labelled proxy in
    /// this process. Nothing here can restart them or cut their database.
    pub async fn external(
        gateways: &[SocketAddr],
        leases: Leases,
        control: Option<Database>,
        writer: Option<PathBuf>,
    ) -> Target {
        let mut replicas = Vec::new();
        for addr in gateways {
            replicas.push(Replica {
                addr: *addr,
                hop: Proxy::start(*addr).await,
                process: None,
            });
        }
        Target {
            replicas,
            leases,
            database_link: Mutex::new(None),
            control,
            writer,
            _db: None,
        }
    }

    /// A fresh database on the test Postgres server and `replicas` gateway processes
    /// whose database connections run through a proxy the scenario can cut. Leases and
    /// control writes use the same database, directly.
    pub async fn local(replicas: usize, writer: Option<PathBuf>) -> Target {
        Target::local_with(replicas, writer, LeaseSource::Postgres).await
    }

    /// [`Target::local`] with the leases in `source`: etcd and ZooKeeper run on servers
    /// of the target's own, and the gateways check every token against their elections.
    pub async fn local_with(
        replicas: usize,
        writer: Option<PathBuf>,
        source: LeaseSource,
    ) -> Target {
        let db = TestDb::create().await;
        let leases = match source {
            LeaseSource::Postgres => Leases::postgres(&db.url()).await,
            LeaseSource::Etcd => Leases::etcd().await,
            LeaseSource::Zookeeper => Leases::zookeeper().await,
        }
        .expect("the lease source takes leases");
        let flags = leases.gateway_flags();
        let link = Proxy::start(crate::db::server_addr().await).await;
        let gateway_url = db.url_via(link.addr());
        let mut started = Vec::new();
        for _ in 0..replicas {
            let gateway = Gateway::builder()
                .database(&gateway_url)
                .arg("--backend-timeout")
                .arg("1s")
                .arg("--metrics-resource-cap")
                .arg("1000000")
                .args(&flags.iter().map(String::as_str).collect::<Vec<_>>())
                .spawn()
                .await;
            started.push(Replica {
                addr: gateway.addr(),
                hop: Proxy::start(gateway.addr()).await,
                process: Some(Mutex::new(gateway)),
            });
        }
        let control = Database::connect(&db.url())
            .await
            .expect("the test database is reachable");
        Target {
            replicas: started,
            leases,
            database_link: Mutex::new(Some(link)),
            control: Some(control),
            writer,
            _db: Some(db),
        }
    }

    /// Whether gateway processes and the database link are under this harness's control.
    pub fn is_local(&self) -> bool {
        self.replicas.iter().all(|r| r.process.is_some())
    }
}
