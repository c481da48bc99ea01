//! `/v1/kv/{resource}/{key}`: fenced object writes, and reads.

use std::sync::Arc;

use fencegate_proto::body::WriteAccepted;
use fencegate_proto::headers::{Precondition, FENCING_TOKEN};
use fencegate_proto::{ObjectKey, ResourceName};
use http::header::{CONTENT_TYPE, ETAG};
use http::{HeaderValue, Response, StatusCode};

use crate::api::request::{fencing_of, read_body, Req};
use crate::api::response::{etag_value, json_response, number_value};
use crate::api::Body;
use crate::coordinator::Applied;
use crate::coordinator::Coordinator;
use crate::error::ApiError;
use crate::store::{Write, WriteOp};

/// What a fenced write does to its object.
pub enum Change {
    /// `PUT`: the request's body becomes the object's value.
    Put,
    /// `DELETE`.
    Delete,
}

/// `PUT` or `DELETE`: every check that needs no database first — headers, the fence
/// cache (so a stale writer's body is never buffered), a write permit — then the body,
/// then the write.
pub async fn write(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    key: ObjectKey,
    change: Change,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let fencing = fencing_of(request, &resource)?;
    let precondition = Precondition::from_headers(&request.head.headers)?;
    coordinator.check_cached(&resource, Some(&key), &fencing, request.identity.as_deref())?;
    let _in_flight = coordinator.write_permit(request.client(coordinator))?;
    coordinator
        .check_issued(&resource, &fencing, request.identity.as_deref())
        .await?;
    // The body's memory stays counted until the write is done with it.
    let (op, _body) = match change {
        Change::Put => {
            let body = read_body(coordinator, request).await?;
            (WriteOp::Put(body.bytes.clone()), Some(body))
        }
        Change::Delete => (WriteOp::Delete, None),
    };
    let write = Write {
        resource: resource.clone(),
        key: key.clone(),
        token: fencing.token,
        precondition,
        op,
    };
    let Applied { version, created } = coordinator
        .write(write, &fencing, request.identity.as_deref())
        .await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let accepted = WriteAccepted {
        resource,
        key,
        token: fencing.token,
        version,
    };
    let mut response = json_response(status, &accepted);
    response.headers_mut().insert(ETAG, etag_value(version));
    Ok(response)
}

pub async fn get(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    key: ObjectKey,
    request: &Req,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let (object, body) = coordinator
        .get(&resource, &key, &request.conn)
        .await?
        .ok_or(ApiError::NotFound("no such object"))?;
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(ETAG, etag_value(object.version));
    headers.insert(FENCING_TOKEN, number_value(object.token.get()));
    Ok(response)
}
