//! `/v1/kv/{resource}/{key}`: fenced object writes, and reads.

use std::sync::Arc;

use fencegate_proto::body::WriteAccepted;
use fencegate_proto::headers::{etag, Fencing, Precondition, FENCING_TOKEN};
use fencegate_proto::{ObjectKey, ResourceName};
use http::header::{CONTENT_TYPE, ETAG};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

use super::{json_response, read_body, Body, Req};
use crate::app::App;
use crate::error::ApiError;
use crate::store::{Write, WriteOp, WriteOutcome};

pub async fn put(
    app: &Arc<App>,
    resource: ResourceName,
    key: ObjectKey,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let (fencing, precondition) = fencing_of(request, &resource)?;
    // Checked before the body is read: a stale writer's body is never buffered.
    app.check_cached(&resource, Some(&key), &fencing)?;
    let _in_flight = app.write_permit()?;
    let value = read_body(app, request).await?;
    write(
        app,
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
    app: &Arc<App>,
    resource: ResourceName,
    key: ObjectKey,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let (fencing, precondition) = fencing_of(request, &resource)?;
    app.check_cached(&resource, Some(&key), &fencing)?;
    let _in_flight = app.write_permit()?;
    write(
        app,
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
    app: &Arc<App>,
    resource: ResourceName,
    key: ObjectKey,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let result = app.store.get(&resource, &key).await;
    app.backend_result(&result);
    let object = result?.ok_or(ApiError::NotFound("no such object"))?;
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
    app: &Arc<App>,
    write: Write,
    fencing: &Fencing,
) -> Result<Response<Body>, ApiError> {
    let (resource, key, token) = (write.resource.clone(), write.key.clone(), write.token);
    let WriteOutcome::Applied { version, created } = app.write(write, fencing).await? else {
        unreachable!("App::write turns every other outcome into an error")
    };
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
