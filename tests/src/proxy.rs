//! A loopback TCP proxy that a test controls: hold traffic, release it, cut it.
//!
//! - [`Proxy::hold`]: bytes from clients are read but not forwarded — a request sent
//!   now sits "in the network" until [`Proxy::release`]. Replies always flow.
//! - [`Proxy::cut`]: every connection is closed at once and the port stops listening
//!   (connections are refused), as when a database host goes away;
//!   [`Proxy::restore`] listens again on the same port.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Proxy {
    addr: SocketAddr,
    target: SocketAddr,
    held: watch::Sender<bool>,
    /// Client bytes read while held and not yet forwarded.
    waiting: Arc<AtomicU64>,
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
        let (target, held, tasks) = (self.target, self.held.subscribe(), Arc::clone(&self.tasks));
        let waiting = Arc::clone(&self.waiting);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let upstream = tokio::spawn(pump(
                    client_read,
                    server_write,
                    Some((held.clone(), Arc::clone(&waiting))),
                ));
                let downstream = tokio::spawn(pump(server_read, client_write, None));
                tasks.lock().unwrap().extend([upstream, downstream]);
            }
        });
        self.tasks.lock().unwrap().push(accept);
        self
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
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
