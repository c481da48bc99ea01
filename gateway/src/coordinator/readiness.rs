//! What readiness asks of the store: that it answers ([`Coordinator::ping`]), and that
//! it takes writes ([`Coordinator::writable`]), by a real write probed at most every
//! [`WRITE_PROBE_EVERY`].

use std::sync::Arc;
use std::time::Duration;

use super::Coordinator;
use crate::error::ApiError;
use crate::store::NotWritable;

/// How long a write probe's outcome answers readiness before the store is probed again.
const WRITE_PROBE_EVERY: Duration = Duration::from_secs(1);

/// The latest write probe of the store and when it ran; see [`Coordinator::writable`].
#[derive(Default)]
pub(super) struct WriteProbe {
    last: tokio::sync::Mutex<Option<(tokio::time::Instant, Result<(), NotWritable>)>>,
}

impl Coordinator {
    /// Succeeds if the backend can serve requests now.
    pub async fn ping(self: &Arc<Self>) -> Result<(), ApiError> {
        let this = Arc::clone(self);
        let result = self
            .store_call(async move { this.store.ping().await })
            .await?;
        Ok(result?)
    }

    /// Whether the store can take writes, by a real write ([`crate::store::Store::probe_write`]) at
    /// most every [`WRITE_PROBE_EVERY`], or at once after a write failed in storage.
    /// Readiness callers wait for one probe rather than each run their own.
    pub async fn writable(self: &Arc<Self>) -> Result<Result<(), NotWritable>, ApiError> {
        let mut last = self.write_probe.last.lock().await;
        if let Some((at, outcome)) = &*last {
            if at.elapsed() < WRITE_PROBE_EVERY && !self.store.write_failed_since_probe() {
                return Ok(outcome.clone());
            }
        }
        let this = Arc::clone(self);
        let result = self
            .store_call(async move { this.store.probe_write().await })
            .await?;
        let outcome = result?;
        self.metrics.store_writable(outcome.is_ok());
        let was_writable = last.as_ref().is_none_or(|(_, before)| before.is_ok());
        match &outcome {
            Err(not) => tracing::warn!(
                reason = not.reason.as_str(),
                detail = %not.detail,
                "the store cannot take writes: not ready"
            ),
            Ok(()) if !was_writable => tracing::info!("the store takes writes again"),
            Ok(()) => {}
        }
        *last = Some((tokio::time::Instant::now(), outcome.clone()));
        Ok(outcome)
    }
}
