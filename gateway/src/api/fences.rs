//! `/v1/fences/{resource}`: read a fence, or advance it without writing an object.

use std::sync::Arc;

use fencegate_proto::body::FenceState;
use fencegate_proto::{ResourceName, Token};
use http::{Response, StatusCode};

use crate::api::keyed;
use crate::api::request::{fencing_of, Idempotency, Req};
use crate::api::response::json_response;
use crate::api::Body;
use crate::coordinator::Coordinator;
use crate::error::ApiError;
use crate::store::txn::{OpDone, TxnOp};

pub async fn get(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let highest = coordinator.fence(&resource).await?;
    Ok(json_response(
        StatusCode::OK,
        &FenceState { resource, highest },
    ))
}

/// Raises the fence to the presented token. A new leader calls this right after it
/// acquires its lease, so that writes still in flight from the previous term are
/// rejected before its own first write.
pub async fn advance(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let fencing = fencing_of(request, &resource)?;
    let idempotency = keyed::key_of(request)?;
    // A keyed advance is decided by the store alone; see `keyed`.
    let _in_flight = request
        .admit_write(
            coordinator,
            &resource,
            None,
            &fencing,
            Idempotency::of(&idempotency),
        )
        .await?;
    let Some(idempotency) = idempotency else {
        coordinator
            .advance(&resource, &fencing, request.identity.as_deref())
            .await?;
        return Ok(advanced(resource, fencing.token));
    };
    let op = TxnOp::Advance {
        resource: resource.clone(),
        token: fencing.token,
    };
    let token = fencing.token;
    let applied = move |_: OpDone| advanced(resource.clone(), token);
    let holder = fencing.holder.as_deref();
    keyed::single(coordinator, request, idempotency, op, &[], holder, applied).await
}

/// The answer to an applied advance.
fn advanced(resource: ResourceName, token: Token) -> Response<Body> {
    json_response(
        StatusCode::OK,
        &FenceState {
            resource,
            highest: Some(token),
        },
    )
}
