//! `/v1/kv/{resource}/{key}`: fenced object writes, and reads.

use std::sync::Arc;

use fencegate_proto::body::WriteAccepted;
use fencegate_proto::headers::{Fencing, Precondition, FENCING_TOKEN};
use fencegate_proto::{ObjectKey, ResourceName, Token};
use http::header::{CONTENT_TYPE, ETAG};
use http::{HeaderValue, Response, StatusCode};

use crate::api::keyed;
use crate::api::request::{fencing_of, read_body, Idempotency, Req};
use crate::api::response::{etag_value, json_response, number_value};
use crate::api::Body;
use crate::coordinator::AppliedWrite;
use crate::coordinator::{Coordinator, FrontDoor};
use crate::error::ApiError;
use crate::store::txn::{OpDone, TxnOp};
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
    if let Some(idempotency) = keyed::key_of(request)? {
        let write = KeyedWrite {
            resource,
            key,
            change,
            fencing,
            precondition,
        };
        return Box::pin(write_keyed(coordinator, write, idempotency, request)).await;
    }
    let _in_flight = request
        .admit_write(
            coordinator,
            &resource,
            Some(&key),
            &fencing,
            Idempotency::Unkeyed,
        )
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
    let AppliedWrite { version, created } = coordinator
        .write(
            write,
            &fencing,
            request.identity.as_deref(),
            FrontDoor::Http,
        )
        .await?;
    Ok(accepted(resource, key, fencing.token, version, created))
}

/// The answer to an applied write.
fn accepted(
    resource: ResourceName,
    key: ObjectKey,
    token: Token,
    version: u64,
    created: bool,
) -> Response<Body> {
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let accepted = WriteAccepted {
        resource,
        key,
        token,
        version,
    };
    let mut response = json_response(status, &accepted);
    response.headers_mut().insert(ETAG, etag_value(version));
    response
}

/// A write with an `Idempotency-Key`, as its parts were read.
struct KeyedWrite {
    resource: ResourceName,
    key: ObjectKey,
    change: Change,
    fencing: Fencing,
    precondition: Precondition,
}

/// A write with an `Idempotency-Key`: a one-operation transaction that stores its
/// answer ([`keyed`]). Not checked against the fence cache: the store decides, so that
/// a retry of an accepted write gets its answer after a newer term began.
async fn write_keyed(
    coordinator: &Arc<Coordinator>,
    write: KeyedWrite,
    idempotency: String,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let KeyedWrite {
        resource,
        key,
        change,
        fencing,
        precondition,
    } = write;
    let _in_flight = request
        .admit_write(
            coordinator,
            &resource,
            Some(&key),
            &fencing,
            Idempotency::Keyed,
        )
        .await?;
    let (op, body) = match change {
        Change::Put => {
            let body = read_body(coordinator, request).await?;
            let op = TxnOp::Put {
                resource: resource.clone(),
                key: key.clone(),
                token: fencing.token,
                value: body.bytes.clone(),
                precondition,
            };
            (op, Some(body))
        }
        Change::Delete => {
            let op = TxnOp::Delete {
                resource: resource.clone(),
                key: key.clone(),
                token: fencing.token,
                precondition,
            };
            (op, None)
        }
    };
    let bytes = body
        .as_ref()
        .map(|body| body.bytes.clone())
        .unwrap_or_default();
    let token = fencing.token;
    let applied = move |done: OpDone| {
        accepted(
            resource.clone(),
            key.clone(),
            token,
            done.version.unwrap_or_default(),
            done.created,
        )
    };
    let holder = fencing.holder.as_deref();
    keyed::single(
        coordinator,
        request,
        idempotency,
        op,
        &bytes,
        holder,
        applied,
    )
    .await
}

pub async fn get(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    key: ObjectKey,
    request: &Req,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let (responses, conn) = (Arc::clone(&request.responses), Arc::clone(&request.conn));
    let (mut object, room) = coordinator
        .get(&resource, &key, move |length| {
            responses.room_for(length, &conn)
        })
        .await?
        .ok_or(ApiError::NotFound("no such object"))?;
    let body = Body::in_room(std::mem::take(&mut object.value), room);
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
