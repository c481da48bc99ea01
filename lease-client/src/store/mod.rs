//! Where leases live.
//!
//! A store answers three compare-and-swap questions, each decided by the store in one
//! atomic step and on the store's own clock:
//!
//! - **acquire**: take the lease if it is free, expired, or already ours, and return a
//!   new epoch, strictly above every epoch the store has handed out for this lease.
//! - **renew**: extend the lease only if it is still ours *at the epoch we name* and
//!   not yet expired; never change the epoch.
//! - **release**: free the lease only if it is still ours at that epoch (a late release
//!   from a replaced holder must not free its successor's lease).
//!
//! # Re-acquiring a lease this holder already holds
//!
//! Acquire always mints a new epoch, also when the store finds the lease held by the
//! same holder identity (a process that restarted under the same name). The old
//! process's term might already have looked expired to someone, and its writes may
//! still be in flight: the new term must fence them. A restarted holder thus takes its
//! lease back at once, without waiting for expiry, and with a new token.
//!
//! Holder identities must therefore be unique among *running* processes: two live
//! processes under one identity would take the lease from each other (safely fenced,
//! but neither would get work done).
//!
//! - [`gateway`]: leases hosted by the fencegate gateway itself.
//! - [`postgres`]: the seed's `leader_lease` table.
//! - [`redis`] (feature `redis`): `SET NX PX` with a counter minted in the same script.
//! - [`etcd`] (feature `etcd`): etcd's election recipe; the token is the leading key's
//!   create revision.
//! - [`zookeeper`] (feature `zookeeper`): ZooKeeper's election recipe; the token is the
//!   leading node's `czxid`.
//!
//! # Losing a term before the next renewal
//!
//! Stores whose server can end a term by itself — an etcd lease that expires or is
//! revoked, a ZooKeeper session that expires — say so through [`LeaseStore::lost`],
//! and the elector ends the term at once (`session_lost`) instead of at the next
//! renewal. The holder's own deadline still steps it down first when its renewals go
//! unanswered.

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod gateway;
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "zookeeper")]
pub mod zookeeper;

use std::future::Future;
use std::time::Duration;

use fencegate_proto::Token;

/// A lease backend. Implementations must make each operation one atomic step in the
/// store, judged on the store's clock.
pub trait LeaseStore: Send + Sync + 'static {
    /// Takes the lease for `holder` for `ttl` if it is free, expired or already held by
    /// `holder`; `Ok(None)` if someone else holds it.
    fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<Token>, StoreError>> + Send;

    /// Extends the lease by `ttl` if `holder` still holds it at `epoch` and it has not
    /// expired; `Ok(false)` if not (the holder was replaced).
    fn renew(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Frees the lease if `holder` still holds it at `epoch`; `Ok(false)` if not.
    fn release(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Resolves when the store itself has ended the term of `epoch` (its session
    /// expired, its key was deleted), sooner than a renewal would find out. Stores that
    /// cannot tell never resolve, which is the default.
    fn lost(&self, lease: &str, holder: &str, epoch: Token) -> impl Future<Output = ()> + Send {
        let _ = (lease, holder, epoch);
        std::future::pending()
    }
}

/// Runs `forget` when dropped before [`ForgetOnDrop::completed`]: a store call whose
/// future is dropped mid-flight (the elector's timeout) may sit on a connection stuck
/// behind a black-holed network, which the kernel may not close for many minutes. The
/// stores forget such a connection so that the next call opens a fresh one.
pub(crate) struct ForgetOnDrop<F: FnMut()> {
    forget: Option<F>,
}

impl<F: FnMut()> ForgetOnDrop<F> {
    pub(crate) fn new(forget: F) -> Self {
        ForgetOnDrop {
            forget: Some(forget),
        }
    }

    /// The call got its answer (or its error): keep the connection.
    pub(crate) fn completed(mut self) {
        self.forget = None;
    }
}

impl<F: FnMut()> Drop for ForgetOnDrop<F> {
    fn drop(&mut self) {
        if let Some(mut forget) = self.forget.take() {
            forget();
        }
    }
}

/// A store's signed number (a counter, a revision, a zxid) as a token; `what` names it
/// in the error if it is not one.
pub(crate) fn token_of(value: i64, what: &str) -> Result<Token, StoreError> {
    u64::try_from(value)
        .ok()
        .and_then(|value| Token::new(value).ok())
        .ok_or_else(|| StoreError::Unexpected(format!("{what} {value} is not a token")))
}

/// A store operation that did not give an answer. The holder cannot tell whether it
/// still leads: it keeps trying until its renew deadline.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the lease store is unreachable: {0}")]
    Unavailable(String),
    #[error("the lease store answered something unexpected: {0}")]
    Unexpected(String),
    #[error("invalid lease store settings: {0}")]
    Invalid(String),
}

/// A shared store: several electors (or an elector and an operator tool) on one
/// connection.
impl<S: LeaseStore> LeaseStore for std::sync::Arc<S> {
    fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> impl Future<Output = Result<Option<Token>, StoreError>> + Send {
        (**self).acquire(lease, holder, ttl)
    }

    fn renew(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
        ttl: Duration,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        (**self).renew(lease, holder, epoch, ttl)
    }

    fn release(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send {
        (**self).release(lease, holder, epoch)
    }

    fn lost(&self, lease: &str, holder: &str, epoch: Token) -> impl Future<Output = ()> + Send {
        (**self).lost(lease, holder, epoch)
    }
}
