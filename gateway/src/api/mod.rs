//! HTTP handlers.
//!
//! [`handle`] is the outer layer: it routes, times the request, records its metrics,
//! turns an error into its response and logs it — once. The endpoint modules below are
//! the inner layer, written with `?`.
//!
//! # Unread bodies
//!
//! Handlers answer as early as they can — a stale token from the fence cache, a body
//! too large by its Content-Length — without reading the body. Over HTTP/1.1 the client
//! may still be sending it, and must see the answer anyway:
//!
//! - a body of at most [`request::DRAIN_LIMIT`] bytes is read and thrown away, so that
//!   the connection stays open for the next request: before the answer if it comes at
//!   once (within 2 ms), else after it, by a task of its own;
//! - a larger one, or one whose length is unknown, gets `Connection: close`, and the
//!   connection lingers while the client finishes sending ([`crate::server::conn`]).
//!
//! A client that sends `Expect: 100-continue` is asked for its body only when a
//! handler reads it, so a rejected write never sends its body at all.
//!
//! Over HTTP/2, a stream whose body was left unread ends with a reset after the answer,
//! and some clients (curl 7.88 among them) then report the reset and lose the answer.
//! So a body of at most [`request::DRAIN_LIMIT`] declared bytes is read and discarded
//! before the answer, for at most `--body-first-byte-timeout`.
//!
//! - [`kv`]: `GET/PUT/DELETE /v1/kv/{resource}/{key}`
//! - [`fences`]: `GET /v1/fences/{resource}`, `POST /v1/fences/{resource}/advance`
//! - [`sql`]: `POST /v1/sql/{resource}`
//! - [`leases`]: `GET /v1/leases/{resource}`, `POST /v1/leases/{resource}/{step}`,
//!   `POST /v1/fences/{resource}/reset`
//! - [`txn`]: `POST /v1/txn`
//! - [`keyed`]: what every write sent with an `Idempotency-Key` goes through
//! - [`ops`]: `/metrics`, `/healthz`, `/readyz`, `/v1/openapi.json`

pub mod body;
mod fences;
mod keyed;
mod kv;
mod leases;
mod ops;
mod request;
mod response;
mod sql;
mod txn;

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Instant;

use fencegate_proto::path::{Family, Target};
use fencegate_proto::ErrorCode;
use http::header::CONNECTION;
use http::{HeaderValue, Method, Request, Response, Version};
use hyper::body::Incoming;
use tracing::Instrument;

use crate::auth::{Action, ClientCertificate, Identity};
use crate::coordinator::Coordinator;
use crate::error::ApiError;

use crate::server::conn::ConnState;
pub use body::{Body, ResponseBudget};
use request::Req;
use response::error_response;

/// Answers one request. Never fails: every error becomes its response here.
pub async fn handle(
    coordinator: Arc<Coordinator>,
    request: Request<Incoming>,
    peer: IpAddr,
    conn: &Arc<ConnState>,
    responses: Arc<ResponseBudget>,
) -> Response<Body> {
    let mut request = Req::new(request, peer, Arc::clone(conn), responses);
    let mut response = answer(&coordinator, &mut request).await;
    if request.head.version < Version::HTTP_2 {
        if !request.keeps_connection(&coordinator).await {
            response
                .headers_mut()
                .insert(CONNECTION, HeaderValue::from_static("close"));
        }
    } else {
        request.drain_before_early_answer(&coordinator).await;
    }
    response
}

async fn answer(coordinator: &Arc<Coordinator>, request: &mut Req) -> Response<Body> {
    let started = Instant::now();
    let route = route_label(&request.head.method, request.head.uri.path());
    // At debug level only: at info, a span per request (its fields formatted, recorded
    // and closed) costs more than answering a stale write. The events logged at info
    // and above carry their own facts instead: the stale rejection its resource, tokens
    // and identity, a failed request its method, route, path and identity.
    let span = tracing::debug_span!(
        "request",
        method = %request.head.method,
        route,
        resource = tracing::field::Empty,
        presented = tracing::field::Empty,
        identity = tracing::field::Empty,
        outcome = tracing::field::Empty,
    );
    let result = dispatch(coordinator, request)
        .instrument(span.clone())
        .await;
    let (response, outcome) = match result {
        Ok(response) => (response, None),
        Err(error) => {
            let code = error.code();
            let _entered = span.enter();
            match code {
                ErrorCode::Internal | ErrorCode::BackendUnavailable => tracing::error!(
                    error = %error,
                    code = code.as_str(),
                    method = %request.head.method,
                    route,
                    path = request.head.uri.path(),
                    identity = request.identity.as_deref(),
                    "request failed"
                ),
                // Stale rejections were logged with their facts where they were decided;
                // overload is counted, and logging each one would add to it.
                _ => tracing::debug!(error = %error, code = code.as_str(), "request refused"),
            }
            if let ApiError::Overloaded(reason) = error {
                coordinator.limit_rejected(reason);
            }
            (error_response(&error), Some(code))
        }
    };
    span.record(
        "outcome",
        outcome.map_or(crate::metrics::OK, ErrorCode::as_str),
    );
    coordinator.answered(route, outcome, started.elapsed());
    response
}

async fn dispatch(
    coordinator: &Arc<Coordinator>,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let path = request.head.uri.path();
    // Authentication comes first: a caller without a key or a known client certificate
    // learns nothing, not even whether its path or resource name is valid.
    let identity = match coordinator.authenticator() {
        Some(auth) if path != Target::Healthz.path() => Some(
            auth.authenticate(
                request
                    .head
                    .headers
                    .get(http::header::AUTHORIZATION)
                    .map(|value| value.as_bytes()),
                request.head.extensions.get::<ClientCertificate>(),
            )?,
        ),
        _ => None,
    };
    let target = Target::parse(path)?;
    let method = request.head.method.clone();
    if let Some(identity) = &identity {
        tracing::Span::current().record("identity", identity.name.as_str());
        authorize(identity, &method, &target)?;
        request.identity = Some(identity.name.clone());
    }
    match (method, target) {
        (Method::GET, Target::Object { resource, key }) => {
            kv::get(coordinator, resource, key, request).await
        }
        (Method::PUT, Target::Object { resource, key }) => {
            kv::write(coordinator, resource, key, kv::Change::Put, request).await
        }
        (Method::DELETE, Target::Object { resource, key }) => {
            kv::write(coordinator, resource, key, kv::Change::Delete, request).await
        }
        (_, Target::Object { .. }) => Err(ApiError::MethodNotAllowed {
            allow: "GET, PUT, DELETE",
        }),
        (Method::GET, Target::Fence { resource }) => fences::get(coordinator, resource).await,
        (_, Target::Fence { .. }) => Err(ApiError::MethodNotAllowed { allow: "GET" }),
        (Method::POST, Target::FenceAdvance { resource }) => {
            fences::advance(coordinator, resource, request).await
        }
        (_, Target::FenceAdvance { .. }) => Err(ApiError::MethodNotAllowed { allow: "POST" }),
        (Method::POST, Target::FenceReset { resource }) => {
            leases::reset(coordinator, resource, request).await
        }
        (Method::POST, Target::Sql { resource }) => sql::post(coordinator, resource, request).await,
        (Method::GET, Target::Lease { resource }) => leases::get(coordinator, resource).await,
        (_, Target::Lease { .. }) => Err(ApiError::MethodNotAllowed { allow: "GET" }),
        (Method::POST, Target::LeaseStep { resource, step }) => {
            leases::step(coordinator, resource, step, request).await
        }
        (_, Target::Sql { .. } | Target::FenceReset { .. } | Target::LeaseStep { .. }) => {
            Err(ApiError::MethodNotAllowed { allow: "POST" })
        }
        (Method::POST, Target::Txn) => txn::post(coordinator, request, identity.as_deref()).await,
        (_, Target::Txn) => Err(ApiError::MethodNotAllowed { allow: "POST" }),
        (Method::GET, Target::Metrics) => Ok(ops::metrics(coordinator)),
        (Method::GET, Target::Healthz) => Ok(ops::healthz()),
        (Method::GET, Target::Readyz) => ops::readyz(coordinator).await,
        (Method::GET, Target::OpenApi) => Ok(ops::openapi()),
        (_, Target::Metrics | Target::Healthz | Target::Readyz | Target::OpenApi) => {
            Err(ApiError::MethodNotAllowed { allow: "GET" })
        }
    }
}

/// Refuses a request the identity holds no grant for. Requests whose method the path
/// does not take need only an identity (they are refused further on).
fn authorize(identity: &Identity, method: &Method, target: &Target) -> Result<(), ApiError> {
    let (action, resource) = match (method, target) {
        (
            &Method::GET,
            Target::Object { resource, .. }
            | Target::Fence { resource }
            | Target::Lease { resource },
        ) => (Action::Read, Some(resource)),
        (&Method::POST, Target::LeaseStep { resource, .. }) => (Action::Lease, Some(resource)),
        (&Method::POST, Target::FenceReset { .. }) => (Action::Admin, None),
        (&Method::PUT | &Method::DELETE, Target::Object { resource, .. }) => {
            (Action::Write, Some(resource))
        }
        (&Method::POST, Target::FenceAdvance { resource }) => (Action::Advance, Some(resource)),
        (&Method::POST, Target::Sql { resource }) => (Action::Sql, Some(resource)),
        (&Method::GET, Target::Metrics | Target::Readyz) => (Action::Metrics, None),
        _ => return Ok(()),
    };
    if identity.may(action, resource) {
        return Ok(());
    }
    Err(ApiError::Forbidden {
        identity: identity.name.clone(),
        action,
        resource: resource.cloned(),
    })
}

/// The `route` label: the endpoint a request was meant for, from a closed set, known
/// even when the path's parameters are invalid.
fn route_label(method: &Method, path: &str) -> &'static str {
    match Family::of(path) {
        Some(Family::Object) => match *method {
            Method::GET => "kv_get",
            Method::PUT => "kv_put",
            Method::DELETE => "kv_delete",
            _ => "kv_other",
        },
        Some(Family::Fence) => "fence_get",
        Some(Family::FenceAdvance) => "fence_advance",
        Some(Family::FenceReset) => "fence_reset",
        Some(Family::Sql) => "sql",
        Some(Family::Lease) => "lease_get",
        Some(Family::LeaseStep) => "lease_step",
        Some(Family::Txn) => "txn",
        Some(Family::Metrics) => "metrics",
        Some(Family::Healthz) => "healthz",
        Some(Family::Readyz) => "readyz",
        Some(Family::OpenApi) => "openapi",
        None => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencegate_proto::path::LeaseStep;

    /// The document's path and methods for each kind of target the router knows. A new
    /// target does not compile until it is documented here — and in openapi.json.
    fn documented(target: &Target) -> (&'static str, &'static [&'static str]) {
        match target {
            Target::Object { .. } => ("/v1/kv/{resource}/{key}", &["get", "put", "delete"]),
            Target::Fence { .. } => ("/v1/fences/{resource}", &["get"]),
            Target::FenceAdvance { .. } => ("/v1/fences/{resource}/advance", &["post"]),
            Target::FenceReset { .. } => ("/v1/fences/{resource}/reset", &["post"]),
            Target::Sql { .. } => ("/v1/sql/{resource}", &["post"]),
            Target::Lease { .. } => ("/v1/leases/{resource}", &["get"]),
            Target::LeaseStep { step, .. } => match step {
                LeaseStep::Acquire => ("/v1/leases/{resource}/acquire", &["post"]),
                LeaseStep::Renew => ("/v1/leases/{resource}/renew", &["post"]),
                LeaseStep::Release => ("/v1/leases/{resource}/release", &["post"]),
            },
            Target::Txn => ("/v1/txn", &["post"]),
            Target::Metrics => ("/metrics", &["get"]),
            Target::Healthz => ("/healthz", &["get"]),
            Target::Readyz => ("/readyz", &["get"]),
            Target::OpenApi => ("/v1/openapi.json", &["get"]),
        }
    }

    #[test]
    fn the_openapi_document_matches_the_routes_and_the_codes() {
        let doc: serde_json::Value = serde_json::from_str(ops::OPENAPI).unwrap();
        assert_eq!(doc["openapi"], "3.1.0");
        let codes: Vec<&str> = doc["components"]["schemas"]["ErrorCode"]["enum"]
            .as_array()
            .unwrap()
            .iter()
            .map(|code| code.as_str().unwrap())
            .collect();
        assert_eq!(codes, ErrorCode::ALL.map(ErrorCode::as_str));
        let samples = [
            "/v1/kv/r/a/b",
            "/v1/fences/r",
            "/v1/fences/r/advance",
            "/v1/fences/r/reset",
            "/v1/sql/r",
            "/v1/leases/r",
            "/v1/leases/r/acquire",
            "/v1/leases/r/renew",
            "/v1/leases/r/release",
            "/v1/txn",
            "/metrics",
            "/healthz",
            "/readyz",
            "/v1/openapi.json",
        ];
        let mut seen = Vec::new();
        for sample in samples {
            let (path, methods) = documented(&Target::parse(sample).unwrap());
            let operations = doc["paths"][path]
                .as_object()
                .unwrap_or_else(|| panic!("{path} is not documented"));
            let mut listed: Vec<&str> = operations
                .keys()
                .map(String::as_str)
                .filter(|key| *key != "parameters")
                .collect();
            listed.sort_unstable();
            let mut expected = methods.to_vec();
            expected.sort_unstable();
            assert_eq!(listed, expected, "{path}");
            for method in methods {
                let route = route_label(&method.to_uppercase().parse().unwrap(), sample);
                assert_ne!(route, "unknown", "{method} {path}");
            }
            seen.push(path);
        }
        let mut documented_paths: Vec<&str> = doc["paths"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        documented_paths.sort_unstable();
        seen.sort_unstable();
        assert_eq!(documented_paths, seen, "every documented path is routed");
    }

    #[test]
    fn route_labels_are_the_known_ones() {
        for (method, path) in [
            (Method::PUT, "/v1/kv/a/b"),
            (Method::GET, "/v1/kv/a/b"),
            (Method::DELETE, "/v1/kv/a/b"),
            (Method::PATCH, "/v1/kv/a/b"),
            (Method::GET, "/v1/fences/a"),
            (Method::POST, "/v1/fences/a/advance"),
            (Method::POST, "/v1/sql/a"),
            (Method::POST, "/v1/fences/a/reset"),
            (Method::GET, "/v1/leases/a"),
            (Method::POST, "/v1/leases/a/renew"),
            (Method::POST, "/v1/txn"),
            (Method::GET, "/metrics"),
            (Method::GET, "/healthz"),
            (Method::GET, "/readyz"),
            (Method::GET, "/v1/openapi.json"),
            (Method::GET, "/elsewhere"),
        ] {
            let route = route_label(&method, path);
            assert!(crate::metrics::ROUTES.contains(&route), "{route}");
        }
    }

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
