//! The election loop: follow, acquire, lead and renew, step down.
//!
//! # Behavior
//!
//! - **Following**: try to acquire every `retry_period` (jittered up by 20 %), until
//!   acquired or shut down. Store errors are logged and retried.
//! - **Acquired**: a new [`Term`] with the store's new epoch. If fences are configured,
//!   the gateway's fence of each resource is advanced to the epoch first, so writes
//!   still in flight from older terms are rejected from now on; then the leading code
//!   starts with the term.
//! - **Leading**: renew every `renew_interval` from the last successful renewal's send
//!   instant; retry a failed renewal every `renew_retry_period`, each try abandoned after
//!   `max_round_trip`, until one succeeds or the deadline passes. The term ends, first reason
//!   wins, when:
//!   a renewal matches nothing (`replaced`); no renewal has succeeded for
//!   `renew_deadline` on this process's monotonic clock (`renew_deadline`); the gateway
//!   rejected a write as stale (`stale_rejection`); the leading code returned
//!   (`released`); or shutdown was asked for (`shutdown`).
//!
//! # Ordering on loss
//!
//! 1. The term's cancellation fires and `Lost` is published — at the instant of the
//!    decision, before anything else.
//! 2. The elector waits for the leading code to return (honouring the signal is the
//!    leading code's job; [`Term::run_until_lost`] makes it the easy path).
//! 3. Only then is the lease handed back (release names our epoch, so it never frees a
//!    successor's lease), unless it was already taken (`replaced`): a successor can
//!    acquire without waiting for expiry, but never while our leading code still runs.
//! 4. `released` and `shutdown` end [`Elector::run`]; the others go back to following
//!    after one `retry_period`.
//!
//! The elector never leads on a guess: an unanswered renewal counts as failed.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use fencegate_proto::{ResourceName, Token};
use tokio::sync::broadcast;
use tokio::time::{sleep, sleep_until, timeout, Instant};
use tokio_util::sync::CancellationToken;

use crate::client::{FencedClient, WriteError};
use crate::config::{validate_holder, validate_name, ConfigError, LeaseConfig};
use crate::store::LeaseStore;
use crate::term::{LossReason, Term};

/// How many transitions a slow subscriber may fall behind before it misses some.
const EVENT_BUFFER: usize = 256;

/// A change of leadership state, published to [`Elector::subscribe`]rs. `at` is the
/// instant the elector decided it; `deadline` is the instant this process will step
/// down unless it renews before (the send instant of the acquisition or renewal plus
/// `renew_deadline`): no rival can hold the lease before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    Acquired {
        epoch: Token,
        at: Instant,
        deadline: Instant,
    },
    Renewed {
        epoch: Token,
        at: Instant,
        deadline: Instant,
    },
    Lost {
        epoch: Token,
        reason: LossReason,
        at: Instant,
    },
}

impl Transition {
    pub fn epoch(&self) -> Token {
        match *self {
            Transition::Acquired { epoch, .. }
            | Transition::Renewed { epoch, .. }
            | Transition::Lost { epoch, .. } => epoch,
        }
    }

    pub fn at(&self) -> Instant {
        match *self {
            Transition::Acquired { at, .. }
            | Transition::Renewed { at, .. }
            | Transition::Lost { at, .. } => at,
        }
    }

    /// The metric label: `acquired`, `renewed` or `lost`.
    pub fn kind(&self) -> &'static str {
        match self {
            Transition::Acquired { .. } => "acquired",
            Transition::Renewed { .. } => "renewed",
            Transition::Lost { .. } => "lost",
        }
    }
}

/// Competes for one lease on behalf of one holder.
pub struct Elector<S> {
    store: S,
    config: LeaseConfig,
    lease: String,
    holder: String,
    fences: Option<(FencedClient, Vec<ResourceName>)>,
    events: broadcast::Sender<Transition>,
    #[cfg(feature = "prometheus")]
    metrics: Option<crate::metrics::LeaseMetrics>,
}

impl<S: LeaseStore> Elector<S> {
    /// An elector for `lease` as `holder`; rejects invalid timing, names and holders.
    ///
    /// `holder` must be unique among running processes (see the store module's rule on
    /// re-acquiring); a node name plus a process id or random suffix is a good choice.
    pub fn new(
        store: S,
        lease: &str,
        holder: &str,
        config: LeaseConfig,
    ) -> Result<Elector<S>, ConfigError> {
        config.validate()?;
        validate_name(lease)?;
        validate_holder(holder)?;
        Ok(Elector {
            store,
            config,
            lease: lease.to_owned(),
            holder: holder.to_owned(),
            fences: None,
            events: broadcast::channel(EVENT_BUFFER).0,
            #[cfg(feature = "prometheus")]
            metrics: None,
        })
    }

    /// On every acquisition, advance the gateway's fence of each of `resources` to the
    /// new epoch before the leading code starts.
    pub fn advance_fences(mut self, client: FencedClient, resources: Vec<ResourceName>) -> Self {
        self.fences = Some((client, resources));
        self
    }

    /// Counts transitions in `metrics` (`fencegate_lease_*`).
    #[cfg(feature = "prometheus")]
    pub fn with_metrics(mut self, metrics: crate::metrics::LeaseMetrics) -> Self {
        metrics.init(&self.lease);
        self.metrics = Some(metrics);
        self
    }

    /// Transitions from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Transition> {
        self.events.subscribe()
    }

    pub fn config(&self) -> &LeaseConfig {
        &self.config
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// Competes for the lease and runs `lead` with each term won, until `shutdown` is
    /// cancelled or `lead` returns while its term is still live (then the lease is
    /// released and `run` returns).
    pub async fn run<F, Fut>(&self, shutdown: CancellationToken, mut lead: F)
    where
        F: FnMut(Term) -> Fut,
        Fut: Future<Output = ()>,
    {
        loop {
            let Some((epoch, sent)) = self.follow(&shutdown).await else {
                return;
            };
            let term = Term::new(&self.lease, &self.holder, epoch);
            self.publish(Transition::Acquired {
                epoch,
                at: Instant::now(),
                deadline: sent + self.config.renew_deadline,
            });
            let reason = self.lead(&term, sent, &shutdown, lead(term.clone())).await;
            if matches!(reason, LossReason::Released | LossReason::Shutdown) {
                return;
            }
            // Do not turn straight around: a holder that just lost is the worst
            // candidate for the next term.
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = sleep(self.jittered(self.config.retry_period)) => {}
            }
        }
    }

    /// Tries to acquire until it succeeds; `None` on shutdown. Returns the epoch and
    /// the instant the successful request was sent.
    async fn follow(&self, shutdown: &CancellationToken) -> Option<(Token, Instant)> {
        let mut failures = 0u32;
        loop {
            let sent = Instant::now();
            let attempt = timeout(
                self.config.max_round_trip,
                self.store
                    .acquire(&self.lease, &self.holder, self.config.lease_duration),
            );
            let result = tokio::select! {
                () = shutdown.cancelled() => return None,
                result = attempt => result,
            };
            match result {
                Ok(Ok(Some(epoch))) => return Some((epoch, sent)),
                Ok(Ok(None)) => failures = 0,
                Ok(Err(error)) => {
                    failures += 1;
                    self.store_trouble(failures, "acquire", &error.to_string());
                }
                Err(_) => {
                    failures += 1;
                    self.store_trouble(failures, "acquire", "no answer in time");
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => return None,
                () = sleep(self.jittered(self.config.retry_period)) => {}
            }
        }
    }

    /// Leads one term; returns why it ended, after the leading code has stopped and
    /// the lease has been handed back.
    async fn lead(
        &self,
        term: &Term,
        acquired_sent: Instant,
        shutdown: &CancellationToken,
        leading: impl Future<Output = ()>,
    ) -> LossReason {
        let epoch = term.epoch();
        let config = self.config;
        let mut work = pin!(async {
            self.advance(term).await;
            if term.is_live() {
                leading.await;
            }
        });
        let mut work_done = false;
        let mut lost = pin!(self.store.lost(&self.lease, &self.holder, epoch));
        let mut last_ok = acquired_sent;
        let mut next_renewal = acquired_sent + config.renew_interval;
        let mut failures = 0u32;
        let reason = loop {
            let renewal = async {
                sleep_until(next_renewal).await;
                let sent = Instant::now();
                let renewed = timeout(
                    config.max_round_trip,
                    self.store
                        .renew(&self.lease, &self.holder, epoch, config.lease_duration),
                )
                .await;
                (sent, renewed)
            };
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break LossReason::Shutdown,
                () = term.cancelled() => break term.loss_reason().unwrap_or(LossReason::StaleRejection),
                () = &mut lost => break LossReason::SessionLost,
                () = sleep_until(last_ok + config.renew_deadline) => break LossReason::RenewDeadline,
                () = &mut work => {
                    work_done = true;
                    break LossReason::Released;
                }
                (sent, renewed) = renewal => match renewed {
                    Ok(Ok(true)) => {
                        failures = 0;
                        last_ok = sent;
                        next_renewal = sent + config.renew_interval;
                        self.publish(Transition::Renewed {
                            epoch,
                            at: Instant::now(),
                            deadline: sent + config.renew_deadline,
                        });
                    }
                    Ok(Ok(false)) => break LossReason::Replaced,
                    Ok(Err(error)) => {
                        failures += 1;
                        self.store_trouble(failures, "renew", &error.to_string());
                        next_renewal = Instant::now() + self.jittered(config.renew_retry_period);
                    }
                    Err(_) => {
                        failures += 1;
                        self.store_trouble(failures, "renew", "no answer in time");
                        next_renewal = Instant::now() + self.jittered(config.renew_retry_period);
                    }
                },
            }
        };
        // 1. Authority ends now: cancel, then tell.
        term.end(reason);
        let reason = term.loss_reason().unwrap_or(reason);
        self.publish(Transition::Lost {
            epoch,
            reason,
            at: Instant::now(),
        });
        // 2. Let the leading code stop.
        if !work_done {
            let margin = config.lease_duration.saturating_sub(config.renew_deadline);
            if timeout(margin, &mut work).await.is_err() {
                tracing::warn!(
                    lease = self.lease,
                    epoch = epoch.get(),
                    "the leading code has not stopped within the lease margin; waiting for it"
                );
                work.await;
            }
        }
        // 3. Hand the lease back unless it was taken or the store ended it.
        if !matches!(reason, LossReason::Replaced | LossReason::SessionLost) {
            self.release(epoch).await;
        }
        reason
    }

    async fn advance(&self, term: &Term) {
        let Some((client, resources)) = &self.fences else {
            return;
        };
        for resource in resources {
            match client.advance(term, resource).await {
                Ok(_) => {}
                // The term is over (the client ended it); the leading code will not start.
                Err(WriteError::Stale { .. } | WriteError::TermOver { .. }) => return,
                // The writes themselves are still fenced; advancing only rejects old
                // in-flight writes sooner.
                Err(error) => tracing::warn!(
                    lease = self.lease,
                    resource = resource.as_str(),
                    epoch = term.epoch().get(),
                    %error,
                    "could not advance the fence; leading anyway"
                ),
            }
        }
    }

    async fn release(&self, epoch: Token) {
        let released = timeout(
            self.config.max_round_trip,
            self.store.release(&self.lease, &self.holder, epoch),
        )
        .await;
        match released {
            Ok(Ok(true)) => {
                tracing::info!(lease = self.lease, epoch = epoch.get(), "lease released")
            }
            Ok(Ok(false)) => tracing::info!(
                lease = self.lease,
                epoch = epoch.get(),
                "lease not released: no longer ours"
            ),
            Ok(Err(error)) => tracing::warn!(
                lease = self.lease,
                epoch = epoch.get(),
                %error,
                "lease not released; it will expire"
            ),
            Err(_) => tracing::warn!(
                lease = self.lease,
                epoch = epoch.get(),
                "lease release unanswered; it will expire"
            ),
        }
    }

    fn publish(&self, transition: Transition) {
        let (lease, holder) = (self.lease.as_str(), self.holder.as_str());
        match transition {
            Transition::Acquired { epoch, .. } => {
                tracing::info!(lease, holder, epoch = epoch.get(), "lease acquired")
            }
            Transition::Renewed { epoch, .. } => {
                tracing::debug!(lease, holder, epoch = epoch.get(), "lease renewed")
            }
            Transition::Lost { epoch, reason, .. } => match reason {
                LossReason::Released | LossReason::Shutdown => {
                    tracing::info!(
                        lease,
                        holder,
                        epoch = epoch.get(),
                        reason = reason.as_str(),
                        "leadership ended"
                    )
                }
                _ => {
                    tracing::warn!(
                        lease,
                        holder,
                        epoch = epoch.get(),
                        reason = reason.as_str(),
                        "leadership lost"
                    )
                }
            },
        }
        #[cfg(feature = "prometheus")]
        if let Some(metrics) = &self.metrics {
            metrics.record(lease, &transition);
        }
        // No subscribers is fine.
        let _ = self.events.send(transition);
    }

    /// Logs store trouble: the first failure in a row as a warning, the rest as debug.
    fn store_trouble(&self, failures: u32, operation: &str, error: &str) {
        if failures == 1 {
            tracing::warn!(
                lease = self.lease,
                operation,
                error,
                "lease store call failed; retrying"
            );
        } else {
            tracing::debug!(
                lease = self.lease,
                operation,
                error,
                failures,
                "lease store call failed again"
            );
        }
    }

    /// `period` plus up to 20 %, so that followers do not retry in lockstep.
    fn jittered(&self, period: Duration) -> Duration {
        period.mul_f64(1.0 + 0.2 * rand::random::<f64>())
    }
}
