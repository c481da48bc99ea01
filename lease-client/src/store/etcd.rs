//! etcd's election recipe, with the leading key's create revision as the token.
//!
//! The election of lease `L` is every key under `<prefix>L/`. A candidate grants an
//! etcd lease of the TTL and writes `<prefix>L/<lease id in hex>` = its holder identity,
//! attached to that lease; the key created first leads. That is the layout of etcd's
//! own `concurrency.Election`, of `etcdctl elect` and of the v3election service, so a
//! gateway checking tokens against etcd (`--issued-by etcd:...`) reads any of them.
//!
//! - acquire: grant a lease, create the candidate key, and read the election's
//!   first-created key. Ours: the term's token is its create revision. Another
//!   holder's: take our key back (revoke the lease) and answer `None`. Our own
//!   identity's (a restarted process): delete that key and look again.
//! - renew: keep the etcd lease alive once, and check that the key still exists with
//!   the term's create revision.
//! - release: revoke the etcd lease, which deletes the key.
//! - lost: a watch on the key resolves when it is deleted — the etcd lease expired or
//!   was revoked, or someone deleted the key — before the next renewal would notice.
//!
//! # Why the token only rises
//!
//! etcd's revision is one counter for the whole cluster, raised by every change and
//! agreed through Raft: a key created later has a higher create revision than any key
//! created before it, in any election. A new term's key is created after the previous
//! term's key was written, so its token is higher.
//!
//! # What this store does not guarantee
//!
//! - A cluster restored from a snapshot without `etcdutl snapshot restore
//!   --bump-revision` starts again at the snapshot's revision: tokens handed out after
//!   the snapshot are handed out again. The gateway's fence then refuses the new
//!   leader's writes as stale (safe, but it cannot work until the revision passes the
//!   fence, or an operator resets the fence); restore with `--bump-revision` (and
//!   `--mark-compacted`) by more than the writes since the snapshot.
//! - etcd grants leases in whole seconds, and never below its minimum TTL (about
//!   1.5 × the election timeout, 2 s by default): a shorter `ttl` is raised to a whole
//!   second and then to that minimum. The elector's own deadlines must fit in the lease
//!   the server granted; keep `lease_duration` a whole number of seconds of 2 or more.
//! - A lease is kept alive at its granted TTL; renew's `ttl` does not change it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, WatchOptions,
};
use fencegate_proto::Token;

use super::{token_of, LeaseStore, StoreError};

/// The key prefix used unless another is given.
pub const DEFAULT_PREFIX: &str = "/fencegate/elections/";

/// Leases as etcd election keys, the leading key's create revision as the token.
pub struct EtcdStore {
    client: Client,
    prefix: String,
    /// The terms this store leads, by lease name: the etcd lease and key of each.
    held: Mutex<HashMap<String, Held>>,
}

/// A term this store leads.
#[derive(Debug, Clone)]
struct Held {
    epoch: Token,
    lease_id: i64,
    key: String,
}

/// The first-created key of an election, as read.
#[derive(Debug, Clone)]
pub struct Leader {
    pub key: Vec<u8>,
    /// The key's value: the leader's holder identity.
    pub holder: Vec<u8>,
    /// The term's token.
    pub create_revision: i64,
}

/// An election as read: its leader if any, and the cluster's revision at the read.
#[derive(Debug, Clone)]
pub struct Election {
    pub leader: Option<Leader>,
    pub revision: i64,
}

/// A client of the etcd cluster of `endpoints`, as the store and the gateway's issuer
/// check use it. Connects lazily.
pub async fn connect(endpoints: &[String]) -> Result<Client, StoreError> {
    if endpoints.is_empty() {
        return Err(StoreError::Invalid("no etcd endpoint".into()));
    }
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(2))
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2))
        .with_require_leader(true);
    Client::connect(endpoints, Some(options))
        .await
        .map_err(|e| StoreError::Invalid(format!("etcd endpoints {endpoints:?}: {e}")))
}

/// The cluster's revision now, from the header of a read of one key (`key`, which need
/// not exist).
pub async fn revision(client: &Client, key: &str) -> Result<i64, StoreError> {
    let found = client
        .clone()
        .get(key, Some(GetOptions::new().with_count_only()))
        .await
        .map_err(failed)?;
    Ok(found.header().map_or(0, |header| header.revision()))
}

/// Reads the election whose candidate keys start with `election`: its first-created
/// key leads.
pub async fn read_election(client: &Client, election: &str) -> Result<Election, StoreError> {
    let options = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1);
    let found = client
        .clone()
        .get(election, Some(options))
        .await
        .map_err(failed)?;
    Ok(Election {
        leader: found.kvs().first().map(|kv| Leader {
            key: kv.key().to_vec(),
            holder: kv.value().to_vec(),
            create_revision: kv.create_revision(),
        }),
        revision: found.header().map_or(0, |header| header.revision()),
    })
}

impl EtcdStore {
    /// A store on the etcd cluster of `endpoints` (`127.0.0.1:2379`, or with a scheme),
    /// its election keys starting with `prefix`. Connects lazily: an unreachable
    /// cluster is an error of the first call, not of this one.
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<EtcdStore, StoreError> {
        Ok(EtcdStore {
            client: connect(endpoints).await?,
            prefix: prefix.to_owned(),
            held: Mutex::new(HashMap::new()),
        })
    }

    /// The prefix of every candidate key of `lease`'s election.
    pub fn election(&self, lease: &str) -> String {
        format!("{}{lease}/", self.prefix)
    }

    fn held(&self, lease: &str, epoch: Token) -> Option<Held> {
        let held = self.held.lock().unwrap();
        held.get(lease).filter(|held| held.epoch == epoch).cloned()
    }

    /// The election's first-created key, if any.
    async fn leader(&self, lease: &str) -> Result<Option<Leader>, StoreError> {
        Ok(read_election(&self.client, &self.election(lease))
            .await?
            .leader)
    }

    /// Gives up a candidate key that does not lead (its lease, and so the key).
    async fn withdraw(&self, lease_id: i64) {
        if let Err(error) = self.client.clone().lease_revoke(lease_id).await {
            tracing::debug!(%error, lease_id, "could not revoke an etcd lease; it will expire");
        }
    }

    async fn campaign(
        &self,
        lease: &str,
        holder: &str,
        lease_id: i64,
    ) -> Result<Option<Token>, StoreError> {
        let mut client = self.client.clone();
        let key = format!("{}{lease_id:x}", self.election(lease));
        let create = Txn::new()
            .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(
                key.as_str(),
                holder,
                Some(PutOptions::new().with_lease(lease_id)),
            )]);
        let created = client.txn(create).await.map_err(failed)?;
        if !created.succeeded() {
            return Err(StoreError::Unexpected(format!(
                "candidate key {key} already exists"
            )));
        }
        // A restarted process under our identity may still lead with its old key:
        // its term ends, ours begins (see the module documentation of `store`).
        for _ in 0..2 {
            let Some(leader) = self.leader(lease).await? else {
                return Err(StoreError::Unexpected(format!(
                    "candidate key {key} vanished"
                )));
            };
            if leader.key == key.as_bytes() {
                let epoch = token_of(leader.create_revision, "revision")?;
                self.held.lock().unwrap().insert(
                    lease.to_owned(),
                    Held {
                        epoch,
                        lease_id,
                        key,
                    },
                );
                return Ok(Some(epoch));
            }
            if leader.holder != holder.as_bytes() {
                return Ok(None);
            }
            let unseat = Txn::new()
                .when([Compare::create_revision(
                    leader.key.clone(),
                    CompareOp::Equal,
                    leader.create_revision,
                )])
                .and_then([TxnOp::delete(leader.key, None)]);
            client.txn(unseat).await.map_err(failed)?;
        }
        Ok(None)
    }
}

/// A token as the revision it was.
fn as_revision(epoch: Token) -> i64 {
    i64::try_from(epoch.get()).unwrap_or(i64::MAX)
}

/// etcd's lease TTL for `ttl`: whole seconds, rounded up.
fn seconds(ttl: Duration) -> i64 {
    let whole = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
    i64::try_from(whole.max(1)).unwrap_or(i64::MAX)
}

/// gRPC status codes (their numbers are the protocol's).
const GRPC_UNKNOWN: i32 = 2;
const GRPC_DEADLINE_EXCEEDED: i32 = 4;
const GRPC_NOT_FOUND: i32 = 5;
const GRPC_UNAVAILABLE: i32 = 14;

/// A failed call: unreachable unless etcd answered it with an error of its own.
fn failed(error: etcd_client::Error) -> StoreError {
    match error {
        etcd_client::Error::GRpcStatus(status)
            if !matches!(
                status.code() as i32,
                GRPC_UNKNOWN | GRPC_DEADLINE_EXCEEDED | GRPC_UNAVAILABLE
            ) =>
        {
            StoreError::Unexpected(status.message().to_owned())
        }
        other => StoreError::Unavailable(other.to_string()),
    }
}

/// Whether etcd said the lease does not exist (expired or revoked).
fn lease_not_found(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() as i32 == GRPC_NOT_FOUND || status.message().contains("lease not found")
        }
        etcd_client::Error::LeaseKeepAliveError(message) => message.contains("lease not found"),
        _ => false,
    }
}

impl LeaseStore for EtcdStore {
    async fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Token>, StoreError> {
        let granted = self
            .client
            .clone()
            .lease_grant(seconds(ttl), None)
            .await
            .map_err(failed)?;
        let lease_id = granted.id();
        let outcome = self.campaign(lease, holder, lease_id).await;
        if !matches!(outcome, Ok(Some(_))) {
            self.withdraw(lease_id).await;
        }
        outcome
    }

    async fn renew(
        &self,
        lease: &str,
        _holder: &str,
        epoch: Token,
        _ttl: Duration,
    ) -> Result<bool, StoreError> {
        let Some(held) = self.held(lease, epoch) else {
            return Ok(false);
        };
        let mut client = self.client.clone();
        let kept = async {
            let (mut keeper, mut answers) = client.lease_keep_alive(held.lease_id).await?;
            keeper.keep_alive().await?;
            answers.message().await
        };
        let alive = match kept.await {
            Ok(answer) => answer.is_some_and(|answer| answer.ttl() > 0),
            Err(error) if lease_not_found(&error) => false,
            Err(error) => return Err(failed(error)),
        };
        if !alive {
            self.held.lock().unwrap().remove(lease);
            return Ok(false);
        }
        let found = client.get(held.key.as_str(), None).await.map_err(failed)?;
        Ok(found
            .kvs()
            .first()
            .is_some_and(|kv| kv.create_revision() == as_revision(epoch)))
    }

    async fn release(&self, lease: &str, _holder: &str, epoch: Token) -> Result<bool, StoreError> {
        let Some(held) = self.held(lease, epoch) else {
            return Ok(false);
        };
        let revoked = self.client.clone().lease_revoke(held.lease_id).await;
        self.held.lock().unwrap().remove(lease);
        match revoked {
            Ok(_) => Ok(true),
            Err(error) if lease_not_found(&error) => Ok(false),
            Err(error) => Err(failed(error)),
        }
    }

    async fn lost(&self, lease: &str, _holder: &str, epoch: Token) {
        self.until_lost(lease, epoch).await;
        // The term is over: its renewals answer `false` from now on.
        let mut held = self.held.lock().unwrap();
        if held.get(lease).is_some_and(|held| held.epoch == epoch) {
            held.remove(lease);
        }
    }
}

impl EtcdStore {
    /// Resolves when the term of `epoch` ended: see [`LeaseStore::lost`].
    async fn until_lost(&self, lease: &str, epoch: Token) {
        let Some(held) = self.held(lease, epoch) else {
            return;
        };
        let mut client = self.client.clone();
        // From the key's creation on: a deletion before the watch began is replayed.
        let start = as_revision(epoch).saturating_add(1);
        let options = WatchOptions::new().with_start_revision(start);
        let Ok(mut events) = client.watch(held.key.as_str(), Some(options)).await else {
            // Unreachable: the renewals and the deadline decide.
            return std::future::pending().await;
        };
        loop {
            match events.message().await {
                Ok(Some(answer)) => {
                    if answer
                        .events()
                        .iter()
                        .any(|event| event.event_type() == EventType::Delete)
                    {
                        return;
                    }
                    if answer.canceled() {
                        // Compacted past the key's creation: look at the key instead.
                        let found = client.get(held.key.as_str(), None).await;
                        if found.is_ok_and(|found| found.kvs().is_empty()) {
                            return;
                        }
                        return std::future::pending().await;
                    }
                }
                Ok(None) | Err(_) => return std::future::pending().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttls_round_up_to_whole_seconds() {
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
        assert_eq!(seconds(Duration::from_millis(2001)), 3);
        assert_eq!(seconds(Duration::ZERO), 1);
    }
}
