//! The Postgres door: writers keep their Postgres driver and point it at the gateway.
//!
//! A session-mode relay. Each client connection gets its own connection to the
//! Postgres server of `--database-url` — with several hosts and
//! `target_session_attrs=read-write`, to the primary ([`upstream`]) — to the database and
//! as the user the client names; start-up parameters (`options`, `fencegate.token`, any other setting) go to
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
//! What reaches the database is the door's own connection, so the server's pg_hba.conf
//! sees the gateway's address and the door's TLS, never the client's. The door stands in
//! for those rules: it can require TLS of clients and admit only some database/role
//! pairs, and it caps the connections still logging in, so that clients that never
//! finish cannot take the server's slots — all before it connects upstream.
//!
//! - `admission`: who is let in, and how the others are turned away.
//! - `logs`: the door's lines about clients, at most one per kind and window.
//! - `startup`: TLS (SSLRequest or direct), GSSENCRequest, CancelRequest.
//! - `session`: one session: its upstream connection, its login, then the relay with
//!   the door's view of it.
//! - `relay`: the messages of a logged-in session streamed both ways, and what the door
//!   reads in them, behind a small observer (tested in-process over in-memory pipes).
//! - `login`: authentication, relayed.
//! - `cancel`: the door's cancel keys, mapped to the upstream backends' and their hosts.
//! - `upstream`: the connection to the server: which host of `--database-url` (the
//!   primary, when asked), with TLS as the URL asks.
//! - `wire`: framing, with every length checked before it is allocated.

mod admission;
mod cancel;
pub(crate) mod capacity;
mod login;
mod logs;
mod relay;
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
use tokio_util::sync::CancellationToken;

use crate::config::DoorGrant;
use crate::coordinator::Coordinator;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::tls::Tls;
use admission::{Authenticating, DoorRefusal, PendingAuth};
use cancel::CancelKeys;
use logs::{DoorLogs, LineKind};
use relay::Ending;
use startup::{ClientStream, Hello, StartupMessage};
use upstream::Upstream;

/// The door's settings, from the command line.
#[derive(Debug, Clone)]
pub struct DoorOptions {
    pub max_message: usize,
    pub max_connections: usize,
    /// Most connections still authenticating, in all and per client address.
    pub max_pending_auth: usize,
    pub max_pending_auth_per_peer: usize,
    /// Refuse clients that do not use TLS.
    pub require_tls: bool,
    /// The database/role pairs admitted; empty: all.
    pub allow: Vec<DoorGrant>,
    pub startup_timeout: Duration,
    pub grace: Duration,
    /// `idle_in_transaction_session_timeout` of every session; `None`: the server's.
    pub idle_in_transaction: Option<Duration>,
}

impl DoorOptions {
    /// The options of the door's flags, with what is settled elsewhere: the most
    /// connections it may open, whether it requires TLS, and the grace on shutdown.
    pub fn new(
        door: &crate::config::DoorArgs,
        max_connections: usize,
        require_tls: bool,
        grace: Duration,
    ) -> DoorOptions {
        DoorOptions {
            max_message: door.pg_max_message,
            max_connections,
            max_pending_auth: door.pg_max_pending_auth,
            max_pending_auth_per_peer: door.pg_max_pending_auth_per_peer,
            require_tls,
            allow: door.pg_allow.clone(),
            startup_timeout: door.pg_startup_timeout,
            grace,
            idle_in_transaction: Some(door.pg_idle_in_transaction_timeout)
                .filter(|timeout| !timeout.is_zero()),
        }
    }
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
    #[error("--database-url: {0}")]
    Hosts(String),
    #[error(
        "--database-url: the Postgres door relays writers to the primary: \
         target_session_attrs may be read-write or any"
    )]
    SessionAttrs,
}

/// What every session of the door shares.
pub(crate) struct Door {
    upstream: Upstream,
    /// The door's TLS, reloaded when its files change ([`crate::tls`]).
    tls: Option<Arc<Tls>>,
    max_message: usize,
    startup_timeout: Duration,
    require_tls: bool,
    allow: Vec<DoorGrant>,
    pending_auth: Arc<PendingAuth>,
    logs: DoorLogs,
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
        tls: Option<Arc<Tls>>,
        options: &DoorOptions,
        coordinator: Arc<Coordinator>,
        shutdown: CancellationToken,
    ) -> Result<Door, DoorStartError> {
        Ok(Door {
            upstream: Upstream::from_url(database_url)?,
            tls,
            max_message: options.max_message,
            startup_timeout: options.startup_timeout,
            require_tls: options.require_tls,
            allow: options.allow.clone(),
            pending_auth: Arc::new(PendingAuth::new(
                options.max_pending_auth,
                options.max_pending_auth_per_peer,
            )),
            logs: DoorLogs::default(),
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

    /// Counts a refusal, and logs it (at most one line a window).
    fn refused(&self, refusal: DoorRefusal, peer: SocketAddr) {
        self.metrics().pg_refused(refusal.reason());
        if let Some(unlogged) = self.logs.take_line(LineKind::Refused) {
            tracing::info!(
                %peer,
                reason = refusal.reason(),
                unlogged,
                "Postgres door refused a client"
            );
        }
    }

    /// Counts a protocol error, and logs it (at most one line a window).
    fn protocol_error(&self, peer: SocketAddr, user: Option<&str>, error: &wire::ProtocolError) {
        self.metrics().pg_protocol_error();
        if let Some(unlogged) = self.logs.take_line(LineKind::ProtocolError) {
            tracing::info!(%peer, ?user, %error, unlogged, "Postgres client broke the protocol");
        }
    }

    /// Serves one connection, from its first byte to its end; `authenticating` counts
    /// it until its login is over.
    async fn connection(
        self: Arc<Self>,
        tcp: TcpStream,
        peer: SocketAddr,
        authenticating: Authenticating,
    ) {
        let deadline = tokio::time::Instant::now() + self.startup_timeout;
        // The configuration in force when the connection came, as on the HTTP listener.
        let acceptor = self.tls.as_ref().map(|tls| tls.acceptor());
        let negotiated =
            tokio::time::timeout_at(deadline, startup::negotiate(tcp, acceptor.as_ref())).await;
        let (stream, hello) = match negotiated {
            Ok(Ok(negotiated)) => negotiated,
            Ok(Err(error)) => {
                if let wire::WireError::Protocol(error) = &error {
                    self.protocol_error(peer, None, error);
                } else {
                    tracing::debug!(%peer, %error, "Postgres client left during start-up");
                }
                return;
            }
            Err(_) => {
                // The client is silent: there is no one to tell.
                self.refused(DoorRefusal::AuthTimeout, peer);
                return;
            }
        };
        let packet = match hello {
            Hello::Startup(packet) => packet,
            Hello::Cancel(key) => {
                drop(authenticating);
                self.cancel(&key, peer).await;
                // libpq 17 sends cancels over TLS and waits for an orderly close.
                match stream {
                    ClientStream::Plain(mut stream) => session::close(&mut stream).await,
                    ClientStream::Tls(mut stream) => session::close(&mut stream).await,
                }
                return;
            }
        };
        // Judged as Postgres reads it, and what is judged is what is forwarded.
        let startup = match StartupMessage::parse(&packet) {
            Ok(startup) => startup,
            Err(error) => {
                self.protocol_error(peer, None, &error);
                let sqlstate = error.sqlstate();
                let message = format!("fencegate: {error}");
                match stream {
                    ClientStream::Plain(mut stream) => {
                        admission::turn_away(&mut stream, sqlstate, &message).await
                    }
                    ClientStream::Tls(mut stream) => {
                        admission::turn_away(&mut stream, sqlstate, &message).await
                    }
                }
                return;
            }
        };
        let refusal = match &stream {
            ClientStream::Plain(_) if self.require_tls => Some(DoorRefusal::TlsRequired),
            _ if !admission::allowed(&self.allow, &startup) => Some(DoorRefusal::NotAllowed),
            _ => match self.coordinator.door_admits().await {
                Ok(()) => None,
                Err(ApiError::NotSynchronouslyReplicated) => {
                    Some(DoorRefusal::NotSynchronouslyReplicated)
                }
                Err(_) => Some(DoorRefusal::ServerNotAudited),
            },
        };
        if let Some(refusal) = refusal {
            self.refused(refusal, peer);
            let (sqlstate, message) = (refusal.sqlstate(), refusal.message());
            match stream {
                ClientStream::Plain(mut stream) => {
                    admission::turn_away(&mut stream, sqlstate, message).await
                }
                ClientStream::Tls(mut stream) => {
                    admission::turn_away(&mut stream, sqlstate, message).await
                }
            }
            return;
        }
        let (user, database) = (Some(startup.user()), Some(startup.database()));
        let ended = match stream {
            // A TCP stream splits into halves without a lock between them.
            ClientStream::Plain(stream) => {
                let client = stream.into_split();
                session::run(&self, client, startup, deadline, authenticating).await
            }
            ClientStream::Tls(stream) => {
                let client = tokio::io::split(stream);
                session::run(&self, client, startup, deadline, authenticating).await
            }
        };
        match ended {
            Ok(Ending::LoginTimedOut) => self.refused(DoorRefusal::AuthTimeout, peer),
            Ok(Ending::LoginRefused(sqlstate)) => {
                if let Some(unlogged) = self.logs.take_line(LineKind::LoginFailed) {
                    let sqlstate = sqlstate.map(|code| String::from_utf8_lossy(&code).into_owned());
                    tracing::info!(
                        %peer,
                        ?user,
                        ?database,
                        sqlstate,
                        unlogged,
                        "Postgres door login failed"
                    );
                }
            }
            Ok(ending) => tracing::debug!(%peer, ?user, ?ending, "Postgres session ended"),
            Err(wire::WireError::Protocol(error)) => {
                self.protocol_error(peer, user.as_deref(), &error)
            }
            Err(wire::WireError::Io(error)) => {
                tracing::debug!(%peer, ?user, %error, "Postgres session ended on a socket error");
            }
        }
    }

    /// Forwards a cancel request for a key the door issued to its session's backend;
    /// ignores any other (no reply either way, as Postgres).
    async fn cancel(&self, key: &wire::CancelKey, peer: SocketAddr) {
        let Some((upstream, host)) = self.keys.upstream(key) else {
            self.metrics().pg_cancel(false);
            if let Some(unlogged) = self.logs.take_line(LineKind::UnknownCancel) {
                tracing::info!(
                    %peer,
                    pid = key.pid,
                    unlogged,
                    "Postgres cancel request with an unknown key ignored"
                );
            }
            return;
        };
        self.metrics().pg_cancel(true);
        self.cancel_upstream(host, &upstream).await;
    }

    /// Sends a cancel request for the upstream backend of `key`, on host `host` (an
    /// index into the URL's hosts): the host of its session.
    async fn cancel_upstream(&self, host: usize, key: &wire::CancelKey) {
        let sent = self.upstream.cancel(host, key);
        if let Err(error) = tokio::time::timeout(self.startup_timeout, sent)
            .await
            .unwrap_or_else(|_| Err(std::io::ErrorKind::TimedOut.into()))
        {
            tracing::warn!(
                %error,
                host = %self.upstream.host(host),
                "could not send a cancel request to the database"
            );
        }
    }

    /// Ends a session whose server is not, or no longer (`during`: `login` or
    /// `session`), the primary: counts it, logs it, and forgets the host, so that the
    /// next session searches for the primary.
    fn not_primary(&self, host: usize, during: &'static str) {
        self.metrics().pg_not_primary(during);
        self.upstream.forget(host);
        tracing::info!(
            host = %self.upstream.host(host),
            during,
            "Postgres door session ended: its database server is not the primary"
        );
    }
}

/// How many refused clients may be being told so at once; past it, more are closed
/// without a word.
const MAX_TURNING_AWAY: usize = 256;

/// Accepts Postgres clients on `listener` until `shutdown`, then lets their sessions
/// end: idle ones at once (with FATAL 57P01), the others at the end of their
/// transaction, for at most the grace period.
///
/// A client over `--pg-max-connections` or the caps on connections still
/// authenticating is refused at once (FATAL 53300), never queued.
pub(crate) async fn serve(listener: TcpListener, door: Arc<Door>, options: DoorOptions) {
    let permits = Arc::new(Semaphore::new(options.max_connections));
    let turning_away = Arc::new(Semaphore::new(MAX_TURNING_AWAY));
    let mut sessions = JoinSet::new();
    let summaries = tokio::spawn(summarise_logs(Arc::clone(&door)));
    loop {
        while sessions.try_join_next().is_some() {}
        let Some((mut stream, peer)) = crate::accept::next(&listener, &door.shutdown, "pg").await
        else {
            break;
        };
        let admitted = match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => door
                .pending_auth
                .start(peer.ip())
                .map(|authenticating| (permit, authenticating)),
            Err(_) => Err(DoorRefusal::Connections),
        };
        let door = Arc::clone(&door);
        match admitted {
            Ok((permit, authenticating)) => {
                sessions.spawn(async move {
                    let _open = door.metrics().pg_connection_opened();
                    Arc::clone(&door)
                        .connection(stream, peer, authenticating)
                        .await;
                    drop(permit);
                });
            }
            Err(refusal) => {
                door.refused(refusal, peer);
                if let Ok(turning) = Arc::clone(&turning_away).try_acquire_owned() {
                    tokio::spawn(async move {
                        admission::turn_away(&mut stream, refusal.sqlstate(), refusal.message())
                            .await;
                        drop(turning);
                    });
                }
            }
        }
    }
    drop(listener);
    summaries.abort();
    let all_ended = async { while sessions.join_next().await.is_some() {} };
    if !crate::accept::drain(
        options.grace,
        all_ended,
        "Postgres door sessions in a transaction",
    )
    .await
    {
        sessions.shutdown().await;
    }
    door.logs.summarise();
}

/// Writes the door's summary lines every window.
async fn summarise_logs(door: Arc<Door>) {
    let mut every = tokio::time::interval(Duration::from_secs(logs::WINDOW_SECS));
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        door.logs.summarise();
    }
}
