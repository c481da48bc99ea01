//! `/v1/fences/{resource}`: read a fence, or advance it without writing an object.

use std::sync::Arc;

use fencegate_proto::body::FenceState;
use fencegate_proto::ResourceName;
use http::{Response, StatusCode};

use super::{fencing_of, json_response, Body, Req};
use crate::app::App;
use crate::error::ApiError;

pub async fn get(app: &Arc<App>, resource: ResourceName) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let result = app.store.fence(&resource).await;
    app.backend_result(&result);
    let highest = result?;
    if let Some(highest) = highest {
        // Read from committed state: safe to cache.
        app.committed(&resource, highest);
    }
    Ok(json_response(
        StatusCode::OK,
        &FenceState { resource, highest },
    ))
}

/// Raises the fence to the presented token. A new leader calls this right after it
/// acquires its lease, so that writes still in flight from the previous term are
/// rejected before its own first write.
pub async fn advance(
    app: &Arc<App>,
    resource: ResourceName,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let fencing = fencing_of(request, &resource)?;
    app.check_cached(&resource, None, &fencing)?;
    let _in_flight = app.write_permit()?;
    app.advance(&resource, &fencing).await?;
    Ok(json_response(
        StatusCode::OK,
        &FenceState {
            resource,
            highest: Some(fencing.token),
        },
    ))
}
