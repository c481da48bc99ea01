//! ZooKeeper's leader-election recipe, with the leading node's `czxid` as the token.
//!
//! The election of lease `L` is the children of `<prefix>/L`. A candidate creates an
//! ephemeral sequential node `<prefix>/L/n-<10 digits>` holding its holder identity, in
//! its own ZooKeeper session; the node with the lowest sequence number leads (the
//! recipe of ZooKeeper's documentation and of Curator's `LeaderLatch`, whose node names
//! also end in the sequence number, so a gateway checking tokens against ZooKeeper
//! (`--issued-by zookeeper:...`) reads either).
//!
//! - acquire: create the node and list the election. Ours first: the term's token is
//!   the node's `czxid`. Another holder's first: delete ours and answer `None`. Our own
//!   identity's (a restarted process): delete that node and look again.
//! - renew: check that the session is connected and that the node still exists with
//!   the term's `czxid` in this session (ZooKeeper's own heartbeats keep the session).
//! - release: delete the node.
//! - lost: resolves when the session expires or is closed, when it stays disconnected
//!   for the session timeout (the server may have expired it), or when the node is
//!   deleted — before the next renewal would notice.
//!
//! # Why the token is the `czxid`, not the sequence number
//!
//! The sequence suffix is a per-parent 32-bit counter: it wraps, and it starts again at
//! 0 when the parent is deleted and created again (a container node removed while
//! empty, a cleanup). The `czxid` is the zxid of the transaction that created the node:
//! `(epoch << 32) | counter`, where the epoch rises with every ZooKeeper leader change
//! and the counter with every transaction, so a node created later — in any path,
//! across leader changes and restarts of the ensemble — has a higher `czxid`.
//!
//! # What this store does not guarantee
//!
//! - An ensemble restored from an older snapshot, or a new ensemble, hands out lower
//!   zxids: the gateway's fence then refuses the new leader's writes as stale.
//! - Session expiry runs on the ZooKeeper leader's clock. The session timeout is
//!   negotiated at connect (bounded by the server's `minSessionTimeout` and
//!   `maxSessionTimeout`, by default 2 and 20 ticks); the elector's `renew_deadline` must
//!   be below it, so that the holder steps down before the server can expire the
//!   session and a rival can lead. The `ttl` of each call is not used.

use std::sync::Mutex;
use std::time::Duration;

use fencegate_proto::Token;
use zookeeper_client::{Acls, Client, CreateMode, EventType, SessionState};

use super::{token_of, LeaseStore, StoreError};

/// The path prefix used unless another is given.
pub const DEFAULT_PREFIX: &str = "/fencegate/elections";

/// The start of a candidate node's name; ZooKeeper appends 10 digits.
const NODE_PREFIX: &str = "n-";

/// Leases as ZooKeeper election nodes, the leading node's `czxid` as the token.
pub struct ZooKeeperStore {
    connect: String,
    prefix: String,
    session_timeout: Duration,
    /// The open session, if any; a new one is opened after it expires.
    session: Mutex<Option<Client>>,
    /// The terms this store leads: lease name, token, node path.
    held: Mutex<Vec<(String, Token, String)>>,
    /// Whether sessions outlive the store (see [`ZooKeeperStore::with_detached_sessions`]).
    detached: bool,
}

impl ZooKeeperStore {
    /// A store on the ensemble of `connect` (`host:port,host:port`, optionally with a
    /// chroot), its elections under `prefix`, asking for `session_timeout`. Connects
    /// on the first call.
    pub fn new(
        connect: &str,
        prefix: &str,
        session_timeout: Duration,
    ) -> Result<ZooKeeperStore, StoreError> {
        if !prefix.starts_with('/') || (prefix.len() > 1 && prefix.ends_with('/')) {
            return Err(StoreError::Invalid(format!(
                "ZooKeeper prefix {prefix:?}: an absolute path, without a trailing /"
            )));
        }
        Ok(ZooKeeperStore {
            connect: connect.to_owned(),
            prefix: prefix.trim_end_matches('/').to_owned(),
            session_timeout,
            session: Mutex::new(None),
            held: Mutex::new(Vec::new()),
            detached: false,
        })
    }

    /// Leaves the store's session open on the server when the store is dropped, to
    /// expire after its timeout as a crashed process's does, instead of closing it (and
    /// deleting its nodes) at once. For failure drills and failover measurements.
    pub fn with_detached_sessions(mut self) -> ZooKeeperStore {
        self.detached = true;
        self
    }

    /// The election path of `lease`: its candidates are its children.
    pub fn election(&self, lease: &str) -> String {
        format!("{}/{lease}", self.prefix)
    }

    /// The session timeout the server granted, once connected.
    pub fn granted_session_timeout(&self) -> Option<Duration> {
        let session = self.session.lock().unwrap();
        session.as_ref().map(Client::session_timeout)
    }

    /// The open session, or a new one if there is none or it has ended.
    async fn session(&self) -> Result<Client, StoreError> {
        if let Some(client) = self.session.lock().unwrap().as_ref() {
            if !client.state().is_terminated() {
                return Ok(client.clone());
            }
        }
        let client = open(&self.connect, self.session_timeout, self.detached).await?;
        *self.session.lock().unwrap() = Some(client.clone());
        // Terms of an ended session are over.
        self.held.lock().unwrap().clear();
        Ok(client)
    }

    fn held(&self, lease: &str, epoch: Token) -> Option<String> {
        let held = self.held.lock().unwrap();
        held.iter()
            .find(|(name, token, _)| name == lease && *token == epoch)
            .map(|(_, _, path)| path.clone())
    }

    fn forget(&self, lease: &str) {
        self.held
            .lock()
            .unwrap()
            .retain(|(name, _, _)| name != lease);
    }

    async fn campaign(
        &self,
        client: &Client,
        lease: &str,
        holder: &str,
        ours: &str,
        ours_czxid: i64,
    ) -> Result<Option<Token>, StoreError> {
        let election = self.election(lease);
        for _ in 0..2 {
            let Some(first) = first_candidate(client, &election).await? else {
                return Err(StoreError::Unexpected(format!("candidate {ours} vanished")));
            };
            if first.path == ours {
                let epoch = token_of(ours_czxid, "zxid")?;
                let mut held = self.held.lock().unwrap();
                held.retain(|(name, _, _)| name != lease);
                held.push((lease.to_owned(), epoch, ours.to_owned()));
                return Ok(Some(epoch));
            }
            if first.holder != holder.as_bytes() {
                return Ok(None);
            }
            match client.delete(&first.path, None).await {
                Ok(()) | Err(zookeeper_client::Error::NoNode) => {}
                Err(error) => return Err(failed(error)),
            }
        }
        Ok(None)
    }
}

/// A session on the ensemble of `connect`, as the store and the gateway's issuer check
/// open it.
pub async fn connect(connect: &str, session_timeout: Duration) -> Result<Client, StoreError> {
    open(connect, session_timeout, false).await
}

async fn open(
    connect: &str,
    session_timeout: Duration,
    detached: bool,
) -> Result<Client, StoreError> {
    let mut connector = Client::connector()
        .with_session_timeout(session_timeout)
        .with_connection_timeout(session_timeout.min(Duration::from_secs(2)));
    if detached {
        connector = connector.with_detached();
    }
    connector
        .connect(connect)
        .await
        .map_err(|e| StoreError::Unavailable(format!("ZooKeeper {connect}: {e}")))
}

/// The leading candidate of an election, as read.
pub struct Candidate {
    pub path: String,
    pub holder: Vec<u8>,
    pub czxid: i64,
}

/// The sequence number ending a candidate's name, if it ends in one.
pub fn sequence(name: &str) -> Option<u64> {
    let digits = name.get(name.len().checked_sub(10)?..)?;
    digits
        .bytes()
        .all(|b| b.is_ascii_digit())
        .then(|| digits.parse().ok())
        .flatten()
}

/// The candidate of `election` with the lowest sequence number, if any: the leader.
/// Names that do not end in a sequence number are not candidates.
pub async fn first_candidate(
    client: &Client,
    election: &str,
) -> Result<Option<Candidate>, StoreError> {
    loop {
        let children = match client.list_children(election).await {
            Ok(children) => children,
            Err(zookeeper_client::Error::NoNode) => return Ok(None),
            Err(error) => return Err(failed(error)),
        };
        let Some(first) = children
            .iter()
            .filter_map(|name| Some((sequence(name)?, name)))
            .min()
            .map(|(_, name)| format!("{election}/{name}"))
        else {
            return Ok(None);
        };
        match client.get_data(&first).await {
            Ok((holder, stat)) => {
                return Ok(Some(Candidate {
                    path: first,
                    holder,
                    czxid: stat.czxid,
                }))
            }
            // It went between the listing and the read: list again.
            Err(zookeeper_client::Error::NoNode) => continue,
            Err(error) => return Err(failed(error)),
        }
    }
}

/// A failed call: unreachable unless ZooKeeper answered it with an error of its own.
fn failed(error: zookeeper_client::Error) -> StoreError {
    use zookeeper_client::Error;
    match error {
        Error::ConnectionLoss
        | Error::SessionExpired
        | Error::ClientClosed
        | Error::Timeout
        | Error::NoHosts
        | Error::Throttled => StoreError::Unavailable(error.to_string()),
        other => StoreError::Unexpected(other.to_string()),
    }
}

impl LeaseStore for ZooKeeperStore {
    async fn acquire(
        &self,
        lease: &str,
        holder: &str,
        _ttl: Duration,
    ) -> Result<Option<Token>, StoreError> {
        let client = self.session().await?;
        let election = self.election(lease);
        let directory = CreateMode::Persistent.with_acls(Acls::anyone_all());
        client.mkdir(&election, &directory).await.map_err(failed)?;
        let candidate = CreateMode::EphemeralSequential.with_acls(Acls::anyone_all());
        let node = format!("{election}/{NODE_PREFIX}");
        let (stat, sequence) = client
            .create(&node, holder.as_bytes(), &candidate)
            .await
            .map_err(failed)?;
        let ours = format!("{node}{sequence}");
        let outcome = self
            .campaign(&client, lease, holder, &ours, stat.czxid)
            .await;
        if !matches!(outcome, Ok(Some(_))) {
            if let Err(error) = client.delete(&ours, None).await {
                tracing::debug!(%error, node = ours, "could not delete a candidate node; it ends with the session");
            }
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
        let Some(path) = self.held(lease, epoch) else {
            return Ok(false);
        };
        let client = self.session().await?;
        match client.check_stat(&path).await {
            Ok(Some(stat)) => Ok(u64::try_from(stat.czxid).ok() == Some(epoch.get())
                && stat.ephemeral_owner == client.session_id().0),
            Ok(None) => {
                self.forget(lease);
                Ok(false)
            }
            Err(zookeeper_client::Error::SessionExpired) => {
                self.forget(lease);
                Ok(false)
            }
            Err(error) => Err(failed(error)),
        }
    }

    async fn release(&self, lease: &str, _holder: &str, epoch: Token) -> Result<bool, StoreError> {
        let Some(path) = self.held(lease, epoch) else {
            return Ok(false);
        };
        let client = self.session().await?;
        self.forget(lease);
        match client.delete(&path, None).await {
            Ok(()) => Ok(true),
            Err(zookeeper_client::Error::NoNode) => Ok(false),
            Err(error) => Err(failed(error)),
        }
    }

    async fn lost(&self, lease: &str, _holder: &str, epoch: Token) {
        self.until_lost(lease, epoch).await;
        // The term is over: its renewals answer `false` from now on.
        self.held
            .lock()
            .unwrap()
            .retain(|(name, token, _)| !(name == lease && *token == epoch));
    }
}

impl ZooKeeperStore {
    /// Resolves when the term of `epoch` ended: see [`LeaseStore::lost`].
    async fn until_lost(&self, lease: &str, epoch: Token) {
        let Some(path) = self.held(lease, epoch) else {
            return;
        };
        let Some(client) = self.session.lock().unwrap().clone() else {
            return;
        };
        let mut states = client.state_watcher();
        let timeout = client.session_timeout();
        loop {
            let node = match client.check_and_watch_stat(&path).await {
                Ok((Some(stat), watcher))
                    if u64::try_from(stat.czxid).ok() == Some(epoch.get()) =>
                {
                    watcher
                }
                Ok(_) => return,
                Err(
                    zookeeper_client::Error::SessionExpired | zookeeper_client::Error::ClientClosed,
                ) => return,
                // Unreachable for now: the session states below decide.
                Err(_) => {
                    if session_ended(&mut states, timeout).await {
                        return;
                    }
                    continue;
                }
            };
            tokio::select! {
                event = node.changed() => {
                    if event.event_type == EventType::NodeDeleted {
                        return;
                    }
                }
                () = async {
                    while !session_ended(&mut states, timeout).await {}
                } => return,
            }
        }
    }
}

/// Waits for the next change of the session's state; whether it ended the session:
/// expired, closed, or disconnected for longer than `timeout`.
async fn session_ended(states: &mut zookeeper_client::StateWatcher, timeout: Duration) -> bool {
    let state = states.changed().await;
    match state {
        SessionState::Expired | SessionState::Closed | SessionState::AuthFailed => true,
        SessionState::Disconnected => {
            let reconnected = async {
                loop {
                    match states.changed().await {
                        SessionState::SyncConnected | SessionState::ConnectedReadOnly => {
                            return false
                        }
                        SessionState::Disconnected => {}
                        _ => return true,
                    }
                }
            };
            tokio::time::timeout(timeout, reconnected)
                .await
                .unwrap_or(true)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_are_ordered_by_their_sequence_suffix() {
        assert_eq!(sequence("n-0000000042"), Some(42));
        assert_eq!(
            sequence("_c_8f1e2d3c-latch-0000000007"),
            Some(7),
            "Curator's LeaderLatch"
        );
        assert_eq!(sequence("n-42"), None);
        assert_eq!(sequence("lock"), None);
        assert_eq!(sequence("n-00000000x1"), None);
    }
}
