//! The coordinator's trust steps: hosted leases, the issuer check of a presented token,
//! and fence resets (applied here, and followed from other replicas).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use fencegate_proto::body::{ErrorBody, FenceResetDone};
use fencegate_proto::headers::Fencing;
use fencegate_proto::path::LeaseStep;
use fencegate_proto::{ErrorCode, ResourceName, Token};

use super::{Coordinator, FrontDoor, Gate, RESET_POLL};

/// How often the etcd cluster's revision is read (with `etcd:` bindings).
pub const ISSUER_WATCH: std::time::Duration = std::time::Duration::from_secs(1);
use super::issuers::{judge, AskError, Issued, Verdict};
use crate::config::IssuerKind;
use crate::dbfence::NotIssuedRejection;
use crate::error::ApiError;
use crate::store::leases::{
    Claimant, LeaseOp, LeaseOutcome, LeaseRecord, Reset, ResetOutcome, ResetRecord,
};
use crate::store::txn::{Answered, Keyed};
use crate::store::{StoreError, UnavailableReason};

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
                            Issued {
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

    /// Refuses a token that `resource`'s issuer did not issue, or issued to another
    /// identity than `identity` ([`crate::coordinator::issuers`]). Asks the issuer only when the
    /// token is above the latest one this gateway knows it issued.
    pub async fn check_issued(
        self: &Arc<Self>,
        resource: &ResourceName,
        fencing: &Fencing,
        identity: Option<&str>,
    ) -> Result<(), ApiError> {
        let Some(issuer) = self.issuers.issuer_of(resource) else {
            return Ok(());
        };
        let known = self.issuers.known(resource);
        let issued = match &known {
            Some(known) if fencing.token <= known.token => Some(known.clone()),
            _ => {
                let (this, task_resource) = (Arc::clone(self), resource.clone());
                let asked = self
                    .detached(async move {
                        let asked = this.issuers.ask(issuer, &this.store, &task_resource).await;
                        match &asked {
                            Err(AskError::Store(error)) => this.backend_failed(error),
                            Ok(_) if issuer.in_store() => this.backend_succeeded(),
                            _ => {}
                        }
                        asked
                    })
                    .await?;
                match asked {
                    Ok(issued) => {
                        if let (Some(known), Some(now)) = (&known, &issued) {
                            if now.token < known.token {
                                self.issuer_went_back(issuer, resource, known.token, now.token);
                            }
                        }
                        issued
                    }
                    Err(AskError::Store(error)) => return Err(error.into()),
                    Err(AskError::Unreachable { issuer, detail }) => {
                        self.metrics.token_refused("issuer_unavailable");
                        if self.stale_log.admit().is_some() {
                            tracing::warn!(
                                resource = resource.as_str(),
                                presented = fencing.token.get(),
                                issuer = issuer.as_str(),
                                error = detail,
                                outcome = "issuer_unavailable",
                                "token refused: its issuer cannot be asked"
                            );
                        }
                        return Err(ApiError::IssuerUnavailable {
                            issuer: issuer.as_str(),
                            resource: resource.clone(),
                            presented: fencing.token,
                        });
                    }
                }
            }
        };
        let verdict = judge(fencing.token, identity, issued.as_ref());
        let (reason, mut body) = match &verdict {
            Verdict::Issued => return Ok(()),
            Verdict::Earlier { current } => {
                // The fence cache learns nothing: the issuer's term is not committed.
                self.metrics.token_refused("earlier_term");
                if self.stale_log.admit().is_some() {
                    tracing::warn!(
                        resource = resource.as_str(),
                        presented = fencing.token.get(),
                        current = current.get(),
                        issuer = issuer.as_str(),
                        identity,
                        holder = fencing.holder.as_deref(),
                        outcome = "stale_token",
                        "token refused: its issuer has a later term"
                    );
                }
                return Err(ApiError::Stale {
                    resource: resource.clone(),
                    presented: fencing.token,
                    highest: *current,
                });
            }
            Verdict::NotIssued { issued } => {
                let message = match issued {
                    Some(issued) => format!(
                        "token {} was not issued for resource {resource}: its issuer ({}) has issued up to {issued}; nothing was applied",
                        fencing.token,
                        issuer.as_str()
                    ),
                    None => format!(
                        "token {} was not issued for resource {resource}: its issuer ({}) has issued none; nothing was applied",
                        fencing.token,
                        issuer.as_str()
                    ),
                };
                let mut body = ErrorBody::new(ErrorCode::TokenNotIssued, message);
                body.issued = *issued;
                ("not_issued", body)
            }
            Verdict::HolderMismatch { .. } => (
                "holder_mismatch",
                ErrorBody::new(
                    ErrorCode::TokenHolderMismatch,
                    format!(
                        "token {} of resource {resource} was issued to another holder than identity {:?}; nothing was applied",
                        fencing.token,
                        identity.unwrap_or_default()
                    ),
                ),
            ),
        };
        self.metrics.token_refused(reason);
        if self.stale_log.admit().is_some() {
            let holder = match &verdict {
                Verdict::HolderMismatch { holder } => Some(&**holder),
                _ => None,
            };
            tracing::warn!(
                resource = resource.as_str(),
                presented = fencing.token.get(),
                issued = issued.as_ref().map(|issued| issued.token.get()),
                issuer = issuer.as_str(),
                identity,
                issued_to = holder,
                outcome = reason,
                "token refused by its issuer"
            );
        }
        body.resource = Some(resource.clone());
        body.presented = Some(fencing.token);
        Err(ApiError::Refused(Box::new(body)))
    }

    /// Reads etcd's revision every [`ISSUER_WATCH`] while resources are bound to etcd,
    /// until shutdown: a revision below one etcd answered before is a cluster restored
    /// from an older snapshot, found before any new leader's write is refused.
    pub(super) async fn watch_issuers(self: Arc<Self>) {
        let mut tick = tokio::time::interval(ISSUER_WATCH);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            match self.issuers.etcd_revision().await {
                None => return,
                Some(Ok((now, before))) if now < before => {
                    self.metrics.issuer_regressed(IssuerKind::Etcd.as_str());
                    tracing::error!(
                        revision = now,
                        before,
                        "etcd's revision went back: the cluster was restored from an older \
                         snapshot without --bump-revision, and hands out election tokens it \
                         handed out before. New leaders' writes are refused as stale. Restore \
                         again with `etcdutl snapshot restore --bump-revision N \
                         --mark-compacted`, N above the writes since the snapshot; or reset \
                         the fences of etcd-bound resources once no older holder can write"
                    );
                }
                Some(_) => {}
            }
        }
    }

    /// Counts and logs an issuer whose current term's token is below one it issued
    /// before: the source went back (an etcd cluster restored from a snapshot without
    /// `--bump-revision`, a ZooKeeper ensemble restored or rebuilt). Its new terms'
    /// writes are refused as stale until the fence is reset.
    pub(crate) fn issuer_went_back(
        &self,
        issuer: IssuerKind,
        resource: &ResourceName,
        known: Token,
        now: Token,
    ) {
        self.metrics.issuer_regressed(issuer.as_str());
        tracing::error!(
            resource = resource.as_str(),
            issuer = issuer.as_str(),
            known = known.get(),
            current = now.get(),
            "the issuer's current term has a lower token than one it issued before: it went back \
             (restored from an older snapshot?). Its new leaders' writes are refused as stale. \
             Restore etcd with `etcdutl snapshot restore --bump-revision N --mark-compacted`, N \
             above the writes since the snapshot; or reset the fence to the current term's token \
             (POST /v1/fences/{resource}/reset) once no older holder can write"
        );
    }

    /// Counts and logs a token the in-database fence refused, with its proof, as not
    /// issued (SQLSTATE ZF005), relayed to `/v1/sql` or a client of the Postgres door.
    pub(super) fn not_issued_in_database(&self, rejection: &NotIssuedRejection, door: FrontDoor) {
        self.metrics.token_refused("not_issued");
        if self.stale_log.admit().is_none() {
            return;
        }
        tracing::warn!(
            resource = rejection.resource.as_str(),
            presented = rejection.presented.get(),
            issued = rejection.issued.map(Token::get),
            issuer = IssuerKind::Gateway.as_str(),
            door = door.as_str(),
            outcome = "not_issued",
            "token refused by its issuer"
        );
    }

    /// The answer to a token the in-database fence refused as not issued.
    pub fn not_issued_answer(rejection: &NotIssuedRejection) -> ApiError {
        let message = format!(
            "token {} was not issued for resource {}: its lease has issued up to {}; nothing was applied",
            rejection.presented,
            rejection.resource,
            rejection.issued.map_or(0, Token::get)
        );
        let mut body = ErrorBody::new(ErrorCode::TokenNotIssued, message);
        body.issued = rejection.issued;
        body.resource = Some(rejection.resource.clone());
        body.presented = Some(rejection.presented);
        ApiError::Refused(Box::new(body))
    }

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
                    self.resets_followed
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
            let since = self.resets_followed.load(Ordering::Acquire);
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
            .resets_followed
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
