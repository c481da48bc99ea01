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
pub mod s3door;
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
use crate::sql::{SqlEndpoint, SqlStartError};
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
    #[error(transparent)]
    S3Door(#[from] s3door::S3StartError),
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
    let metrics = Metrics::new(config.logging.metrics_resource_cap);
    let store = open_store(&config, &metrics).await?;
    let sql = SqlEndpoint::start(&config, &store).await?;
    let auth = (config.auth.auth_file.as_deref())
        .map(auth::Authenticator::load)
        .transpose()?
        .map(Arc::new);
    let tls = tls::Tls::start(tls::TlsFiles::http(&config.tls))?;
    warn_of_idle_certificate_settings(auth.as_deref(), tls.as_deref());
    let (issuers, bindings_generation) = issuers(&config, &store).await?;
    let pg_max_connections = door_capacity(&config, &store).await?;
    let stop = CancellationToken::new();
    let parts = coordinator::Parts {
        shutdown: stop.clone(),
        store,
        sql,
        metrics,
        auth,
        issuers,
        bindings_generation,
    };
    let coordinator = Arc::new(Coordinator::new(&config, parts)?);
    let door = open_door(&config, pg_max_connections, &coordinator).await?;
    let s3 = s3door::open(&config.s3, &coordinator).await?;
    let replication = coordinator.start().await;
    let limits = server::Limits::new(&config.http, &config.limits);
    let addr = listener.local_addr().map_err(StartError::Listener)?;
    let pg_addr = (door.as_ref().map(|(listener, ..)| listener.local_addr()))
        .transpose()
        .map_err(StartError::Listener)?;
    let s3_addr = (s3.as_ref().map(|door| door.listener.local_addr()))
        .transpose()
        .map_err(StartError::Listener)?;
    tracing::info!(
        %addr,
        pg_addr = pg_addr.map(tracing::field::display),
        s3_addr = s3_addr.map(tracing::field::display),
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
        require_synchronous_replication = config.replication.require_synchronous_replication,
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
    let pg = async {
        if let Some((listener, door, options)) = door {
            pgdoor::serve(listener, door, options).await;
        }
    };
    let grace = config.http.shutdown_timeout;
    let s3 = async {
        if let Some(door) = s3 {
            s3door::serve(door, stop.clone(), grace).await;
        }
    };
    tokio::join!(signal, http, pg, s3);
    tracing::info!("fencegate stopped");
    Ok(())
}

/// The store: Postgres with a database URL, else the embedded one.
async fn open_store(config: &Config, metrics: &Metrics) -> Result<Store, StartError> {
    let store = &config.store;
    Ok(match store.database_url.as_deref() {
        Some(url) => {
            let options = PgOptions::new(store, config.term_takeover_timeout, metrics);
            Store::Postgres(PgStore::connect(url, options).await?)
        }
        None => Store::Embedded(EmbeddedStore::open(
            &store.data_dir,
            store.init_store,
            store.group_commit_max,
            store.backend_timeout,
            metrics.commit_group_size(),
        )?),
    })
}

/// The issuers resources are bound to (`--issued-by`), checked, and with Postgres the
/// generation of the bindings recorded in the database.
async fn issuers(
    config: &Config,
    store: &Store,
) -> Result<(coordinator::issuers::Issuers, Option<i64>), StartError> {
    let url = config.store.database_url.as_deref();
    let issuers =
        coordinator::issuers::Issuers::new(&config.issuers, url).map_err(StartError::Issuers)?;
    issuers
        .check_leader_lease_table()
        .await
        .map_err(StartError::Issuers)?;
    let generation = match store {
        Store::Postgres(pg) => Some(record_bindings(config, pg).await?),
        Store::Embedded(_) => None,
    };
    Ok((issuers, generation))
}

/// The most connections the Postgres door may open: `--pg-max-connections`, fitted to
/// the database server's limit if the door runs.
async fn door_capacity(config: &Config, store: &Store) -> Result<usize, StartError> {
    match store {
        Store::Postgres(pg) if config.pg_door().is_some() => pgdoor::capacity::settle(config, pg)
            .await
            .map_err(StartError::PgCapacity),
        _ => Ok(config.pg_max_connections()),
    }
}

/// The Postgres door's listener, the door and its options, if it runs.
async fn open_door(
    config: &Config,
    max_connections: usize,
    coordinator: &Arc<Coordinator>,
) -> Result<Option<(TcpListener, Arc<pgdoor::Door>, pgdoor::DoorOptions)>, StartError> {
    let (Some(addr), Some(url)) = (config.pg_door(), config.store.database_url.as_deref()) else {
        return Ok(None);
    };
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::PgListen { addr, source })?;
    let tls = tls::Tls::start(tls::TlsFiles::postgres(&config.door))?;
    let options = pgdoor::DoorOptions::new(
        &config.door,
        max_connections,
        config.pg_requires_tls(),
        config.http.shutdown_timeout,
    );
    let shutdown = coordinator.shutdown().clone();
    let door = pgdoor::Door::new(url, tls, &options, Arc::clone(coordinator), shutdown)?;
    Ok(Some((listener, Arc::new(door), options)))
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
