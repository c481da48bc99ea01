//! Writes sent with an `Idempotency-Key`: the key read, the request's fingerprint, and
//! answers stored and replayed.
//!
//! A keyed write runs as a transaction of the store ([`crate::store::txn`]) that stores
//! its answer with it. The answer is rendered from the outcome by the endpoint's own
//! function, the same for the first attempt and for the store, so that a retry gets the
//! very bytes the first attempt got (plus `Idempotency-Replayed: true`).
//!
//! A keyed write skips the fence cache's early rejection: a retry of a write that was
//! accepted must get its `201` even after a newer term raised the fence, and only the
//! store knows it was accepted.

use std::sync::Arc;

use fencegate_proto::body::ErrorBody;
use fencegate_proto::headers::idempotency_key;
use fencegate_proto::ErrorCode;
use http::Response;
use ring::digest;

use crate::api::request::Req;
use crate::api::response::{error_response, respond};
use crate::api::Body;
use crate::coordinator::{Coordinator, FrontDoor};
use crate::error::ApiError;
use crate::store::txn::{Answered, Keyed, OpDone, Render, StoredAnswer, Txn, TxnOp, TxnOutcome};
use crate::store::StoreError;

/// The request's `Idempotency-Key`, if it has one.
pub fn key_of(request: &Req) -> Result<Option<String>, ApiError> {
    Ok(idempotency_key(&request.head.headers)?)
}

/// The request headers that decide what a write does, beside its method, path and
/// body: two requests that differ in one of them are different requests.
const DECIDING_HEADERS: [&str; 3] = ["fencing-token", "if-match", "if-none-match"];

/// A digest of what the request asks for: method, path, the deciding headers and the
/// body. Each part is length-prefixed, so no two requests share an encoding.
pub fn fingerprint(request: &Req, body: &[u8]) -> [u8; 32] {
    let mut context = digest::Context::new(&digest::SHA256);
    let mut part = |bytes: &[u8]| {
        context.update(&(bytes.len() as u64).to_be_bytes());
        context.update(bytes);
    };
    part(request.head.method.as_str().as_bytes());
    part(request.head.uri.path().as_bytes());
    for name in DECIDING_HEADERS {
        for value in request.head.headers.get_all(name) {
            part(name.as_bytes());
            part(value.as_bytes());
        }
    }
    part(body);
    let mut fingerprint = [0; 32];
    fingerprint.copy_from_slice(context.finish().as_ref());
    fingerprint
}

/// The key record of a write about to run, with the answer's renderer.
pub fn keyed<O>(
    coordinator: &Coordinator,
    request: &Req,
    key: String,
    body: &[u8],
    render: Render<O>,
) -> Keyed<O> {
    Keyed {
        identity: request.identity.clone().unwrap_or_default(),
        key,
        fingerprint: fingerprint(request, body),
        ttl: coordinator.idempotency_ttl(),
        render,
    }
}

/// A renderer from an endpoint's function of the outcome to its response.
pub fn renderer<O>(render: impl Fn(&O) -> Response<Body> + Send + Sync + 'static) -> Render<O> {
    Arc::new(move |outcome| store(render(outcome)))
}

/// A response as it is stored.
fn store(response: Response<Body>) -> StoredAnswer {
    let (parts, body) = response.into_parts();
    StoredAnswer {
        status: parts.status.as_u16(),
        headers: parts
            .headers
            .iter()
            .filter_map(|(name, value)| {
                Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
            })
            .collect(),
        body: body.into_bytes(),
    }
}

/// A stored answer as the handler's result: an error answer goes the way of every error
/// (counted by its code, logged), with its stored status, headers and body.
fn result_of(answer: StoredAnswer, replayed: bool) -> Result<Response<Body>, ApiError> {
    if answer.status < 400 {
        return Ok(respond(&answer, replayed));
    }
    let code = serde_json::from_slice::<ErrorBody>(&answer.body)
        .map(|body| body.error)
        .unwrap_or(ErrorCode::Internal);
    Err(ApiError::Stored {
        code,
        answer: Box::new(answer),
        replayed,
    })
}

/// The response to what a transaction, keyed or not, came to.
pub fn answer<O>(answered: Answered<O>, render: &Render<O>) -> Result<Response<Body>, ApiError> {
    match answered {
        Answered::Ran {
            stored: Some(answer),
            ..
        } => result_of(answer, false),
        Answered::Ran {
            outcome,
            stored: None,
        } => result_of(render(&outcome), false),
        Answered::Replayed(answer) => result_of(answer, true),
        Answered::KeyReused => Err(ApiError::IdempotencyKeyReused),
        Answered::InFlight => Err(ApiError::IdempotencyInFlight),
    }
}

/// A single keyed write — an object's put or delete, or an advance — as a transaction of
/// one operation that stores its answer. `applied` renders the answer of the applied
/// write; a refusal is answered as the same write without a key would be.
pub async fn single(
    coordinator: &Arc<Coordinator>,
    request: &Req,
    idempotency: String,
    op: TxnOp,
    body: &[u8],
    holder: Option<&str>,
    applied: impl Fn(OpDone) -> Response<Body> + Send + Sync + 'static,
) -> Result<Response<Body>, ApiError> {
    let (resource, token) = (op.resource().clone(), op.token());
    let txn = Txn::new(vec![op]).map_err(|error| StoreError::Internal(error.to_string()))?;
    let render = renderer(move |outcome: &TxnOutcome| match outcome {
        TxnOutcome::Applied(done) => applied(done.first().copied().unwrap_or(OpDone {
            version: None,
            created: false,
        })),
        TxnOutcome::Stale(members) => error_response(&ApiError::Stale {
            resource: resource.clone(),
            presented: token,
            highest: members.first().map_or(token, |member| member.highest),
        }),
        TxnOutcome::PreconditionFailed { current, .. } => {
            error_response(&ApiError::VersionMismatch { current: *current })
        }
    });
    let record = keyed(coordinator, request, idempotency, body, Arc::clone(&render));
    let answered = coordinator
        .txn(
            Arc::new(txn),
            Some(record),
            holder,
            request.identity.as_deref(),
            FrontDoor::Http,
        )
        .await?;
    answer(answered, &render)
}
