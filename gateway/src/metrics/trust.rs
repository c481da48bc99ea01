//! Metrics of hosted leases, issued tokens and fence resets.

use prometheus::core::Collector;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};

/// Every value of the `outcome` label of `fencegate_lease_steps_total`.
pub const LEASE_OUTCOMES: [&str; 5] = ["granted", "released", "held", "lost", "exhausted"];
/// Every value of the `reason` label of `fencegate_token_refusals_total`.
pub const REFUSAL_REASONS: [&str; 2] = ["not_issued", "holder_mismatch"];

pub(super) struct TrustMetrics {
    pub(super) lease_steps: IntCounterVec,
    pub(super) token_refusals: IntCounterVec,
    pub(super) resets: IntCounter,
    pub(super) reset_generation: IntGauge,
    pub(super) regressions: IntCounter,
}

impl TrustMetrics {
    pub(super) fn new() -> TrustMetrics {
        let lease_steps = IntCounterVec::new(
            Opts::new(
                "fencegate_lease_steps_total",
                "Steps of leases hosted by the gateway, by step and outcome.",
            ),
            &["step", "outcome"],
        )
        .unwrap();
        for step in fencegate_proto::path::LeaseStep::ALL {
            for outcome in LEASE_OUTCOMES {
                lease_steps.with_label_values(&[step.as_str(), outcome]);
            }
        }
        let token_refusals = IntCounterVec::new(
            Opts::new(
                "fencegate_token_refusals_total",
                "Tokens refused because their resource's issuer did not issue them (not_issued) or issued them to another identity (holder_mismatch).",
            ),
            &["reason"],
        )
        .unwrap();
        for reason in REFUSAL_REASONS {
            token_refusals.with_label_values(&[reason]);
        }
        let resets = IntCounter::new(
            "fencegate_fence_resets_total",
            "Fence resets applied through this gateway (POST /v1/fences/{resource}/reset).",
        )
        .unwrap();
        let reset_generation = IntGauge::new(
            "fencegate_fence_reset_generation",
            "The latest fence reset this gateway has applied to its fence cache.",
        )
        .unwrap();
        let regressions = IntCounter::new(
            "fencegate_fence_regressions_total",
            "Fences found below a token this gateway saw committed (the database lost committed transactions, as after a failover to an asynchronous standby), and restored.",
        )
        .unwrap();
        TrustMetrics {
            regressions,
            lease_steps,
            token_refusals,
            resets,
            reset_generation,
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.lease_steps.clone()),
            Box::new(self.token_refusals.clone()),
            Box::new(self.resets.clone()),
            Box::new(self.reset_generation.clone()),
            Box::new(self.regressions.clone()),
        ]
    }
}
