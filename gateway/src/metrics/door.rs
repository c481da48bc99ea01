//! The Postgres door's own metrics: connections, sessions, bytes relayed, cancel
//! requests, refusals and protocol errors.

use prometheus::{IntCounter, IntCounterVec, IntGauge, Opts};

use super::Metrics;

/// The Postgres door's own metrics.
pub(super) struct DoorMetrics {
    connections: IntGauge,
    sessions: IntCounter,
    bytes: IntCounterVec,
    /// The two series of `bytes`, resolved once: they are counted per message.
    bytes_from_client: IntCounter,
    bytes_to_client: IntCounter,
    cancels: IntCounterVec,
    auth_failures: IntCounter,
    protocol_errors: IntCounter,
    refusals: IntCounterVec,
    not_primary: IntCounterVec,
}

/// The `direction` label of `fencegate_pg_bytes_total`.
pub const PG_DIRECTIONS: [&str; 2] = ["from_client", "to_client"];

/// The `outcome` label of `fencegate_pg_cancels_total`.
pub const PG_CANCEL_OUTCOMES: [&str; 2] = ["forwarded", "unknown_key"];

/// The `reason` label of `fencegate_pg_refusals_total`.
pub const PG_REFUSAL_REASONS: [&str; 8] = [
    "tls_required",
    "not_allowed",
    "auth_pending",
    "auth_pending_peer",
    "auth_timeout",
    "connections",
    "server_not_audited",
    "not_synchronously_replicated",
];

/// The `during` label of `fencegate_pg_not_primary_total`: the session's login, or the
/// session itself (its server turned read-only).
pub const PG_NOT_PRIMARY_DURING: [&str; 2] = ["login", "session"];

impl DoorMetrics {
    pub(super) fn new() -> DoorMetrics {
        let bytes = IntCounterVec::new(
            Opts::new(
                "fencegate_pg_bytes_total",
                "Bytes relayed by the Postgres door, by direction.",
            ),
            &["direction"],
        )
        .unwrap();
        let cancels = IntCounterVec::new(
            Opts::new(
                "fencegate_pg_cancels_total",
                "Cancel requests received by the Postgres door: forwarded to a session's backend, or with an unknown key.",
            ),
            &["outcome"],
        )
        .unwrap();
        let refusals = IntCounterVec::new(
            Opts::new(
                "fencegate_pg_refusals_total",
                "Postgres door clients refused before reaching the database, by reason.",
            ),
            &["reason"],
        )
        .unwrap();
        for reason in PG_REFUSAL_REASONS {
            refusals.with_label_values(&[reason]);
        }
        let not_primary = IntCounterVec::new(
            Opts::new(
                "fencegate_pg_not_primary_total",
                "Postgres door sessions ended because their server was not, or no longer, the primary (target_session_attrs=read-write), by when it showed.",
            ),
            &["during"],
        )
        .unwrap();
        for during in PG_NOT_PRIMARY_DURING {
            not_primary.with_label_values(&[during]);
        }
        let [from_client, to_client] = PG_DIRECTIONS;
        for outcome in PG_CANCEL_OUTCOMES {
            cancels.with_label_values(&[outcome]);
        }
        DoorMetrics {
            connections: IntGauge::new(
                "fencegate_pg_connections",
                "Client connections open on the Postgres door.",
            )
            .unwrap(),
            sessions: IntCounter::new(
                "fencegate_pg_sessions_total",
                "Postgres door sessions that completed authentication.",
            )
            .unwrap(),
            bytes_from_client: bytes.with_label_values(&[from_client]),
            bytes_to_client: bytes.with_label_values(&[to_client]),
            bytes,
            cancels,
            auth_failures: IntCounter::new(
                "fencegate_pg_auth_failures_total",
                "Postgres door sessions refused during authentication.",
            )
            .unwrap(),
            protocol_errors: IntCounter::new(
                "fencegate_pg_protocol_errors_total",
                "Postgres door connections closed because the client broke the protocol.",
            )
            .unwrap(),
            refusals,
            not_primary,
        }
    }

    pub(super) fn collectors(&self) -> [Box<dyn prometheus::core::Collector>; 8] {
        [
            Box::new(self.connections.clone()),
            Box::new(self.sessions.clone()),
            Box::new(self.bytes.clone()),
            Box::new(self.cancels.clone()),
            Box::new(self.auth_failures.clone()),
            Box::new(self.protocol_errors.clone()),
            Box::new(self.refusals.clone()),
            Box::new(self.not_primary.clone()),
        ]
    }
}

/// An open Postgres door connection, counted until dropped.
pub struct OpenConnection<'a>(&'a IntGauge);

impl Drop for OpenConnection<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Metrics {
    /// Counts a Postgres door connection as open until the guard is dropped.
    pub fn pg_connection_opened(&self) -> OpenConnection<'_> {
        self.pg.connections.inc();
        OpenConnection(&self.pg.connections)
    }

    /// Counts a Postgres door session that completed authentication.
    pub fn pg_session(&self) {
        self.pg.sessions.inc();
    }

    /// Counts bytes relayed from a Postgres client to the server.
    pub fn pg_bytes_from_client(&self, bytes: usize) {
        self.pg.bytes_from_client.inc_by(bytes as u64);
    }

    /// Counts bytes relayed from the server to a Postgres client.
    pub fn pg_bytes_to_client(&self, bytes: usize) {
        self.pg.bytes_to_client.inc_by(bytes as u64);
    }

    /// Counts a cancel request: forwarded, or with an unknown key.
    pub fn pg_cancel(&self, forwarded: bool) {
        let outcome = PG_CANCEL_OUTCOMES[usize::from(!forwarded)];
        self.pg.cancels.with_label_values(&[outcome]).inc();
    }

    /// Counts a session refused during authentication.
    pub fn pg_auth_failure(&self) {
        self.pg.auth_failures.inc();
    }

    /// Counts a connection closed for breaking the protocol.
    pub fn pg_protocol_error(&self) {
        self.pg.protocol_errors.inc();
    }

    /// Counts a client the door refused, by `reason` (one of [`PG_REFUSAL_REASONS`]).
    pub fn pg_refused(&self, reason: &str) {
        self.pg.refusals.with_label_values(&[reason]).inc();
    }

    /// Counts a session ended because its server is not the primary, `during` (one of
    /// [`PG_NOT_PRIMARY_DURING`]) its login or later.
    pub fn pg_not_primary(&self, during: &str) {
        self.pg.not_primary.with_label_values(&[during]).inc();
    }
}
