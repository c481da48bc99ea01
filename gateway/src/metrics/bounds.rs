//! Metrics of the process's bounds: requests turned away at one, connections closed
//! for not reading, memory held by answers waiting for their clients.

use prometheus::core::Collector;
use prometheus::{IntCounterVec, IntGauge, Opts};

/// Every value of the `reason` label of `fencegate_connections_closed_total`.
pub const CLOSE_REASONS: [&str; 2] = ["write_timeout", "answers_stalled"];

pub(super) struct BoundMetrics {
    pub(super) limit_rejections: IntCounterVec,
    pub(super) connections_closed: IntCounterVec,
    pub(super) response_bytes: IntGauge,
}

impl BoundMetrics {
    pub(super) fn new() -> BoundMetrics {
        let limit_rejections = IntCounterVec::new(
            Opts::new(
                "fencegate_limit_rejections_total",
                "HTTP requests answered 503 overloaded at one of the gateway's bounds, by bound: writes (--max-writes-in-flight), body_memory (--max-body-memory), writes_share and body_share (one client's share of them, --max-client-share), response_memory (--max-response-memory), pending_answers (--max-pending-answers on one connection).",
            ),
            &["reason"],
        )
        .unwrap();
        for reason in crate::error::Overload::ALL {
            limit_rejections.with_label_values(&[reason.as_str()]);
        }
        let connections_closed = IntCounterVec::new(
            Opts::new(
                "fencegate_connections_closed_total",
                "HTTP connections closed because their client did not read: a write to the socket waited longer than --write-timeout (write_timeout), or large answers made no progress for as long (answers_stalled).",
            ),
            &["reason"],
        )
        .unwrap();
        for reason in CLOSE_REASONS {
            connections_closed.with_label_values(&[reason]);
        }
        let response_bytes = IntGauge::new(
            "fencegate_response_bytes_pending",
            "Bytes of large answers held in memory until their clients read them (bounded by --max-response-memory).",
        )
        .unwrap();
        BoundMetrics {
            limit_rejections,
            connections_closed,
            response_bytes,
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.limit_rejections.clone()),
            Box::new(self.connections_closed.clone()),
            Box::new(self.response_bytes.clone()),
        ]
    }
}
