//! Fences behind what this gateway saw committed: a database that lost committed
//! transactions, as after a failover to an asynchronous standby.
//!
//! The fence cache holds, per resource, a token this gateway saw committed. A database
//! whose fence is below it has lost that commit; on it, the writes of older terms
//! would be accepted again — by every replica that did not see the token, and by this
//! one after a restart. So the gateway compares its cache with the database when its
//! connections reach a server it has not audited before (a failover, a restore, a
//! restart) — before any of those connections is used for anything else, see
//! [`crate::store::postgres::ServerWatch`] — after any connection failure, and every
//! [`AUDIT_INTERVAL`], and raises every fence that is behind back to the token it saw:
//! older terms stay out.
//! Each one is counted (`fencegate_fence_regressions_total`) and logged as an error,
//! since acknowledged writes of that resource may be lost with the commit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::time::Instant;

use futures_util::future::BoxFuture;

use super::Coordinator;
use crate::store::postgres::ServerAuditor;
use crate::store::StoreError;

/// Whether the fences are due for an audit before [`AUDIT_INTERVAL`] is up.
#[derive(Default)]
pub(super) struct AuditDue {
    /// The database connection failed since the last audit.
    suspect: AtomicBool,
}

/// How often the cache is compared with the database when nothing failed.
pub const AUDIT_INTERVAL: Duration = Duration::from_secs(60);

/// Resources per statement of an audit.
const AUDIT_BATCH: usize = 10_000;

impl Coordinator {
    /// From now on, no connection to a database server this gateway has not audited is
    /// used before the audit of its fences (Postgres).
    pub(super) fn audit_new_servers(this: &Arc<Coordinator>) {
        if let crate::store::Store::Postgres(store) = &this.store {
            let auditor: Weak<dyn ServerAuditor> = Arc::downgrade(this) as Weak<dyn ServerAuditor>;
            store.watch().set_auditor(auditor);
        }
    }

    /// Marks the fences for an audit: the database connection failed, and what answers
    /// next may be another server.
    pub(super) fn suspect_fences(&self) {
        self.audit.suspect.store(true, Ordering::Release);
    }

    /// Runs an audit if one is due (after a failure, or every [`AUDIT_INTERVAL`]);
    /// `last` is when the last one succeeded.
    pub(super) async fn audit_if_due(&self, last: &mut Instant) {
        if self.store.server_changed() {
            self.suspect_fences();
        }
        let suspect = self.audit.suspect.load(Ordering::Acquire);
        if !suspect && last.elapsed() < AUDIT_INTERVAL {
            return;
        }
        // Cleared first: a failure during the audit marks it again.
        self.audit.suspect.store(false, Ordering::Release);
        match self.audit_fences_on(None).await {
            Ok(()) => *last = Instant::now(),
            Err(error) => {
                self.suspect_fences();
                tracing::debug!(%error, "fence audit deferred: the database is unavailable");
            }
        }
    }

    /// Compares every cached fence with the database — on `client`'s server, or
    /// through the store's connections — and restores those behind.
    async fn audit_fences_on(
        &self,
        client: Option<&tokio_postgres::Client>,
    ) -> Result<(), StoreError> {
        // Taken before the snapshot: a reset learned later is excluded by the store.
        let followed = self.resets.generation.load(Ordering::Acquire);
        for batch in self.cache.snapshot(AUDIT_BATCH) {
            let regressions = match client {
                Some(client) => {
                    crate::store::postgres::restore_fences_on(client, &batch, followed).await?
                }
                None => self.store.restore_fences(&batch, followed).await?,
            };
            for regression in regressions {
                self.metrics.fence_regressed();
                tracing::error!(
                    resource = regression.resource.as_str(),
                    seen = regression.seen.get(),
                    found = regression.found.map(|token| token.get()),
                    "fence behind a token this gateway saw committed: the database lost \
                     committed transactions (failover to an asynchronous standby?); \
                     acknowledged writes of this resource may be lost. The fence is \
                     restored, so older terms stay out"
                );
            }
        }
        Ok(())
    }
}

impl ServerAuditor for Coordinator {
    fn audit<'a>(
        &'a self,
        client: Option<&'a tokio_postgres::Client>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(self.audit_fences_on(client))
    }
}
