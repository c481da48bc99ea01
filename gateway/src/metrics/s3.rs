//! Metrics of the S3 door: its requests by method and status, their duration, and
//! what its collector removed. Its stale rejections are counted with every door's
//! (`fencegate_stale_rejections_total`, `fencegate_door_stale_rejections_total`).

use prometheus::core::Collector;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};

/// The methods the S3 door's request metrics name; any other is counted as `other`.
pub const S3_METHODS: [&str; 6] = ["GET", "HEAD", "PUT", "POST", "DELETE", "other"];

/// Every value of the `status` label of `fencegate_s3_requests_total`.
pub const S3_STATUS_CLASSES: [&str; 4] = ["2xx", "3xx", "4xx", "5xx"];

/// Every value of the `kind` label of `fencegate_s3_collected_total`.
pub const S3_COLLECTED: [&str; 2] = ["object", "intent"];

pub(super) struct S3Metrics {
    pub(super) requests: IntCounterVec,
    pub(super) duration: HistogramVec,
    pub(super) collected: IntCounterVec,
}

impl S3Metrics {
    pub(super) fn new() -> S3Metrics {
        let requests = IntCounterVec::new(
            Opts::new(
                "fencegate_s3_requests_total",
                "Requests answered by the S3 door, by HTTP method and status class (2xx, 3xx, 4xx, 5xx).",
            ),
            &["method", "status"],
        )
        .unwrap();
        let duration = HistogramVec::new(
            HistogramOpts::new(
                "fencegate_s3_request_duration_seconds",
                "Time from a request's head to its answer's head at the S3 door, by HTTP method (a GET's body streams after).",
            )
            .buckets(vec![
                0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["method"],
        )
        .unwrap();
        let collected = IntCounterVec::new(
            Opts::new(
                "fencegate_s3_collected_total",
                "What the S3 door's collector removed: object (a physical object no mapping or intent named, past --s3-gc-grace), intent (an upload older than --s3-upload-max-age, which can then never be committed).",
            ),
            &["kind"],
        )
        .unwrap();
        for method in S3_METHODS {
            duration.with_label_values(&[method]);
            for class in S3_STATUS_CLASSES {
                requests.with_label_values(&[method, class]);
            }
        }
        for kind in S3_COLLECTED {
            collected.with_label_values(&[kind]);
        }
        S3Metrics {
            requests,
            duration,
            collected,
        }
    }

    pub(super) fn collectors(&self) -> Vec<Box<dyn Collector>> {
        vec![
            Box::new(self.requests.clone()),
            Box::new(self.duration.clone()),
            Box::new(self.collected.clone()),
        ]
    }
}
