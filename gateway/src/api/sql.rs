//! `POST /v1/sql/{resource}`: a writer's own SQL statements, run in the fenced
//! transaction of the resource ([`crate::sql`]).
//!
//! Refusals come as early as they can: a disabled endpoint or a token the fence cache
//! already knows to be stale before the body is read; a malformed body, too many
//! statements or a statement that is not allowed ([`crate::sql::guard`]) before anything
//! reaches the database.

use std::sync::Arc;

use fencegate_proto::body::{SqlAccepted, SqlRequest};
use fencegate_proto::ResourceName;
use http::{Response, StatusCode};

use crate::api::request::{fencing_of, read_body, Req};
use crate::api::response::json_response;
use crate::api::Body;
use crate::coordinator::{Coordinator, Door};
use crate::dbfence::{Refusal, Reported};
use crate::error::ApiError;
use crate::sql::{SqlEndpoint, SqlError, SqlFailure, SqlTransaction};

pub async fn post(
    coordinator: &Arc<Coordinator>,
    resource: ResourceName,
    request: &mut Req,
) -> Result<Response<Body>, ApiError> {
    let fencing = fencing_of(request, &resource)?;
    let service = match coordinator.sql() {
        SqlEndpoint::Enabled(service) => Arc::clone(service),
        SqlEndpoint::Disabled => return Err(SqlError::Disabled.into()),
        SqlEndpoint::NotSupported => return Err(SqlError::NotSupportedByBackend.into()),
    };
    let policy = service.policy();
    coordinator.check_cached(&resource, None, &fencing, request.identity.as_deref())?;
    let _in_flight = coordinator.write_permit(request.client(coordinator))?;
    coordinator
        .check_issued(&resource, &fencing, request.identity.as_deref())
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
    let token = fencing.token;
    let tx = SqlTransaction {
        resource: resource.clone(),
        token,
        statements,
    };
    let in_task = Arc::clone(coordinator);
    let seen = coordinator.seen();
    let outcome = coordinator
        .detached(async move {
            let outcome = service.run(&tx).await;
            if outcome.is_ok() {
                in_task.committed(&tx.resource, tx.token, seen);
            }
            // Only the backend's own failures count against it; the writer's SQL
            // errors and stale tokens are answers from a healthy database.
            match &outcome {
                Err(SqlFailure::Store(error)) => in_task.backend_failed(error),
                _ => in_task.backend_succeeded(),
            }
            outcome
        })
        .await?;
    match outcome {
        Ok(results) => {
            let answer = SqlAccepted {
                resource,
                token,
                results,
            };
            let (head, body) = json_response(StatusCode::OK, &answer).into_parts();
            let body = body.paced_committed(coordinator.responses(), &request.conn);
            Ok(Response::from_parts(head, body))
        }
        Err(SqlFailure::Fence(refusal)) => {
            let answer = match &refusal {
                Refusal::Stale(rejection) => ApiError::Stale {
                    resource: rejection.resource.clone(),
                    presented: rejection.presented,
                    highest: rejection.highest,
                },
                Refusal::NotIssued(rejection) => Coordinator::not_issued_answer(rejection),
            };
            coordinator.db_refusal(&Reported::Proven(refusal), fencing.holder, Door::Http);
            Err(answer)
        }
        Err(SqlFailure::Forged { code, failed }) => {
            coordinator.db_refusal(&Reported::Unproven { code }, fencing.holder, Door::Http);
            Err(failed.into())
        }
        Err(SqlFailure::Store(error)) => Err(ApiError::Store(error)),
        Err(SqlFailure::Refused(error)) => Err(error.into()),
    }
}
