//! A loopback TCP proxy that a test controls: hold traffic, release it, cut it.
//!
//! - [`Proxy::hold`]: bytes from clients are read but not forwarded — a request sent
//!   now sits "in the network" until [`Proxy::release`]. Replies always flow.
//! - [`Proxy::hold_replies`]: the other direction — bytes from the target wait until
//!   [`Proxy::release_replies`]: a database that committed a write but whose answer
//!   is late.
//! - [`Proxy::cut`]: every connection is closed at once and the port stops listening
//!   (connections are refused), as when a database host goes away;
//!   [`Proxy::restore`] listens again on the same port.
//!
//! # Labelled requests
//!
//! An HTTP request that carries the [`LABEL_HEADER`] is one the test can name. Before
//! sending it, the test registers a rule for its label ([`Proxy::hold_request`],
//! [`Proxy::delay_request`]); the proxy then reads the request in full and keeps it
//! until the test decides: [`Proxy::release_request`] forwards it,
//! [`Proxy::drop_request`] closes the client's connection without forwarding anything,
//! [`Proxy::duplicate_request`] delivers it, waits for the answer, and delivers the same
//! bytes again on a second connection (the copy's answer is kept for
//! [`Proxy::duplicate_reply`]), and [`Proxy::reorder`] forwards several held requests
//! in a chosen order (each one answered before the next goes). A rule applies to the *connection* whose first request carries
//! the label, so a labelled request must open its own connection (pipelined requests
//! behind it share its fate — which is how a flood of requests is held at once).
//! Labelled requests without a rule, and all other traffic, pass as before; traffic
//! that does not start like an HTTP request (the Postgres protocol) is never parsed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod frame;

pub(crate) use frame::parse_response;
use frame::{exchange, request_len, sniff_label};

/// The request header that names a request for the per-request controls.
pub const LABEL_HEADER: &str = "fencegate-replay-label";

/// Longest request head the proxy reads while looking for a label.
const MAX_HEAD: usize = 64 * 1024;

pub struct Proxy {
    addr: SocketAddr,
    target: SocketAddr,
    held: watch::Sender<bool>,
    /// Client bytes read while held and not yet forwarded.
    waiting: Arc<AtomicU64>,
    replies_held: watch::Sender<bool>,
    /// Target bytes read while replies are held and not yet forwarded.
    replies_waiting: Arc<AtomicU64>,
    /// Rules and states of labelled requests.
    labels: Arc<Labels>,
    /// The accept loop and every connection's pumps, aborted by [`Proxy::cut`].
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Proxy {
    /// Starts a proxy on a free loopback port, forwarding to `target`.
    pub async fn start(target: SocketAddr) -> Proxy {
        let proxy = Proxy {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            target,
            held: watch::channel(false).0,
            waiting: Arc::new(AtomicU64::new(0)),
            replies_held: watch::channel(false).0,
            replies_waiting: Arc::new(AtomicU64::new(0)),
            labels: Arc::new(Labels::default()),
            tasks: Arc::new(Mutex::new(Vec::new())),
        };
        proxy.listen().await
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops forwarding client bytes until [`Proxy::release`].
    pub fn hold(&self) {
        self.held.send_replace(true);
    }

    /// Client bytes that arrived while held and wait to be forwarded: a test waits for
    /// this to be non-zero to know that its request is "in the network".
    pub fn held_bytes(&self) -> u64 {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Forwards everything held, and everything after.
    pub fn release(&self) {
        self.held.send_replace(false);
    }

    /// Stops forwarding the target's bytes (answers) until [`Proxy::release_replies`].
    pub fn hold_replies(&self) {
        self.replies_held.send_replace(true);
    }

    /// Answer bytes that wait to be forwarded.
    pub fn held_reply_bytes(&self) -> u64 {
        self.replies_waiting.load(Ordering::SeqCst)
    }

    /// Forwards every held answer, and everything after.
    pub fn release_replies(&self) {
        self.replies_held.send_replace(false);
    }

    /// Closes every connection and stops listening.
    pub fn cut(&self) {
        for task in self.tasks.lock().unwrap().drain(..) {
            task.abort();
        }
    }

    /// Listens again on the same port after [`Proxy::cut`].
    pub async fn restore(self) -> Proxy {
        self.listen().await
    }

    async fn listen(mut self) -> Proxy {
        let socket = TcpSocket::new_v4().expect("a socket can be made");
        socket.set_reuseaddr(true).expect("SO_REUSEADDR can be set");
        socket
            .bind(self.addr)
            .unwrap_or_else(|e| panic!("proxy cannot bind {}: {e}", self.addr));
        let listener: TcpListener = socket.listen(128).expect("the proxy can listen");
        self.addr = listener
            .local_addr()
            .expect("a bound socket has an address");
        let link = Link {
            target: self.target,
            held: self.held.subscribe(),
            waiting: Arc::clone(&self.waiting),
            replies_held: self.replies_held.subscribe(),
            replies_waiting: Arc::clone(&self.replies_waiting),
            labels: Arc::clone(&self.labels),
            tasks: Arc::clone(&self.tasks),
        };
        let tasks = Arc::clone(&self.tasks);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let connection = tokio::spawn(link.clone().serve(client));
                tasks.lock().unwrap().push(connection);
            }
        });
        self.tasks.lock().unwrap().push(accept);
        self
    }
}

/// Per-request controls (see the module's "Labelled requests").
impl Proxy {
    /// Keeps the request labelled `label`, once it arrives, until a release, drop,
    /// duplicate or reorder names it. Register before sending.
    pub fn hold_request(&self, label: &str) {
        self.labels.register(label, None);
    }

    /// Keeps the request labelled `label` for `delay` after it has arrived in full,
    /// then forwards it.
    pub fn delay_request(&self, label: &str, delay: Duration) {
        self.labels.register(label, Some(delay));
    }

    /// Waits until the request labelled `label` has arrived in full (it is held, or
    /// already on its way after a delay) and at least `min_bytes` of its connection
    /// have arrived; `false` after `timeout`.
    pub async fn wait_held(&self, label: &str, min_bytes: usize, timeout: Duration) -> bool {
        self.labels
            .wait(timeout, |labels| {
                labels.get(label).is_some_and(|entry| {
                    entry.state != RequestState::Expected && entry.buffered >= min_bytes
                })
            })
            .await
    }

    /// The state of the labelled request, `None` if no rule names it.
    pub fn request_state(&self, label: &str) -> Option<RequestState> {
        self.labels
            .entries
            .lock()
            .unwrap()
            .get(label)
            .map(|e| e.state)
    }

    /// Forwards the held request (and everything after it on its connection).
    pub fn release_request(&self, label: &str) {
        self.labels.command(label, Command::Forward);
    }

    /// Closes the held request's client connection; nothing reaches the target.
    pub fn drop_request(&self, label: &str) {
        self.labels.command(label, Command::Drop);
    }

    /// Delivers the held request, then the same bytes again on a new connection.
    pub fn duplicate_request(&self, label: &str) {
        self.labels.command(label, Command::Duplicate);
    }

    /// The copy's answer `(status, body)` once a duplicate has been delivered;
    /// `None` after `timeout` or if the copy got no answer.
    pub async fn duplicate_reply(&self, label: &str, timeout: Duration) -> Option<(u16, Vec<u8>)> {
        let done = self
            .labels
            .wait(timeout, |labels| {
                labels
                    .get(label)
                    .is_some_and(|e| e.state == RequestState::Duplicated)
            })
            .await;
        if !done {
            return None;
        }
        let entries = self.labels.entries.lock().unwrap();
        entries.get(label).and_then(|e| e.duplicate_reply.clone())
    }

    /// Forwards held requests in the given order: each one is forwarded and answered
    /// by the target before the next is released, so the target also *handles* them
    /// in that order. `false` if one was not answered within `timeout`.
    pub async fn reorder(&self, labels: &[&str], timeout: Duration) -> bool {
        for label in labels {
            self.release_request(label);
            let forwarded = self
                .labels
                .wait(timeout, |entries| {
                    entries.get(*label).is_some_and(|e| {
                        matches!(e.state, RequestState::Answered | RequestState::Closed)
                    })
                })
                .await;
            if !forwarded {
                return false;
            }
        }
        true
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
}

/// Where a labelled request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestState {
    /// A rule is registered; the request has not arrived in full.
    Expected,
    /// Read in full and kept.
    Held,
    /// Written to the target.
    Forwarded,
    /// The target's answer has begun to flow back (or its connection ended).
    Answered,
    /// Delivered twice; the copy's answer is recorded.
    Duplicated,
    /// Dropped, or its connection ended before a decision.
    Closed,
}

/// What the test decided for a held request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Command {
    Wait,
    Forward,
    Drop,
    Duplicate,
}

struct Entry {
    state: RequestState,
    delay: Option<Duration>,
    command: watch::Sender<Command>,
    /// Bytes of the connection read so far (the request and anything pipelined).
    buffered: usize,
    duplicate_reply: Option<(u16, Vec<u8>)>,
}

/// The labelled requests of one proxy. Every change bumps `changed`, which waiters
/// watch.
#[derive(Default)]
struct Labels {
    entries: Mutex<HashMap<String, Entry>>,
    changed: watch::Sender<u64>,
}

impl Labels {
    fn register(&self, label: &str, delay: Option<Duration>) {
        let entry = Entry {
            state: RequestState::Expected,
            delay,
            command: watch::channel(Command::Wait).0,
            buffered: 0,
            duplicate_reply: None,
        };
        self.entries.lock().unwrap().insert(label.to_owned(), entry);
        self.bump();
    }

    fn command(&self, label: &str, command: Command) {
        let entries = self.entries.lock().unwrap();
        let entry = entries
            .get(label)
            .unwrap_or_else(|| panic!("no rule names the request {label:?}"));
        entry.command.send_replace(command);
    }

    fn update(&self, label: &str, change: impl FnOnce(&mut Entry)) {
        if let Some(entry) = self.entries.lock().unwrap().get_mut(label) {
            change(entry);
        }
        self.bump();
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n += 1);
    }

    async fn wait(
        &self,
        timeout: Duration,
        done: impl Fn(&HashMap<String, Entry>) -> bool,
    ) -> bool {
        let mut changed = self.changed.subscribe();
        tokio::time::timeout(timeout, async {
            loop {
                if done(&self.entries.lock().unwrap()) {
                    return;
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        })
        .await
        .is_ok()
    }
}

/// What a connection task needs of its proxy.
#[derive(Clone)]
struct Link {
    target: SocketAddr,
    held: watch::Receiver<bool>,
    waiting: Arc<AtomicU64>,
    replies_held: watch::Receiver<bool>,
    replies_waiting: Arc<AtomicU64>,
    labels: Arc<Labels>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Link {
    /// One client connection: sniffs a label, then either proxies plainly (under the
    /// global hold) or follows the label's rule.
    async fn serve(self, client: TcpStream) {
        let _ = client.set_nodelay(true);
        let (mut client_read, client_write) = client.into_split();
        let mut head = Vec::new();
        let label = sniff_label(&mut client_read, &mut head).await;
        let ruled = label.filter(|l| self.labels.entries.lock().unwrap().contains_key(l));
        if let Some(label) = ruled {
            return self.labelled(label, client_read, client_write, head).await;
        }
        let Ok(server) = TcpStream::connect(self.target).await else {
            return;
        };
        let _ = server.set_nodelay(true);
        let (server_read, mut server_write) = server.into_split();
        let mut held = Some((self.held.clone(), Arc::clone(&self.waiting)));
        if !head.is_empty() && !forward(&head, &mut server_write, &mut held).await {
            return;
        }
        self.pumps(client_read, client_write, server_read, server_write);
    }

    fn pumps(
        &self,
        client_read: OwnedReadHalf,
        client_write: OwnedWriteHalf,
        server_read: OwnedReadHalf,
        server_write: OwnedWriteHalf,
    ) {
        let held = Some((self.held.clone(), Arc::clone(&self.waiting)));
        let upstream = tokio::spawn(pump(client_read, server_write, held));
        let replies = Some((self.replies_held.clone(), Arc::clone(&self.replies_waiting)));
        let downstream = tokio::spawn(pump(server_read, client_write, replies));
        self.tasks.lock().unwrap().extend([upstream, downstream]);
    }

    async fn labelled(
        self,
        label: String,
        mut client_read: OwnedReadHalf,
        mut client_write: OwnedWriteHalf,
        mut buffer: Vec<u8>,
    ) {
        let labels = &self.labels;
        let (mut command, delay) = {
            let entries = labels.entries.lock().unwrap();
            let entry = &entries[&label];
            (entry.command.subscribe(), entry.delay)
        };
        // Read the first request in full before calling it held.
        let mut chunk = vec![0u8; 64 * 1024];
        while request_len(&buffer).is_none_or(|len| buffer.len() < len) {
            match client_read.read(&mut chunk).await {
                Ok(0) | Err(_) => {
                    labels.update(&label, |e| e.state = RequestState::Closed);
                    return;
                }
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
        labels.update(&label, |e| {
            e.state = RequestState::Held;
            e.buffered = buffer.len();
        });
        if let Some(delay) = delay {
            let labels = Arc::clone(labels);
            let label = label.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                labels.command(&label, Command::Forward);
            });
        }
        // Keep reading what follows on the connection until the test decides.
        let mut open = true;
        let decision = loop {
            let current = *command.borrow_and_update();
            if current != Command::Wait {
                break current;
            }
            tokio::select! {
                read = client_read.read(&mut chunk), if open => match read {
                    Ok(0) | Err(_) => open = false,
                    Ok(n) => {
                        buffer.extend_from_slice(&chunk[..n]);
                        labels.update(&label, |e| e.buffered = buffer.len());
                    }
                },
                changed = command.changed() => if changed.is_err() { break Command::Drop },
            }
        };
        match decision {
            Command::Wait | Command::Drop => {
                labels.update(&label, |e| e.state = RequestState::Closed);
            }
            Command::Forward => {
                let Ok(server) = TcpStream::connect(self.target).await else {
                    labels.update(&label, |e| e.state = RequestState::Closed);
                    return;
                };
                let _ = server.set_nodelay(true);
                let (server_read, mut server_write) = server.into_split();
                let written = server_write.write_all(&buffer).await.is_ok();
                labels.update(&label, |e| {
                    e.state = if written {
                        RequestState::Forwarded
                    } else {
                        RequestState::Closed
                    }
                });
                if !written {
                    return;
                }
                // The first bytes of the answer mark the request as answered, which
                // `reorder` waits for before forwarding the next.
                let (mut server_read, mut client_write) = (server_read, client_write);
                let mut chunk = vec![0u8; 64 * 1024];
                let first = server_read.read(&mut chunk).await;
                labels.update(&label, |e| e.state = RequestState::Answered);
                match first {
                    Ok(n) if n > 0 && client_write.write_all(&chunk[..n]).await.is_ok() => {
                        self.pumps(client_read, client_write, server_read, server_write);
                    }
                    _ => {
                        let _ = client_write.shutdown().await;
                    }
                }
            }
            Command::Duplicate => {
                let first = exchange(self.target, &buffer).await;
                if let Some((_, raw)) = &first {
                    let _ = client_write.write_all(raw).await;
                }
                let copy = exchange(self.target, &buffer).await;
                labels.update(&label, |e| {
                    e.state = RequestState::Duplicated;
                    e.duplicate_reply = copy.map(|(reply, _)| reply);
                });
                let _ = client_write.shutdown().await;
            }
        }
    }
}

/// Writes `bytes` to `to`, first waiting out the global hold like [`pump`].
async fn forward(
    bytes: &[u8],
    to: &mut OwnedWriteHalf,
    held: &mut Option<(watch::Receiver<bool>, Arc<AtomicU64>)>,
) -> bool {
    if let Some((held, waiting)) = held.as_mut() {
        if *held.borrow() {
            waiting.fetch_add(bytes.len() as u64, Ordering::SeqCst);
            let released = held.wait_for(|held| !*held).await.is_ok();
            waiting.fetch_sub(bytes.len() as u64, Ordering::SeqCst);
            if !released {
                return false;
            }
        }
    }
    to.write_all(bytes).await.is_ok()
}

/// Copies bytes from `from` to `to`; while `held` says so, read bytes wait before being
/// written.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut held: Option<(watch::Receiver<bool>, Arc<AtomicU64>)>,
) {
    let mut buffer = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buffer).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some((held, waiting)) = held.as_mut() {
            if *held.borrow() {
                waiting.fetch_add(n as u64, Ordering::SeqCst);
                let released = held.wait_for(|held| !*held).await.is_ok();
                waiting.fetch_sub(n as u64, Ordering::SeqCst);
                if !released {
                    break;
                }
            }
        }
        if to.write_all(&buffer[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
