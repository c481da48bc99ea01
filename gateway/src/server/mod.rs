//! The accept loop: HTTP/1.1 and HTTP/2 on one listener — in cleartext (h2c), or over
//! TLS only ([`tls`]) — with bounded connections and graceful shutdown.
//!
//! # Connections
//!
//! At most [`Limits::max_connections`] are open at once. At the cap the loop first asks
//! the longest idle connection to close ([`conn::ConnState::evict`]), and otherwise
//! stops accepting until one closes: new clients wait in the listen backlog instead of
//! meeting a refused connection or an exhausted file-descriptor table. At start the
//! open-file limit is raised to its hard limit, and the cap kept below it.
//!
//! Each connection has an idle deadline, a header deadline and a lingering close
//! ([`conn`]); headers are bounded in size and number.
//!
//! # TLS
//!
//! With a certificate, each connection's handshake runs in the connection's own task,
//! never in the accept loop, and must end within the header deadline from the accept.
//! While it runs the connection holds its place under the cap, but is not idle: it
//! is not evicted to make room. A handshake that fails or times out closes that
//! connection alone (logged at debug). After it, [`conn::Watched`] wraps the TLS
//! stream, so the deadlines and the lingering close read and write through TLS. The
//! client certificate's names, if one was presented, are added to each request of the
//! connection ([`crate::auth::ClientCertificate`]).
//!
//! # Shutdown
//!
//! When the shutdown future completes, the listener is closed (new connections are
//! refused), idle connections and those with an incomplete request head are closed at
//! once, requests still receiving their body are answered `503 shutting_down`, and
//! requests in the backend run to completion — for at most the grace period, after
//! which the remaining connections are dropped. TLS handshakes still under way are
//! broken off, like incomplete heads.

pub mod conn;

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::api::{self, ResponseBudget};
use crate::auth::ClientCertificate;
use crate::config::{HttpArgs, LimitArgs};
use crate::coordinator::Coordinator;
use crate::tls::{self, Tls};
use conn::{ConnState, Deadlines, Watched};

/// File descriptors kept free of client connections: database pools, the store's
/// file, logs, cancel requests.
const RESERVED_FDS: u64 = 128;

/// How the server treats connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub max_header_size: usize,
    pub deadlines: Deadlines,
    pub http2_keep_alive_interval: Duration,
    pub http2_keep_alive_timeout: Duration,
    pub grace: Duration,
    /// `--max-response-memory`: answers waiting for their clients, in all.
    pub max_response_memory: usize,
    /// `--max-pending-answers`: answers waiting on one connection.
    pub max_pending_answers: usize,
}

impl Limits {
    /// The limits the HTTP and limit flags set; raises the open-file limit for
    /// `--max-connections` ([`connection_cap`]).
    pub fn new(http: &HttpArgs, limits: &LimitArgs) -> Limits {
        Limits {
            max_connections: connection_cap(http.max_connections),
            max_header_size: http.max_header_size,
            deadlines: Deadlines {
                idle: http.idle_timeout,
                header: http.header_timeout,
                write: http.write_timeout,
            },
            http2_keep_alive_interval: http.http2_keepalive_interval,
            http2_keep_alive_timeout: http.http2_keepalive_timeout,
            grace: http.shutdown_timeout,
            max_response_memory: limits.max_response_memory,
            max_pending_answers: limits.max_pending_answers,
        }
    }
}

/// Raises the soft open-file limit to the hard one, and returns how many connections
/// fit under it next to [`RESERVED_FDS`] — at most `wanted`.
pub fn connection_cap(wanted: usize) -> usize {
    let limit = match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "could not read or raise the open-file limit");
            return wanted;
        }
    };
    let fits = usize::try_from(limit.saturating_sub(RESERVED_FDS).max(1)).unwrap_or(usize::MAX);
    if fits < wanted {
        tracing::warn!(
            open_file_limit = limit,
            max_connections = fits,
            "the open-file limit is below --max-connections; connections are capped lower"
        );
    }
    wanted.min(fits)
}

/// Open connections, for eviction at the cap.
#[derive(Default)]
struct Registry {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<ConnState>>>,
}

impl Registry {
    fn open(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<ConnState>>> {
        self.open
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn add(&self, state: Arc<ConnState>) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.open().insert(id, state);
        id
    }

    fn remove(&self, id: u64) {
        self.open().remove(&id);
    }

    /// Asks every connection to close as soon as it has no request in flight.
    fn evict_all(&self) {
        for state in self.open().values() {
            state.evict();
        }
    }

    /// Asks the longest idle connection to close; false if none is idle.
    fn evict_one(&self) -> bool {
        let open = self.open();
        let oldest = open
            .values()
            .filter_map(|state| Some((state.idle_since()?, state)))
            .min_by_key(|(since, _)| *since);
        match oldest {
            Some((_, state)) => {
                state.evict();
                true
            }
            None => false,
        }
    }
}

/// Serves HTTP on `listener` — over TLS only if `tls` is given — until `shutdown` is
/// cancelled; then finishes as the module doc says.
pub async fn serve(
    listener: TcpListener,
    coordinator: Arc<Coordinator>,
    shutdown: CancellationToken,
    limits: Limits,
    tls: Option<Arc<Tls>>,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // The header deadline is the connection's own (conn.rs): from the first byte of
        // a request, not from the end of the previous one.
        .header_read_timeout(None)
        // At most 100 headers: hyper's own limit, checked without setting one. Setting
        // one (`max_headers`) makes hyper initialise room for that many on every request.
        .max_buf_size(limits.max_header_size.max(8192))
        // One buffer per answer, head and body copied together, one write: nearly every
        // answer is small (an acceptance, a rejection), and a stale flood's rejections
        // cost 3–4 % less CPU this way than as a vectored write of two buffers. A large
        // GET pays one copy of its body.
        .writev(false);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.http2_keep_alive_interval)
        .keep_alive_timeout(limits.http2_keep_alive_timeout)
        .max_header_list_size(u32::try_from(limits.max_header_size).unwrap_or(u32::MAX));
    let responses = ResponseBudget::new(
        limits.max_response_memory,
        limits.max_pending_answers,
        coordinator.metrics().response_bytes(),
    );
    let shared = Arc::new(Shared {
        builder,
        coordinator: Arc::clone(&coordinator),
        responses,
        registry: Registry::default(),
        deadlines: limits.deadlines,
    });
    let graceful = GracefulShutdown::new();
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let permit = tokio::select! {
            permit = connection_permit(&permits, &shared.registry) => permit,
            () = shutdown.cancelled() => break,
        };
        let Some((stream, peer)) = crate::accept::next(&listener, &shutdown, "http").await else {
            break;
        };
        let accepted = Accepted {
            peer,
            permit,
            // Taken here, before the shutdown can begin, so that the shutdown waits for
            // this connection even while its handshake runs.
            graceful: graceful.watcher(),
        };
        match &tls {
            None => {
                let state = shared.register();
                tokio::spawn(Arc::clone(&shared).connection(stream, state, None, accepted));
            }
            Some(tls) => {
                tokio::spawn(Arc::clone(&shared).handshake(stream, tls.acceptor(), accepted));
            }
        }
    }
    drop(listener);
    // Idle connections, and those with an incomplete head, close now; the others once
    // their request is answered.
    shared.registry.evict_all();
    tracing::info!(
        connections = graceful.count(),
        "shutting down: finishing requests in flight"
    );
    crate::accept::drain(limits.grace, graceful.shutdown(), "HTTP connections").await;
}

/// What every connection's task uses.
struct Shared {
    builder: auto::Builder<TokioExecutor>,
    coordinator: Arc<Coordinator>,
    /// The budget of answers waiting for their clients, shared by every connection.
    responses: Arc<ResponseBudget>,
    registry: Registry,
    deadlines: Deadlines,
}

/// A connection just accepted: what it holds until it closes.
struct Accepted {
    peer: std::net::SocketAddr,
    /// Its place under the connection cap.
    permit: OwnedSemaphorePermit,
    graceful: Watcher,
}

impl Shared {
    /// A new connection's state, registered for eviction.
    fn register(&self) -> (Arc<ConnState>, u64) {
        let state = ConnState::new(self.coordinator.shutdown().clone());
        let id = self.registry.add(Arc::clone(&state));
        (state, id)
    }

    /// Runs the TLS handshake within the header deadline, then serves the connection;
    /// see the module doc.
    async fn handshake(
        self: Arc<Self>,
        stream: TcpStream,
        acceptor: TlsAcceptor,
        accepted: Accepted,
    ) {
        let peer = accepted.peer;
        let shutdown = self.coordinator.shutdown().clone();
        let handshake = tokio::time::timeout(self.deadlines.header, acceptor.accept(stream));
        let stream = tokio::select! {
            result = handshake => match result {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "tls handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "tls handshake not finished within the header deadline");
                    return;
                }
            },
            () = shutdown.cancelled() => return,
        };
        let certificate = tls::client_certificate(stream.get_ref().1);
        let state = self.register();
        self.connection(stream, state, certificate, accepted).await;
    }

    /// Serves HTTP on an accepted (and, with TLS, handshaken) connection until it
    /// closes.
    async fn connection<IO>(
        self: Arc<Self>,
        io: IO,
        (state, id): (Arc<ConnState>, u64),
        certificate: Option<ClientCertificate>,
        accepted: Accepted,
    ) where
        IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let peer = accepted.peer.ip();
        let service = {
            let (coordinator, state) = (Arc::clone(&self.coordinator), Arc::clone(&state));
            let responses = Arc::clone(&self.responses);
            service_fn(move |mut request| {
                let (coordinator, conn) = (Arc::clone(&coordinator), Arc::clone(&state));
                let responses = Arc::clone(&responses);
                let in_flight = state.request();
                if let Some(certificate) = &certificate {
                    request.extensions_mut().insert(certificate.clone());
                }
                async move {
                    let response = api::handle(coordinator, request, peer, &conn, responses).await;
                    drop(in_flight);
                    Ok::<_, Infallible>(response)
                }
            })
        };
        let io = Watched::new(io, Arc::clone(&state), self.deadlines);
        let connection = accepted.graceful.watch(
            self.builder
                .serve_connection(TokioIo::new(io), service)
                .into_owned(),
        );
        tokio::select! {
            ended = connection => if let Err(error) = ended {
                if is_write_timeout(&*error) {
                    self.coordinator.metrics().connection_closed("write_timeout");
                }
                tracing::debug!(peer = %accepted.peer, %error, "connection ended with an error");
            },
            () = state.stalled(self.deadlines.write) => {
                self.coordinator.metrics().connection_closed("answers_stalled");
                tracing::debug!(peer = %accepted.peer, "connection closed: its client read none of its answers within the write deadline");
            }
        }
        self.registry.remove(id);
        drop(accepted.permit);
    }
}

/// Whether a connection ended because its client did not read within the write
/// deadline ([`conn::Watched`]).
fn is_write_timeout(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(error);
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            return io
                .get_ref()
                .is_some_and(|inner| inner.is::<conn::WriteTimeout>());
        }
        source = error.source();
    }
    false
}

/// A place for one more connection: at once if there is one, else after asking an idle
/// connection to make room, else when one closes.
async fn connection_permit(permits: &Arc<Semaphore>, registry: &Registry) -> OwnedSemaphorePermit {
    if let Ok(permit) = Arc::clone(permits).try_acquire_owned() {
        return permit;
    }
    loop {
        if !registry.evict_one() {
            tracing::debug!("at the connection cap with no idle connection; not accepting");
        }
        // Connections that were busy may be idle a moment later: look again.
        tokio::select! {
            permit = Arc::clone(permits).acquire_owned() => {
                return permit.expect("the semaphore is never closed");
            }
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
}
