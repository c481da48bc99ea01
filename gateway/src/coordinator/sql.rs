//! Fenced SQL transactions (`/v1/sql`) through the coordinator, as [`super::txn`] does
//! for `/v1/txn`: the SQL service runs them ([`crate::sql`]); the coordinator decides a
//! keyed one's gate, raises the fence cache from what committed, keeps the backend's
//! readiness, counts what became of each key, and counts and logs what the fence
//! refused.

use std::sync::Arc;

use fencegate_proto::headers::Fencing;

use super::{Coordinator, FrontDoor, Gate};
use crate::dbfence::Reported;
use crate::error::ApiError;
use crate::sql::{SqlEndpoint, SqlError, SqlFailure, SqlOutcome, SqlService, SqlTransaction};
use crate::store::txn::{Answered, Keyed};

impl Coordinator {
    /// The SQL service of `/v1/sql`, or why this gateway has none.
    pub fn sql_service(&self) -> Result<Arc<SqlService>, ApiError> {
        match &self.sql {
            SqlEndpoint::Enabled(service) => Ok(Arc::clone(service)),
            SqlEndpoint::Disabled => Err(SqlError::Disabled.into()),
            SqlEndpoint::NotSupported => Err(SqlError::NotSupportedByBackend.into()),
        }
    }

    /// Runs `tx`, keyed or not, after its checks ([`Coordinator::admit`], the statement
    /// guard). A keyed transaction the fence cache knows stale runs only if no earlier
    /// attempt stored an answer ([`Coordinator::keyed_gate`]); else it is refused as
    /// the same transaction without a key.
    pub async fn sql(
        self: &Arc<Self>,
        tx: SqlTransaction,
        keyed: Option<Keyed<SqlOutcome>>,
        fencing: &Fencing,
        identity: Option<&str>,
    ) -> Result<Answered<SqlOutcome>, ApiError> {
        let service = self.sql_service()?;
        if let Some(keyed) = &keyed {
            let highest = self.cached_above(&tx.resource, tx.token);
            match (self.keyed_gate(keyed, highest.is_some()).await?, highest) {
                (Gate::Answered(answered), _) => return Ok(answered),
                (Gate::Stale, Some(highest)) => {
                    return Err(self.stale_by_cache(&tx.resource, fencing, identity, highest));
                }
                (Gate::Run | Gate::Stale, _) => {}
            }
        }
        let this = Arc::clone(self);
        let seen = self.seen();
        let answered = self
            .detached(async move {
                let answered = match &keyed {
                    Some(keyed) => service.run_keyed(&tx, keyed).await,
                    None => Answered::Ran {
                        outcome: service.run(&tx).await,
                        stored: None,
                    },
                };
                match &answered {
                    Answered::Ran { outcome: Ok(_), .. } => {
                        this.committed(&tx.resource, tx.token, seen);
                        this.backend_succeeded();
                    }
                    // Only the backend's own failures count against it; the writer's SQL
                    // errors and stale tokens are answers from a healthy database.
                    Answered::Ran {
                        outcome: Err(SqlFailure::Store(error)),
                        ..
                    } => this.backend_failed(error),
                    _ => this.backend_succeeded(),
                }
                // Counted here, not after: a client that left must not hide its key.
                if let Some(keyed) = &keyed {
                    this.keyed_ran(keyed, &answered);
                }
                answered
            })
            .await?;
        if let Answered::Ran {
            outcome: Err(failure),
            ..
        } = &answered
        {
            self.sql_refused(failure, fencing.holder.clone());
        }
        Ok(answered)
    }

    /// Counts and logs what the fence refused, or a fence error the writer's SQL raised.
    fn sql_refused(&self, failure: &SqlFailure, holder: Option<String>) {
        match failure {
            SqlFailure::Fence(refusal) => {
                self.db_refusal(&Reported::Proven(refusal.clone()), holder, FrontDoor::Http)
            }
            SqlFailure::Forged { code, .. } => {
                self.db_refusal(&Reported::Unproven { code }, holder, FrontDoor::Http)
            }
            SqlFailure::Store(_) | SqlFailure::Refused(_) => {}
        }
    }
}
