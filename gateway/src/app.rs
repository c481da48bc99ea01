//! Shared state of a running gateway, and the steps every fenced write goes through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ObjectKey, ResourceName, Token};

use crate::config::Config;
use crate::error::ApiError;
use crate::fence_cache::FenceCache;
use crate::metrics::Metrics;
use crate::sql::SqlEndpoint;
use crate::store::{AdvanceOutcome, Store, StoreError, Write, WriteOutcome};

/// Everything a request handler needs.
pub struct App {
    pub store: Store,
    /// Fenced SQL transactions (`/v1/sql`), if this gateway runs them.
    pub sql: SqlEndpoint,
    /// Highest committed token per resource; see its module for the invariant.
    pub cache: FenceCache,
    pub metrics: Metrics,
    pub max_body: usize,
    stale_log: LogBudget,
}

/// A budget of "stale write rejected" lines per wall-clock second (`--stale-log-limit`).
///
/// By default every rejection is logged. Under a stale flood — a writer that goes on
/// writing after losing its lease — writing the line costs more than the rejection
/// itself, so operators may cap it: metrics still count every rejection, and the next
/// line logged says how many were left out (`unlogged`).
struct LogBudget {
    /// Lines per second; 0 for no limit.
    limit: u64,
    started: Instant,
    /// `second << 32 | lines logged in that second`, seconds counted from `started`.
    window: AtomicU64,
    /// Lines refused since the last one admitted.
    refused: AtomicU64,
}

impl LogBudget {
    fn new(limit: u64) -> LogBudget {
        LogBudget {
            limit,
            started: Instant::now(),
            window: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// `Some(refused)` if a line may be logged now, with the number of lines refused
    /// since the previous one; `None` if this second's budget is spent.
    fn admit(&self) -> Option<u64> {
        if self.limit == 0 {
            return Some(0);
        }
        let second = self.started.elapsed().as_secs() & u64::from(u32::MAX);
        let mut current = self.window.load(Ordering::Relaxed);
        loop {
            let next = if current >> 32 != second {
                second << 32 | 1
            } else if current & u64::from(u32::MAX) < self.limit {
                current + 1
            } else {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            match self.window.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.refused.swap(0, Ordering::Relaxed)),
                Err(actual) => current = actual,
            }
        }
    }
}

impl App {
    pub fn new(config: &Config, store: Store, sql: SqlEndpoint, metrics: Metrics) -> App {
        App {
            store,
            sql,
            cache: FenceCache::new(config.cache_size),
            metrics,
            max_body: config.max_body,
            stale_log: LogBudget::new(config.stale_log_limit),
        }
    }

    /// The fast path: rejects `fencing` from memory if the cache already knows a higher
    /// committed token. `Ok` means only "not known to be stale": the backend decides.
    pub fn check_cached(
        &self,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
    ) -> Result<(), ApiError> {
        match self.cache.highest(resource) {
            Some(highest) if fencing.token < highest => {
                Err(self.stale(resource, key, fencing, highest))
            }
            _ => Ok(()),
        }
    }

    /// Runs a backend call in its own task, so that a client that disconnects cannot
    /// cancel it between commit and cache update: whatever the backend commits is
    /// recorded by `call` itself, whether or not anyone still waits for the answer.
    pub async fn detached<T: Send + 'static>(
        &self,
        call: impl std::future::Future<Output = T> + Send + 'static,
    ) -> Result<T, ApiError> {
        tokio::spawn(call)
            .await
            .map_err(|error| StoreError::Internal(format!("backend task failed: {error}")).into())
    }

    /// Applies a fenced write; see [`App::detached`].
    pub async fn write(
        self: &Arc<Self>,
        write: Write,
        fencing: &Fencing,
    ) -> Result<WriteOutcome, ApiError> {
        let app = Arc::clone(self);
        let (write, outcome) = self
            .detached(async move {
                let outcome = app.store.write(&write).await;
                if let Ok(WriteOutcome::Applied { .. }) = outcome {
                    app.committed(&write.resource, write.token);
                }
                app.backend_result(&outcome);
                (write, outcome)
            })
            .await?;
        match outcome? {
            WriteOutcome::Stale { highest } => {
                Err(self.stale(&write.resource, Some(&write.key), fencing, highest))
            }
            WriteOutcome::PreconditionFailed { current } => {
                Err(ApiError::VersionMismatch { current })
            }
            applied => Ok(applied),
        }
    }

    /// Raises a resource's fence without writing an object; see [`App::write`].
    pub async fn advance(
        self: &Arc<Self>,
        resource: &ResourceName,
        fencing: &Fencing,
    ) -> Result<(), ApiError> {
        let app = Arc::clone(self);
        let (task_resource, token) = (resource.clone(), fencing.token);
        let outcome = self
            .detached(async move {
                let outcome = app.store.advance(&task_resource, token).await;
                if let Ok(AdvanceOutcome::Applied) = outcome {
                    app.committed(&task_resource, token);
                }
                app.backend_result(&outcome);
                outcome
            })
            .await?;
        match outcome? {
            AdvanceOutcome::Applied => Ok(()),
            AdvanceOutcome::Stale { highest } => Err(self.stale(resource, None, fencing, highest)),
        }
    }

    /// Records that `token` is committed for `resource`.
    pub fn committed(&self, resource: &ResourceName, token: Token) {
        if self.cache.raise(resource, token).changed {
            self.metrics.highest_raised(resource, token);
        }
    }

    /// Counts and logs a stale rejection (within the `--stale-log-limit` budget), and
    /// returns the error to answer with. `highest` must be a committed token above the
    /// presented one.
    pub fn stale(
        &self,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
        highest: Token,
    ) -> ApiError {
        let rejections = self.cache.count_rejection(resource, highest);
        self.metrics
            .stale_rejected(resource, fencing.token, highest);
        if let Some(unlogged) = self.stale_log.admit() {
            tracing::warn!(
                resource = resource.as_str(),
                key = key.map(ObjectKey::as_str),
                presented = fencing.token.get(),
                highest = highest.get(),
                holder = fencing.holder.as_deref(),
                outcome = "stale_token",
                rejections,
                // Only present when the cap left lines out.
                unlogged = (unlogged > 0).then_some(unlogged),
                "stale write rejected"
            );
        }
        ApiError::Stale {
            resource: resource.clone(),
            presented: fencing.token,
            highest,
        }
    }

    /// Keeps `fencegate_backend_errors_total` and `fencegate_backend_ready` current.
    pub fn backend_result<T>(&self, result: &Result<T, StoreError>) {
        match result {
            Ok(_) => self.backend_succeeded(),
            Err(error) => self.backend_failed(error),
        }
    }

    pub fn backend_succeeded(&self) {
        self.metrics.backend_ready.set(1);
    }

    pub fn backend_failed(&self, error: &StoreError) {
        self.metrics
            .backend_errors
            .with_label_values(&[error.kind()])
            .inc();
        if let StoreError::Unavailable { .. } = error {
            self.metrics.backend_ready.set(0);
        } else {
            tracing::error!(%error, "backend error");
        }
    }
}
