//! The Postgres door: writers keep their Postgres driver and point it at the gateway.
//!
//! A session-mode relay. Each client connection gets its own connection to the
//! Postgres server of `--database-url`, to the database and as the user the client
//! names; start-up parameters (`options`, `fencegate.token`, any other setting) go to
//! the server unchanged, and authentication is the server's own (`pg_hba.conf`), relayed
//! message by message — the gateway stores no secrets. No SQL is parsed or rewritten:
//! the fence runs inside Postgres, in the triggers of protected tables and in
//! `fencegate.fence()` ([`crate::dbfence`]), so a stale transaction is refused atomically
//! whichever way it reaches the database.
//!
//! What the door adds is the gateway's view of it: every stale rejection it relays is
//! counted and logged like one from the HTTP API, and the door's own traffic is in the
//! metrics. See docs/postgres-door.md.
//!
//! - `startup`: TLS (SSLRequest or direct), GSSENCRequest, CancelRequest.
//! - `session`: one session, and the two streaming directions.
//! - `login`: authentication, relayed.
//! - `cancel`: the door's cancel keys, mapped to the upstream backends'.
//! - `upstream`: the connection to the server, with TLS as `--database-url` asks.
//! - `wire`: framing, with every length checked before it is allocated.

mod cancel;
mod login;
mod session;
mod startup;
mod upstream;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::coordinator::Coordinator;
use crate::metrics::Metrics;
use cancel::CancelKeys;
pub use startup::TlsConfigError;
use startup::{ClientStream, Hello};
use upstream::Upstream;

/// The door's settings, from the command line.
#[derive(Debug, Clone)]
pub struct DoorOptions {
    pub max_message: usize,
    pub max_connections: usize,
    pub startup_timeout: Duration,
    pub grace: Duration,
    /// `idle_in_transaction_session_timeout` of every session; `None`: the server's.
    pub idle_in_transaction: Option<Duration>,
}

/// Why the door could not start.
#[derive(Debug, thiserror::Error)]
pub enum DoorStartError {
    #[error("--database-url: {0}")]
    Url(#[from] crate::pgtls::PgUrlError),
    #[error("the Postgres door needs a TCP host in --database-url, not a Unix socket directory")]
    UnixSocket,
    #[error("--database-url: sslnegotiation=direct needs sslmode=require or stronger")]
    WeakDirect,
    #[error("--pg-tls-cert/--pg-tls-key: {0}")]
    Tls(#[from] TlsConfigError),
}

/// What every session of the door shares.
pub(crate) struct Door {
    upstream: Upstream,
    tls: Option<TlsAcceptor>,
    max_message: usize,
    startup_timeout: Duration,
    keys: Arc<CancelKeys>,
    coordinator: Arc<Coordinator>,
    shutdown: CancellationToken,
    /// Pinned in every session's start-up options, after the client's own.
    idle_in_transaction: Option<Duration>,
}

impl Door {
    /// The door for `database_url`, with TLS if a certificate and key are given.
    pub(crate) fn new(
        database_url: &str,
        tls: Option<(&std::path::Path, &std::path::Path)>,
        options: &DoorOptions,
        coordinator: Arc<Coordinator>,
    ) -> Result<Door, DoorStartError> {
        let shutdown = coordinator.shutdown().clone();
        Ok(Door {
            upstream: Upstream::from_url(database_url)?,
            tls: tls
                .map(|(cert, key)| startup::acceptor(cert, key))
                .transpose()?,
            max_message: options.max_message,
            startup_timeout: options.startup_timeout,
            keys: Arc::default(),
            coordinator,
            shutdown,
            idle_in_transaction: options.idle_in_transaction,
        })
    }

    fn metrics(&self) -> &Metrics {
        self.coordinator.metrics()
    }

    /// The key of the fence's proofs, to tell its refusals from forgeries.
    fn proof_key(&self) -> &crate::dbfence::ProofKey {
        self.coordinator
            .proof_key()
            .expect("the door runs on the Postgres backend, which has the key")
    }

    /// Whether the door ends TLS itself.
    pub(crate) fn has_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Serves one connection, from its first byte to its end.
    async fn connection(self: Arc<Self>, tcp: TcpStream, peer: SocketAddr) {
        let deadline = tokio::time::Instant::now() + self.startup_timeout;
        let negotiated =
            tokio::time::timeout_at(deadline, startup::negotiate(tcp, self.tls.as_ref())).await;
        let (stream, hello) = match negotiated {
            Ok(Ok(negotiated)) => negotiated,
            Ok(Err(error)) => {
                if let wire::WireError::Protocol(error) = &error {
                    self.metrics().pg_protocol_error();
                    tracing::info!(%peer, %error, "Postgres client broke the protocol during start-up");
                } else {
                    tracing::debug!(%peer, %error, "Postgres client left during start-up");
                }
                return;
            }
            Err(_) => {
                tracing::debug!(%peer, "Postgres client did not finish start-up in time");
                return;
            }
        };
        let startup = match hello {
            Hello::Startup(startup) => startup,
            Hello::Cancel(key) => {
                self.cancel(&key).await;
                // libpq 17 sends cancels over TLS and waits for an orderly close.
                match stream {
                    ClientStream::Plain(mut stream) => session::close(&mut stream).await,
                    ClientStream::Tls(mut stream) => session::close(&mut stream).await,
                }
                return;
            }
        };
        let user = startup.parameter("user");
        let ended = match stream {
            // A TCP stream splits into halves without a lock between them.
            ClientStream::Plain(stream) => {
                session::run(&self, stream.into_split(), startup, deadline).await
            }
            ClientStream::Tls(stream) => {
                session::run(&self, tokio::io::split(stream), startup, deadline).await
            }
        };
        match ended {
            Ok(ending) => tracing::debug!(%peer, ?user, ?ending, "Postgres session ended"),
            Err(wire::WireError::Protocol(error)) => {
                self.metrics().pg_protocol_error();
                tracing::info!(%peer, ?user, %error, "Postgres client broke the protocol");
            }
            Err(wire::WireError::Io(error)) => {
                tracing::debug!(%peer, ?user, %error, "Postgres session ended on a socket error");
            }
        }
    }

    /// Forwards a cancel request for a key the door issued to its session's backend;
    /// ignores any other (no reply either way, as Postgres).
    async fn cancel(&self, key: &wire::CancelKey) {
        let Some(upstream) = self.keys.upstream(key) else {
            self.metrics().pg_cancel(false);
            tracing::info!(
                pid = key.pid,
                "Postgres cancel request with an unknown key ignored"
            );
            return;
        };
        self.metrics().pg_cancel(true);
        self.cancel_upstream(&upstream).await;
    }

    /// Sends a cancel request for the upstream backend of `key`.
    async fn cancel_upstream(&self, key: &wire::CancelKey) {
        let sent = self.upstream.cancel(key);
        if let Err(error) = tokio::time::timeout(self.startup_timeout, sent)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        {
            tracing::warn!(%error, "could not send a cancel request to the database");
        }
    }
}

/// Accepts Postgres clients on `listener` until `shutdown`, then lets their sessions
/// end: idle ones at once (with FATAL 57P01), the others at the end of their
/// transaction, for at most the grace period.
pub(crate) async fn serve(listener: TcpListener, door: Arc<Door>, options: DoorOptions) {
    let permits = Arc::new(Semaphore::new(options.max_connections));
    let mut sessions = JoinSet::new();
    loop {
        while sessions.try_join_next().is_some() {}
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => permit.expect("never closed"),
            () = door.shutdown.cancelled() => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "Postgres door: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = door.shutdown.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let door = Arc::clone(&door);
        sessions.spawn(async move {
            let _open = door.metrics().pg_connection_opened();
            Arc::clone(&door).connection(stream, peer).await;
            drop(permit);
        });
    }
    drop(listener);
    let drained = tokio::time::timeout(options.grace, async {
        while sessions.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            sessions = sessions.len(),
            "Postgres door: grace period elapsed with sessions still in a transaction; closing them"
        );
        sessions.shutdown().await;
    }
}
