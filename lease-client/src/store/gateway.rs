//! Leases hosted by fencegate itself (`/v1/leases/{name}`): election and fencing from
//! one binary, with no Postgres or Redis of the writer's own.
//!
//! The gateway decides each step in one transaction of its store, on its store's
//! clock, and mints each term's token together with raising the resource's fence to
//! it — so a new term's first write needs no advance, and the previous term's late
//! writes are rejected from the moment the new token exists. The lease is named like
//! the resource it fences.
//!
//! With authentication on, give the client the key of the identity that holds the
//! lease ([`FencedClient::with_key`]): the gateway binds the lease to that identity.

use std::time::Duration;

use fencegate_proto::body::{LeaseRequest, LeaseState};
use fencegate_proto::path::{LeaseStep, Target};
use fencegate_proto::{ErrorCode, ResourceName, Token};
use http::StatusCode;

use crate::client::{refusal, FencedClient, WriteError};
use crate::store::{LeaseStore, StoreError};

/// Leases kept by a fencegate gateway.
#[derive(Clone)]
pub struct GatewayStore {
    client: FencedClient,
}

impl GatewayStore {
    /// Leases of the gateway that `client` talks to.
    pub fn new(client: FencedClient) -> GatewayStore {
        GatewayStore { client }
    }

    /// One step: `Ok(Some(state))` when granted, `Ok(None)` when refused with `refused`.
    async fn step(
        &self,
        lease: &str,
        step: LeaseStep,
        request: LeaseRequest,
        refused: ErrorCode,
    ) -> Result<Option<LeaseState>, StoreError> {
        let resource = ResourceName::new(lease)
            .map_err(|e| StoreError::Invalid(format!("lease name {lease:?}: {e}")))?;
        let path = Target::LeaseStep { resource, step }.path();
        let (status, headers, body) = self
            .client
            .post_json(&path, &request)
            .await
            .map_err(unavailable)?;
        if status == StatusCode::OK {
            return serde_json::from_slice(&body).map(Some).map_err(|e| {
                StoreError::Unexpected(format!("a lease answer that does not decode: {e}"))
            });
        }
        match refusal(status, &headers, &body).map_err(unavailable)? {
            WriteError::Refused { body, .. } if body.error == refused => Ok(None),
            WriteError::Refused { status, body } if status >= 500 => Err(StoreError::Unavailable(
                format!("{}: {}", body.error, body.message),
            )),
            WriteError::Refused { body, .. } => Err(StoreError::Unexpected(format!(
                "{}: {}",
                body.error, body.message
            ))),
            other => Err(unavailable(other)),
        }
    }
}

fn unavailable(error: WriteError) -> StoreError {
    StoreError::Unavailable(error.to_string())
}

fn millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)
}

impl LeaseStore for GatewayStore {
    async fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Token>, StoreError> {
        let request = LeaseRequest {
            holder: holder.to_owned(),
            token: None,
            ttl_ms: Some(millis(ttl)),
        };
        let granted = self
            .step(lease, LeaseStep::Acquire, request, ErrorCode::LeaseHeld)
            .await?;
        match granted {
            Some(state) => state
                .token
                .map(Some)
                .ok_or_else(|| StoreError::Unexpected("an acquired lease without a token".into())),
            None => Ok(None),
        }
    }

    async fn renew(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let request = LeaseRequest {
            holder: holder.to_owned(),
            token: Some(epoch),
            ttl_ms: Some(millis(ttl)),
        };
        let renewed = self
            .step(lease, LeaseStep::Renew, request, ErrorCode::LeaseLost)
            .await?;
        Ok(renewed.is_some())
    }

    async fn release(&self, lease: &str, holder: &str, epoch: Token) -> Result<bool, StoreError> {
        let request = LeaseRequest {
            holder: holder.to_owned(),
            token: Some(epoch),
            ttl_ms: None,
        };
        let released = self
            .step(lease, LeaseStep::Release, request, ErrorCode::LeaseLost)
            .await?;
        Ok(released.is_some())
    }
}
