//! `POST /v1/sql/{resource}`: a writer's own SQL statements, run in the fenced
//! transaction of the resource.
//!
//! Refusals come as early as they can: a disabled endpoint or a token the fence cache
//! already knows to be stale before the body is read; a malformed body, too many
//! statements or a statement that is not allowed ([`crate::sqlguard`]) before anything
//! reaches the database. The rest is the backend's ([`crate::store::postgres`]'s
//! `sql_tx`).

use std::sync::Arc;

use fencegate_proto::body::{SqlAccepted, SqlRequest, SqlResult};
use fencegate_proto::headers::Fencing;
use fencegate_proto::ResourceName;
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::{fencing_of, json_response, read_body, Body};
use crate::app::App;
use crate::error::ApiError;
use crate::sqlguard;
use crate::store::postgres::{SqlFailure, SqlOutcome, SqlRefusal, SqlTransaction};
use crate::store::{Store, StoreError};

pub async fn post(
    app: &Arc<App>,
    resource: ResourceName,
    request: Request<Incoming>,
) -> Result<Response<Body>, ApiError> {
    let fencing = fencing_of(&request, &resource)?;
    if let Store::Embedded(_) = app.store {
        return Err(SqlRefusal::NotSupportedByBackend.into());
    }
    let policy = app.store.sql_policy().ok_or(ApiError::SqlDisabled)?;
    let (allow_ddl, max_statements) = (policy.allow_ddl, policy.max_statements);
    app.check_cached(&resource, None, &fencing)?;
    let body = read_body(request, app.max_body).await?;
    let SqlRequest { statements } = serde_json::from_slice(&body)
        .map_err(|error| ApiError::InvalidSqlRequest(error.to_string()))?;
    if statements.is_empty() {
        return Err(ApiError::InvalidSqlRequest(
            "`statements` must hold at least one statement".to_owned(),
        ));
    }
    if statements.len() > max_statements {
        return Err(ApiError::TooManyStatements {
            given: statements.len(),
            limit: max_statements,
        });
    }
    for (index, statement) in statements.iter().enumerate() {
        sqlguard::check(&statement.sql, allow_ddl).map_err(|refused| {
            ApiError::StatementNotAllowed {
                statement: index,
                reason: refused.0,
            }
        })?;
    }
    let token = fencing.token;
    let results = run(
        app,
        SqlTransaction {
            resource: resource.clone(),
            token,
            statements,
        },
        &fencing,
    )
    .await?;
    Ok(json_response(
        StatusCode::OK,
        &SqlAccepted {
            resource,
            token,
            results,
        },
    ))
}

/// Runs the transaction in its own task, so that a client that disconnects cannot
/// cancel it between commit and cache update (as [`App::write`] does).
async fn run(
    app: &Arc<App>,
    tx: SqlTransaction,
    fencing: &Fencing,
) -> Result<Vec<SqlResult>, ApiError> {
    let task_app = Arc::clone(app);
    let (tx, outcome) = tokio::spawn(async move {
        let outcome = task_app.store.sql(&tx).await;
        if let Ok(SqlOutcome::Committed(_)) = outcome {
            task_app.committed(&tx.resource, tx.token);
        }
        // Only the backend's own failures count against it; the writer's SQL errors
        // are answers from a healthy database.
        let outcome = match outcome {
            Err(SqlFailure::Store(error)) => {
                let failed: Result<SqlOutcome, StoreError> = Err(error);
                task_app.backend_result(&failed);
                failed.map_err(SqlFailure::Store)
            }
            other => {
                task_app.backend_result(&Ok::<(), StoreError>(()));
                other
            }
        };
        (tx, outcome)
    })
    .await
    .map_err(|error| StoreError::Internal(format!("sql task failed: {error}")))?;
    match outcome {
        Ok(SqlOutcome::Committed(results)) => Ok(results),
        Ok(SqlOutcome::Stale { highest }) => Err(app.stale(&tx.resource, None, fencing, highest)),
        Err(SqlFailure::Store(error)) => Err(ApiError::Store(error)),
        Err(SqlFailure::Refused(refusal)) => Err(ApiError::Sql(refusal)),
    }
}
