//! The checks every fenced request passes before its write, in their one order; each
//! step is in the file named for it: `cache_check`, `permits`, `issuer_check`.

use std::sync::Arc;

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ObjectKey, ResourceName};

use super::{ClientKey, Coordinator, WritePermit};
use crate::error::ApiError;

/// A fenced request at the door of the store: what it writes, with which token, for
/// whom.
pub struct FencedRequest<'a> {
    pub resource: &'a ResourceName,
    /// The object written, if one is (for the rejection's log line).
    pub key: Option<&'a ObjectKey>,
    pub fencing: &'a Fencing,
    /// The authenticated identity, if any.
    pub identity: Option<&'a str>,
    /// Whose share of the write bounds the request takes.
    pub client: ClientKey,
    /// The request carries an `Idempotency-Key`: the store alone decides its token, so
    /// that the retry of an accepted request gets its answer even after a newer term
    /// began — the fence cache does not turn it away.
    pub keyed: bool,
    /// The door the request came through, for the log and the metrics.
    pub door: super::FrontDoor,
}

impl Coordinator {
    /// Lets a fenced write in, or refuses it, with the checks in this order:
    ///
    /// 1. the fence cache: a token below a fence this gateway knows is refused from
    ///    memory, before the request takes a permit or its body is read;
    /// 2. a write permit: the bounds on writes in flight, in all and per client, and
    ///    the required replication; held until the write is done with;
    /// 3. the token's issuer, which may ask the issuer (and so waits, within the
    ///    permit).
    ///
    /// A multi-resource transaction takes one permit and checks each resource's issuer
    /// itself ([`Coordinator::check_issued`]).
    pub async fn admit(
        self: &Arc<Self>,
        entry: FencedRequest<'_>,
    ) -> Result<WritePermit, ApiError> {
        let FencedRequest {
            resource,
            key,
            fencing,
            identity,
            client,
            keyed,
            door,
        } = entry;
        if !keyed {
            self.check_cached(resource, key, fencing, identity, door)?;
        }
        let permit = self.write_permit(client)?;
        self.check_issued(resource, fencing, identity).await?;
        Ok(permit)
    }
}
