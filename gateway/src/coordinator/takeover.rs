//! Authority that outlives a term, bounded: the sessions of older terms that hold a
//! fence a new term raises, and the issuer bindings every replica follows.
//!
//! # Behavior
//!
//! - A backend call that may raise a fence (an advance, a write whose token is above
//!   the highest this gateway knows, a lease acquire) and has not completed after
//!   `--term-takeover-timeout` ends, on Postgres, the sessions that hold the fence for an
//!   older term (`fencegate.end_older_terms()`): open transactions through the Postgres
//!   door, `/v1/sql`, or writers' own connections. Their transactions roll back; the
//!   raise then completes. The in-database fence does the same for raises through
//!   `fencegate.fence()` and fenced tables.
//! - Every second the gateway reads the sessions ended since it last looked (by any
//!   replica or by the in-database fence), counts them
//!   (`fencegate_term_takeovers_total`) and logs each; and compares the issuer bindings
//!   in the database with its own flags ([`crate::store::postgres::bindings`]).

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use fencegate_proto::{ResourceName, Token};

use super::Coordinator;
use crate::store::postgres::bindings::{describe, Drift};
use crate::store::Store;

impl Coordinator {
    /// Runs `call`, which may raise `resource`'s fence to `token`; see the module doc.
    pub(super) async fn taking_over<T>(
        self: &Arc<Self>,
        resource: &ResourceName,
        token: Token,
        call: impl Future<Output = T>,
    ) -> T {
        if !matches!(self.store, Store::Postgres(_)) || self.term_takeover.is_zero() {
            return call.await;
        }
        let call = std::pin::pin!(call);
        let mut call = call;
        tokio::select! {
            biased;
            done = &mut call => return done,
            () = tokio::time::sleep(self.term_takeover) => {}
        }
        let (this, resource) = (Arc::clone(self), resource.clone());
        tokio::spawn(async move {
            let Store::Postgres(pg) = &this.store else {
                return;
            };
            match pg.end_older_terms(&resource, token).await {
                Ok(0) => {}
                Ok(ended) => tracing::warn!(
                    resource = resource.as_str(),
                    token = token.get(),
                    ended,
                    "ended sessions of an older term that held the fence a new term raises"
                ),
                Err(error) => tracing::warn!(
                    resource = resource.as_str(),
                    %error,
                    "could not end the sessions of an older term"
                ),
            }
        });
        call.await
    }

    /// Whether a write of `token` may raise `resource`'s fence: its token is above the
    /// highest this gateway knows committed, or it knows none.
    pub(super) fn may_raise(&self, resource: &ResourceName, token: Token) -> bool {
        self.cache
            .highest(resource)
            .is_none_or(|highest| token > highest)
    }

    /// Starts following the takeover log from its end.
    pub(super) async fn start_following_takeovers(&self) {
        if let Store::Postgres(pg) = &self.store {
            match pg.last_takeover().await {
                Ok(last) => self.takeovers_followed.store(last, Ordering::Release),
                Err(error) => tracing::warn!(%error, "could not read the takeover log"),
            }
        }
    }

    /// Counts and logs the older-term sessions ended since the last look, and compares
    /// the issuer bindings with this gateway's flags.
    pub(super) async fn follow_authority(&self) {
        let Store::Postgres(pg) = &self.store else {
            return;
        };
        let after = self.takeovers_followed.load(Ordering::Acquire);
        match pg.takeovers_since(after).await {
            Ok(ended) => {
                for takeover in &ended {
                    tracing::warn!(
                        resource = takeover.resource.as_str(),
                        token = takeover.token,
                        pid = takeover.pid,
                        role = takeover.role.as_str(),
                        ended_by = takeover.ended_by.as_str(),
                        "a new term ended a session of an older term that held its fence"
                    );
                }
                if let Some(last) = ended.last() {
                    self.takeovers_followed.store(last.id, Ordering::Release);
                    self.metrics.terms_taken_over(ended.len() as u64);
                }
            }
            Err(error) => tracing::debug!(%error, "could not read the takeover log"),
        }
        let Some(generation) = self.bindings_generation else {
            return;
        };
        match pg
            .follow_bindings(self.issuers.bindings(), generation)
            .await
        {
            Ok(Drift::None) => self.metrics.issuer_bindings_drift(false),
            Ok(Drift::Restored { found }) => {
                self.metrics.issuer_bindings_restored();
                self.metrics.issuer_bindings_drift(false);
                tracing::error!(
                    found = describe(&found),
                    generation,
                    "the issuer bindings in the database were changed without --replace-issuer-bindings; this gateway restored its own"
                );
            }
            Ok(Drift::Replaced { generation: newer }) => {
                self.metrics.issuer_bindings_drift(true);
                if !self.bindings_replaced.swap(true, Ordering::AcqRel) {
                    tracing::error!(
                        generation,
                        newer,
                        "another gateway replaced the issuer bindings (--replace-issuer-bindings): this replica's --issued-by flags differ from what the in-database fence and the other replicas follow; restart it with the new flags"
                    );
                }
            }
            Err(error) => tracing::debug!(%error, "could not read the issuer bindings"),
        }
    }
}
