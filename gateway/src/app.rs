//! Shared state of a running gateway, and the steps every fenced write goes through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_proto::headers::Fencing;
use fencegate_proto::{ObjectKey, ResourceName, Token};

use crate::config::Config;
use crate::error::ApiError;
use crate::fence_cache::FenceCache;
use crate::metrics::Metrics;
use crate::sql::SqlEndpoint;
use crate::store::{AdvanceOutcome, Store, StoreError, Write, WriteOutcome};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

/// Everything a request handler needs.
pub struct App {
    pub store: Store,
    /// Fenced SQL transactions (`/v1/sql`), if this gateway runs them.
    pub sql: SqlEndpoint,
    /// Highest committed token per resource; see its module for the invariant.
    pub cache: FenceCache,
    pub metrics: Metrics,
    pub max_body: usize,
    pub body_timeout: Duration,
    /// Writes being processed (`--max-writes-in-flight`).
    writes: Arc<Semaphore>,
    /// Request-body bytes held in memory (`--max-body-memory`), one permit a byte.
    body_bytes: Arc<Semaphore>,
    /// Cancelled when shutdown begins: requests still receiving their body stop.
    pub shutdown: CancellationToken,
    stale_log: LogBudget,
}

/// Why a request was turned away before any work: the gateway is at one of its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    Writes,
    BodyMemory,
}

/// A budget of "stale write rejected" lines per wall-clock second (`--stale-log-limit`,
/// 100 by default; 0 for no limit).
///
/// Under a stale flood — a writer that goes on writing after losing its lease — writing
/// every line costs more than the rejection itself, and lets one client fill the log.
/// Metrics still count every rejection; the next line logged says how many were left
/// out (`unlogged`), and so does a summary line once a second while lines are left out.
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

    /// Lines refused since the last line or summary that counted them.
    fn take_refused(&self) -> u64 {
        self.refused.swap(0, Ordering::Relaxed)
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
                Ok(_) => return Some(self.take_refused()),
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
            body_timeout: config.body_timeout,
            writes: Arc::new(Semaphore::new(config.max_writes_in_flight)),
            body_bytes: Arc::new(Semaphore::new(config.max_body_memory)),
            shutdown: CancellationToken::new(),
            stale_log: LogBudget::new(config.stale_log_limit),
        }
    }

    /// A place for one more write in flight, held until the permit is dropped.
    pub fn write_permit(&self) -> Result<OwnedSemaphorePermit, Overload> {
        Arc::clone(&self.writes)
            .try_acquire_owned()
            .map_err(|_| Overload::Writes)
    }

    /// Room for `bytes` of request body in memory, held until the permit is dropped.
    pub fn body_permit(&self, bytes: usize) -> Result<OwnedSemaphorePermit, Overload> {
        let bytes = u32::try_from(bytes).map_err(|_| Overload::BodyMemory)?;
        Arc::clone(&self.body_bytes)
            .try_acquire_many_owned(bytes)
            .map_err(|_| Overload::BodyMemory)
    }

    /// Shutdown has begun: stop reading request bodies.
    pub fn shutting_down(&self) {
        self.shutdown.cancel();
    }

    /// Logs, once a second while a stale flood lasts, how many "stale write rejected"
    /// lines `--stale-log-limit` left out; runs until shutdown.
    pub async fn summarise_unlogged_rejections(self: Arc<Self>) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = self.shutdown.cancelled() => return,
            }
            let unlogged = self.stale_log.take_refused();
            if unlogged > 0 {
                tracing::warn!(
                    unlogged,
                    limit = self.stale_log.limit,
                    "stale write rejections not logged (--stale-log-limit); metrics count every one"
                );
            }
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
