//! `/v1/leases/{resource}`: leases hosted by the gateway ([`crate::store::leases`]),
//! and `POST /v1/fences/{resource}/reset`, the recovery of a fence raised by a token
//! that was never issued.

use std::sync::Arc;
use std::time::Duration;

use fencegate_proto::body::{ErrorBody, FenceResetRequest, LeaseRequest, LeaseState};
use fencegate_proto::headers::MAX_HOLDER_LEN;
use fencegate_proto::path::LeaseStep;
use fencegate_proto::{ErrorCode, ResourceName};
use http::{Response, StatusCode};
use serde::de::DeserializeOwned;

use crate::api::keyed;
use crate::api::request::{read_body, Req};
use crate::api::response::{error_response, json_response};
use crate::api::Body;
use crate::coordinator::Coordinator;
use crate::error::ApiError;
use crate::store::leases::{Claimant, LeaseOp, LeaseOutcome, LeaseRecord};
use crate::store::txn::{Answered, StoredAnswer};

/// The shortest and longest lease a holder may ask for.
pub const MIN_TTL: Duration = Duration::from_millis(10);
pub const MAX_TTL: Duration = Duration::from_secs(24 * 60 * 60);
/// The longest reason a reset may give.
const MAX_REASON_LEN: usize = 1000;

pub async fn get(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let lease = coordinator.read_lease(&resource).await?;
    Ok(json_response(StatusCode::OK, &state(resource, &lease)))
}

/// Acquire, renew or release. The holder is bound to the caller's identity when
/// authentication is on.
pub async fn step(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    step: LeaseStep,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    let idempotency = keyed::key_of(request)?;
    let _in_flight = coordinator.write_permit(request.client(coordinator))?;
    let body = read_body(coordinator, request).await?;
    let LeaseRequest {
        holder,
        token,
        ttl_ms,
    } = serde_json::from_slice(&body.bytes).map_err(|error| invalid(error.to_string()))?;
    let body = body.bytes;
    check_holder(&holder)?;
    let op = match step {
        LeaseStep::Acquire => {
            no_field("token", token.is_some())?;
            LeaseOp::Acquire { ttl: ttl(ttl_ms)? }
        }
        LeaseStep::Renew => LeaseOp::Renew {
            token: needed("token", token)?,
            ttl: ttl(ttl_ms)?,
        },
        LeaseStep::Release => {
            no_field("ttl_ms", ttl_ms.is_some())?;
            LeaseOp::Release {
                token: needed("token", token)?,
            }
        }
    };
    let claimant = Claimant {
        holder,
        identity: request.identity.clone(),
    };
    let shown = resource.clone();
    let render = keyed::renderer(move |outcome| lease_answer(&resource, outcome));
    let keyed =
        idempotency.map(|key| keyed::keyed(coordinator, request, key, &body, Arc::clone(&render)));
    let answered = coordinator.lease(&shown, op, claimant, keyed).await?;
    let answered = match answered {
        Answered::Replayed(answer) => {
            Answered::Replayed(as_of_now(coordinator, &shown, answer).await?)
        }
        answered => answered,
    };
    keyed::answer(answered, &render)
}

/// A replayed lease answer, with the time it gives as of now: `expires_in_ms` is a
/// span from the answer's own moment, which a retry comes after. The term it granted
/// has what is left of the lease if the lease still has that token and holder, else
/// nothing (`held: false`, `expires_in_ms: 0`). A refusal is replayed as stored.
async fn as_of_now(
    coordinator: &Arc<Coordinator>,
    resource: &ResourceName,
    mut answer: StoredAnswer,
) -> Result<StoredAnswer, ApiError> {
    let Ok(mut granted) = serde_json::from_slice::<LeaseState>(&answer.body) else {
        return Ok(answer);
    };
    let now = coordinator.read_lease(resource).await?;
    let same_term = now.token == granted.token && now.holder == granted.holder;
    granted.expires_in_ms = if same_term { millis(now.remaining) } else { 0 };
    granted.held = same_term && now.held();
    answer.body = serde_json::to_vec(&granted)
        .expect("a lease state serializes")
        .into();
    Ok(answer)
}

/// The answer to a lease step's outcome: what is sent, and stored with a key.
fn lease_answer(resource: &ResourceName, outcome: &LeaseOutcome) -> Response<Body> {
    let refusal = |code: ErrorCode, message: String, lease: Option<&LeaseRecord>| {
        let mut body = ErrorBody::new(code, message);
        body.resource = Some(resource.clone());
        if let Some(lease) = lease {
            body.holder = lease.holder.clone();
            body.expires_in_ms = Some(millis(lease.remaining));
        }
        error_response(&ApiError::Refused(Box::new(body)))
    };
    match outcome {
        LeaseOutcome::Granted(lease) | LeaseOutcome::Released(lease) => {
            json_response(StatusCode::OK, &state(resource.clone(), lease))
        }
        LeaseOutcome::Held(lease) => refusal(
            ErrorCode::LeaseHeld,
            format!(
                "lease {resource} is held by {:?} for another {} ms",
                lease.holder.as_deref().unwrap_or_default(),
                millis(lease.remaining)
            ),
            Some(lease),
        ),
        LeaseOutcome::Lost(lease) => refusal(
            ErrorCode::LeaseLost,
            format!(
                "this holder does not hold lease {resource} at that token (it expired, or another holder took it): the term is over"
            ),
            Some(lease),
        ),
        LeaseOutcome::Exhausted => refusal(
            ErrorCode::TokensExhausted,
            format!(
                "the fence of {resource} is at the largest token, so no new term can start; an administrator must reset it"
            ),
            None,
        ),
    }
}

/// `POST /v1/fences/{resource}/reset` (action `admin`).
pub async fn reset(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    tracing::Span::current().record("resource", resource.as_str());
    if keyed::key_of(request)?.is_some() {
        return Err(ApiError::Proto(
            fencegate_proto::ProtoError::InvalidIdempotencyKey(
                "a fence reset does not take one: it lowers the fence only where it is above `to`, so repeating it refuses rather than applies twice",
            ),
        ));
    }
    // With --auth-file, the identity's admin grant was checked with every request's.
    if coordinator.authenticator().is_none() {
        let authorization = request
            .head
            .headers
            .get(http::header::AUTHORIZATION)
            .map(|value| value.as_bytes());
        match coordinator.admin_key() {
            Some(key) if key.admits(authorization) => {}
            Some(_) => return Err(ApiError::Unauthenticated),
            None => return Err(ApiError::NoAdminCredential),
        }
    }
    let _in_flight = coordinator.write_permit(request.client(coordinator))?;
    let FenceResetRequest { to, reason } = read_json(coordinator, request).await?;
    let reason = reason.trim().to_owned();
    if reason.is_empty()
        || reason.len() > MAX_REASON_LEN
        || reason
            .chars()
            .any(fencegate_proto::names::is_forbidden_char)
    {
        return Err(invalid(format!(
            "`reason` must say why, in 1 to {MAX_REASON_LEN} bytes without control or bidirectional formatting characters"
        )));
    }
    let identity = request.identity.clone();
    let done = coordinator
        .reset(&resource, to, reason, identity.as_deref())
        .await?;
    Ok(json_response(StatusCode::OK, &done))
}

async fn read_json<T: DeserializeOwned>(
    coordinator: &Coordinator,
    request: &mut Req,
) -> Result<T, ApiError> {
    let body = read_body(coordinator, request).await?;
    serde_json::from_slice(&body.bytes).map_err(|error| invalid(error.to_string()))
}

fn state(resource: ResourceName, lease: &LeaseRecord) -> LeaseState {
    LeaseState {
        resource,
        held: lease.held(),
        holder: lease.holder.clone(),
        identity: lease.identity.clone(),
        token: lease.token,
        expires_in_ms: millis(lease.remaining),
    }
}

fn check_holder(holder: &str) -> Result<(), ApiError> {
    if holder.is_empty()
        || holder.len() > MAX_HOLDER_LEN
        || !holder.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
    {
        return Err(invalid(format!(
            "`holder` must be 1 to {MAX_HOLDER_LEN} bytes of printable ASCII"
        )));
    }
    Ok(())
}

fn ttl(ttl_ms: Option<u64>) -> Result<Duration, ApiError> {
    let ttl = Duration::from_millis(needed("ttl_ms", ttl_ms)?);
    if !(MIN_TTL..=MAX_TTL).contains(&ttl) {
        return Err(invalid(format!(
            "`ttl_ms` must be between {} and {}",
            MIN_TTL.as_millis(),
            MAX_TTL.as_millis()
        )));
    }
    Ok(ttl)
}

fn needed<T>(field: &str, value: Option<T>) -> Result<T, ApiError> {
    value.ok_or_else(|| invalid(format!("this step needs `{field}`")))
}

fn no_field(field: &str, present: bool) -> Result<(), ApiError> {
    match present {
        true => Err(invalid(format!("this step takes no `{field}`"))),
        false => Ok(()),
    }
}

fn invalid(message: String) -> ApiError {
    ApiError::Refused(Box::new(ErrorBody::new(
        ErrorCode::InvalidBody,
        format!("invalid request body: {message}"),
    )))
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
