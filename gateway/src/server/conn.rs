//! One client connection: its deadlines, its requests in flight, and a close that lets
//! the client read the answer.
//!
//! # Deadlines
//!
//! [`Watched`] wraps the socket and enforces, while no request is in flight:
//!
//! - **idle**: a connection with no request in flight and no byte of a new one is
//!   closed `idle` after its last answer (or after it was accepted);
//! - **headers** (HTTP/1.x): once the first byte of a request has arrived, its headers
//!   must be complete within `header` — a client that sends a byte a second is closed.
//!
//! While a request is in flight, its body has its own deadline (the API's), and the
//! backend call the backend's. HTTP/2 connections have only the idle deadline, counted
//! from their last stream; the PING keep-alive of the HTTP/2 layer detects dead peers.
//!
//! Whatever is in flight, a write to the socket that waits for the client to read
//! fails after **write** (`--write-timeout`), and the connection closes: a client that
//! does not read its answers cannot hold them, nor its connection, for good. HTTP/2
//! streams whose windows stay shut while the socket is writable are caught by their
//! paced answers instead ([`ConnState::stalled`], [`crate::api::body`]).
//!
//! # Lingering close
//!
//! When the gateway closes a connection whose client may still be sending (an answer
//! sent before the body was read, with `Connection: close`), closing the socket at once
//! would make the kernel reset the connection, and the client could lose the answer
//! before it reads it. So shutting down first sends FIN, then reads and discards what
//! the client still sends, until it closes or [`LINGER`] has passed — as nginx and Go's
//! net/http do.
//!
//! # Eviction
//!
//! At the connection cap, the accept loop asks the longest idle connection to go
//! ([`ConnState::evict`]); the connection closes the next time it waits with nothing
//! in flight.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// How long a closing connection keeps reading what the client still sends.
pub const LINGER: Duration = Duration::from_secs(5);

/// The same, once the gateway is shutting down: a client that neither reads nor
/// closes must not hold up the exit.
pub const SHUTDOWN_LINGER: Duration = Duration::from_secs(1);

/// The first bytes of every HTTP/2 connection (RFC 9113, 3.4).
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// The deadlines of idle connections.
#[derive(Debug, Clone, Copy)]
pub struct Deadlines {
    pub idle: Duration,
    pub header: Duration,
    /// How long a write to the socket may wait for the client to read.
    pub write: Duration,
}

/// What the connection's requests and its socket share.
pub struct ConnState {
    inner: Mutex<Phase>,
    /// Woken when a paced answer starts on a connection that had none.
    answers: Notify,
    evict: CancellationToken,
    /// The server's shutdown: lingering is cut short once it has begun.
    shutdown: CancellationToken,
}

/// The clock is read only when a deadline needs it — when the connection waits with
/// nothing in flight — not at each request's start and end: a request whose head
/// arrives whole, nearly every one, never waits between the two.
#[derive(Debug)]
struct Phase {
    /// Requests being answered (HTTP/2: streams; HTTP/1.x: 0 or 1).
    in_flight: usize,
    /// When the last request was answered, or the connection accepted. `None` just
    /// after an answer, until the connection next waits (read then, a moment later).
    idle_since: Option<Instant>,
    /// The next request's head has started to arrive (HTTP/1.x), and since when: `None`
    /// until the connection waits for the rest of it.
    head_started: Option<Option<Instant>>,
    /// The client opened with the HTTP/2 preface.
    http2: bool,
    /// The socket's reader, parked while a request was in flight: the server does not
    /// read again after answering unless woken, and the deadlines start then.
    reader: Option<Waker>,
    /// Paced answers not yet sent whole ([`crate::api::body`]).
    answers_pending: usize,
    /// When one of them last handed a chunk to the HTTP layer, or started.
    answer_progress: Instant,
    /// Room held for paced answers not produced yet (their writes run): counted
    /// against the connection's pending answers, not watched for progress.
    answers_reserved: usize,
}

impl ConnState {
    pub fn new(shutdown: CancellationToken) -> Arc<ConnState> {
        Arc::new(ConnState {
            shutdown,
            inner: Mutex::new(Phase {
                in_flight: 0,
                idle_since: Some(Instant::now()),
                head_started: None,
                http2: false,
                reader: None,
                answers_pending: 0,
                answer_progress: Instant::now(),
                answers_reserved: 0,
            }),
            answers: Notify::new(),
            evict: CancellationToken::new(),
        })
    }

    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        // The lock guards plain data; a panic while holding it cannot leave it torn.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Marks a request as being answered until the returned guard is dropped.
    pub fn request(self: &Arc<Self>) -> InFlight {
        let mut phase = self.phase();
        phase.in_flight += 1;
        phase.head_started = None;
        InFlight(Arc::clone(self))
    }

    /// Since when the connection has been idle; `None` while it is answering or
    /// receiving a request.
    pub fn idle_since(&self) -> Option<Instant> {
        let phase = self.phase();
        (phase.in_flight == 0 && phase.head_started.is_none())
            .then(|| phase.idle_since.unwrap_or_else(Instant::now))
    }

    /// Asks the connection to close as soon as it is idle.
    pub fn evict(&self) {
        self.evict.cancel();
    }

    /// A paced answer starts, unless the connection already has `max` of them unsent.
    pub fn answer_started(&self, max: usize) -> bool {
        let mut phase = self.phase();
        if phase.answers_pending + phase.answers_reserved >= max {
            return false;
        }
        phase.answers_pending += 1;
        if phase.answers_pending == 1 {
            phase.answer_progress = Instant::now();
            drop(phase);
            self.answers.notify_one();
        }
        true
    }

    /// Room for a paced answer still to be produced, unless the connection already
    /// has `max` answers unsent or reserved.
    pub fn answer_reserved(&self, max: usize) -> bool {
        let mut phase = self.phase();
        if phase.answers_pending + phase.answers_reserved >= max {
            return false;
        }
        phase.answers_reserved += 1;
        true
    }

    /// A reservation was turned into an answer, or given back.
    pub fn reservation_ended(&self) {
        self.phase().answers_reserved -= 1;
    }

    /// A paced answer handed a chunk to the HTTP layer.
    pub fn answer_progressed(&self) {
        self.phase().answer_progress = Instant::now();
    }

    /// A paced answer was sent whole, or dropped with its stream or connection.
    pub fn answer_ended(&self) {
        let mut phase = self.phase();
        phase.answers_pending -= 1;
        phase.answer_progress = Instant::now();
    }

    /// Completes once the connection's paced answers have made no progress for
    /// `timeout`: its client does not read them.
    pub async fn stalled(&self, timeout: Duration) {
        loop {
            let since = {
                let phase = self.phase();
                (phase.answers_pending > 0).then_some(phase.answer_progress)
            };
            match since {
                None => self.answers.notified().await,
                Some(since) if since.elapsed() >= timeout => return,
                Some(since) => tokio::time::sleep_until(since + timeout).await,
            }
        }
    }

    /// When the connection must have made progress by, if it is waiting with nothing
    /// in flight; otherwise parks `reader` until the last request in flight ends.
    fn deadline(&self, deadlines: Deadlines, reader: &Waker) -> Option<Instant> {
        let mut phase = self.phase();
        if phase.in_flight > 0 {
            phase.reader = Some(reader.clone());
            return None;
        }
        Some(match &mut phase.head_started {
            Some(started) => *started.get_or_insert_with(Instant::now) + deadlines.header,
            None => *phase.idle_since.get_or_insert_with(Instant::now) + deadlines.idle,
        })
    }

    /// Bytes arrived: the start of a request's head, unless one is in flight.
    fn received(&self, first_bytes: &[u8]) {
        let mut phase = self.phase();
        if first_bytes.starts_with(H2_PREFACE) {
            phase.http2 = true;
        }
        if phase.in_flight == 0 && phase.head_started.is_none() && !phase.http2 {
            phase.head_started = Some(None);
        }
    }
}

/// A request in flight on its connection; see [`ConnState::request`].
pub struct InFlight(Arc<ConnState>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut phase = self.0.phase();
        phase.in_flight -= 1;
        if phase.in_flight == 0 {
            phase.idle_since = None;
            if let Some(reader) = phase.reader.take() {
                reader.wake();
            }
        }
    }
}

/// The socket, with the connection's deadlines and lingering close; see the module doc.
pub struct Watched<IO> {
    io: IO,
    state: Arc<ConnState>,
    deadlines: Deadlines,
    timer: Pin<Box<Sleep>>,
    evicted: Pin<Box<WaitForCancellationFutureOwned>>,
    /// `evicted` has been polled, so the task is woken when it completes: from then on
    /// a look at the token is enough (polling it again takes a lock each time).
    evict_watched: bool,
    /// Whether any byte has been read: the first read tells HTTP/2 from HTTP/1.x.
    started: bool,
    /// Set once the write side is shut down: until when to keep reading.
    linger_until: Option<Instant>,
    /// While a write waits for the client to read: the write deadline's timer, made
    /// on the first wait (most connections never wait to write).
    write_timer: Option<Pin<Box<Sleep>>>,
    /// The write waiting now has been waiting since the timer was set.
    write_waiting: bool,
}

impl<IO> Watched<IO> {
    pub fn new(io: IO, state: Arc<ConnState>, deadlines: Deadlines) -> Watched<IO> {
        let evicted = Box::pin(state.evict.clone().cancelled_owned());
        Watched {
            io,
            state,
            deadlines,
            timer: Box::pin(tokio::time::sleep_until(Instant::now())),
            evicted,
            evict_watched: false,
            started: false,
            linger_until: None,
            write_timer: None,
            write_waiting: false,
        }
    }

    /// After a write to the socket: a write that waits starts the write deadline (if
    /// not started yet), one that goes through ends it; a write that has waited past
    /// the deadline fails, and the connection closes.
    fn written<T>(
        &mut self,
        cx: &mut Context<'_>,
        result: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if result.is_ready() {
            self.write_waiting = false;
            return result;
        }
        let deadline = self.deadlines.write;
        let timer = self
            .write_timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(deadline)));
        if !self.write_waiting {
            self.write_waiting = true;
            timer.as_mut().reset(Instant::now() + deadline);
        }
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => {
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, WriteTimeout)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Why a write failed: the client did not read within the write deadline.
#[derive(Debug, thiserror::Error)]
#[error("the client did not read its answer within the write deadline")]
pub struct WriteTimeout;

impl<IO: AsyncRead + Unpin> AsyncRead for Watched<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let read = &buf.filled()[before..];
                if !read.is_empty() {
                    this.state.received(if this.started { &[] } else { read });
                    this.started = true;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => {
                let Some(deadline) = this.state.deadline(this.deadlines, cx.waker()) else {
                    return Poll::Pending;
                };
                let evicted = match this.evict_watched {
                    true => this.state.evict.is_cancelled(),
                    false => {
                        this.evict_watched = true;
                        this.evicted.as_mut().poll(cx).is_ready()
                    }
                };
                if evicted {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "idle connection closed to make room for a new one",
                    )));
                }
                if this.timer.deadline() != deadline {
                    this.timer.as_mut().reset(deadline);
                }
                match this.timer.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client sent nothing, or no complete request head, in time",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write(cx, buf);
        this.written(cx, result)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        this.written(cx, result)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let result = Pin::new(&mut this.io).poll_flush(cx);
        this.written(cx, result)
    }

    /// Sends FIN, then reads and discards until the client closes or [`LINGER`]
    /// passes; see the module doc.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.linger_until.is_none() {
            if let Err(error) = std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx)) {
                return Poll::Ready(Err(error));
            }
            let linger = match this.state.shutdown.is_cancelled() {
                true => SHUTDOWN_LINGER,
                false => LINGER,
            };
            let until = Instant::now() + linger;
            this.linger_until = Some(until);
            this.timer.as_mut().reset(until);
        }
        let mut scratch = [0u8; 8192];
        loop {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                // The client closed, or reset: nothing more can be lost.
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => continue,
                Poll::Pending => {
                    return match this.timer.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Ok(())),
                        Poll::Pending => Poll::Pending,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const DEADLINES: Deadlines = Deadlines {
        idle: Duration::from_secs(60),
        header: Duration::from_secs(10),
        write: Duration::from_secs(20),
    };

    fn pair() -> (
        Watched<tokio::io::DuplexStream>,
        tokio::io::DuplexStream,
        Arc<ConnState>,
    ) {
        let (server, client) = tokio::io::duplex(64);
        let state = ConnState::new(CancellationToken::new());
        (
            Watched::new(server, Arc::clone(&state), DEADLINES),
            client,
            state,
        )
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_connection_is_closed_after_the_idle_deadline() {
        let (mut server, _client, _state) = pair();
        let started = Instant::now();
        let error = server.read(&mut [0; 16]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), DEADLINES.idle);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_head_is_closed_after_the_header_deadline() {
        let (mut server, mut client, _state) = pair();
        tokio::time::sleep(Duration::from_secs(30)).await;
        client
            .write_all(b"PUT /v1/kv/a/b HTTP/1.1\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        let mut buf = [0; 64];
        assert!(server.read(&mut buf).await.unwrap() > 0);
        let error = loop {
            match server.read(&mut buf).await {
                Ok(_) => {}
                Err(error) => break error,
            }
        };
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), DEADLINES.header);
    }

    #[tokio::test(start_paused = true)]
    async fn no_deadline_while_a_request_is_in_flight() {
        let (mut server, mut client, state) = pair();
        let request = state.request();
        let reader = tokio::spawn(async move {
            let mut buf = [0; 16];
            let result = server.read(&mut buf).await.map(|n| buf[..n].to_vec());
            (server, result)
        });
        tokio::time::sleep(Duration::from_secs(600)).await;
        client.write_all(b"x").await.unwrap();
        let (mut server, result) = reader.await.unwrap();
        assert_eq!(result.unwrap(), b"x");
        // The answer ends the request: the idle deadline starts from there.
        drop(request);
        let started = Instant::now();
        assert!(server.read(&mut [0; 16]).await.is_err());
        assert_eq!(started.elapsed(), DEADLINES.idle);
    }

    /// The server may not read again after its answer unless woken: the end of the
    /// request wakes the reader, so that the idle deadline starts.
    #[tokio::test(start_paused = true)]
    async fn the_end_of_a_request_starts_the_idle_deadline_of_a_waiting_reader() {
        let (mut server, _client, state) = pair();
        let request = state.request();
        let reader = tokio::spawn(async move { server.read(&mut [0; 16]).await });
        tokio::time::sleep(Duration::from_secs(5)).await;
        let answered = Instant::now();
        drop(request);
        let error = reader.await.unwrap().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(answered.elapsed(), DEADLINES.idle);
    }

    /// A connection that waited idle, then answered a request, closes `idle` after that
    /// answer, not after it first began to wait.
    #[tokio::test(start_paused = true)]
    async fn each_answer_pushes_the_idle_deadline_back() {
        let (mut server, mut client, state) = pair();
        let reader = tokio::spawn(async move {
            let mut buf = [0; 16];
            let result = server.read(&mut buf).await.map(|n| buf[..n].to_vec());
            (server, result)
        });
        tokio::time::sleep(DEADLINES.idle / 2).await;
        client.write_all(b"x").await.unwrap();
        let (mut server, result) = reader.await.unwrap();
        assert_eq!(result.unwrap(), b"x");
        drop(state.request());
        let answered = Instant::now();
        let error = server.read(&mut [0; 16]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(answered.elapsed(), DEADLINES.idle);
    }

    /// A head that starts while the connection waits idle brings the deadline forward.
    #[tokio::test(start_paused = true)]
    async fn a_head_begun_while_idle_brings_the_deadline_forward() {
        let (mut server, mut client, _state) = pair();
        let reader = tokio::spawn(async move {
            let mut buf = [0; 64];
            let result = server.read(&mut buf).await.map(|n| n > 0);
            (server, result)
        });
        tokio::time::sleep(Duration::from_secs(5)).await;
        client
            .write_all(b"PUT /v1/kv/a/b HTTP/1.1\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        let (mut server, result) = reader.await.unwrap();
        assert!(result.unwrap());
        let error = server.read(&mut [0; 64]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), DEADLINES.header);
    }

    #[tokio::test(start_paused = true)]
    async fn http2_connections_have_only_the_idle_deadline() {
        let (mut server, mut client, _state) = pair();
        client
            .write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0; 64];
        assert!(server.read(&mut buf).await.unwrap() > 0);
        let error = server.read(&mut buf).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
    }

    #[tokio::test(start_paused = true)]
    async fn an_evicted_idle_connection_closes() {
        let (mut server, _client, state) = pair();
        let reader = tokio::spawn(async move { server.read(&mut [0; 16]).await });
        tokio::time::sleep(Duration::from_secs(1)).await;
        state.evict();
        let error = reader.await.unwrap().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
    }

    #[tokio::test(start_paused = true)]
    async fn a_write_the_client_does_not_read_fails_after_the_write_deadline() {
        let (mut server, client, _state) = pair();
        let started = Instant::now();
        let error = server.write_all(&[1; 4096]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert!(error.get_ref().unwrap().is::<WriteTimeout>());
        assert_eq!(started.elapsed(), DEADLINES.write);
        drop(client);
    }

    /// The deadline is for one wait: a client that reads slowly but steadily keeps its
    /// connection however long the whole answer takes.
    #[tokio::test(start_paused = true)]
    async fn a_client_that_reads_steadily_is_never_cut_off() {
        let (mut server, mut client, _state) = pair();
        let reader = tokio::spawn(async move {
            let mut read = 0;
            let mut buf = [0; 64];
            while read < 64 * 20 {
                tokio::time::sleep(DEADLINES.write / 2).await;
                read += client.read(&mut buf).await.unwrap();
            }
        });
        server.write_all(&[1; 64 * 20]).await.unwrap();
        reader.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn paced_answers_without_progress_are_stalled_after_the_deadline() {
        let state = ConnState::new(CancellationToken::new());
        let deadline = Duration::from_secs(20);
        // Nothing pending: never stalled.
        let nothing = tokio::time::timeout(deadline * 3, state.stalled(deadline)).await;
        assert!(nothing.is_err());
        assert!(state.answer_started(2));
        let started = Instant::now();
        let watch = tokio::spawn({
            let state = Arc::clone(&state);
            async move { state.stalled(deadline).await }
        });
        // Progress pushes the deadline back.
        tokio::time::sleep(deadline / 2).await;
        state.answer_progressed();
        watch.await.unwrap();
        assert_eq!(started.elapsed(), deadline / 2 + deadline);
        // Once the answer has ended, the connection is not stalled.
        state.answer_ended();
        let ended = tokio::time::timeout(deadline * 3, state.stalled(deadline)).await;
        assert!(ended.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn shutting_down_lingers_until_the_client_closes() {
        let (mut server, mut client, _state) = pair();
        let closing = tokio::spawn(async move { server.shutdown().await });
        // The client is still sending its body; the server reads and discards it.
        client.write_all(&[7; 1000]).await.unwrap();
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "the server sent FIN");
        drop(client);
        closing.await.unwrap().unwrap();
    }
}
