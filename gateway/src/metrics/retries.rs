//! Metrics of keyed writes and transactions: what became of each Idempotency-Key, the
//! expired answers removed, and the size of transactions.

use prometheus::core::Collector;
use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts};

/// Every value of the `outcome` label of `fencegate_idempotency_requests_total`.
pub const IDEMPOTENCY_OUTCOMES: [&str; 6] = [
    "stored",
    "replayed",
    "key_reused",
    "in_flight",
    "quota_exceeded",
    "stale",
];

pub(super) struct RetryMetrics {
    pub(super) idempotency: IntCounterVec,
    pub(super) expired: IntCounter,
    pub(super) txn_operations: Histogram,
    pub(super) stored_records: IntGauge,
    pub(super) stored_bytes: IntGauge,
}

impl RetryMetrics {
    pub(super) fn new() -> RetryMetrics {
        let idempotency = IntCounterVec::new(
            Opts::new(
                "fencegate_idempotency_requests_total",
                "Writes sent with an Idempotency-Key, by outcome: stored (applied or refused now, its answer stored), replayed (the answer of an earlier attempt sent again, nothing applied), key_reused (the key was used for another request: 422), in_flight (an attempt with the key was still running: 409), quota_exceeded (a new key while the stored answers were at a bound: 429, nothing applied), stale (a new key whose token the fence cache knew stale: 409, nothing applied or stored).",
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
        let stored_records = IntGauge::new(
            "fencegate_idempotency_stored_records",
            "Answers of keyed writes stored and not yet expired, over every identity, as the store last counted them (about once a second).",
        )
        .unwrap();
        let stored_bytes = IntGauge::new(
            "fencegate_idempotency_stored_bytes",
            "Bytes of the stored answers of keyed writes, over every identity, as the store last counted them; bounded by --idempotency-max-bytes.",
        )
        .unwrap();
        RetryMetrics {
            idempotency,
            expired,
            txn_operations,
            stored_records,
            stored_bytes,
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.idempotency.clone()),
            Box::new(self.expired.clone()),
            Box::new(self.txn_operations.clone()),
            Box::new(self.stored_records.clone()),
            Box::new(self.stored_bytes.clone()),
        ]
    }
}
