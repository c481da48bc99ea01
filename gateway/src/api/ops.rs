//! Operational endpoints: metrics, liveness, readiness, and the API's description.

use std::sync::Arc;

use bytes::Bytes;
use fencegate_proto::body::ErrorBody;
use fencegate_proto::ErrorCode;
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Response, StatusCode};

use crate::api::response::json_response;
use crate::api::Body;
use crate::coordinator::Coordinator;
use crate::error::ApiError;
use crate::store::NotWritableReason;

pub fn metrics(coordinator: &Coordinator) -> Response<Body> {
    let mut response = Response::new(Body::whole(Bytes::from(coordinator.encode_metrics())));
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

/// The process is up and serving HTTP; says nothing about the backend.
pub fn healthz() -> Response<Body> {
    json_response(StatusCode::OK, &serde_json::json!({ "status": "ok" }))
}

/// The backend answers: the gateway can accept writes now.
pub async fn readyz(coordinator: &Arc<Coordinator>) -> Result<Response<Body>, ApiError> {
    coordinator.ping().await?;
    if let Err(not) = coordinator.writable().await? {
        let message = match not.reason {
            NotWritableReason::DiskFull => "the store's disk is full, so writes fail",
            NotWritableReason::ReadOnly => "the store is read-only, so writes fail",
            NotWritableReason::WriteFailed => {
                "the store's write probe failed, so writes fail (the gateway's log says why)"
            }
        };
        let mut body = ErrorBody::new(ErrorCode::BackendUnavailable, message);
        body.reason = Some(not.reason.as_str().to_owned());
        return Err(ApiError::Refused(Box::new(body)));
    }
    Ok(json_response(
        StatusCode::OK,
        &serde_json::json!({ "status": "ready" }),
    ))
}

/// The OpenAPI 3.1 document of the API (`gateway/openapi.json`), checked against the
/// routes and error codes by the tests.
pub const OPENAPI: &str = include_str!("../../openapi.json");

pub fn openapi() -> Response<Body> {
    let mut response = Response::new(Body::whole(Bytes::from_static(OPENAPI.as_bytes())));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}
