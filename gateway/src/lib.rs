//! fencegate: an HTTP gateway that applies a write only if its fencing token is current.
//!
//! Writers holding a lease send their writes here with the lease's fencing token. For
//! each resource the gateway keeps the highest token it has accepted and applies a
//! write only if its token is at least that high — checked and applied in one
//! database transaction, so that a paused leader or a delayed packet from an old term
//! can never land after a newer term has written.
//!
//! # Layout
//!
//! - [`config`]: the command line and environment, validated.
//! - [`auth`]: identities, their keys and grants (`--auth-file`).
//! - `server`: the HTTP listener (HTTP/1.1 and HTTP/2, in cleartext or over TLS with
//!   client certificates) and its graceful shutdown.
//! - `accept`, `tls`: what the two listeners — HTTP and the Postgres door — share: the
//!   accept loop's back-off and drain under the gateway's one shutdown, and TLS loaded
//!   and reloaded one way.
//! - `reload`: files read again when they change (the auth file, the TLS files).
//! - `api`: routing and the endpoint handlers.
//! - `coordinator`: shared state, and the road of every backend call: the checks before
//!   a write in their one order (`admit`: the fence cache, a write permit, the issuer),
//!   the backend in a task of its own, and what committed recorded. Its parts:
//!   `fence_cache` (resource -> highest committed token, for rejecting stale writes
//!   early) and `issuers` (the lease stores whose tokens the gateway checks).
//! - [`store`]: the backends, with the contract every one of them keeps.
//! - [`dbfence`]: the fence check inside Postgres, for writers' own tables: the
//!   `fencegate.fence()` function, the triggers of protected tables, and how its
//!   refusals are read and proven.
//! - [`admin`]: the operator's commands on a database (`protect`, `unprotect`,
//!   `check`, `grant`, `leader-lease guard`…), above the store whose schema they
//!   migrate first.
//! - `sql`: fenced SQL transactions (`/v1/sql`) on a writer-only login.
//! - `pgdoor`: the Postgres door, a session relay for writers that keep their own
//!   Postgres driver; the fence runs in the database, the door counts its rejections.
//! - [`pgtls`]: TLS to Postgres, as the `sslmode` of each database URL asks, for every
//!   upstream connection.
//! - `metrics`, `log_budget`, [`telemetry`]: Prometheus metrics and logging.
//!
//! # Invariants
//!
//! 1. A write is applied only if, at commit time, its token is >= the durable highest
//!    token of its resource, and the durable highest becomes `max(highest, token)` in the
//!    same transaction (`store`).
//! 2. The fence cache never holds a value above the durable one, so a rejection from it
//!    is always correct (`fence_cache`).
//! 3. Tokens never go down for a resource, across restarts and replicas (`store`).
//! 4. A failed or rolled-back write changes nothing (`store`).
//! 5. Gateways keep no authoritative state: several replicas on one database are as
//!    safe as one.
#![forbid(unsafe_code)]

pub(crate) mod accept;
pub mod admin;
pub(crate) mod api;
pub mod auth;
pub mod config;
pub(crate) mod coordinator;
pub mod dbfence;
pub(crate) mod error;
pub(crate) mod log_budget;
pub(crate) mod metrics;
pub(crate) mod pgdoor;
pub mod pgtls;
pub(crate) mod reload;
pub(crate) mod server;
pub(crate) mod sql;
pub mod store;
pub mod telemetry;
pub(crate) mod tls;

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{Cli, Config};

use crate::config::ConfigError;
use crate::coordinator::Coordinator;
use crate::metrics::Metrics;
use crate::sql::{SqlEndpoint, SqlService, SqlStartError};
use crate::store::embedded::EmbeddedStartError;
use crate::store::postgres::{PgOptions, PgStartError};
use crate::store::{EmbeddedStore, PgStore, Store};

/// Why the gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Postgres(#[from] PgStartError),
    #[error(transparent)]
    Embedded(#[from] EmbeddedStartError),
    #[error(transparent)]
    Sql(#[from] SqlStartError),
    #[error(transparent)]
    Auth(#[from] auth::AuthFileError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("invalid issuer binding: {0}")]
    Issuers(String),
    #[error("could not record the gateway's settings in the database: {0}")]
    Settings(store::StoreError),
    #[error("the listener has no local address: {0}")]
    Listener(std::io::Error),
    #[error(transparent)]
    PgDoor(#[from] pgdoor::DoorStartError),
    #[error("the Postgres door: {0}")]
    PgCapacity(String),
    #[error("could not listen on {addr} for the Postgres door (--pg-listen): {source}")]
    PgListen {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
}

/// Runs the gateway on `listener` until `shutdown` completes, then finishes the
/// requests in flight and returns.
pub async fn run(
    config: Config,
    listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) -> Result<(), StartError> {
    config.validate()?;
    // Backend selection: a database URL means Postgres; otherwise the embedded store.
    let metrics = Metrics::new(config.metrics_resource_cap);
    let store = match config.database_url.as_deref() {
        Some(url) => Store::Postgres(
            PgStore::connect(
                url,
                PgOptions {
                    pool_size: config.pool_size,
                    timeout: config.backend_timeout,
                    write_lanes: config.write_lanes,
                    group_commit_max: config.group_commit_max,
                    lane_lock_timeout: config.write_lock_timeout,
                    term_takeover: config.term_takeover_timeout,
                    group_size: metrics.commit_group_size(),
                    off_lanes: metrics.writes_off_lanes(),
                },
            )
            .await?,
        ),
        None => Store::Embedded(EmbeddedStore::open(
            &config.data_dir,
            config.init_store,
            config.group_commit_max,
            config.backend_timeout,
            metrics.commit_group_size(),
        )?),
    };
    let sql = match &store {
        Store::Postgres(pg) if config.sql => {
            SqlEndpoint::Enabled(Arc::new(SqlService::connect(&config, pg).await?))
        }
        Store::Postgres(_) => SqlEndpoint::Disabled,
        Store::Embedded(_) => SqlEndpoint::NotSupported,
    };
    let auth = match &config.auth_file {
        Some(path) => {
            let auth = Arc::new(auth::Authenticator::load(path)?);
            tokio::spawn(Arc::clone(&auth).watch());
            Some(auth)
        }
        None => None,
    };
    let tls = tls::Tls::start(config.tls_cert.clone().zip(config.tls_key.clone()).map(
        |(cert, key)| tls::TlsFiles {
            listener: tls::Listener::Http,
            cert,
            key,
            client_ca: config.tls_client_ca.clone(),
        },
    ))?;
    warn_of_idle_certificate_settings(auth.as_deref(), tls.as_deref());
    let issuers =
        coordinator::issuers::Issuers::new(&config.issuers, config.database_url.as_deref())
            .map_err(StartError::Issuers)?;
    issuers
        .check_leader_lease_table()
        .await
        .map_err(StartError::Issuers)?;
    let bindings_generation = match &store {
        Store::Postgres(pg) => Some(record_bindings(&config, pg).await?),
        Store::Embedded(_) => None,
    };
    let pg_max_connections = match &store {
        Store::Postgres(pg) if config.pg_door().is_some() => pgdoor::capacity::settle(&config, pg)
            .await
            .map_err(StartError::PgCapacity)?,
        _ => config.pg_max_connections(),
    };
    let stop = CancellationToken::new();
    let coordinator = Arc::new(Coordinator::new(
        &config,
        coordinator::Parts {
            shutdown: stop.clone(),
            store,
            sql,
            metrics,
            auth,
            issuers,
            bindings_generation,
        },
    )?);
    let limits = server::Limits {
        max_connections: server::connection_cap(config.max_connections),
        max_header_size: config.max_header_size,
        deadlines: server::conn::Deadlines {
            idle: config.idle_timeout,
            header: config.header_timeout,
            write: config.write_timeout,
        },
        http2_keep_alive_interval: config.http2_keepalive_interval,
        http2_keep_alive_timeout: config.http2_keepalive_timeout,
        grace: config.shutdown_timeout,
        max_response_memory: config.max_response_memory,
        max_pending_answers: config.max_pending_answers,
    };
    let door = match (config.pg_door(), config.database_url.as_deref()) {
        (Some(addr), Some(url)) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::PgListen { addr, source })?;
            let tls = tls::Tls::start(
                config
                    .pg_tls_cert
                    .clone()
                    .zip(config.pg_tls_key.clone())
                    .map(|(cert, key)| tls::TlsFiles {
                        listener: tls::Listener::Postgres,
                        cert,
                        key,
                        client_ca: None,
                    }),
            )?;
            let options = pgdoor::DoorOptions {
                max_message: config.pg_max_message,
                max_connections: pg_max_connections,
                max_pending_auth: config.pg_max_pending_auth,
                max_pending_auth_per_peer: config.pg_max_pending_auth_per_peer,
                require_tls: config.pg_requires_tls(),
                allow: config.pg_allow.clone(),
                startup_timeout: config.pg_startup_timeout,
                grace: config.shutdown_timeout,
                idle_in_transaction: Some(config.pg_idle_in_transaction_timeout)
                    .filter(|timeout| !timeout.is_zero()),
            };
            let door =
                pgdoor::Door::new(url, tls, &options, Arc::clone(&coordinator), stop.clone())?;
            Some((listener, Arc::new(door), options))
        }
        _ => None,
    };
    Coordinator::audit_new_servers(&coordinator);
    tokio::spawn(Arc::clone(&coordinator).summarise_unlogged_rejections());
    let expire_every = (config.idempotency_ttl / 4).min(std::time::Duration::from_secs(60));
    tokio::spawn(Arc::clone(&coordinator).expire_idempotency(expire_every));
    tokio::spawn(Arc::clone(&coordinator).follow_answers(coordinator::ANSWERS_REPORT));
    coordinator.start_following_resets().await;
    tokio::spawn(Arc::clone(&coordinator).follow_resets());
    // One write probe before the first /readyz, so that fencegate_store_writable says
    // from the start whether the store takes writes (a failure is logged by the probe).
    if let Err(error) = coordinator.writable().await {
        tracing::warn!(%error, "the store could not be probed for writes at start");
    }
    let replication = coordinator.check_replication().await;
    tokio::spawn(Arc::clone(&coordinator).watch_replication());
    tokio::spawn(Arc::clone(&coordinator).watch_issuers());
    let addr = listener.local_addr().map_err(StartError::Listener)?;
    let pg_addr = match &door {
        Some((listener, ..)) => Some(listener.local_addr().map_err(StartError::Listener)?),
        None => None,
    };
    tracing::info!(
        %addr,
        pg_addr = pg_addr.map(tracing::field::display),
        tls = match &tls {
            None => "off",
            Some(tls) if tls.verifies_clients() => "on, client certificates",
            Some(_) => "on",
        },
        pg_tls = door.as_ref().map(|(_, door, _)| door.has_tls()),
        pg_require_tls = door.as_ref().map(|_| config.pg_requires_tls()),
        pg_max_connections = door.as_ref().map(|(.., options)| options.max_connections),
        backend = %coordinator.describe_backend(),
        replication = replication.as_ref().map(|reading| reading.describe()),
        timeline = replication.as_ref().map(|reading| reading.timeline),
        require_synchronous_replication = config.require_synchronous_replication,
        auth = coordinator.authenticator().map(|auth| auth.identities().len()),
        max_connections = limits.max_connections,
        threads = tokio::runtime::Handle::current().metrics().num_workers(),
        "fencegate ready"
    );
    // One shutdown for both listeners, and for the requests reading a body.
    let signal = async {
        shutdown.await;
        stop.cancel();
    };
    let http = server::serve(
        listener,
        Arc::clone(&coordinator),
        stop.clone(),
        limits,
        tls,
    );
    match door {
        Some((listener, door, options)) => {
            tokio::join!(signal, http, pgdoor::serve(listener, door, options));
        }
        None => {
            tokio::join!(signal, http);
        }
    }
    tracing::info!("fencegate stopped");
    Ok(())
}

/// Adopts or writes the issuer bindings the in-database fence and every replica follow
/// (see [`store::postgres::bindings`]), and the settings the schema's functions read;
/// returns the bindings' generation.
async fn record_bindings(config: &Config, pg: &PgStore) -> Result<i64, StartError> {
    use store::postgres::bindings::{describe, Adopted};
    let flags = &config.issuers.bindings;
    let adopted = pg
        .adopt_bindings(flags, config.issuers.replace_issuer_bindings)
        .await
        .map_err(|error| StartError::Issuers(format!("could not record the bindings: {error}")))?;
    let generation = match adopted {
        Adopted::Same { generation } => generation,
        Adopted::Written { generation } => {
            tracing::info!(
                generation,
                "recorded this gateway's issuer bindings in the database"
            );
            generation
        }
        Adopted::Differs { recorded } => {
            let ours: Vec<_> = flags
                .iter()
                .map(|b| {
                    let (pattern, prefix) = b.pattern.parts();
                    (pattern.to_owned(), prefix, b.issuer.as_str().to_owned())
                })
                .collect();
            return Err(StartError::Issuers(format!(
                "the issuer bindings recorded in the database ({}) differ from --issued-by ({}); \
                 every replica and the in-database fence follow the recorded ones. Start with \
                 the same flags, or with --replace-issuer-bindings to replace them",
                describe(&recorded),
                describe(&ours)
            )));
        }
    };
    let takeover = config.term_takeover_timeout.as_millis().to_string();
    pg.set_setting("term_takeover_timeout_ms", &takeover)
        .await
        .map_err(StartError::Settings)?;
    Ok(generation)
}

/// Client certificates authenticate only when both the TLS layer verifies them
/// (`--tls-client-ca`) and the auth file names them: half of that is likely a mistake.
fn warn_of_idle_certificate_settings(auth: Option<&auth::Authenticator>, tls: Option<&tls::Tls>) {
    let verifies = tls.is_some_and(|tls| tls.verifies_clients());
    match auth {
        None if verifies => tracing::warn!(
            "--tls-client-ca without --auth-file: client certificates are verified but grant nothing"
        ),
        Some(auth) if !verifies && auth.identities().lists_certificates() => tracing::warn!(
            "the auth file lists certificate names, but without --tls-cert and --tls-client-ca \
             no client presents a certificate: those names authenticate no one"
        ),
        _ => {}
    }
}
