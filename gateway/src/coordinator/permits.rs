//! The process's bounds, handed out as permits that a request holds until it is
//! answered: writes in flight (`--max-writes-in-flight`) — the second step of
//! [`Coordinator::admit`] — and request bodies in memory (`--max-body-memory`), each
//! also within its client's share ([`super::shares`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::shares::{self, ClientKey, Shares};
use super::Coordinator;
use crate::config::{HttpArgs, LimitArgs};
use crate::error::{ApiError, Overload};

/// The process's bounds, and the sizes and times a request must keep.
pub(super) struct Bounds {
    /// Largest request body (`--max-body`).
    max_body: usize,
    /// Longest time a request body may take (`--body-timeout`).
    body_timeout: Duration,
    /// Longest wait for a body's first byte (`--body-first-byte-timeout`).
    body_first_byte: Duration,
    /// Writes being processed (`--max-writes-in-flight`).
    writes: Arc<Semaphore>,
    /// Request-body bytes held in memory (`--max-body-memory`), one permit a byte.
    body_bytes: Arc<Semaphore>,
    /// Each client's share of `writes` and `body_bytes` (`--max-client-share`).
    shares: Arc<Shares>,
    /// Most operations in one transaction (`--txn-max-operations`).
    txn_max_operations: usize,
    /// Largest transaction body (`--txn-max-bytes`, at most `--max-body`).
    txn_max_bytes: usize,
}

impl Bounds {
    pub(super) fn new(limits: &LimitArgs, http: &HttpArgs) -> Bounds {
        Bounds {
            max_body: limits.max_body,
            body_timeout: http.body_timeout,
            body_first_byte: http.body_first_byte_timeout,
            writes: Arc::new(Semaphore::new(limits.max_writes_in_flight)),
            body_bytes: Arc::new(Semaphore::new(limits.max_body_memory)),
            shares: Shares::new(
                share_of(limits.max_writes_in_flight, limits.max_client_share),
                share_of(limits.max_body_memory, limits.max_client_share),
            ),
            txn_max_operations: limits.txn_max_operations,
            txn_max_bytes: limits.txn_max_bytes.min(limits.max_body),
        }
    }
}

/// A write's place under `--max-writes-in-flight` and its client's share of it.
pub struct WritePermit {
    _global: OwnedSemaphorePermit,
    _share: shares::Share,
}

/// Room for a request body under `--max-body-memory` and its client's share, claimed
/// as the body arrives and given back when dropped.
pub struct BodyMemory {
    global: Arc<Semaphore>,
    held: Option<OwnedSemaphorePermit>,
    share: shares::Share,
    bytes: usize,
}

impl BodyMemory {
    /// Claims room for `total` bytes in all, if not claimed yet.
    pub fn grow_to(&mut self, total: usize) -> Result<(), Overload> {
        let more = total.saturating_sub(self.bytes);
        if more == 0 {
            return Ok(());
        }
        let permits = u32::try_from(more).map_err(|_| Overload::BodyMemory)?;
        let permit = Arc::clone(&self.global)
            .try_acquire_many_owned(permits)
            .map_err(|_| Overload::BodyMemory)?;
        self.share.grow_body(more)?;
        match &mut self.held {
            Some(held) => held.merge(permit),
            None => self.held = Some(permit),
        }
        self.bytes = total;
        Ok(())
    }
}

/// `percent` of `total`, at least 1.
fn share_of(total: usize, percent: u8) -> usize {
    (total.saturating_mul(usize::from(percent)) / 100).max(1)
}

impl Coordinator {
    /// The largest request body (`--max-body`).
    pub fn max_body(&self) -> usize {
        self.bounds.max_body
    }

    /// The longest time a request body may take to arrive (`--body-timeout`).
    pub fn body_timeout(&self) -> Duration {
        self.bounds.body_timeout
    }

    /// How long a request body may take to send its first byte
    /// (`--body-first-byte-timeout`).
    pub fn body_first_byte(&self) -> Duration {
        self.bounds.body_first_byte
    }

    /// Most operations in one transaction (`--txn-max-operations`).
    pub fn txn_max_operations(&self) -> usize {
        self.bounds.txn_max_operations
    }

    /// Largest transaction body (`--txn-max-bytes`, at most `--max-body`).
    pub fn txn_max_bytes(&self) -> usize {
        self.bounds.txn_max_bytes
    }

    /// The client a request counts against, for its shares.
    pub fn client(&self, identity: Option<&str>, peer: std::net::IpAddr) -> ClientKey {
        self.bounds.shares.client(identity, peer)
    }

    /// A place for one more write in flight of `client`, held until the permit is
    /// dropped.
    /// Refused while the fence database is not synchronously replicated, if the gateway
    /// requires it ([`super::replication`]).
    pub fn write_permit(&self, client: ClientKey) -> Result<WritePermit, ApiError> {
        self.require_replication()?;
        let share = self.bounds.shares.write(client)?;
        let global = Arc::clone(&self.bounds.writes)
            .try_acquire_owned()
            .map_err(|_| Overload::Writes)?;
        Ok(WritePermit {
            _global: global,
            _share: share,
        })
    }

    /// An empty claim on body memory for `client`, grown as its body arrives.
    pub fn body_memory(&self, client: ClientKey) -> BodyMemory {
        BodyMemory {
            global: Arc::clone(&self.bounds.body_bytes),
            held: None,
            share: self.bounds.shares.body(client),
            bytes: 0,
        }
    }

    /// Counts a request turned away at one of the bounds.
    pub fn limit_rejected(&self, reason: Overload) {
        self.metrics.limit_rejected(reason.as_str());
    }
}
