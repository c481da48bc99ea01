//! `/v1/fences/{resource}`: read a fence, or advance it without writing an object.

use std::sync::Arc;

use fencegate_proto::body::FenceState;
use fencegate_proto::ResourceName;
use http::{Response, StatusCode};

use crate::api::request::{fencing_of, Req};
use crate::api::response::json_response;
use crate::api::Body;
use crate::coordinator::Coordinator;
use crate::error::ApiError;

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
    coordinator.check_cached(&resource, None, &fencing, request.identity.as_deref())?;
    let _in_flight = coordinator.write_permit(request.client(coordinator))?;
    coordinator
        .check_issued(&resource, &fencing, request.identity.as_deref())
        .await?;
    coordinator
        .advance(&resource, &fencing, request.identity.as_deref())
        .await?;
    Ok(json_response(
        StatusCode::OK,
        &FenceState {
            resource,
            highest: Some(fencing.token),
        },
    ))
}
