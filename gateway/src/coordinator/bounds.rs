//! The process's bounds, handed out as permits that a request holds until it is
//! answered: writes in flight (`--max-writes-in-flight`) and request bodies in memory
//! (`--max-body-memory`), each also within its client's share ([`super::shares`]).

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::shares::{self, ClientKey};
use super::Coordinator;
use crate::error::{ApiError, Overload};

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
pub(super) fn share_of(total: usize, percent: u8) -> usize {
    (total.saturating_mul(usize::from(percent)) / 100).max(1)
}

impl Coordinator {
    /// The client a request counts against, for its shares.
    pub fn client(&self, identity: Option<&str>, peer: std::net::IpAddr) -> ClientKey {
        self.shares.client(identity, peer)
    }

    /// A place for one more write in flight of `client`, held until the permit is
    /// dropped.
    /// Refused while the fence database is not synchronously replicated, if the gateway
    /// requires it ([`super::replication`]).
    pub fn write_permit(&self, client: ClientKey) -> Result<WritePermit, ApiError> {
        self.require_replication()?;
        let share = self.shares.write(client)?;
        let global = Arc::clone(&self.writes)
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
            global: Arc::clone(&self.body_bytes),
            held: None,
            share: self.shares.body(client),
            bytes: 0,
        }
    }

    /// Counts a request turned away at one of the bounds.
    pub fn limit_rejected(&self, reason: Overload) {
        self.metrics.limit_rejected(reason.as_str());
    }
}
