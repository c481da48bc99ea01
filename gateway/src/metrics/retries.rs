//! Metrics of keyed writes and transactions: what became of each Idempotency-Key, the
//! expired answers removed, and the size of transactions.

use prometheus::core::Collector;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts};

/// Every value of the `outcome` label of `fencegate_idempotency_requests_total`.
pub const IDEMPOTENCY_OUTCOMES: [&str; 4] = ["stored", "replayed", "key_reused", "in_flight"];

pub(super) struct RetryMetrics {
    pub(super) idempotency: IntCounterVec,
    pub(super) expired: IntCounter,
    pub(super) txn_operations: Histogram,
}

impl RetryMetrics {
    pub(super) fn new() -> RetryMetrics {
        let idempotency = IntCounterVec::new(
            Opts::new(
                "fencegate_idempotency_requests_total",
                "Writes sent with an Idempotency-Key, by outcome: stored (applied or refused now, its answer stored), replayed (the answer of an earlier attempt sent again, nothing applied), key_reused (the key was used for another request: 422), in_flight (an attempt with the key was still running: 409).",
            ),
            &["outcome"],
        )
        .unwrap();
        for outcome in IDEMPOTENCY_OUTCOMES {
            idempotency.with_label_values(&[outcome]);
        }
        let expired = IntCounter::new(
            "fencegate_idempotency_expired_total",
            "Stored answers of keyed writes removed after --idempotency-ttl.",
        )
        .unwrap();
        let txn_operations = Histogram::with_opts(
            HistogramOpts::new(
                "fencegate_txn_operations",
                "Operations per POST /v1/txn that reached the store.",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0]),
        )
        .unwrap();
        RetryMetrics {
            idempotency,
            expired,
            txn_operations,
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.idempotency.clone()),
            Box::new(self.expired.clone()),
            Box::new(self.txn_operations.clone()),
        ]
    }
}
