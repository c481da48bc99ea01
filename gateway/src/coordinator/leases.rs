//! Hosted leases through the coordinator: each step applied by the store, a new term's
//! token raised in the fence cache and remembered as the latest its issuer issued.

use std::sync::Arc;

use fencegate_proto::path::LeaseStep;
use fencegate_proto::ResourceName;

use super::issuers::IssuedToken;
use super::{Coordinator, Gate};
use crate::error::ApiError;
use crate::store::leases::{Claimant, LeaseOp, LeaseOutcome, LeaseRecord};
use crate::store::txn::{Answered, Keyed};

impl Coordinator {
    /// Applies one step of a hosted lease. A new term raises the fence cache to its
    /// token (the store raised the fence in the same transaction) and is remembered as
    /// the resource's latest issued token.
    pub async fn lease(
        self: &Arc<Self>,
        resource: &ResourceName,
        op: LeaseOp,
        claimant: Claimant,
        keyed: Option<Keyed<LeaseOutcome>>,
    ) -> Result<Answered<LeaseOutcome>, ApiError> {
        let step = match op {
            LeaseOp::Acquire { .. } => LeaseStep::Acquire,
            LeaseOp::Renew { .. } => LeaseStep::Renew,
            LeaseOp::Release { .. } => LeaseStep::Release,
        };
        if let Some(keyed) = &keyed {
            // Never stale: a step's token is the lease's.
            match self.keyed_gate(keyed, false).await? {
                Gate::Answered(answered) => return Ok(answered),
                Gate::Run | Gate::Stale => {}
            }
        }
        let (this, task_resource) = (Arc::clone(self), resource.clone());
        let seen = self.seen();
        let outcome = self
            .detached(async move {
                let outcome = this
                    .store
                    .lease(&task_resource, &op, &claimant, keyed.as_ref())
                    .await;
                this.backend_result(&outcome);
                if let (Some(keyed), Ok(answered)) = (&keyed, &outcome) {
                    this.keyed_ran(keyed, answered);
                }
                let ran = match &outcome {
                    Ok(Answered::Ran { outcome, .. }) => Some(outcome),
                    _ => None,
                };
                if let (Some(LeaseOutcome::Granted(lease)), LeaseOp::Acquire { .. }) = (ran, &op) {
                    if let Some(token) = lease.token {
                        this.committed(&task_resource, token, seen);
                        this.issuers.learn(
                            &task_resource,
                            IssuedToken {
                                token,
                                holder: lease.identity.as_deref().map(Arc::from),
                            },
                        );
                    }
                }
                outcome
            })
            .await??;
        if let Answered::Ran { outcome, .. } = &outcome {
            let label = match outcome {
                LeaseOutcome::Granted(_) => "granted",
                LeaseOutcome::Released(_) => "released",
                LeaseOutcome::Held(_) => "held",
                LeaseOutcome::Lost(_) => "lost",
                LeaseOutcome::Exhausted => "exhausted",
            };
            self.metrics.lease_step(step.as_str(), label);
        }
        Ok(outcome)
    }

    /// A hosted lease as it stands.
    pub async fn read_lease(
        self: &Arc<Self>,
        resource: &ResourceName,
    ) -> Result<LeaseRecord, ApiError> {
        let (this, resource) = (Arc::clone(self), resource.clone());
        let result = self
            .store_call(async move { this.store.read_lease(&resource).await })
            .await?;
        Ok(result?)
    }
}
