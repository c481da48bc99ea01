//! Metrics of hosted leases, issued tokens and fence resets.

use prometheus::core::Collector;
use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};

/// Every value of the `outcome` label of `fencegate_lease_steps_total`.
pub const LEASE_OUTCOMES: [&str; 5] = ["granted", "released", "held", "lost", "exhausted"];
/// Every value of the `reason` label of `fencegate_token_refusals_total`.
pub const REFUSAL_REASONS: [&str; 4] = [
    "not_issued",
    "holder_mismatch",
    "issuer_unavailable",
    "earlier_term",
];
/// Every value of the `issuer` label of `fencegate_issuer_regressions_total`.
pub const SOURCES: [&str; 3] = ["leader_lease", "etcd", "zookeeper"];
/// Every value of the `door` label of `fencegate_forged_refusals_total`.
pub const DOORS: [&str; 2] = ["http", "pg"];
/// Every value of the `door` label of `fencegate_door_stale_rejections_total`.
pub const WRITE_DOORS: [&str; 3] = ["http", "pg", "s3"];

pub(super) struct TrustMetrics {
    pub(super) lease_steps: IntCounterVec,
    pub(super) token_refusals: IntCounterVec,
    pub(super) resets: IntCounter,
    pub(super) reset_generation: IntGauge,
    pub(super) regressions: IntCounter,
    pub(super) issuer_regressions: IntCounterVec,
    pub(super) forged_refusals: IntCounterVec,
    pub(super) door_stale_rejections: IntCounterVec,
    pub(super) takeovers: IntCounter,
    pub(super) bindings_drift: IntGauge,
    pub(super) binding_restores: IntCounter,
    pub(super) synchronous_standbys: IntGauge,
    pub(super) synchronous_replication: IntGauge,
    pub(super) timeline: IntGauge,
    pub(super) patroni_synchronous_mode: IntGauge,
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
                "Tokens refused because their resource's issuer did not issue them (not_issued), issued them to another identity (holder_mismatch), could not be asked about a token above what this gateway knows it issued (issuer_unavailable), or issued a later term than the token's (earlier_term: answered 409 stale_token).",
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
        let issuer_regressions = IntCounterVec::new(
            Opts::new(
                "fencegate_issuer_regressions_total",
                "Times an issuer outside the gateway went back: its current term's token below one it issued before, or (etcd) the cluster's revision below one it answered before — a restore from an older snapshot. The new terms' writes are refused as stale until the fence is reset.",
            ),
            &["issuer"],
        )
        .unwrap();
        for issuer in SOURCES {
            issuer_regressions.with_label_values(&[issuer]);
        }
        let forged_refusals = IntCounterVec::new(
            Opts::new(
                "fencegate_forged_refusals_total",
                "Errors with a fence SQLSTATE (ZF001, ZF005) that the fence did not raise (no valid proof), relayed by a door: raised by a client's SQL, never counted as rejections.",
            ),
            &["door"],
        )
        .unwrap();
        for door in DOORS {
            forged_refusals.with_label_values(&[door]);
        }
        let door_stale_rejections = IntCounterVec::new(
            Opts::new(
                "fencegate_door_stale_rejections_total",
                "Writes refused as stale (below the resource's highest token), by the door they came through: the HTTP API, the Postgres door, the S3 door. fencegate_stale_rejections_total counts the same refusals by resource.",
            ),
            &["door"],
        )
        .unwrap();
        for door in WRITE_DOORS {
            door_stale_rejections.with_label_values(&[door]);
        }
        let takeovers = IntCounter::new(
            "fencegate_term_takeovers_total",
            "Sessions of an older term that held a fence row a new term was raising, ended after --term-takeover-timeout (by the in-database fence or by this gateway; read from fencegate.takeovers).",
        )
        .unwrap();
        let bindings_drift = IntGauge::new(
            "fencegate_issuer_bindings_drift",
            "1 while the issuer bindings in the database differ from this gateway's --issued-by flags, else 0.",
        )
        .unwrap();
        let binding_restores = IntCounter::new(
            "fencegate_issuer_binding_restores_total",
            "Times this gateway found the issuer bindings in the database changed without --replace-issuer-bindings, and restored its own.",
        )
        .unwrap();
        let synchronous_standbys = IntGauge::new(
            "fencegate_backend_synchronous_standbys",
            "Standbys streaming as sync or quorum in the fence database primary's pg_stat_replication (Postgres; -1 until read, and with the embedded store).",
        )
        .unwrap();
        synchronous_standbys.set(-1);
        let synchronous_replication = IntGauge::new(
            "fencegate_backend_synchronous_replication",
            "1 while a commit of the gateway's sessions waits for a synchronous standby that is streaming (synchronous_commit, synchronous_standby_names, pg_stat_replication), 0 while it does not, -1 until read and with the embedded store.",
        )
        .unwrap();
        synchronous_replication.set(-1);
        let timeline = IntGauge::new(
            "fencegate_backend_timeline",
            "The timeline of the fence database's primary: it rises with every promotion, and is the epoch of the lease tokens minted on it (Postgres; 0 until read).",
        )
        .unwrap();
        let patroni_synchronous_mode = IntGauge::new(
            "fencegate_backend_patroni_synchronous_mode",
            "Patroni's synchronous mode, read from --patroni-url: 0 off, 1 on, 2 strict; -1 without --patroni-url or when Patroni does not answer.",
        )
        .unwrap();
        patroni_synchronous_mode.set(-1);
        TrustMetrics {
            synchronous_standbys,
            synchronous_replication,
            timeline,
            patroni_synchronous_mode,
            forged_refusals,
            door_stale_rejections,
            takeovers,
            bindings_drift,
            binding_restores,
            regressions,
            issuer_regressions,
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
            Box::new(self.issuer_regressions.clone()),
            Box::new(self.resets.clone()),
            Box::new(self.reset_generation.clone()),
            Box::new(self.regressions.clone()),
            Box::new(self.forged_refusals.clone()),
            Box::new(self.door_stale_rejections.clone()),
            Box::new(self.takeovers.clone()),
            Box::new(self.bindings_drift.clone()),
            Box::new(self.binding_restores.clone()),
            Box::new(self.synchronous_standbys.clone()),
            Box::new(self.synchronous_replication.clone()),
            Box::new(self.timeline.clone()),
            Box::new(self.patroni_synchronous_mode.clone()),
        ]
    }
}
