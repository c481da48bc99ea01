//! Fence resets: applied here, audited, and followed from the other replicas through
//! the reset log, which also paces the fence audit ([`super::audit`]) and the authority
//! followed ([`super::authority`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use fencegate_proto::body::{ErrorBody, FenceResetDone};
use fencegate_proto::{ErrorCode, ResourceName, Token};

use super::issuers::AskError;
use super::{Coordinator, RESET_POLL};
use crate::error::ApiError;
use crate::store::leases::{Reset, ResetOutcome, ResetRecord};
use crate::store::{StoreError, UnavailableReason};

/// The last fence reset this gateway has applied to its cache.
#[derive(Default)]
pub(super) struct ResetsFollowed {
    /// Its generation in the reset log.
    pub(super) generation: AtomicU64,
}

impl Coordinator {
    /// Lowers a fence that a token nobody issued raised, within its floors (see
    /// [`crate::store::leases`]); audited, and applied to this gateway's cache at once
    /// and to the other replicas' within [`RESET_POLL`].
    pub async fn reset(
        self: &Arc<Self>,
        resource: &ResourceName,
        to: Token,
        reason: String,
        identity: Option<&str>,
    ) -> Result<FenceResetDone, ApiError> {
        // The leader_lease table is outside the store: its latest epoch is a floor the
        // store cannot see for itself.
        let floor = match self.issuers.issuer_of(resource) {
            Some(issuer) if !issuer.in_store() => {
                let (this, task_resource) = (Arc::clone(self), resource.clone());
                let asked = self
                    .detached(
                        async move { this.issuers.ask(issuer, &this.store, &task_resource).await },
                    )
                    .await?;
                match asked {
                    Ok(issued) => issued.map(|issued| issued.token),
                    Err(AskError::Store(error)) => return Err(error.into()),
                    // Without the issuer's latest, the floor is unknown: no reset.
                    Err(AskError::Unreachable { .. }) => {
                        return Err(ApiError::Store(StoreError::Unavailable {
                            reason: UnavailableReason::Connect,
                            applied: Some(false),
                        }))
                    }
                }
            }
            _ => None,
        };
        let reset = Reset {
            resource: resource.clone(),
            to,
            floor,
            identity: identity.map(str::to_owned),
            reason,
        };
        let this = Arc::clone(self);
        let task_reset = reset.clone();
        let outcome = self
            .store_call(async move { this.store.reset(&task_reset).await })
            .await??;
        let refused = |message: String| {
            Err(ApiError::Refused(Box::new(reset_refused(
                resource, message,
            ))))
        };
        match outcome {
            ResetOutcome::Applied { from, generation } => {
                self.metrics.fence_reset();
                tracing::warn!(
                    resource = resource.as_str(),
                    from = from.get(),
                    to = to.get(),
                    generation,
                    identity,
                    reason = reset.reason.as_str(),
                    "fence reset"
                );
                self.forget_reset(&ResetRecord {
                    generation,
                    resource: resource.clone(),
                    to,
                });
                Ok(FenceResetDone {
                    resource: resource.clone(),
                    from,
                    to,
                    generation,
                })
            }
            ResetOutcome::NotLower { highest: None } => refused(format!(
                "resource {resource} has no fence to reset; nothing changed"
            )),
            ResetOutcome::NotLower {
                highest: Some(highest),
            } => refused(format!(
                "the fence of {resource} is at {highest}, not above {to}: a reset only lowers a fence; nothing changed"
            )),
            ResetOutcome::BelowFloor { floor } => refused(format!(
                "token {floor} of {resource} was issued or written with: the fence cannot go below it, or that term's older writes could land; nothing changed"
            )),
        }
    }

    /// Starts following the reset and takeover logs from their ends: what the cache
    /// holds is newer.
    pub(super) async fn start_following_resets(&self) {
        self.start_following_takeovers().await;
        match self.store.resets_since(0).await {
            Ok(resets) => {
                if let Some(last) = resets.last() {
                    self.resets
                        .generation
                        .store(last.generation, Ordering::Release);
                }
            }
            Err(error) => tracing::warn!(%error, "could not read the fence reset log"),
        }
    }

    /// Applies fence resets made through other replicas to this gateway's cache, every
    /// [`RESET_POLL`], and audits the cached fences when due ([`super::audit`]), until
    /// shutdown.
    pub(super) async fn follow_resets(self: Arc<Self>) {
        let mut last_audit = tokio::time::Instant::now();
        let mut tick = tokio::time::interval(RESET_POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            let since = self.resets.generation.load(Ordering::Acquire);
            match self.store.resets_since(since).await {
                Ok(resets) => {
                    for reset in &resets {
                        self.forget_reset(reset);
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "could not read the fence reset log");
                    continue;
                }
            }
            self.audit_if_due(&mut last_audit).await;
            self.follow_authority().await;
        }
    }

    fn forget_reset(&self, reset: &ResetRecord) {
        self.cache.forget(&reset.resource);
        // The reset may follow the retirement of a forged issuer record.
        self.issuers.forget(&reset.resource);
        let previous = self
            .resets
            .generation
            .fetch_max(reset.generation, Ordering::AcqRel);
        if previous < reset.generation {
            self.metrics
                .reset_followed(reset.generation, &reset.resource, reset.to);
            tracing::info!(
                resource = reset.resource.as_str(),
                to = reset.to.get(),
                generation = reset.generation,
                "fence reset applied to the cache"
            );
        }
    }
}

fn reset_refused(resource: &ResourceName, message: String) -> ErrorBody {
    let mut body = ErrorBody::new(ErrorCode::ResetRefused, message);
    body.resource = Some(resource.clone());
    body
}
