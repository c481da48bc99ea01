//! The third step of [`Coordinator::admit`]: a presented token checked against its
//! resource's issuer ([`super::issuers`]), asked only when the token is above the latest
//! one this gateway knows it issued; and an issuer that went back, found and reported.

use std::sync::Arc;

use fencegate_proto::body::ErrorBody;
use fencegate_proto::headers::Fencing;
use fencegate_proto::{ErrorCode, ResourceName, Token};

use super::issuers::{judge, AskError, Verdict};
use super::{Coordinator, FrontDoor};
use crate::config::IssuerKind;
use crate::dbfence::NotIssuedRejection;
use crate::error::ApiError;

/// How often the etcd cluster's revision is read (with `etcd:` bindings).
pub const ISSUER_WATCH: std::time::Duration = std::time::Duration::from_secs(1);

impl Coordinator {
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
                        if self.stale_log.take_line().is_some() {
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
                if self.stale_log.take_line().is_some() {
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
        if self.stale_log.take_line().is_some() {
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
        if self.stale_log.take_line().is_none() {
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
}
