//! `POST /v1/txn`: operations on several resources, applied all or none in one
//! transaction; see [`crate::store::txn`] for the order of its steps.

use std::sync::Arc;

use base64::Engine as _;
use bytes::Bytes;
use fencegate_proto::body::{
    ErrorBody, IfMatch, StaleResource, TxnAccepted, TxnOpKind, TxnOperation, TxnRequest, TxnResult,
};
use fencegate_proto::headers::{Fencing, Precondition, FENCING_HIGHEST};
use fencegate_proto::ErrorCode;
use http::{Response, StatusCode};

use crate::api::keyed;
use crate::api::request::{read_body_within, Req};
use crate::api::response::{json_response, number_value};
use crate::api::Body;
use crate::auth::{Action, Identity};
use crate::coordinator::{Coordinator, FrontDoor};
use crate::error::ApiError;
use crate::store::txn::{Txn, TxnOp, TxnOutcome};

/// Reads, checks and applies a transaction. Every check that needs no database comes
/// first: the body's form and limits, the caller's grants for every resource, the
/// issuers of every token; nothing is applied if one fails.
pub async fn post(
    coordinator: &Arc<Coordinator>,
    request: &mut Req,
    identity: Option<&Identity>,
) -> Result<Response<Body>, ApiError> {
    let key = keyed::key_of(request)?;
    let _in_flight = coordinator.write_permit(request.client(coordinator))?;
    let body = read_body_within(coordinator, request, coordinator.txn_max_bytes()).await?;
    let parsed: TxnRequest = serde_json::from_slice(&body.bytes)
        .map_err(|error| invalid(None, format!("the body is not a transaction: {error}")))?;
    if parsed.operations.is_empty() {
        return Err(invalid(
            None,
            "a transaction needs at least one operation".to_owned(),
        ));
    }
    if parsed.operations.len() > coordinator.txn_max_operations() {
        let mut refusal = ErrorBody::new(
            ErrorCode::TooManyOperations,
            format!(
                "the transaction has {} operations; this gateway takes at most {} (--txn-max-operations)",
                parsed.operations.len(),
                coordinator.txn_max_operations()
            ),
        );
        refusal.operation = Some(coordinator.txn_max_operations());
        return Err(ApiError::Refused(Box::new(refusal)));
    }
    if let Some(identity) = identity {
        for operation in &parsed.operations {
            let action = match operation {
                TxnOperation::Put { .. } | TxnOperation::Delete { .. } => Action::Write,
                TxnOperation::Advance { .. } => Action::Advance,
                TxnOperation::Check { .. } => Action::Read,
            };
            if !identity.may(action, Some(operation.resource())) {
                return Err(ApiError::Forbidden {
                    identity: identity.name.clone(),
                    action,
                    resource: Some(operation.resource().clone()),
                });
            }
        }
    }
    let ops = parsed
        .operations
        .into_iter()
        .enumerate()
        .map(|(at, operation)| op_of(at, operation))
        .collect::<Result<Vec<_>, _>>()?;
    let txn = Arc::new(Txn::new(ops).map_err(|error| invalid(Some(error.op), error.to_string()))?);
    let caller = request.identity.clone();
    for involved in txn.involved() {
        let fencing = Fencing {
            token: involved.token,
            holder: None,
        };
        coordinator
            .check_issued(&involved.resource, &fencing, caller.as_deref())
            .await?;
    }
    let shown = Arc::clone(&txn);
    let render = keyed::renderer(move |outcome| txn_answer(&shown, outcome));
    let keyed = key.map(|key| keyed::keyed(coordinator, request, key, &body.bytes, render.clone()));
    let answered = coordinator
        .txn(txn, keyed, None, caller.as_deref(), FrontDoor::Http)
        .await?;
    keyed::answer(answered, &render)
}

/// A `400 invalid_transaction`, naming the operation at fault if there is one.
fn invalid(op: Option<usize>, message: String) -> ApiError {
    let mut refusal = ErrorBody::new(ErrorCode::InvalidTransaction, message);
    refusal.operation = op;
    ApiError::Refused(Box::new(refusal))
}

fn precondition(if_match: Option<IfMatch>) -> Precondition {
    match if_match {
        None => Precondition::None,
        Some(IfMatch::Any(_)) => Precondition::MustExist,
        Some(IfMatch::Version(0)) => Precondition::MustNotExist,
        Some(IfMatch::Version(version)) => Precondition::Version(version),
    }
}

/// One operation of the body as the store takes it.
fn op_of(at: usize, operation: TxnOperation) -> Result<TxnOp, ApiError> {
    Ok(match operation {
        TxnOperation::Put {
            resource,
            key,
            token,
            value,
            value_base64,
            if_match,
        } => {
            let value = match (value, value_base64) {
                (Some(text), None) => Bytes::from(text),
                (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                    .decode(encoded)
                    .map(Bytes::from)
                    .map_err(|error| {
                        invalid(
                            Some(at),
                            format!("operation {at}: value_base64 is not base64: {error}"),
                        )
                    })?,
                _ => {
                    return Err(invalid(
                        Some(at),
                        format!(
                            "operation {at}: a put takes exactly one of value and value_base64"
                        ),
                    ))
                }
            };
            TxnOp::Put {
                resource,
                key,
                token,
                value,
                precondition: precondition(if_match),
            }
        }
        TxnOperation::Delete {
            resource,
            key,
            token,
            if_match,
        } => TxnOp::Delete {
            resource,
            key,
            token,
            precondition: precondition(if_match),
        },
        TxnOperation::Advance { resource, token } => TxnOp::Advance { resource, token },
        TxnOperation::Check {
            resource,
            token,
            key,
            version,
        } => {
            let object = match (key, version) {
                (None, None) => None,
                (Some(key), Some(version)) => {
                    Some((key, precondition(Some(IfMatch::Version(version)))))
                }
                _ => {
                    return Err(invalid(
                        Some(at),
                        format!("operation {at}: a check of an object takes both key and version"),
                    ))
                }
            };
            TxnOp::Check {
                resource,
                token,
                object,
            }
        }
    })
}

/// The answer to a transaction's outcome: what is sent, and stored with a key.
fn txn_answer(txn: &Txn, outcome: &TxnOutcome) -> Response<Body> {
    match outcome {
        TxnOutcome::Applied(done) => {
            let results = txn
                .ops()
                .iter()
                .zip(done)
                .map(|(op, done)| {
                    let (kind, key) = match op {
                        TxnOp::Put { key, .. } => (TxnOpKind::Put, Some(key.clone())),
                        TxnOp::Delete { key, .. } => (TxnOpKind::Delete, Some(key.clone())),
                        TxnOp::Advance { .. } => (TxnOpKind::Advance, None),
                        TxnOp::Check { object, .. } => (
                            TxnOpKind::Check,
                            object.as_ref().map(|(key, _)| key.clone()),
                        ),
                    };
                    TxnResult {
                        op: kind,
                        resource: op.resource().clone(),
                        token: op.token(),
                        key,
                        version: done.version,
                        created: done.created,
                    }
                })
                .collect();
            json_response(StatusCode::OK, &TxnAccepted { results })
        }
        TxnOutcome::Stale(members) => {
            let first = &members[0];
            let mut message = String::from("stale fencing tokens, nothing was applied: ");
            for (at, member) in members.iter().enumerate() {
                if at > 0 {
                    message.push_str("; ");
                }
                message.push_str(&crate::error::stale_message(
                    &member.resource,
                    member.presented,
                    member.highest,
                ));
            }
            let mut body = ErrorBody::new(ErrorCode::StaleToken, message);
            body.resource = Some(first.resource.clone());
            body.presented = Some(first.presented);
            body.highest = Some(first.highest);
            body.stale = members
                .iter()
                .map(|member| StaleResource {
                    resource: member.resource.clone(),
                    presented: member.presented,
                    highest: member.highest,
                })
                .collect();
            let mut response = json_response(StatusCode::CONFLICT, &body);
            response
                .headers_mut()
                .insert(FENCING_HIGHEST, number_value(first.highest.get()));
            response
        }
        TxnOutcome::PreconditionFailed { op, current } => {
            let error = ApiError::VersionMismatch { current: *current };
            let mut body = error.body();
            body.message = format!("operation {op}: {}; nothing was applied", body.message);
            body.operation = Some(*op);
            json_response(StatusCode::PRECONDITION_FAILED, &body)
        }
    }
}
