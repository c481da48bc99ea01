//! The accept loop: HTTP/1.1 and cleartext HTTP/2 on one listener, with bounded
//! connections and graceful shutdown.
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
//! # Shutdown
//!
//! When the shutdown future completes, the listener is closed (new connections are
//! refused), idle connections and those with an incomplete request head are closed at
//! once, requests still receiving their body are answered `503 shutting_down`, and
//! requests in the backend run to completion — for at most the grace period, after
//! which the remaining connections are dropped.

pub mod conn;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::api;
use crate::coordinator::Coordinator;
use conn::{ConnState, Deadlines, Watched};

/// File descriptors kept free of client connections: database pools, the store's
/// file, logs, cancel requests.
const RESERVED_FDS: u64 = 128;

/// Headers per request, at most.
const MAX_HEADERS: usize = 64;

/// How the server treats connections.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub max_header_size: usize,
    pub deadlines: Deadlines,
    pub http2_keep_alive_interval: Duration,
    pub http2_keep_alive_timeout: Duration,
    pub grace: Duration,
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

pub async fn serve(
    listener: TcpListener,
    coordinator: Arc<Coordinator>,
    shutdown: impl Future<Output = ()>,
    limits: Limits,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // The header deadline is the connection's own (conn.rs): from the first byte of
        // a request, not from the end of the previous one.
        .header_read_timeout(None)
        .max_buf_size(limits.max_header_size.max(8192))
        .max_headers(MAX_HEADERS);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(limits.http2_keep_alive_interval)
        .keep_alive_timeout(limits.http2_keep_alive_timeout)
        .max_header_list_size(u32::try_from(limits.max_header_size).unwrap_or(u32::MAX));
    let graceful = GracefulShutdown::new();
    let registry = Arc::new(Registry::default());
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = connection_permit(&permits, &registry) => permit,
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Typically EMFILE: back off instead of spinning on the error.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Small request/response exchanges: do not let Nagle hold them back.
        let _ = stream.set_nodelay(true);
        let state = ConnState::new(coordinator.shutdown().clone());
        let id = registry.add(Arc::clone(&state));
        let service = {
            let (coordinator, state) = (Arc::clone(&coordinator), Arc::clone(&state));
            service_fn(move |request| {
                let coordinator = Arc::clone(&coordinator);
                let in_flight = state.request();
                async move {
                    let response = api::handle(coordinator, request).await;
                    drop(in_flight);
                    Ok::<_, Infallible>(response)
                }
            })
        };
        let io = Watched::new(stream, state, limits.deadlines);
        let connection = graceful.watch(
            builder
                .serve_connection(TokioIo::new(io), service)
                .into_owned(),
        );
        let registry = Arc::clone(&registry);
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            registry.remove(id);
            drop(permit);
        });
    }
    drop(listener);
    coordinator.shutting_down();
    // Idle connections, and those with an incomplete head, close now; the others once
    // their request is answered.
    registry.evict_all();
    tracing::info!(
        connections = graceful.count(),
        "shutting down: finishing requests in flight"
    );
    tokio::select! {
        () = graceful.shutdown() => {}
        () = tokio::time::sleep(limits.grace) => {
            tracing::warn!(grace = ?limits.grace, "shutdown grace period elapsed; closing the remaining connections");
        }
    }
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
