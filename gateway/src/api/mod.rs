//! HTTP handlers.
//!
//! [`handle`] is the outer layer: it routes, times the request, records its metrics,
//! turns an error into its response and logs it — once. The endpoint modules below are
//! the inner layer, written with `?`.
//!
//! - [`kv`]: `GET/PUT/DELETE /v1/kv/{resource}/{key}`
//! - [`fences`]: `GET /v1/fences/{resource}`, `POST /v1/fences/{resource}/advance`
//! - [`sql`]: `POST /v1/sql/{resource}`
//! - [`ops`]: `/metrics`, `/healthz`, `/readyz`

mod fences;
mod kv;
mod ops;
mod sql;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use fencegate_proto::headers::{Fencing, FENCING_HIGHEST};
use fencegate_proto::path::Target;
use fencegate_proto::ResourceName;
use http::header::{ALLOW, CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use tracing::Instrument;

use crate::app::App;
use crate::error::ApiError;

pub type Body = Full<Bytes>;

/// Answers one request. Never fails: every error becomes its response here.
pub async fn handle(app: Arc<App>, request: Request<Incoming>) -> Response<Body> {
    let started = Instant::now();
    let route = route_label(request.method(), request.uri().path());
    let span = tracing::info_span!(
        "request",
        method = %request.method(),
        route,
        resource = tracing::field::Empty,
        presented = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let result = dispatch(&app, request).instrument(span.clone()).await;
    let (response, outcome) = match result {
        Ok(response) => (response, "ok"),
        Err(error) => {
            let code = error.code();
            let _entered = span.enter();
            match code.status() {
                500.. => tracing::error!(error = %error, code = code.as_str(), "request failed"),
                // Stale rejections were logged with their facts where they were decided.
                _ => tracing::debug!(error = %error, code = code.as_str(), "request refused"),
            }
            (error_response(&error), code.as_str())
        }
    };
    span.record("outcome", outcome);
    app.metrics
        .requests
        .with_label_values(&[route, outcome])
        .inc();
    app.metrics
        .request_duration
        .with_label_values(&[route, outcome])
        .observe(started.elapsed().as_secs_f64());
    response
}

async fn dispatch(app: &Arc<App>, request: Request<Incoming>) -> Result<Response<Body>, ApiError> {
    let target = Target::parse(request.uri().path())?;
    let method = request.method().clone();
    match (method, target) {
        (Method::GET, Target::Object { resource, key }) => kv::get(app, resource, key).await,
        (Method::PUT, Target::Object { resource, key }) => {
            kv::put(app, resource, key, request).await
        }
        (Method::DELETE, Target::Object { resource, key }) => {
            kv::delete(app, resource, key, request).await
        }
        (_, Target::Object { .. }) => Err(ApiError::MethodNotAllowed {
            allow: "GET, PUT, DELETE",
        }),
        (Method::GET, Target::Fence { resource }) => fences::get(app, resource).await,
        (_, Target::Fence { .. }) => Err(ApiError::MethodNotAllowed { allow: "GET" }),
        (Method::POST, Target::FenceAdvance { resource }) => {
            fences::advance(app, resource, request).await
        }
        (_, Target::FenceAdvance { .. }) => Err(ApiError::MethodNotAllowed { allow: "POST" }),
        (Method::POST, Target::Sql { resource }) => sql::post(app, resource, request).await,
        (_, Target::Sql { .. }) => Err(ApiError::MethodNotAllowed { allow: "POST" }),
        (Method::GET, Target::Metrics) => Ok(ops::metrics(app)),
        (Method::GET, Target::Healthz) => Ok(ops::healthz()),
        (Method::GET, Target::Readyz) => ops::readyz(app).await,
        (_, Target::Metrics | Target::Healthz | Target::Readyz) => {
            Err(ApiError::MethodNotAllowed { allow: "GET" })
        }
    }
}

/// The `route` label: the endpoint a request was meant for, from a closed set, known
/// even when the path's parameters are invalid.
fn route_label(method: &Method, path: &str) -> &'static str {
    if path.starts_with("/v1/kv/") {
        return match *method {
            Method::GET => "kv_get",
            Method::PUT => "kv_put",
            Method::DELETE => "kv_delete",
            _ => "kv_other",
        };
    }
    if let Some(rest) = path.strip_prefix("/v1/fences/") {
        return if rest.ends_with("/advance") {
            "fence_advance"
        } else {
            "fence_get"
        };
    }
    if path.starts_with("/v1/sql/") {
        return "sql";
    }
    match path {
        "/metrics" => "metrics",
        "/healthz" => "healthz",
        "/readyz" => "readyz",
        _ => "unknown",
    }
}

/// Reads a write's fencing headers, recording the resource and the presented token in
/// the request's span.
fn fencing_of(request: &Request<Incoming>, resource: &ResourceName) -> Result<Fencing, ApiError> {
    let span = tracing::Span::current();
    span.record("resource", resource.as_str());
    let fencing = Fencing::from_headers(request.headers())?;
    span.record("presented", fencing.token.get());
    Ok(fencing)
}

/// Reads the whole body, refusing more than `limit` bytes.
async fn read_body(request: Request<Incoming>, limit: usize) -> Result<Bytes, ApiError> {
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    match Limited::new(request.into_body(), limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::BodyTooLarge { limit })
        }
        Err(_) => Err(ApiError::InvalidBody),
    }
}

fn json_response<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Body> {
    let bytes = serde_json::to_vec(body).expect("response bodies serialize");
    let mut response = Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

fn error_response(error: &ApiError) -> Response<Body> {
    let code = error.code();
    let status = StatusCode::from_u16(code.status()).expect("error codes carry valid statuses");
    let mut response = json_response(status, &error.body());
    match error {
        ApiError::Stale { highest, .. } => {
            response
                .headers_mut()
                .insert(FENCING_HIGHEST, HeaderValue::from(highest.get()));
        }
        ApiError::MethodNotAllowed { allow } => {
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static(allow));
        }
        _ => {}
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_labels() {
        assert_eq!(route_label(&Method::PUT, "/v1/kv/a/b"), "kv_put");
        assert_eq!(route_label(&Method::PUT, "/v1/kv/bad%20name/b"), "kv_put");
        assert_eq!(
            route_label(&Method::POST, "/v1/fences/a/advance"),
            "fence_advance"
        );
        assert_eq!(route_label(&Method::GET, "/v1/fences/a"), "fence_get");
        assert_eq!(route_label(&Method::POST, "/v1/sql/a"), "sql");
        assert_eq!(route_label(&Method::GET, "/nope"), "unknown");
    }
}
