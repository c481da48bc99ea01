//! The gateway's configuration: one struct, every field a flag and an environment variable.
//!
//! [`Config`] holds `serve`'s flags in groups (`groups.rs`), one for each part of the
//! gateway they configure, which takes its group whole.
//!
//! Tests build it with [`Cli::try_parse_from`]; nothing here
//! reads the process environment except through clap.

use std::time::Duration;

use clap::{Args, Parser};

mod commands;
mod groups;
mod issuers;
mod validate;
mod values;

pub use commands::{
    AdminCommand, AdminDatabase, CheckArgs, Command, GrantArgs, GrantsArgs, KeyCommand,
    LeaderLeaseCommand, LeaseTableArgs, ProtectArgs, RetireArgs, RevokeArgs, SchemaOwnerDatabase,
    UnprotectArgs,
};
pub use groups::{
    AuthArgs, DoorArgs, HttpArgs, IdempotencyArgs, LimitArgs, LoggingArgs, ReplicationArgs, S3Args,
    SqlArgs, StoreArgs, TlsArgs,
};
pub use issuers::{Binding, IssuerArgs, IssuerKind, DEFAULT_ETCD_PREFIX, DEFAULT_ZOOKEEPER_PREFIX};
pub use validate::ConfigError;
pub use values::{DoorGrant, Listen, LogFormat};

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
pub const DEFAULT_POOL_SIZE: usize = 16;
pub const DEFAULT_MAX_BODY: &str = "1MiB";
pub const DEFAULT_CACHE_SIZE: usize = 1_000_000;
pub const DEFAULT_METRICS_RESOURCE_CAP: usize = 1000;
pub const DEFAULT_BACKEND_TIMEOUT: &str = "5s";
pub const DEFAULT_SHUTDOWN_TIMEOUT: &str = "30s";
pub const DEFAULT_SQL_MAX_STATEMENTS: usize = 100;
pub const DEFAULT_SQL_STATEMENT_TIMEOUT: &str = "2s";
pub const DEFAULT_SQL_MAX_ROWS: usize = 10_000;
pub const DEFAULT_SQL_MAX_RESPONSE: &str = "4MiB";
pub const DEFAULT_SQL_POOL_SIZE: usize = 8;
pub const DEFAULT_SQL_MAX_STATEMENT_SIZE: &str = "64KiB";
pub const DEFAULT_DATA_DIR: &str = "./fencegate-data";
pub const DEFAULT_GROUP_COMMIT_MAX: usize = 256;
pub const DEFAULT_WRITE_LANES: usize = 2;
pub const DEFAULT_THREADS: usize = 0;
/// Up to this many CPU cores, `--threads 0` runs the gateway on one thread.
pub const ONE_THREAD_UP_TO_CORES: usize = 2;
pub const DEFAULT_HEADER_TIMEOUT: &str = "10s";
pub const DEFAULT_IDLE_TIMEOUT: &str = "60s";
pub const DEFAULT_BODY_TIMEOUT: &str = "30s";
pub const DEFAULT_BODY_FIRST_BYTE_TIMEOUT: &str = "1s";
pub const DEFAULT_WRITE_TIMEOUT: &str = "20s";
pub const DEFAULT_MAX_CLIENT_SHARE: u8 = 25;
pub const DEFAULT_MAX_RESPONSE_MEMORY: &str = "256MiB";
pub const DEFAULT_MAX_PENDING_ANSWERS: usize = 8;
pub const DEFAULT_HTTP2_KEEPALIVE_INTERVAL: &str = "20s";
pub const DEFAULT_HTTP2_KEEPALIVE_TIMEOUT: &str = "10s";
pub const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
pub const DEFAULT_MAX_HEADER_SIZE: &str = "16KiB";
pub const DEFAULT_MAX_WRITES_IN_FLIGHT: usize = 4096;
pub const DEFAULT_MAX_BODY_MEMORY: &str = "64MiB";
pub const DEFAULT_STALE_LOG_LIMIT: u64 = 100;
pub const DEFAULT_WRITE_LOCK_TIMEOUT: &str = "200ms";
pub const DEFAULT_PG_LISTEN: &str = "127.0.0.1:7432";
pub const DEFAULT_PG_MAX_MESSAGE: &str = "256MiB";
/// A third of Postgres's default `max_connections` (100) is left for the gateway's own
/// pools and other clients; the start-up check fits it to the server's real limit.
pub const DEFAULT_PG_MAX_CONNECTIONS: usize = 64;
pub const DEFAULT_PG_MAX_PENDING_AUTH: usize = 16;
pub const DEFAULT_PG_MAX_PENDING_AUTH_PER_PEER: usize = 4;
pub const DEFAULT_PG_STARTUP_TIMEOUT: &str = "5s";
pub const DEFAULT_TERM_TAKEOVER_TIMEOUT: &str = "2s";
pub const DEFAULT_IDEMPOTENCY_TTL: &str = "24h";
pub const DEFAULT_IDEMPOTENCY_IDENTITY_MAX_RECORDS: u64 = 100_000_000;
pub const DEFAULT_IDEMPOTENCY_IDENTITY_MAX_BYTES: &str = "16GiB";
pub const DEFAULT_IDEMPOTENCY_MAX_BYTES: &str = "64GiB";
pub const DEFAULT_IDEMPOTENCY_MAX_ANSWER: &str = "256KiB";
pub const DEFAULT_TXN_MAX_OPERATIONS: usize = 64;
pub const DEFAULT_TXN_MAX_BYTES: &str = "1MiB";
pub const DEFAULT_PG_IDLE_IN_TRANSACTION_TIMEOUT: &str = "60s";
pub const DEFAULT_S3_REGION: &str = "us-east-1";
pub const DEFAULT_S3_MAX_OBJECT: &str = "64MiB";
pub const DEFAULT_S3_UPSTREAM_TIMEOUT: &str = "30s";
pub const DEFAULT_S3_GC_INTERVAL: &str = "10m";
pub const DEFAULT_S3_GC_GRACE: &str = "1h";
pub const DEFAULT_S3_UPLOAD_MAX_AGE: &str = "24h";

/// The headings that group the flags in `--help` and `-h`, by door and concern.
pub mod heading {
    pub const HTTP: &str = "HTTP";
    pub const STORE: &str = "Store and writes";
    pub const LIMITS: &str = "Limits";
    pub const AUTH: &str = "Authentication";
    pub const TLS: &str = "TLS";
    pub const ISSUERS: &str = "Leases and issuers";
    pub const IDEMPOTENCY: &str = "Idempotency";
    pub const PG_DOOR: &str = "Postgres door";
    pub const S3_DOOR: &str = "S3 door";
    pub const SQL: &str = "/v1/sql";
    pub const REPLICATION: &str = "Replication";
    pub const LOGGING: &str = "Logging and metrics";

    /// Every heading, in the order `--help` shows them.
    pub const ALL: [&str; 12] = [
        HTTP,
        STORE,
        LIMITS,
        AUTH,
        TLS,
        ISSUERS,
        IDEMPOTENCY,
        PG_DOOR,
        S3_DOOR,
        SQL,
        REPLICATION,
        LOGGING,
    ];
}

/// fencegate: a fencing gateway in front of your storage.
///
/// Writers send their writes here instead of to the database, each with the fencing
/// token of the lease term it was issued under (header `Fencing-Token`). A write is
/// applied only if its token is at least the highest token the resource has accepted,
/// checked and applied in one database transaction; stale writes get `409 stale_token`.
//
// Every flag's doc comment is a one-line summary, which `-h` shows, then a blank line
// and the details, which `--help` adds. `term_width = 0` keeps each summary on the
// flag's line in `-h`: at clap's default width of 100 columns, one long line would put
// every help of its heading under its flag instead.
#[derive(Debug, Parser)]
#[command(
    name = "fencegate",
    version,
    args_conflicts_with_subcommands = true,
    term_width = 0
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub serve: Config,
}

impl Cli {
    /// The command to run: `serve` with the top-level flags unless another was given.
    pub fn into_command(self) -> Command {
        self.command
            .unwrap_or_else(|| Command::Serve(Box::new(self.serve)))
    }
}

/// `serve`: every flag of the gateway, in groups that are the options of the parts
/// they configure.
#[derive(Debug, Clone, Args)]
pub struct Config {
    #[command(flatten)]
    pub http: HttpArgs,

    #[command(flatten)]
    pub store: StoreArgs,

    #[command(flatten)]
    pub limits: LimitArgs,

    #[command(flatten)]
    pub auth: AuthArgs,

    #[command(flatten)]
    pub tls: TlsArgs,

    #[command(flatten)]
    pub issuers: IssuerArgs,

    /// Wait before a new term ends older terms' sessions.
    ///
    /// Postgres: how long a new term waits to raise a fence that sessions of an older
    /// term hold (open transactions through the door, /v1/sql, or writers' own
    /// connections) before it ends them, so that no older term can hold a newer one
    /// off for longer. Their transactions roll back. 0: wait as long as they hold it.
    /// Needs the gateway's login to be a member of pg_signal_backend.
    #[arg(long, env = "FENCEGATE_TERM_TAKEOVER_TIMEOUT", default_value = DEFAULT_TERM_TAKEOVER_TIMEOUT, value_parser = humantime::parse_duration, value_name = "DURATION", help_heading = heading::ISSUERS)]
    pub term_takeover_timeout: Duration,

    #[command(flatten)]
    pub idempotency: IdempotencyArgs,

    #[command(flatten)]
    pub door: DoorArgs,

    #[command(flatten)]
    pub s3: S3Args,

    #[command(flatten)]
    pub sql: SqlArgs,

    #[command(flatten)]
    pub replication: ReplicationArgs,

    #[command(flatten)]
    pub logging: LoggingArgs,
}

#[cfg(test)]
mod tests;
