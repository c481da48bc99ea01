//! Who the door lets in, and how it turns the others away.
//!
//! # Order
//!
//! 1. At accept: `--pg-max-connections` (all connections), then `--pg-max-pending-auth`
//!    and `--pg-max-pending-auth-per-peer` (connections not yet logged in). Over a cap,
//!    the client is told FATAL 53300 at once, before it has sent anything.
//! 2. After the StartupMessage: TLS (`--pg-require-tls`), then `--pg-allow`, both FATAL
//!    28000.
//!
//! All of this happens before the door connects to the database, so a refused client
//! never takes one of the server's connection slots. A connection counts as
//! authenticating from accept until the server's first ReadyForQuery (or its end), and
//! the whole of that is bounded by `--pg-startup-timeout`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::startup::StartupMessage;
use super::wire;
use crate::config::DoorGrant;

/// Why the door refused a client; the `reason` label of `fencegate_pg_refusals_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DoorRefusal {
    /// A StartupMessage in cleartext while `--pg-require-tls`.
    TlsRequired,
    /// A database and role outside `--pg-allow`.
    NotAllowed,
    /// `--pg-max-pending-auth` connections were already authenticating.
    AuthPending,
    /// `--pg-max-pending-auth-per-peer` connections of the client's address were.
    AuthPendingPeer,
    /// Start-up and authentication took longer than `--pg-startup-timeout`.
    AuthTimeout,
    /// `--pg-max-connections` connections were open.
    Connections,
    /// The database server the gateway reaches has not been audited yet (a failover),
    /// or cannot be reached to find out.
    ServerNotAudited,
    /// `--require-synchronous-replication`, and the fence database has no synchronous
    /// standby streaming.
    NotSynchronouslyReplicated,
}

impl DoorRefusal {
    #[cfg(test)]
    const ALL: [DoorRefusal; 8] = [
        DoorRefusal::TlsRequired,
        DoorRefusal::NotAllowed,
        DoorRefusal::AuthPending,
        DoorRefusal::AuthPendingPeer,
        DoorRefusal::AuthTimeout,
        DoorRefusal::Connections,
        DoorRefusal::ServerNotAudited,
        DoorRefusal::NotSynchronouslyReplicated,
    ];

    pub(crate) fn reason(self) -> &'static str {
        match self {
            DoorRefusal::TlsRequired => "tls_required",
            DoorRefusal::NotAllowed => "not_allowed",
            DoorRefusal::AuthPending => "auth_pending",
            DoorRefusal::AuthPendingPeer => "auth_pending_peer",
            DoorRefusal::AuthTimeout => "auth_timeout",
            DoorRefusal::Connections => "connections",
            DoorRefusal::ServerNotAudited => "server_not_audited",
            DoorRefusal::NotSynchronouslyReplicated => "not_synchronously_replicated",
        }
    }

    /// The SQLSTATE the client is told: Postgres's own for the same refusal.
    pub(crate) fn sqlstate(self) -> &'static str {
        match self {
            // invalid_authorization_specification, as pg_hba.conf refusals.
            DoorRefusal::TlsRequired | DoorRefusal::NotAllowed => "28000",
            // too_many_connections.
            DoorRefusal::AuthPending | DoorRefusal::AuthPendingPeer | DoorRefusal::Connections => {
                "53300"
            }
            // connection_failure, as the door has always said on a timeout.
            DoorRefusal::AuthTimeout => "08006",
            // cannot_connect_now, as a server that is starting up.
            DoorRefusal::ServerNotAudited | DoorRefusal::NotSynchronouslyReplicated => "57P03",
        }
    }

    pub(crate) fn message(self) -> &'static str {
        match self {
            DoorRefusal::TlsRequired => {
                "the fencegate door requires TLS; connect with sslmode=require"
            }
            DoorRefusal::NotAllowed => {
                "the fencegate door does not admit this role to this database (--pg-allow)"
            }
            DoorRefusal::AuthPending => {
                "too many connections to the fencegate door are still logging in; try again shortly"
            }
            DoorRefusal::AuthPendingPeer => {
                "too many connections from your address to the fencegate door are still \
                 logging in; try again shortly"
            }
            DoorRefusal::AuthTimeout => {
                "start-up and authentication took longer than --pg-startup-timeout"
            }
            DoorRefusal::Connections => "sorry, too many clients of the fencegate door already",
            DoorRefusal::ServerNotAudited => {
                "the fencegate door is checking the fences of a database server it has not \
                 seen before (a failover?), or cannot reach it; try again shortly"
            }
            DoorRefusal::NotSynchronouslyReplicated => {
                "the fence database has no synchronous standby streaming, and this gateway \
                 requires one (--require-synchronous-replication); try again later"
            }
        }
    }
}

/// The caps on connections that are still authenticating.
pub(crate) struct PendingAuth {
    total: usize,
    per_peer: usize,
    /// Invariant: `total` is the sum of `by_peer`, which holds no zero.
    pending: Mutex<Pending>,
}

#[derive(Default)]
struct Pending {
    total: usize,
    by_peer: HashMap<IpAddr, usize>,
}

impl PendingAuth {
    pub(crate) fn new(total: usize, per_peer: usize) -> PendingAuth {
        PendingAuth {
            total,
            per_peer,
            pending: Mutex::default(),
        }
    }

    /// Counts a new connection from `peer` as authenticating, or says which cap it is
    /// over.
    pub(crate) fn start(self: &Arc<Self>, peer: IpAddr) -> Result<Authenticating, DoorRefusal> {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if pending.total >= self.total {
            return Err(DoorRefusal::AuthPending);
        }
        let mine = pending.by_peer.entry(peer).or_insert(0);
        if *mine >= self.per_peer {
            return Err(DoorRefusal::AuthPendingPeer);
        }
        *mine += 1;
        pending.total += 1;
        Ok(Authenticating {
            pending_auth: Arc::clone(self),
            peer,
        })
    }
}

/// A connection counted as authenticating until this is dropped.
pub(crate) struct Authenticating {
    pending_auth: Arc<PendingAuth>,
    peer: IpAddr,
}

impl Drop for Authenticating {
    fn drop(&mut self) {
        let mut pending = self
            .pending_auth
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        pending.total -= 1;
        if let Some(mine) = pending.by_peer.get_mut(&self.peer) {
            *mine -= 1;
            if *mine == 0 {
                pending.by_peer.remove(&self.peer);
            }
        }
    }
}

/// Whether `--pg-allow` (empty: everyone) admits the role and database Postgres will
/// log the StartupMessage into.
pub(crate) fn allowed(grants: &[DoorGrant], startup: &StartupMessage) -> bool {
    grants.is_empty()
        || grants
            .iter()
            .any(|grant| grant.admits(&startup.database(), &startup.user()))
}

/// How long a refused client may take to read its error and close.
const TURN_AWAY_TIMEOUT: Duration = Duration::from_secs(1);

/// Tells the client a FATAL ErrorResponse and closes: our side first, then
/// whatever the client still sends is read and dropped until it closes too (for a
/// moment at most), so that its unread bytes do not reset the connection before it has
/// read the error.
pub(crate) async fn turn_away<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    sqlstate: &str,
    message: &str,
) {
    let _ = tokio::time::timeout(TURN_AWAY_TIMEOUT, async {
        stream.write_all(&wire::fatal(sqlstate, message)).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 1024];
        let mut left = 64 << 10;
        while left > 0 {
            let read = stream.read(&mut sink).await?;
            if read == 0 {
                break;
            }
            left -= read.min(left);
        }
        std::io::Result::Ok(())
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_count_per_peer_and_in_total_until_dropped() {
        let pending_auth = Arc::new(PendingAuth::new(3, 2));
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = pending_auth.start(a).unwrap();
        let _second = pending_auth.start(a).unwrap();
        assert_eq!(
            pending_auth.start(a).err(),
            Some(DoorRefusal::AuthPendingPeer)
        );
        let _third = pending_auth.start(b).unwrap();
        assert_eq!(pending_auth.start(b).err(), Some(DoorRefusal::AuthPending));
        drop(first);
        assert!(pending_auth.start(b).is_ok(), "a slot freed for anyone");
        let pending = pending_auth.pending.lock().unwrap();
        assert_eq!(pending.total, 2);
        assert_eq!(pending.by_peer.values().sum::<usize>(), 2);
    }

    #[test]
    fn every_reason_is_a_label_of_the_metric() {
        let reasons: Vec<&str> = DoorRefusal::ALL.iter().map(|r| r.reason()).collect();
        assert_eq!(reasons, crate::metrics::door::PG_REFUSAL_REASONS);
    }
}
