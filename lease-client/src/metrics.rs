//! `fencegate_lease_*` metrics, registered into the writer's own registry.
//!
//! | series | type | labels |
//! | --- | --- | --- |
//! | `fencegate_lease_transitions_total` | counter | `lease`, `transition` = acquired, renewed, lost |
//! | `fencegate_lease_lost_total` | counter | `lease`, `reason` = replaced, renew_deadline, stale_rejection, released, shutdown |
//! | `fencegate_lease_is_leader` | gauge (0/1) | `lease` |
//! | `fencegate_lease_epoch` | gauge: the epoch of the current or last term | `lease` |
//!
//! `lease` is the lease name: a process competes for a handful, so the label is
//! bounded by the writer's own configuration.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::elector::Transition;
use crate::term::LossReason;

/// The lease metrics; cheap to clone (the series are shared).
#[derive(Clone)]
pub struct LeaseMetrics {
    transitions: IntCounterVec,
    lost: IntCounterVec,
    is_leader: IntGaugeVec,
    epoch: IntGaugeVec,
}

impl LeaseMetrics {
    /// Creates the series and registers them into `registry`.
    pub fn register(registry: &Registry) -> Result<LeaseMetrics, prometheus::Error> {
        let metrics = LeaseMetrics {
            transitions: IntCounterVec::new(
                Opts::new(
                    "fencegate_lease_transitions_total",
                    "Leadership transitions: acquired, renewed, lost.",
                ),
                &["lease", "transition"],
            )?,
            lost: IntCounterVec::new(
                Opts::new("fencegate_lease_lost_total", "Terms ended, by reason."),
                &["lease", "reason"],
            )?,
            is_leader: IntGaugeVec::new(
                Opts::new(
                    "fencegate_lease_is_leader",
                    "1 while this process holds the lease, else 0.",
                ),
                &["lease"],
            )?,
            epoch: IntGaugeVec::new(
                Opts::new(
                    "fencegate_lease_epoch",
                    "The fencing token of the current or last term of this process.",
                ),
                &["lease"],
            )?,
        };
        registry.register(Box::new(metrics.transitions.clone()))?;
        registry.register(Box::new(metrics.lost.clone()))?;
        registry.register(Box::new(metrics.is_leader.clone()))?;
        registry.register(Box::new(metrics.epoch.clone()))?;
        Ok(metrics)
    }

    /// Creates every series of `lease` at zero, so that dashboards see them from the start.
    pub(crate) fn init(&self, lease: &str) {
        for transition in ["acquired", "renewed", "lost"] {
            self.transitions.with_label_values(&[lease, transition]);
        }
        for reason in LossReason::ALL {
            self.lost.with_label_values(&[lease, reason.as_str()]);
        }
        self.is_leader.with_label_values(&[lease]).set(0);
        self.epoch.with_label_values(&[lease]);
    }

    pub(crate) fn record(&self, lease: &str, transition: &Transition) {
        self.transitions
            .with_label_values(&[lease, transition.kind()])
            .inc();
        match *transition {
            Transition::Acquired { epoch, .. } => {
                self.is_leader.with_label_values(&[lease]).set(1);
                self.epoch.with_label_values(&[lease]).set(epoch.as_i64());
            }
            Transition::Renewed { .. } => {}
            Transition::Lost { reason, .. } => {
                self.is_leader.with_label_values(&[lease]).set(0);
                self.lost.with_label_values(&[lease, reason.as_str()]).inc();
            }
        }
    }
}
