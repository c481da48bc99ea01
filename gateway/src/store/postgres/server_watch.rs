//! Which database server each new connection reaches, so that the first connection to
//! a server the gateway has not audited runs the fence audit before it, or any other
//! connection to that server, is used.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::errors::{classify, Sent};
use super::statements;
use crate::store::{StoreError, UnavailableReason};

/// A database server, as a connection reports it ([`statements::SERVER_IDENTITY`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerId {
    /// The cluster's system identifier: shared by a primary and its standbys.
    pub system: String,
    /// The timeline it writes on (a standby: the one of its last checkpoint).
    pub timeline: i64,
    /// Its postmaster's start time and its address: one run of one server.
    pub instance: String,
    pub standby: bool,
}

impl ServerId {
    pub(crate) async fn read(client: &tokio_postgres::Client) -> Result<ServerId, StoreError> {
        let row = client
            .query_one(statements::SERVER_IDENTITY, &[])
            .await
            .map_err(|e| classify(e, Sent::NoCommit))?;
        Ok(ServerId {
            system: row.get(0),
            timeline: row.get(1),
            instance: row.get(2),
            standby: row.get(3),
        })
    }
}

impl std::fmt::Display for ServerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "system {} timeline {} ({})",
            self.system, self.timeline, self.instance
        )
    }
}

/// What checks a server the gateway has not seen before, before any connection to it
/// is used: the coordinator's fence audit.
pub trait ServerAuditor: Send + Sync {
    /// Audits the fences on `client`'s server, or — `None` — through the store's own
    /// connections (for connections whose login may not raise a fence).
    fn audit<'a>(
        &'a self,
        client: Option<&'a tokio_postgres::Client>,
    ) -> futures_util::future::BoxFuture<'a, Result<(), StoreError>>;
}

/// What a pool's new connection does when it reaches a server not audited yet
/// (`ServerWatch::ensure_audited`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnNewServer {
    /// The store's own login: a connection to a new server runs the audit itself.
    Audits,
    /// Another login (`/v1/sql`): the audit runs through the store's connections, and
    /// this one waits for it.
    Waits,
}

/// Which server the pools' new connections reach, and whether the fence audit has run
/// on it.
///
/// # Invariant
///
/// No connection to a server is handed out before the audit of that server completed
/// (`audited`): a server reached for the first time — after a failover, a restore, a
/// restart — may have lost fences that this gateway saw committed, and until they are
/// restored an older term's write could be accepted. Each connection is checked when
/// it is made (`ServerWatch::ensure_audited`, the pools' post-create hook); one audit runs at
/// a time, and the connections that wait for it wait within their call's deadline.
/// Before an auditor is set (start-up: the cache is empty) a server needs no audit.
#[derive(Default)]
pub struct ServerWatch {
    seen: Mutex<Option<ServerId>>,
    audited: Mutex<Option<ServerId>>,
    changed: AtomicBool,
    /// One audit at a time.
    gate: tokio::sync::Mutex<()>,
    auditor: std::sync::OnceLock<std::sync::Weak<dyn ServerAuditor>>,
}

impl std::fmt::Debug for ServerWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerWatch")
            .field("seen", &self.seen)
            .field("audited", &self.audited)
            .finish_non_exhaustive()
    }
}

impl ServerWatch {
    /// Sets what audits a new server (once).
    pub fn set_auditor(&self, auditor: std::sync::Weak<dyn ServerAuditor>) {
        let _ = self.auditor.set(auditor);
    }

    /// The server the last new connection reached.
    pub fn current(&self) -> Option<ServerId> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Whether the fences of `server` were audited.
    pub fn audited(&self, server: &ServerId) -> bool {
        self.audited
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            == Some(server)
    }

    fn observe(&self, server: &ServerId) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.as_ref().is_some_and(|before| before != server) {
            tracing::info!(%server, "the database server changed (failover or restart)");
            self.changed.store(true, Ordering::Release);
        }
        *seen = Some(server.clone());
    }

    /// Lets a new connection be used once its server was audited; runs the audit if
    /// it is the first connection to reach that server.
    pub(crate) async fn ensure_audited(
        &self,
        client: &tokio_postgres::Client,
        on_new_server: OnNewServer,
    ) -> Result<(), StoreError> {
        let server = ServerId::read(client).await?;
        self.observe(&server);
        // A standby takes no write, so a fence it lost lets nothing in; it is audited
        // once connections reach it as a primary (a URL with
        // target_session_attrs=read-write, or a proxy to the primary, makes sure of it).
        if server.standby || self.audited(&server) {
            return Ok(());
        }
        let Some(auditor) = self.auditor.get() else {
            *self.audited.lock().unwrap_or_else(|e| e.into_inner()) = Some(server);
            return Ok(());
        };
        let Some(auditor) = auditor.upgrade() else {
            // The gateway is stopping.
            return Err(StoreError::Unavailable {
                reason: UnavailableReason::Connect,
                applied: Some(false),
            });
        };
        match on_new_server {
            OnNewServer::Audits => {
                let _one = self.gate.lock().await;
                if !self.audited(&server) {
                    tracing::info!(%server, "auditing the fences of a server not seen before");
                    auditor.audit(Some(client)).await?;
                    *self.audited.lock().unwrap_or_else(|e| e.into_inner()) = Some(server);
                }
                Ok(())
            }
            OnNewServer::Waits => {
                auditor.audit(None).await?;
                if self.audited(&server) {
                    Ok(())
                } else {
                    // The store's connections reach another server than this one.
                    Err(StoreError::Unavailable {
                        reason: UnavailableReason::Connect,
                        applied: Some(false),
                    })
                }
            }
        }
    }

    /// Whether the server changed since the last call.
    pub fn take_changed(&self) -> bool {
        self.changed.swap(false, Ordering::AcqRel)
    }
}
