//! `/v1/kv/{resource}/{key}`: fenced object writes, and reads.

use std::sync::Arc;

use fencegate_proto::body::WriteAccepted;
use fencegate_proto::headers::{etag, Fencing, Precondition, FENCING_TOKEN};
use fencegate_proto::{ObjectKey, ResourceName};
use http::header::{CONTENT_TYPE, ETAG};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

use super::{json_response, read_body, Body, Req};
use crate::coordinator::Applied;
use crate::coordinator::Coordinator;
use crate::error::ApiError;
use crate::store::{Write, WriteOp};

pub async fn put(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    key: ObjectKey,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let (fencing, precondition) = fencing_of(request, &resource)?;
    // Checked before the body is read: a stale writer's body is never buffered.
    coordinator.check_cached(&resource, Some(&key), &fencing)?;
    let _in_flight = coordinator.write_permit()?;
    let value = read_body(coordinator, request).await?;
    write(
        coordinator,
        Write {
            resource,
            key,
            token: fencing.token,
            precondition,
            op: WriteOp::Put(value.bytes.clone()),
        },
        &fencing,
    )
    .await
}

pub async fn delete(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    key: ObjectKey,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let (fencing, precondition) = fencing_of(request, &resource)?;
    coordinator.check_cached(&resource, Some(&key), &fencing)?;
    let _in_flight = coordinator.write_permit()?;
    write(
        coordinator,
        Write {
            resource,
            key,
            token: fencing.token,
            precondition,
            op: WriteOp::Delete,
        },
        &fencing,
    )
    .await
}

pub async fn get(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    key: ObjectKey,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let object = coordinator
        .get(&resource, &key)
        .await?
        .ok_or(ApiError::NotFound("no such object"))?;
    let mut response = Response::new(Full::new(object.value));
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(
        ETAG,
        HeaderValue::from_str(&etag(object.version)).expect("an etag is a valid header"),
    );
    headers.insert(FENCING_TOKEN, HeaderValue::from(object.token.get()));
    Ok(response)
}

fn fencing_of(request: &Req, resource: &ResourceName) -> Result<(Fencing, Precondition), ApiError> {
    let fencing = super::fencing_of(request, resource)?;
    let precondition = Precondition::from_headers(&request.head.headers)?;
    Ok((fencing, precondition))
}

async fn write(
    coordinator: &Arc<Coordinator>,
    write: Write,
    fencing: &Fencing,
) -> Result<Response<Body>, ApiError> {
    let (resource, key, token) = (write.resource.clone(), write.key.clone(), write.token);
    let Applied { version, created } = coordinator.write(write, fencing).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut response = json_response(
        status,
        &WriteAccepted {
            resource,
            key,
            token,
            version,
        },
    );
    response.headers_mut().insert(
        ETAG,
        HeaderValue::from_str(&etag(version)).expect("an etag is a valid header"),
    );
    Ok(response)
}
