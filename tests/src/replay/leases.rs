//! Where the actors' tokens come from: the lease client's Postgres store (the seed's
//! `leader_lease` table), or, when a run has no lease database, a table in memory that
//! follows the same rules (a new epoch per acquisition, renewals never bump it).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use fencegate_lease::{LeaseStore, PostgresStore};
use fencegate_proto::Token;
use tokio::time::Instant;

pub enum Leases {
    Postgres {
        store: Box<PostgresStore>,
        admin: tokio_postgres::Client,
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

    /// The seed's forced expiry: `expires_at = now() - interval '1 second'`.
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
