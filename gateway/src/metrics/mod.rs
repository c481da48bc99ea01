//! Prometheus metrics. Names and labels are a public contract: dashboards and alerts
//! rely on them, so rename nothing.
//!
//! Label values come from closed sets (route, outcome, error kind), except `resource`,
//! which is unbounded and therefore admitted only up to a cap, with slots that follow
//! recent use ([`labels`]); resources without a slot are counted under
//! `resource="_other"`.

mod bounds;
pub(crate) mod door;
mod labels;
mod retries;
mod s3;
mod trust;

use door::DoorMetrics;

use std::sync::OnceLock;

use bounds::BoundMetrics;
use fencegate_proto::{ErrorCode, ResourceName, Token};
use labels::{Label, ResourceLabels};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use retries::RetryMetrics;
use trust::TrustMetrics;

/// The label value for resources beyond the cap.
pub const OTHER_RESOURCE: &str = "_other";

/// Every value of the `route` label.
pub const ROUTES: &[&str] = &[
    "kv_put",
    "kv_get",
    "kv_delete",
    "kv_other",
    "fence_get",
    "fence_advance",
    "fence_reset",
    "sql",
    "lease_get",
    "lease_step",
    "txn",
    "metrics",
    "healthz",
    "readyz",
    "openapi",
    "unknown",
];

/// The `outcome` of a request answered without error.
pub const OK: &str = "ok";

/// Request latency buckets: 100 µs (an answer from the fence cache) to 10 s (a request
/// that waited out the backend timeout).
const DURATION_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// Token lag buckets (highest − presented): a lag of 1 is the usual "previous term";
/// large lags mean a writer that slept through many terms.
const LAG_BUCKETS: &[f64] = &[
    1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 1000.0, 10000.0, 1e6,
];

/// Group sizes: 1 (a write that found a free lane) to `--group-commit-max`'s default.
const GROUP_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Every metric the gateway exports.
pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    request_duration: HistogramVec,
    stale_rejections: IntCounterVec,
    highest_token: IntGaugeVec,
    last_rejected_token: IntGaugeVec,
    rejected_token_lag: Histogram,
    backend_errors: IntCounterVec,
    backend_ready: IntGauge,
    store_writable: IntGauge,
    fence_cache_entries: IntGauge,
    cache_rejections: prometheus::IntCounter,
    /// Writes applied per backend transaction; handed to the store at start-up.
    commit_group_size: Histogram,
    /// Writes of locked resources waiting off the write lanes; handed to the store.
    writes_off_lanes: IntGauge,
    /// The series of each (route, outcome), by [`answered_index`].
    answered: Box<[AnsweredSeries]>,
    labels: ResourceLabels<ResourceSeries>,
    /// The series of `resource="_other"`.
    other: ResourceSeries,
    pg: DoorMetrics,
    trust: TrustMetrics,
    bounds: BoundMetrics,
    retries: RetryMetrics,
    s3: s3::S3Metrics,
}

/// The series of one (route, outcome), resolved once: answering a request then costs
/// two atomic updates, not two lookups of their labels.
struct AnsweredSeries {
    requests: IntCounter,
    /// Made on first use: only the `ok` ones exist from the start.
    duration: OnceLock<Histogram>,
}

/// Where the series of `route` and `outcome` (`None`: ok) are in `Metrics::answered`.
fn answered_index(route: &str, outcome: Option<ErrorCode>) -> Option<usize> {
    let route = ROUTES.iter().position(|known| *known == route)?;
    let outcome = match outcome {
        None => 0,
        Some(code) => 1 + ErrorCode::ALL.iter().position(|known| *known == code)?,
    };
    Some(route * (1 + ErrorCode::ALL.len()) + outcome)
}

/// The series of one `resource` label value, made on first use and held with its
/// label's slot: recording is then a few atomic updates, not a lookup per metric.
#[derive(Default)]
struct ResourceSeries {
    stale_rejections: OnceLock<IntCounter>,
    highest_token: OnceLock<IntGauge>,
    last_rejected_token: OnceLock<IntGauge>,
}

impl Metrics {
    pub fn new(resource_label_cap: usize) -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "fencegate_requests_total",
                "HTTP requests answered, by route and outcome.",
            ),
            &["route", "outcome"],
        )
        .unwrap();
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "fencegate_request_duration_seconds",
                "Time from request head to response, by route and outcome.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["route", "outcome"],
        )
        .unwrap();
        let stale_rejections = IntCounterVec::new(
            Opts::new(
                "fencegate_stale_rejections_total",
                "Writes rejected because their token was below the resource's highest.",
            ),
            &["resource"],
        )
        .unwrap();
        let highest_token = IntGaugeVec::new(
            Opts::new(
                "fencegate_highest_token",
                "Highest accepted fencing token, per resource, as seen by this gateway.",
            ),
            &["resource"],
        )
        .unwrap();
        let last_rejected_token = IntGaugeVec::new(
            Opts::new(
                "fencegate_last_rejected_token",
                "Token presented by the latest stale write, per resource.",
            ),
            &["resource"],
        )
        .unwrap();
        let rejected_token_lag = Histogram::with_opts(
            HistogramOpts::new(
                "fencegate_rejected_token_lag",
                "Highest token minus presented token, per stale rejection.",
            )
            .buckets(LAG_BUCKETS.to_vec()),
        )
        .unwrap();
        let backend_errors = IntCounterVec::new(
            Opts::new(
                "fencegate_backend_errors_total",
                "Backend operations that failed, by kind.",
            ),
            &["kind"],
        )
        .unwrap();
        let backend_ready = IntGauge::new(
            "fencegate_backend_ready",
            "1 if the latest backend operation or readiness probe succeeded, else 0.",
        )
        .unwrap();
        let store_writable = IntGauge::new(
            "fencegate_store_writable",
            "1 if the latest readiness write probe of the store committed, else 0.",
        )
        .unwrap();
        let fence_cache_entries = IntGauge::new(
            "fencegate_fence_cache_entries",
            "Resources whose highest token is cached in memory.",
        )
        .unwrap();
        let cache_rejections = prometheus::IntCounter::new(
            "fencegate_cache_rejections_total",
            "Stale writes rejected from the fence cache, without asking the store (a part of fencegate_stale_rejections_total).",
        )
        .unwrap();
        let commit_group_size = Histogram::with_opts(
            HistogramOpts::new(
                "fencegate_commit_group_size",
                "Writes applied together in one backend transaction (group commit).",
            )
            .buckets(GROUP_BUCKETS.to_vec()),
        )
        .unwrap();
        let writes_off_lanes = IntGauge::new(
            "fencegate_writes_off_lanes",
            "Postgres: writes of resources whose fence row is locked, waiting off the write lanes.",
        )
        .unwrap();
        let build_info = IntGaugeVec::new(
            Opts::new(
                "fencegate_build_info",
                "Always 1; labelled with the gateway's version.",
            ),
            &["version"],
        )
        .unwrap();
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        // Every series whose labels are known in advance exists from the start, at zero:
        // rate() and increase() need a first sample before the first event to see it.
        let mut answered = Vec::with_capacity(ROUTES.len() * (1 + ErrorCode::ALL.len()));
        for route in ROUTES {
            for outcome in std::iter::once(OK).chain(ErrorCode::ALL.iter().map(|c| c.as_str())) {
                let duration = OnceLock::new();
                if outcome == OK {
                    let _ = duration.set(request_duration.with_label_values(&[route, OK]));
                }
                answered.push(AnsweredSeries {
                    requests: requests.with_label_values(&[route, outcome]),
                    duration,
                });
            }
        }
        for kind in crate::store::StoreError::KINDS {
            backend_errors.with_label_values(&[kind]);
        }

        let pg = DoorMetrics::new();
        let trust = TrustMetrics::new();
        let bounds = BoundMetrics::new();
        let s3 = s3::S3Metrics::new();
        let retries = RetryMetrics::new();
        for collector in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(request_duration.clone()),
            Box::new(stale_rejections.clone()),
            Box::new(highest_token.clone()),
            Box::new(last_rejected_token.clone()),
            Box::new(rejected_token_lag.clone()),
            Box::new(backend_errors.clone()),
            Box::new(backend_ready.clone()),
            Box::new(store_writable.clone()),
            Box::new(fence_cache_entries.clone()),
            Box::new(cache_rejections.clone()),
            Box::new(commit_group_size.clone()),
            Box::new(writes_off_lanes.clone()),
            Box::new(build_info),
        ]
        .into_iter()
        .chain(pg.collectors())
        .chain(trust.collectors())
        .chain(bounds.collectors())
        .chain(retries.collectors())
        .chain(s3.collectors())
        {
            registry
                .register(collector)
                .expect("metric names are unique");
        }
        Metrics {
            registry,
            requests,
            request_duration,
            stale_rejections,
            highest_token,
            last_rejected_token,
            rejected_token_lag,
            backend_errors,
            backend_ready,
            store_writable,
            fence_cache_entries,
            cache_rejections,
            commit_group_size,
            writes_off_lanes,
            answered: answered.into_boxed_slice(),
            labels: ResourceLabels::new(resource_label_cap, labels::IDLE),
            other: ResourceSeries::default(),
            pg,
            trust,
            bounds,
            retries,
            s3,
        }
    }

    /// Counts a keyed write by what became of its key (see `IDEMPOTENCY_OUTCOMES`).
    pub fn idempotency(&self, outcome: &str) {
        self.retries.idempotency.with_label_values(&[outcome]).inc();
    }

    /// Counts expired answers of keyed writes removed.
    /// The stored answers of keyed writes, as the store counted them.
    pub fn stored_answers(&self, records: u64, bytes: u64) {
        let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        self.retries.stored_records.set(gauge(records));
        self.retries.stored_bytes.set(gauge(bytes));
    }

    pub fn idempotency_expired(&self, removed: u64) {
        self.retries.expired.inc_by(removed);
    }

    /// Observes the number of operations of a transaction.
    pub fn txn_operations(&self, operations: usize) {
        self.retries.txn_operations.observe(operations as f64);
    }

    /// Counts a step of a hosted lease.
    pub fn lease_step(&self, step: &str, outcome: &str) {
        self.trust
            .lease_steps
            .with_label_values(&[step, outcome])
            .inc();
    }

    /// Counts a token refused by its resource's issuer (`reason`: see REFUSAL_REASONS).
    pub fn token_refused(&self, reason: &str) {
        self.trust.token_refusals.with_label_values(&[reason]).inc();
    }

    /// Counts an error with a fence SQLSTATE that the fence did not raise.
    /// Counts a request the S3 door answered.
    pub fn s3_answered(&self, method: &str, status: u16, elapsed: std::time::Duration) {
        let method = s3::S3_METHODS
            .iter()
            .find(|known| **known == method)
            .copied()
            .unwrap_or("other");
        let class = match status {
            200..=299 => "2xx",
            300..=399 => "3xx",
            400..=499 => "4xx",
            _ => "5xx",
        };
        self.s3.requests.with_label_values(&[method, class]).inc();
        self.s3
            .duration
            .with_label_values(&[method])
            .observe(elapsed.as_secs_f64());
    }

    /// Counts what the S3 door's collector removed (`kind`: object, intent).
    pub fn s3_collected(&self, kind: &str, count: usize) {
        self.s3
            .collected
            .with_label_values(&[kind])
            .inc_by(count as u64);
    }

    /// Counts a stale rejection by the door it came through.
    pub fn door_stale_rejected(&self, door: &str) {
        self.trust
            .door_stale_rejections
            .with_label_values(&[door])
            .inc();
    }

    pub fn forged_refusal(&self, door: &str) {
        self.trust.forged_refusals.with_label_values(&[door]).inc();
    }

    /// Counts a request turned away at one of the bounds (an [`crate::error::Overload`]).
    pub fn limit_rejected(&self, reason: &str) {
        self.bounds
            .limit_rejections
            .with_label_values(&[reason])
            .inc();
    }

    /// Counts an HTTP connection closed because its client did not read.
    pub fn connection_closed(&self, reason: &str) {
        self.bounds
            .connections_closed
            .with_label_values(&[reason])
            .inc();
    }

    /// The gauge of bytes held by answers waiting for their clients.
    pub fn response_bytes(&self) -> prometheus::IntGauge {
        self.bounds.response_bytes.clone()
    }

    /// Counts sessions of older terms ended by a new term.
    pub fn terms_taken_over(&self, sessions: u64) {
        self.trust.takeovers.inc_by(sessions);
    }

    /// Whether the issuer bindings in the database differ from this gateway's.
    pub fn issuer_bindings_drift(&self, drift: bool) {
        self.trust.bindings_drift.set(i64::from(drift));
    }

    /// Counts the issuer bindings restored over a change without --replace-issuer-bindings.
    pub fn issuer_bindings_restored(&self) {
        self.trust.binding_restores.inc();
    }

    /// Records how the fence database replicates (Postgres).
    pub fn backend_replication(&self, synchronous_standbys: i64, synchronous: bool, timeline: i64) {
        self.trust.synchronous_standbys.set(synchronous_standbys);
        self.trust
            .synchronous_replication
            .set(i64::from(synchronous));
        self.trust.timeline.set(timeline);
    }

    /// Records Patroni's synchronous mode (`None`: unknown).
    pub fn patroni_synchronous_mode(&self, mode: Option<(bool, bool)>) {
        let value = match mode {
            None => -1,
            Some((false, _)) => 0,
            Some((true, false)) => 1,
            Some((true, true)) => 2,
        };
        self.trust.patroni_synchronous_mode.set(value);
    }

    /// Counts a fence found behind a committed token, and restored.
    /// Counts an issuer outside the gateway that went back.
    pub fn issuer_regressed(&self, issuer: &str) {
        self.trust
            .issuer_regressions
            .with_label_values(&[issuer])
            .inc();
    }

    pub fn fence_regressed(&self) {
        self.trust.regressions.inc();
    }

    /// Counts a fence reset applied through this gateway.
    pub fn fence_reset(&self) {
        self.trust.resets.inc();
    }

    /// Records the latest fence reset applied to the cache, and the fence it left.
    pub fn reset_followed(&self, generation: u64, resource: &ResourceName, to: Token) {
        self.trust
            .reset_generation
            .set(i64::try_from(generation).unwrap_or(i64::MAX));
        self.highest_raised(resource, to);
    }

    /// Records an answered request: `outcome` is its error, `None` if it succeeded.
    pub fn answered(&self, route: &str, outcome: Option<ErrorCode>, elapsed: std::time::Duration) {
        let seconds = elapsed.as_secs_f64();
        let Some(series) = answered_index(route, outcome).map(|index| &self.answered[index]) else {
            // A route outside ROUTES: not one the gateway answers, but counted all the same.
            let labels = [route, outcome.map_or(OK, ErrorCode::as_str)];
            self.requests.with_label_values(&labels).inc();
            self.request_duration
                .with_label_values(&labels)
                .observe(seconds);
            return;
        };
        series.requests.inc();
        series
            .duration
            .get_or_init(|| {
                let outcome = outcome.map_or(OK, ErrorCode::as_str);
                self.request_duration.with_label_values(&[route, outcome])
            })
            .observe(seconds);
    }

    /// Records a failed backend call of `kind` (a [`crate::store::StoreError::KINDS`]).
    pub fn backend_error(&self, kind: &str) {
        self.backend_errors.with_label_values(&[kind]).inc();
    }

    /// Records whether the latest backend call succeeded.
    pub fn backend_ready(&self, ready: bool) {
        self.backend_ready.set(i64::from(ready));
    }

    /// Records whether the store's latest write probe committed.
    pub fn store_writable(&self, writable: bool) {
        self.store_writable.set(i64::from(writable));
    }

    /// Counts a stale write rejected from the fence cache.
    pub fn cache_rejection(&self) {
        self.cache_rejections.inc();
    }

    /// Records how many resources the fence cache holds.
    pub fn set_cache_entries(&self, entries: usize) {
        self.fence_cache_entries
            .set(i64::try_from(entries).unwrap_or(i64::MAX));
    }

    /// The gauge of writes waiting off the write lanes, for the Postgres backend.
    pub fn writes_off_lanes(&self) -> IntGauge {
        self.writes_off_lanes.clone()
    }

    /// The histogram a backend observes its group sizes in.
    pub fn commit_group_size(&self) -> Histogram {
        self.commit_group_size.clone()
    }

    /// Records that `resource`'s highest token went up to `token`.
    pub fn highest_raised(&self, resource: &ResourceName, token: Token) {
        self.with_series(resource, |series, label| {
            series
                .highest_token
                .get_or_init(|| self.highest_token.with_label_values(&[label]))
                .set(token.as_i64());
        });
    }

    /// Records a stale rejection.
    pub fn stale_rejected(&self, resource: &ResourceName, presented: Token, highest: Token) {
        self.with_series(resource, |series, label| {
            series
                .stale_rejections
                .get_or_init(|| self.stale_rejections.with_label_values(&[label]))
                .inc();
            series
                .last_rejected_token
                .get_or_init(|| self.last_rejected_token.with_label_values(&[label]))
                .set(presented.as_i64());
        });
        self.rejected_token_lag
            .observe(highest.get().saturating_sub(presented.get()) as f64);
    }

    /// Calls `record` with the series of `resource`'s label, and the label. A resource's
    /// rejection counter is created, at zero, when its label is first used — usually by
    /// its first accepted write, well before a stale one — so that increase() sees its
    /// first rejection.
    fn with_series(&self, resource: &ResourceName, record: impl FnOnce(&ResourceSeries, &str)) {
        let name = resource.as_str();
        let make = || {
            let series = ResourceSeries::default();
            let _ = series
                .stale_rejections
                .set(self.stale_rejections.with_label_values(&[name]));
            series
        };
        self.labels.with(name, make, |label| match label {
            Label::Own { series, evicted } => {
                if let Some(evicted) = evicted {
                    // Its slot went to `resource`: its series go, so that the label set
                    // stays bounded.
                    let _ = self.stale_rejections.remove_label_values(&[&evicted]);
                    let _ = self.highest_token.remove_label_values(&[&evicted]);
                    let _ = self.last_rejected_token.remove_label_values(&[&evicted]);
                }
                record(series, name)
            }
            Label::Other => record(&self.other, OTHER_RESOURCE),
        });
    }

    /// The text exposition of every metric.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 * 1024);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("encoding to a Vec cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_labels_are_capped() {
        let metrics = Metrics::new(2);
        for (name, token) in [("a", 5), ("b", 6), ("c", 7), ("d", 8), ("a", 9)] {
            let resource = ResourceName::new(name).unwrap();
            metrics.stale_rejected(
                &resource,
                Token::new(token).unwrap(),
                Token::new(token + 1).unwrap(),
            );
        }
        let text = String::from_utf8(metrics.encode()).unwrap();
        assert!(
            text.contains("fencegate_stale_rejections_total{resource=\"a\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("fencegate_stale_rejections_total{resource=\"b\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("fencegate_stale_rejections_total{resource=\"_other\"} 2"),
            "{text}"
        );
        assert!(!text.contains("resource=\"c\""), "{text}");
        assert!(
            text.contains("fencegate_last_rejected_token{resource=\"a\"} 9"),
            "{text}"
        );
    }

    #[test]
    fn an_idle_resource_gives_its_slot_and_its_series_away() {
        let mut metrics = Metrics::new(1);
        metrics.labels = ResourceLabels::new(1, std::time::Duration::ZERO);
        let (a, b) = (
            ResourceName::new("a").unwrap(),
            ResourceName::new("b").unwrap(),
        );
        metrics.highest_raised(&a, Token::new(3).unwrap());
        metrics.highest_raised(&b, Token::new(4).unwrap());
        let text = String::from_utf8(metrics.encode()).unwrap();
        assert!(!text.contains("resource=\"a\""), "{text}");
        assert!(
            text.contains("fencegate_highest_token{resource=\"b\"} 4"),
            "{text}"
        );
    }

    /// Each (route, outcome) is counted in its own series, resolved once; a duration
    /// series of an error outcome appears with its first request.
    #[test]
    fn answered_requests_land_in_their_series() {
        let metrics = Metrics::new(10);
        let ms = std::time::Duration::from_millis(3);
        metrics.answered("kv_put", None, ms);
        metrics.answered("kv_put", Some(ErrorCode::StaleToken), ms);
        metrics.answered("kv_put", Some(ErrorCode::StaleToken), ms);
        metrics.answered("sql", Some(ErrorCode::Overloaded), ms);
        metrics.answered("unlisted", None, ms);
        let text = String::from_utf8(metrics.encode()).unwrap();
        for series in [
            "fencegate_requests_total{outcome=\"ok\",route=\"kv_put\"} 1",
            "fencegate_requests_total{outcome=\"stale_token\",route=\"kv_put\"} 2",
            "fencegate_requests_total{outcome=\"overloaded\",route=\"sql\"} 1",
            "fencegate_requests_total{outcome=\"ok\",route=\"unlisted\"} 1",
            "fencegate_requests_total{outcome=\"stale_token\",route=\"sql\"} 0",
            "fencegate_request_duration_seconds_count{outcome=\"ok\",route=\"kv_put\"} 1",
            "fencegate_request_duration_seconds_count{outcome=\"stale_token\",route=\"kv_put\"} 2",
            "fencegate_request_duration_seconds_bucket{outcome=\"overloaded\",route=\"sql\",le=\"0.005\"} 1",
            "fencegate_request_duration_seconds_bucket{outcome=\"overloaded\",route=\"sql\",le=\"0.0025\"} 0",
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        assert!(
            !text.contains(
                "fencegate_request_duration_seconds_count{outcome=\"stale_token\",route=\"sql\"}"
            ),
            "no duration series before its first request:\n{text}"
        );
    }

    #[test]
    fn known_series_start_at_zero() {
        let metrics = Metrics::new(10);
        let text = String::from_utf8(metrics.encode()).unwrap();
        for series in [
            "fencegate_requests_total{outcome=\"stale_token\",route=\"kv_put\"} 0",
            "fencegate_requests_total{outcome=\"overloaded\",route=\"sql\"} 0",
            "fencegate_requests_total{outcome=\"ok\",route=\"readyz\"} 0",
            "fencegate_backend_errors_total{kind=\"connection_lost\"} 0",
            "fencegate_backend_errors_total{kind=\"internal\"} 0",
            "fencegate_request_duration_seconds_count{outcome=\"ok\",route=\"kv_put\"} 0",
        ] {
            assert!(text.contains(series), "{series} missing:\n{text}");
        }
        metrics.highest_raised(&ResourceName::new("r").unwrap(), Token::new(3).unwrap());
        let text = String::from_utf8(metrics.encode()).unwrap();
        assert!(
            text.contains("fencegate_stale_rejections_total{resource=\"r\"} 0"),
            "{text}"
        );
    }
}
