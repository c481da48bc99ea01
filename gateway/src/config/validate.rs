//! What the flags mean together: the settings derived from several flags, and the
//! checks that refuse a configuration that cannot work, each with the sentence that
//! says why.

use std::net::SocketAddr;
use std::time::Duration;

use super::{Config, IssuerKind, Listen, DEFAULT_PG_MAX_CONNECTIONS, ONE_THREAD_UP_TO_CORES};

/// A setting that cannot work, with the sentence that says why.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
pub struct ConfigError(pub(super) String);

impl Config {
    /// The Postgres door's address, if it runs: with the Postgres backend, unless
    /// `--pg-listen off`.
    pub fn pg_door(&self) -> Option<SocketAddr> {
        match (self.door.pg_listen, &self.store.database_url) {
            (Listen::On(addr), Some(_)) => Some(addr),
            _ => None,
        }
    }

    /// Whether the Postgres door refuses clients without TLS: `--pg-require-tls`, by
    /// default on exactly when the door has a certificate.
    pub fn pg_requires_tls(&self) -> bool {
        self.door
            .pg_require_tls
            .unwrap_or(self.door.pg_tls_cert.is_some())
    }

    /// `--pg-max-connections`, or its default.
    pub fn pg_max_connections(&self) -> usize {
        self.door
            .pg_max_connections
            .unwrap_or(DEFAULT_PG_MAX_CONNECTIONS)
    }

    /// The threads to serve requests on, for a process that may use `cores` CPU cores:
    /// `--threads`, or for 0 the choice its help describes. On two cores shared with the
    /// database and the clients, one thread spent less CPU per accepted write than two
    /// (half as much for a single writer, a sixth less at 64) and answered stale writes
    /// 10–20 % faster (BENCHMARKS.md, "One thread on two cores").
    pub fn serving_threads(&self, cores: usize) -> usize {
        match self.http.threads {
            0 if cores <= ONE_THREAD_UP_TO_CORES => 1,
            0 => cores,
            threads => threads,
        }
    }

    /// Rejects settings that are individually well-formed but cannot work.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let fail = |msg: &str| Err(ConfigError(msg.to_owned()));
        if self.store.group_commit_max == 0 {
            return fail("--group-commit-max must be at least 1");
        }
        if self.store.database_url.is_none()
            && (self.replication.require_synchronous_replication
                || !self.replication.patroni_url.is_empty())
        {
            return fail(
                "--require-synchronous-replication and --patroni-url need the Postgres \
                 backend (--database-url)",
            );
        }
        for url in &self.replication.patroni_url {
            if !(url.starts_with("http://")
                && url
                    .parse::<hyper::Uri>()
                    .is_ok_and(|uri| uri.host().is_some()))
            {
                return fail(
                    "--patroni-url must be an http:// URL of a Patroni REST API, such as \
                     http://db-1:8008",
                );
            }
        }
        if self.store.pool_size == 0 {
            return fail("--pool-size must be at least 1");
        }
        if self.store.write_lanes == 0 {
            return fail("--write-lanes must be at least 1");
        }
        if self.store.write_lock_timeout < Duration::from_millis(1) {
            return fail("--write-lock-timeout must be at least 1ms");
        }
        if self.limits.max_body == 0 {
            return fail("--max-body must be at least 1 byte");
        }
        if self.store.cache_size == 0 {
            return fail("--cache-size must be at least 1");
        }
        if self.store.backend_timeout < Duration::from_millis(10) {
            return fail("--backend-timeout must be at least 10ms");
        }
        for (flag, value) in [
            ("--header-timeout", self.http.header_timeout),
            ("--idle-timeout", self.http.idle_timeout),
            ("--body-timeout", self.http.body_timeout),
            (
                "--http2-keepalive-interval",
                self.http.http2_keepalive_interval,
            ),
            (
                "--http2-keepalive-timeout",
                self.http.http2_keepalive_timeout,
            ),
        ] {
            if value < Duration::from_millis(10) {
                return Err(ConfigError(format!("{flag} must be at least 10ms")));
            }
        }
        if self.http.max_connections == 0 {
            return fail("--max-connections must be at least 1");
        }
        if self.http.max_header_size < 1024 {
            return fail("--max-header-size must be at least 1KiB");
        }
        if self.limits.max_writes_in_flight == 0 {
            return fail("--max-writes-in-flight must be at least 1");
        }
        if self.auth.auth_file.is_none()
            && !self.auth.insecure_no_auth
            && !self.http.listen.ip().is_loopback()
        {
            return Err(ConfigError(format!(
                "--listen {} is reachable from other hosts, and without --auth-file anyone there \
                 could write, advance or read any resource: give an --auth-file (docs/auth.md), \
                 or say --insecure-no-auth",
                self.http.listen
            )));
        }
        let leader_lease_bound = self
            .issuers
            .bindings
            .iter()
            .any(|binding| binding.issuer == IssuerKind::LeaderLease);
        if leader_lease_bound
            && self.issuers.leader_lease_url.is_none()
            && self.store.database_url.is_none()
        {
            return fail("--issued-by leader_lease:... needs the database of the leader_lease table: --leader-lease-url, or --database-url");
        }
        let bound = |kind: IssuerKind| {
            self.issuers
                .bindings
                .iter()
                .any(|binding| binding.issuer == kind)
        };
        if bound(IssuerKind::Etcd) && self.issuers.etcd_endpoints.is_empty() {
            return fail("--issued-by etcd:... needs the etcd cluster: --etcd-endpoints");
        }
        if bound(IssuerKind::ZooKeeper) && self.issuers.zookeeper_connect.is_none() {
            return fail(
                "--issued-by zookeeper:... needs the ZooKeeper ensemble: --zookeeper-connect",
            );
        }
        if self.store.init_store && self.store.database_url.is_some() {
            return fail("--init-store is for the embedded store (--data-dir); with --database-url the gateway keeps its fences in Postgres");
        }
        if self.auth.auth_file.is_some() && self.auth.insecure_no_auth {
            return fail("--insecure-no-auth and --auth-file contradict each other");
        }
        if self.door.pg_tls_cert.is_some() && self.pg_door().is_none() {
            return fail("--pg-tls-cert and --pg-tls-key need the Postgres door: --database-url, and --pg-listen not `off`");
        }
        if self.door.pg_max_message < 1024 {
            return fail("--pg-max-message must be at least 1KiB");
        }
        if self.pg_max_connections() == 0 {
            return fail("--pg-max-connections must be at least 1");
        }
        if self.door.pg_max_pending_auth == 0 || self.door.pg_max_pending_auth_per_peer == 0 {
            return fail(
                "--pg-max-pending-auth and --pg-max-pending-auth-per-peer must be at least 1",
            );
        }
        self.validate_door_tls()?;
        if self.door.pg_startup_timeout < Duration::from_millis(10) {
            return fail("--pg-startup-timeout must be at least 10ms");
        }
        if self.limits.max_body_memory < self.limits.max_body {
            return fail("--max-body-memory must be at least --max-body, or no body of the largest size could be read");
        }
        self.validate_sql()
    }

    /// The door's TLS rules: TLS required only with a certificate to offer, and no
    /// cleartext door on an address other hosts reach unless asked for.
    fn validate_door_tls(&self) -> Result<(), ConfigError> {
        let Some(addr) = self.pg_door() else {
            return Ok(());
        };
        if self.door.pg_require_tls == Some(true) && self.door.pg_tls_cert.is_none() {
            return Err(ConfigError(
                "--pg-require-tls needs --pg-tls-cert and --pg-tls-key: without a certificate \
                 no client could connect"
                    .to_owned(),
            ));
        }
        if self.door.pg_tls_cert.is_none()
            && !self.door.pg_insecure_cleartext
            && !addr.ip().is_loopback()
        {
            return Err(ConfigError(format!(
                "--pg-listen {addr} is reachable from other hosts, and without --pg-tls-cert \
                 writers' passwords and data would cross the network in cleartext: give \
                 --pg-tls-cert and --pg-tls-key (docs/postgres-door.md), or say \
                 --pg-insecure-cleartext"
            )));
        }
        Ok(())
    }

    /// The `--sql-*` rules: limits that can work, and no SQL setting without `--sql`.
    fn validate_sql(&self) -> Result<(), ConfigError> {
        let fail = |msg: &str| Err(ConfigError(msg.to_owned()));
        if !self.sql.enabled {
            if self.sql.sql_role.is_some()
                || self.sql.sql_allow_ddl
                || self.sql.sql_database_url.is_some()
            {
                return fail("--sql-database-url, --sql-role and --sql-allow-ddl need --sql");
            }
            return Ok(());
        }
        if self.store.database_url.is_none() {
            return fail("--sql needs the Postgres backend (--database-url)");
        }
        if self.sql.sql_database_url.is_none() {
            return fail(
                "--sql needs --sql-database-url: the login of a writer-only role for writers' \
                 SQL, separate from the gateway's own --database-url (see docs/sql.md)",
            );
        }
        if self.sql.sql_pool_size == 0 {
            return fail("--sql-pool-size must be at least 1");
        }
        if self.sql.sql_max_statement_size == 0 {
            return fail("--sql-max-statement-size must be at least 1 byte");
        }
        if self
            .sql
            .sql_role
            .as_deref()
            .is_some_and(|role| role.is_empty() || role.contains('\0'))
        {
            return fail("--sql-role must be a role name");
        }
        if self.sql.sql_max_statements == 0 {
            return fail("--sql-max-statements must be at least 1");
        }
        if self.sql.sql_max_rows == 0 {
            return fail("--sql-max-rows must be at least 1");
        }
        if self.limits.max_pending_answers == 0 {
            return fail("--max-pending-answers must be at least 1");
        }
        if self.limits.txn_max_operations == 0 {
            return fail("--txn-max-operations must be at least 1");
        }
        if self.limits.txn_max_bytes == 0 {
            return fail("--txn-max-bytes must be at least 1 byte");
        }
        if self.idempotency.idempotency_ttl < Duration::from_secs(1) {
            return fail("--idempotency-ttl must be at least 1s: a retry must find its answer");
        }
        if self.idempotency.idempotency_identity_max_records == 0
            || self.idempotency.idempotency_identity_max_bytes == 0
            || self.idempotency.idempotency_max_bytes == 0
        {
            return fail("--idempotency-identity-max-records, --idempotency-identity-max-bytes and --idempotency-max-bytes must each be at least 1");
        }
        if self.idempotency.idempotency_max_answer < 1024 {
            return fail("--idempotency-max-answer must be at least 1KiB");
        }
        if self.sql.sql_max_response == 0 {
            return fail("--sql-max-response must be at least 1 byte");
        }
        if self.sql.enabled && self.sql.sql_max_response > self.limits.max_response_memory {
            return fail("--sql-max-response must not exceed --max-response-memory: a /v1/sql transaction claims room for its answer at that bound before it runs");
        }
        if self.sql.sql_statement_timeout < Duration::from_millis(1) {
            return fail("--sql-statement-timeout must be at least 1ms");
        }
        if self.sql.sql_statement_timeout > self.store.backend_timeout {
            return fail("--sql-statement-timeout must not exceed --backend-timeout, which bounds the whole transaction");
        }
        Ok(())
    }
}
