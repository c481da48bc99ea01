//! `POST /v1/sql/{resource}`: a writer's own SQL statements, run in the fenced
//! transaction of the resource ([`crate::sql`]).
//!
//! Refusals come as early as they can: a disabled endpoint or a token the fence cache
//! already knows to be stale before the body is read; a malformed body, too many
//! statements, a statement that is not allowed ([`crate::sql::guard`]) or no room for
//! the answer under `--max-response-memory` ([`crate::api::body`]) before anything
//! reaches the database.

use std::sync::Arc;

use fencegate_proto::body::{SqlAccepted, SqlRequest, SqlResult};
use fencegate_proto::{ResourceName, Token};
use http::{Response, StatusCode};

use crate::api::keyed;
use crate::api::request::{fencing_of, read_body, Idempotency, Req};
use crate::api::response::{error_response, json_response};
use crate::api::Body;
use crate::coordinator::Coordinator;
use crate::dbfence::FenceRejection;
use crate::error::ApiError;
use crate::sql::{SqlError, SqlFailure, SqlOutcome, SqlTransaction};
use crate::store::txn::Answered;

pub async fn post(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let fencing = fencing_of(request, &resource)?;
    let idempotency = keyed::key_of(request)?;
    let service = coordinator.sql_service()?;
    let policy = service.policy();
    // A keyed transaction is decided by the database alone; see `keyed`.
    let _in_flight = request
        .admit_write(
            coordinator,
            &resource,
            None,
            &fencing,
            Idempotency::of(&idempotency),
        )
        .await?;
    let body = read_body(coordinator, request).await?;
    let SqlRequest { statements } = serde_json::from_slice(&body.bytes)
        .map_err(|error| SqlError::InvalidRequest(error.to_string()))?;
    if statements.is_empty() {
        return Err(SqlError::InvalidRequest(
            "`statements` must hold at least one statement".to_owned(),
        )
        .into());
    }
    if statements.len() > policy.max_statements {
        return Err(SqlError::TooManyStatements {
            given: statements.len(),
            limit: policy.max_statements,
        }
        .into());
    }
    let (statements, verdict) = service.check(statements).await;
    verdict?;
    // Room for the answer, at its bound, before the transaction runs: an answer is
    // never refused once its transaction committed.
    let reserved = request
        .responses
        .reserve(policy.max_response, &request.conn)?;
    let token = fencing.token;
    let tx = SqlTransaction {
        resource: resource.clone(),
        token,
        statements,
    };
    let shown = resource.clone();
    let render = keyed::renderer(move |outcome: &SqlOutcome| match outcome {
        Ok(results) => accepted(shown.clone(), token, results.clone()),
        Err(failure) => error_response(&failed(failure)),
    });
    let keyed = idempotency
        .map(|key| keyed::keyed(coordinator, request, key, &body.bytes, Arc::clone(&render)));
    let identity = request.identity.as_deref();
    let answered = coordinator.sql(tx, keyed, &fencing, identity).await?;
    match answered {
        Answered::Ran {
            outcome: Ok(results),
            stored: None,
        } => {
            let (head, body) = accepted(resource, token, results).into_parts();
            Ok(Response::from_parts(head, body.in_reserved(reserved)))
        }
        Answered::Ran {
            outcome: Err(failure),
            stored,
        } => match stored {
            None => Err(failed(&failure)),
            stored => keyed::answer(
                Answered::Ran {
                    outcome: Err(failure),
                    stored,
                },
                &render,
            ),
        },
        answered => {
            let response = keyed::answer(answered, &render)?;
            let (head, body) = response.into_parts();
            Ok(Response::from_parts(head, body.in_reserved(reserved)))
        }
    }
}

/// The answer to a committed transaction.
fn accepted(resource: ResourceName, token: Token, results: Vec<SqlResult>) -> Response<Body> {
    let answer = SqlAccepted {
        resource,
        token,
        results,
    };
    json_response(StatusCode::OK, &answer)
}

/// The error a failed transaction is answered with.
fn failed(failure: &SqlFailure) -> ApiError {
    match failure {
        SqlFailure::Fence(FenceRejection::Stale(rejection)) => ApiError::Stale {
            resource: rejection.resource.clone(),
            presented: rejection.presented,
            highest: rejection.highest,
        },
        SqlFailure::Fence(FenceRejection::NotIssued(rejection)) => {
            Coordinator::not_issued_answer(rejection)
        }
        SqlFailure::Forged { failed, .. } => failed.clone().into(),
        SqlFailure::Store(error) => ApiError::Store(error.clone()),
        SqlFailure::Refused(error) => error.clone().into(),
    }
}
