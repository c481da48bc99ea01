//! Where the actors' tokens come from: the lease client's Postgres store (the seed's
//! `leader_lease` table), its etcd or ZooKeeper store on a server of the run's own, or,
//! when a run has no lease database, a table in memory that follows the same rules (a
//! new epoch per acquisition, renewals never bump it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_lease::store::{etcd, zookeeper};
use fencegate_lease::{EtcdStore, LeaseStore, PostgresStore, ZooKeeperStore};
use fencegate_proto::Token;
use tokio::time::Instant;

use crate::faults::writer::LeaseSource;
use crate::sources::{Etcd, ZooKeeper};

pub enum Leases {
    Postgres {
        store: Box<PostgresStore>,
        admin: tokio_postgres::Client,
    },
    /// An etcd election per lease; one store for every actor (each acquisition grants
    /// an etcd lease of its own, which expires unless renewed).
    Etcd {
        store: Box<EtcdStore>,
        server: Etcd,
    },
    /// A ZooKeeper election per lease; a store (a session) per actor, with the lease's
    /// TTL as its session timeout.
    ZooKeeper {
        stores: Mutex<HashMap<String, Arc<ZooKeeperStore>>>,
        server: ZooKeeper,
        admin: zookeeper_client::Client,
    },
    Memory(Mutex<HashMap<String, MemoryLease>>),
}

#[derive(Default)]
pub struct MemoryLease {
    holder: Option<String>,
    epoch: u64,
    expires_at: Option<Instant>,
}

impl Leases {
    /// The seed's table in the database at `url` (created if missing).
    pub async fn postgres(url: &str) -> Result<Leases, String> {
        let store = PostgresStore::new(url, "leader_lease", true).map_err(|e| e.to_string())?;
        let (admin, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .map_err(|e| format!("cannot reach the lease database: {e}"))?;
        tokio::spawn(connection);
        Ok(Leases::Postgres {
            store: Box::new(store),
            admin,
        })
    }

    /// Elections in an etcd member started for the run.
    pub async fn etcd() -> Result<Leases, String> {
        let server = Etcd::start().await;
        let store = EtcdStore::connect(&server.endpoints(), etcd::DEFAULT_PREFIX)
            .await
            .map_err(|e| e.to_string())?;
        Ok(Leases::Etcd {
            store: Box::new(store),
            server,
        })
    }

    /// Elections in a ZooKeeper server started for the run.
    pub async fn zookeeper() -> Result<Leases, String> {
        let server = ZooKeeper::start().await;
        let admin = zookeeper::connect(&server.connect(), Duration::from_secs(10))
            .await
            .map_err(|e| e.to_string())?;
        Ok(Leases::ZooKeeper {
            stores: Mutex::new(HashMap::new()),
            server,
            admin,
        })
    }

    /// The source these leases live in; the in-memory table stands in for Postgres.
    pub fn source(&self) -> LeaseSource {
        match self {
            Leases::Postgres { .. } | Leases::Memory(_) => LeaseSource::Postgres,
            Leases::Etcd { .. } => LeaseSource::Etcd,
            Leases::ZooKeeper { .. } => LeaseSource::Zookeeper,
        }
    }

    /// The gateway flags that bind every resource to this source, if it is etcd or
    /// ZooKeeper: the gateway then checks each new term's token against the election.
    pub fn gateway_flags(&self) -> Vec<String> {
        match self {
            Leases::Etcd { server, .. } => vec![
                "--issued-by".into(),
                "etcd:*".into(),
                "--etcd-endpoints".into(),
                server.endpoint(),
            ],
            Leases::ZooKeeper { server, .. } => vec![
                "--issued-by".into(),
                "zookeeper:*".into(),
                "--zookeeper-connect".into(),
                server.connect(),
            ],
            Leases::Postgres { .. } | Leases::Memory(_) => Vec::new(),
        }
    }

    /// The store of `holder` (ZooKeeper: one session per actor).
    fn zookeeper_store(&self, holder: &str, ttl: Duration) -> Option<Arc<ZooKeeperStore>> {
        let Leases::ZooKeeper { stores, server, .. } = self else {
            return None;
        };
        let mut stores = stores.lock().unwrap();
        let store = stores.entry(holder.to_owned()).or_insert_with(|| {
            Arc::new(
                ZooKeeperStore::new(&server.connect(), zookeeper::DEFAULT_PREFIX, ttl)
                    .expect("valid ZooKeeper settings"),
            )
        });
        Some(Arc::clone(store))
    }

    pub fn memory() -> Leases {
        Leases::Memory(Mutex::new(HashMap::new()))
    }

    /// Creates the lease with `epoch` as its stored epoch.
    pub async fn create(&self, lease: &str, epoch: u64) -> Result<(), String> {
        match self {
            Leases::Postgres { store, admin } => {
                store.ensure_lease(lease).await.map_err(|e| e.to_string())?;
                admin
                    .execute(
                        "UPDATE leader_lease SET epoch = $2 WHERE name = $1",
                        &[&lease, &(epoch as i64)],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
            }
            Leases::Etcd { .. } | Leases::ZooKeeper { .. } if epoch != 0 => {
                return Err("start_epoch is for the postgres lease source: etcd and \
                            ZooKeeper tokens are their revisions and zxids"
                    .into())
            }
            Leases::Etcd { .. } | Leases::ZooKeeper { .. } => {}
            Leases::Memory(table) => {
                let mut table = table.lock().unwrap();
                table.entry(lease.to_owned()).or_default().epoch = epoch;
            }
        }
        Ok(())
    }

    pub async fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<u64>, String> {
        match self {
            Leases::Postgres { store, .. } => store
                .acquire(lease, holder, ttl)
                .await
                .map(|token| token.map(Token::get))
                .map_err(|e| e.to_string()),
            Leases::Etcd { store, .. } => store
                .acquire(lease, holder, ttl)
                .await
                .map(|token| token.map(Token::get))
                .map_err(|e| e.to_string()),
            Leases::ZooKeeper { .. } => {
                let store = self
                    .zookeeper_store(holder, ttl)
                    .expect("a ZooKeeper source");
                store
                    .acquire(lease, holder, ttl)
                    .await
                    .map(|token| token.map(Token::get))
                    .map_err(|e| e.to_string())
            }
            Leases::Memory(table) => {
                let mut table = table.lock().unwrap();
                let row = table.entry(lease.to_owned()).or_default();
                let now = Instant::now();
                let free = row.holder.is_none()
                    || row.holder.as_deref() == Some(holder)
                    || row.expires_at.is_none_or(|at| at < now);
                if !free {
                    return Ok(None);
                }
                row.holder = Some(holder.to_owned());
                row.epoch += 1;
                row.expires_at = Some(now + ttl);
                Ok(Some(row.epoch))
            }
        }
    }

    pub async fn renew(
        &self,
        lease: &str,
        holder: &str,
        epoch: u64,
        ttl: Duration,
    ) -> Result<bool, String> {
        match self {
            Leases::Postgres { store, .. } => {
                let token = Token::new(epoch).map_err(|e| e.to_string())?;
                store
                    .renew(lease, holder, token, ttl)
                    .await
                    .map_err(|e| e.to_string())
            }
            Leases::Etcd { store, .. } => {
                let token = Token::new(epoch).map_err(|e| e.to_string())?;
                store
                    .renew(lease, holder, token, ttl)
                    .await
                    .map_err(|e| e.to_string())
            }
            Leases::ZooKeeper { .. } => {
                let token = Token::new(epoch).map_err(|e| e.to_string())?;
                let store = self
                    .zookeeper_store(holder, ttl)
                    .expect("a ZooKeeper source");
                store
                    .renew(lease, holder, token, ttl)
                    .await
                    .map_err(|e| e.to_string())
            }
            Leases::Memory(table) => {
                let mut table = table.lock().unwrap();
                let row = table.entry(lease.to_owned()).or_default();
                let now = Instant::now();
                let ours = row.holder.as_deref() == Some(holder)
                    && row.epoch == epoch
                    && row.expires_at.is_some_and(|at| at > now);
                if ours {
                    row.expires_at = Some(now + ttl);
                }
                Ok(ours)
            }
        }
    }

    /// The seed's forced expiry: `expires_at = now() - interval '1 second'`; for etcd
    /// and ZooKeeper, the election's leading key or node is deleted, as its lease or
    /// session expiring would.
    pub async fn expire(&self, lease: &str) -> Result<(), String> {
        match self {
            Leases::Postgres { admin, .. } => admin
                .execute(
                    "UPDATE leader_lease SET expires_at = now() - interval '1 second' WHERE name = $1",
                    &[&lease],
                )
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            Leases::Etcd { server, .. } => {
                let election = format!("{}{lease}/", etcd::DEFAULT_PREFIX);
                server.etcdctl(&["del", "--prefix", &election]).await.map(drop)
            }
            Leases::ZooKeeper { admin, .. } => {
                let election = format!("{}/{lease}", zookeeper::DEFAULT_PREFIX);
                let leader = zookeeper::first_candidate(admin, &election)
                    .await
                    .map_err(|e| e.to_string())?;
                match leader {
                    Some(leader) => admin
                        .delete(&leader.path, None)
                        .await
                        .map_err(|e| e.to_string()),
                    None => Ok(()),
                }
            }
            Leases::Memory(table) => {
                let mut table = table.lock().unwrap();
                let row = table.entry(lease.to_owned()).or_default();
                let now = Instant::now();
                row.expires_at = Some(now.checked_sub(Duration::from_secs(1)).unwrap_or(now));
                Ok(())
            }
        }
    }
}
