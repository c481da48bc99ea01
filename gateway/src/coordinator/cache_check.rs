//! The first step of [`Coordinator::admit`]: a token below a fence the cache knows
//! committed is refused from memory, before the request takes a permit or its body is
//! read. The cache never holds a token above the committed one ([`super::fence_cache`]),
//! so such a refusal is always right; a token it lets through, the store decides.

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ObjectKey, ResourceName, Token};

use super::rejections::Rejected;
use super::{Coordinator, FrontDoor};
use crate::error::ApiError;

impl Coordinator {
    /// The fast path: rejects `fencing` from memory if the cache already knows a higher
    /// committed token. `Ok` means only "not known to be stale": the backend decides.
    pub(super) fn check_cached(
        &self,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
        identity: Option<&str>,
        door: FrontDoor,
    ) -> Result<(), ApiError> {
        if self.no_cache_rejections {
            return Ok(());
        }
        match self.cache.reject_below(resource, fencing.token) {
            Some((highest, rejections)) => {
                self.metrics.cache_rejection();
                let rejected = Rejected {
                    resource,
                    key,
                    fencing,
                    identity,
                    highest,
                    door,
                };
                Err(self.rejected(&rejected, rejections))
            }
            None => Ok(()),
        }
    }

    /// The committed highest token the cache knows for `resource`, if `token` is below
    /// it (never, with the test-only `--no-cache-rejections`).
    pub(super) fn cached_above(&self, resource: &ResourceName, token: Token) -> Option<Token> {
        let highest = self.cache.highest(resource)?;
        (!self.no_cache_rejections && highest > token).then_some(highest)
    }

    /// The rejection of a write the cache knew stale (`highest`: the token it knew),
    /// counted as a cache rejection and logged.
    pub(super) fn stale_by_cache(
        &self,
        resource: &ResourceName,
        fencing: &Fencing,
        identity: Option<&str>,
        highest: Token,
    ) -> ApiError {
        self.metrics.cache_rejection();
        let seen = self.seen();
        let rejected = Rejected {
            resource,
            key: None,
            fencing,
            identity,
            highest,
            door: FrontDoor::Http,
        };
        self.stale(&rejected, seen)
    }
}
