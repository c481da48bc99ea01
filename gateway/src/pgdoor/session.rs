//! One client session: its own upstream connection (over TLS if `--database-url` asks,
//! see [`super::upstream`]), authentication relayed to Postgres, then messages streamed
//! both ways.
//!
//! # Streaming
//!
//! Each direction reads through a buffer and writes through a buffer, and flushes
//! whenever it has nothing more to read: a batch of pipelined messages travels in as
//! few writes as it came in, and a lone Flush, Sync or reply goes out at once (never
//! held back until a Sync). The messages that a read brought in whole — nearly all of
//! them — are checked or looked into where they lie in the read buffer and passed on
//! together in one write ([`wire::WholeMessages`]); a message the buffer holds only
//! part of has its header read and its body copied through the buffers in pieces, so
//! a 16 MiB value takes the buffers' memory, not 16 MiB. A slow reader on one side
//! stops the reading on the other (backpressure).
//!
//! # What the door reads
//!
//! From the client: message headers only, checked against the protocol's message types
//! and `--pg-max-message`. From the server: authentication requests (SCRAM channel
//! binding is withdrawn), BackendKeyData (replaced by the door's own key, [`super::cancel`]),
//! ErrorResponse (fencegate's stale rejections are counted and logged),
//! ParameterStatus (a server that turns read-only, with `target_session_attrs=read-write`)
//! and ReadyForQuery (the transaction status, for a clean shutdown).
//!
//! # Ending
//!
//! A client that leaves — Terminate, a closed socket, a protocol error — takes its
//! upstream connection with it: the server sees the socket close and rolls back any
//! open transaction, releasing its locks. A server that goes away ends the session; so
//! does, with `target_session_attrs=read-write`, a server that reports
//! `default_transaction_read_only=on` or `in_hot_standby=on` mid-session: the door relays
//! nothing more from it and tells the client with FATAL `08006`
//! ([`super::login::NOT_PRIMARY`]) in place of that ParameterStatus. The server sends it
//! before the ReadyForQuery of the first statement it ran read-only, so no write of the
//! client goes through after it. A client that itself sets
//! `default_transaction_read_only = on` is ended the same way (libpq's read-write check
//! cannot tell either); `BEGIN READ ONLY` is not reported and is fine.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::admission::{Authenticating, Refusal};
use super::login::{authenticate, Login, NOT_PRIMARY, NOT_PRIMARY_SQLSTATE};
use super::upstream::UpstreamStream;
use super::wire::{self, backend, frontend, Header, ProtocolError, StartupPacket, WireError};
use super::Door;
use crate::dbfence::Reported;

/// Buffer size of each direction's reader and writer: four per session, so 64 KiB a
/// session. Larger messages pass through them in pieces.
const BUFFER: usize = 16 << 10;

/// The largest message the server may send: Postgres's own limit is 1 GiB. Server
/// messages are streamed, never held whole, except the few small ones the door reads.
const MAX_SERVER_MESSAGE: usize = 1 << 30;

/// How a session ended, for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending {
    /// The client sent Terminate.
    Terminated,
    /// The client closed its socket.
    ClientClosed,
    /// The client closed its socket while a statement of its was running.
    ClientLeftRunning,
    /// The server closed the connection (after a FATAL error, or shut down).
    ServerClosed,
    /// The login was refused, with this SQLSTATE if the refusal had one.
    LoginRefused(Option<[u8; 5]>),
    /// Start-up and authentication took longer than `--pg-startup-timeout`.
    LoginTimedOut,
    /// The client broke the protocol; it was told so.
    ProtocolError,
    /// The gateway is shutting down; the idle session was told so.
    Shutdown,
    /// The server was not, or no longer, the primary; the client was told so.
    NotPrimary,
}

/// Runs a session from its StartupMessage to its end, on the two halves of the client's
/// stream; `authenticating` is held until the login is over.
pub(crate) async fn run<R, W>(
    door: &Door,
    (client_read, client_write): (R, W),
    startup: StartupPacket,
    deadline: Instant,
    authenticating: Authenticating,
) -> Result<Ending, WireError>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let mut client_read = BufReader::with_capacity(BUFFER, client_read);
    let mut client_write = BufWriter::with_capacity(BUFFER, client_write);
    let ended = session(
        door,
        &mut client_read,
        &mut client_write,
        startup,
        deadline,
        authenticating,
    )
    .await;
    close(&mut client_write).await;
    ended
}

/// Closes the client's side in an orderly way (TLS's close_notify included), unless the
/// client does not take it within a moment.
pub(crate) async fn close<W: AsyncWrite + Unpin>(client: &mut W) {
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, client.shutdown()).await;
}

/// How long an orderly close may wait for the client.
const CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

async fn session<CR, CW>(
    door: &Door,
    client_read: &mut BufReader<CR>,
    client_write: &mut BufWriter<CW>,
    startup: StartupPacket,
    deadline: Instant,
    authenticating: Authenticating,
) -> Result<Ending, WireError>
where
    CR: AsyncRead + Unpin + Send,
    CW: AsyncWrite + Unpin + Send,
{
    let minor = startup.code & 0xffff;
    if startup.code >> 16 != wire::PROTOCOL_MAJOR {
        let error = ProtocolError::Version {
            major: startup.code >> 16,
            minor,
        };
        refuse(client_write, "0A000", &error.to_string()).await?;
        return Err(error.into());
    }
    let (host, upstream) = match tokio::time::timeout_at(deadline, door.upstream.connect()).await {
        Ok(Ok(upstream)) => upstream,
        Ok(Err(error)) => {
            tracing::warn!(%error, upstream = %door.upstream, "the Postgres door could not reach the database");
            let text = format!("fencegate could not reach the database: {error}");
            refuse(client_write, "08006", &text).await?;
            return Ok(Ending::ServerClosed);
        }
        Err(_) => {
            refuse(
                client_write,
                "08006",
                "fencegate timed out reaching the database",
            )
            .await?;
            return Ok(Ending::ServerClosed);
        }
    };
    let session = Session {
        startup,
        deadline,
        authenticating,
        host,
    };
    let client = (client_read, client_write);
    match upstream {
        // A TCP stream splits into halves without a lock between them.
        UpstreamStream::Plain(stream) => {
            let upstream = stream.into_split();
            attached(door, client, upstream, false, session).await
        }
        UpstreamStream::Tls(stream) => {
            let upstream = tokio::io::split(*stream);
            attached(door, client, upstream, true, session).await
        }
    }
}

/// What a session starts with: the client's StartupMessage, the end of its login time,
/// its place among the connections still authenticating, and the index of the host it
/// is connected to.
struct Session {
    startup: StartupPacket,
    deadline: Instant,
    authenticating: Authenticating,
    host: usize,
}

/// The session once its upstream connection is made (`upstream_tls`: over TLS):
/// start-up, authentication, then the relay.
async fn attached<CR, CW, UR, UW>(
    door: &Door,
    (client_read, client_write): (&mut BufReader<CR>, &mut BufWriter<CW>),
    (upstream_read, upstream_write): (UR, UW),
    upstream_tls: bool,
    Session {
        startup,
        deadline,
        authenticating,
        host,
    }: Session,
) -> Result<Ending, WireError>
where
    CR: AsyncRead + Unpin + Send,
    CW: AsyncWrite + Unpin + Send,
    UR: AsyncRead + Unpin + Send,
    UW: AsyncWrite + Unpin + Send,
{
    let mut upstream_read = BufReader::with_capacity(BUFFER, upstream_read);
    let mut upstream_write = BufWriter::with_capacity(BUFFER, upstream_write);
    let startup = match door.idle_in_transaction {
        Some(timeout) => startup.with_options(&format!(
            "-c idle_in_transaction_session_timeout={}",
            timeout.as_millis().max(1)
        )),
        None => startup,
    };
    upstream_write.write_all(&startup.raw).await?;
    upstream_write.flush().await?;

    let mut ends = Ends {
        client_read,
        client_write,
        upstream_read: &mut upstream_read,
        upstream_write: &mut upstream_write,
        upstream_tls,
        upstream_host: host,
    };
    let login = tokio::time::timeout_at(deadline, authenticate(door, &mut ends)).await;
    let (key, status) = match login {
        Ok(Ok(Login::Ready { key, status })) => (key, status),
        Ok(Ok(Login::Refused { sqlstate })) => return Ok(Ending::LoginRefused(sqlstate)),
        Ok(Ok(Login::NotPrimary)) => return Ok(Ending::NotPrimary),
        Ok(Err(error)) => return Err(error),
        Err(_) => {
            let timeout = Refusal::AuthTimeout;
            refuse(ends.client_write, timeout.sqlstate(), timeout.message()).await?;
            return Ok(Ending::LoginTimedOut);
        }
    };
    drop(authenticating);
    door.metrics().pg_session();
    let ending = relay(door, ends, status).await;
    if let (Ok(Ending::ClientLeftRunning), Some((_, upstream))) = (&ending, &key) {
        // Closing the upstream socket ends an idle session at once, but a statement
        // that is running goes on until it next talks to the client: cancel it.
        door.cancel_upstream(host, upstream).await;
    }
    drop(key);
    ending
}

/// Both ends of a session, each side buffered.
pub(super) struct Ends<'a, CR, CW, UR, UW> {
    pub(super) client_read: &'a mut BufReader<CR>,
    pub(super) client_write: &'a mut BufWriter<CW>,
    pub(super) upstream_read: &'a mut BufReader<UR>,
    pub(super) upstream_write: &'a mut BufWriter<UW>,
    /// The upstream connection is TLS: the server supports SCRAM channel binding.
    pub(super) upstream_tls: bool,
    /// The index of the server's host among the URL's.
    pub(super) upstream_host: usize,
}

/// Counts a session's requests and replies, so that shutdown can tell an idle session
/// (nothing asked and unanswered, no transaction open) from a busy one.
struct Progress {
    /// Messages sent that each get one ReadyForQuery (Query, Sync, FunctionCall).
    asked: AtomicU64,
    /// ReadyForQuery messages relayed.
    answered: AtomicU64,
    /// The latest transaction status: `I` idle, `T` in a transaction, `E` failed one.
    status: AtomicU8,
}

impl Progress {
    /// Something asked is not answered yet.
    fn running(&self) -> bool {
        self.asked.load(Ordering::Relaxed) != self.answered.load(Ordering::Relaxed)
    }

    fn idle(&self) -> bool {
        self.status.load(Ordering::Relaxed) == b'I'
            && self.asked.load(Ordering::Relaxed) == self.answered.load(Ordering::Relaxed)
    }
}

/// Streams messages both ways until one side ends the session.
async fn relay<CR, CW, UR, UW>(
    door: &Door,
    ends: Ends<'_, CR, CW, UR, UW>,
    status: u8,
) -> Result<Ending, WireError>
where
    CR: AsyncRead + Unpin + Send,
    CW: AsyncWrite + Unpin + Send,
    UR: AsyncRead + Unpin + Send,
    UW: AsyncWrite + Unpin + Send,
{
    let progress = Progress {
        asked: AtomicU64::new(0),
        answered: AtomicU64::new(0),
        status: AtomicU8::new(status),
    };
    let (failed, failure) = oneshot::channel();
    let from_client = async {
        match from_client(door, ends.client_read, ends.upstream_write, &progress).await {
            // The other direction tells the client, between two of the server's
            // messages, and ends the session.
            Err(WireError::Protocol(error)) => {
                let _ = failed.send(error);
                std::future::pending().await
            }
            other => other,
        }
    };
    let to_client = to_client(
        door,
        ends.upstream_read,
        ends.client_write,
        &progress,
        failure,
        ends.upstream_host,
    );
    let ending = tokio::select! {
        ending = from_client => ending,
        ending = to_client => ending,
    };
    if matches!(ending, Ok(Ending::ClientClosed)) && progress.running() {
        return Ok(Ending::ClientLeftRunning);
    }
    ending
}

/// Client to server: headers checked, bodies streamed.
async fn from_client<R, W>(
    door: &Door,
    client: &mut BufReader<R>,
    upstream: &mut BufWriter<W>,
    progress: &Progress,
) -> Result<Ending, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    loop {
        if client.buffer().is_empty() {
            upstream.flush().await?;
            if client.fill_buf().await?.is_empty() {
                return Ok(Ending::ClientClosed);
            }
        }
        // The messages already read whole: checked in place, passed on in one write.
        let mut whole = wire::WholeMessages::new(client.buffer(), door.max_message, "message");
        let mut passed = 0;
        let mut stop = None;
        while let Some(message) = whole.next() {
            let tag = match message {
                Ok((header, _)) => header.tag,
                Err(error) => {
                    stop = Some(Err(error.into()));
                    break;
                }
            };
            if !frontend::ALL.contains(&tag) {
                stop = Some(Err(ProtocolError::UnexpectedType(tag).into()));
                break;
            }
            if frontend::awaits_ready(tag) {
                progress.asked.fetch_add(1, Ordering::Relaxed);
            }
            passed = whole.read();
            if tag == frontend::TERMINATE {
                stop = Some(Ok(Ending::Terminated));
                break;
            }
        }
        if passed > 0 {
            upstream.write_all(&client.buffer()[..passed]).await?;
            client.consume(passed);
            door.metrics().pg_bytes_from_client(passed);
        }
        match stop {
            Some(Ok(ending)) => {
                upstream.flush().await?;
                return Ok(ending);
            }
            Some(Err(error)) => return Err(error),
            None if passed > 0 => continue,
            None => {}
        }
        // A message the buffer holds only part of: its header read, its body streamed.
        let Some(header) = wire::read_header(client, door.max_message, "message").await? else {
            return Ok(Ending::ClientClosed);
        };
        if !frontend::ALL.contains(&header.tag) {
            return Err(ProtocolError::UnexpectedType(header.tag).into());
        }
        if frontend::awaits_ready(header.tag) {
            progress.asked.fetch_add(1, Ordering::Relaxed);
        }
        upstream.write_all(&header.encode()).await?;
        if !copy_body(client, upstream, header).await? {
            return Ok(Ending::ClientClosed);
        }
        door.metrics().pg_bytes_from_client(header.body_len + 5);
        if header.tag == frontend::TERMINATE {
            upstream.flush().await?;
            return Ok(Ending::Terminated);
        }
    }
}

/// Server to client: everything relayed, errors, ParameterStatus and ReadyForQuery
/// looked into; a client's protocol error, the gateway's shutdown of an idle session or
/// a server that turns read-only (on host `host`) ends it with a FATAL error between two
/// messages.
async fn to_client<R, W>(
    door: &Door,
    upstream: &mut BufReader<R>,
    client: &mut BufWriter<W>,
    progress: &Progress,
    mut failure: oneshot::Receiver<ProtocolError>,
    host: usize,
) -> Result<Ending, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Made once: each new wait on a cancellation token takes a lock to register.
    let mut shutdown = std::pin::pin!(door.shutdown.cancelled());
    let mut shutting_down = false;
    loop {
        if let Ok(error) = failure.try_recv() {
            return tell_protocol_error(door, client, &error).await;
        }
        if upstream.buffer().is_empty() {
            client.flush().await?;
            tokio::select! {
                biased;
                error = &mut failure => {
                    if let Ok(error) = error {
                        return tell_protocol_error(door, client, &error).await;
                    }
                    // The other direction ended; the session is ending.
                    std::future::pending::<()>().await;
                }
                () = &mut shutdown, if !shutting_down && progress.idle() => {
                    shutting_down = true;
                    if !progress.idle() {
                        // A request went out since the guard was checked: close at
                        // its ReadyForQuery instead.
                        continue;
                    }
                    refuse(client, "57P01", "fencegate is shutting down").await?;
                    return Ok(Ending::Shutdown);
                }
                read = upstream.fill_buf() => {
                    if read?.is_empty() {
                        return Ok(Ending::ServerClosed);
                    }
                }
            }
        }
        // The messages already read whole: looked into in place, passed on in one write.
        let mut whole =
            wire::WholeMessages::new(upstream.buffer(), MAX_SERVER_MESSAGE, "server message");
        let mut passed = 0;
        let mut ready = false;
        let mut read_only = false;
        while let Some(message) = whole.next() {
            let (header, body) = message?;
            match look_into(door, progress, header, body) {
                Seen::ReadOnly => {
                    read_only = true;
                    break;
                }
                Seen::Ready => ready = true,
                Seen::Other => {}
            }
            passed = whole.read();
        }
        if passed > 0 {
            client.write_all(&upstream.buffer()[..passed]).await?;
            upstream.consume(passed);
            door.metrics().pg_bytes_to_client(passed);
        }
        if read_only {
            return not_primary(door, client, host).await;
        }
        if passed > 0 {
            if ready && closes_now(door, progress, upstream) {
                refuse(client, "57P01", "fencegate is shutting down").await?;
                return Ok(Ending::Shutdown);
            }
            continue;
        }
        // A message the buffer holds only part of.
        let Some(header) =
            wire::read_header(upstream, MAX_SERVER_MESSAGE, "server message").await?
        else {
            return Ok(Ending::ServerClosed);
        };
        if inspected(header) {
            let body = wire::read_body(upstream, header).await?;
            let seen = look_into(door, progress, header, &body);
            if seen == Seen::ReadOnly {
                return not_primary(door, client, host).await;
            }
            door.metrics().pg_bytes_to_client(header.body_len + 5);
            forward(client, header, &body).await?;
            if seen == Seen::Ready && closes_now(door, progress, upstream) {
                refuse(client, "57P01", "fencegate is shutting down").await?;
                return Ok(Ending::Shutdown);
            }
        } else {
            door.metrics().pg_bytes_to_client(header.body_len + 5);
            client.write_all(&header.encode()).await?;
            if !copy_body(upstream, client, header).await? {
                return Ok(Ending::ServerClosed);
            }
        }
    }
}

/// A server message the door reads whole to look into: an ErrorResponse or a
/// ParameterStatus (within [`wire::MAX_INSPECTED_MESSAGE`]), or a ReadyForQuery.
fn inspected(header: Header) -> bool {
    match header.tag {
        backend::ERROR_RESPONSE | backend::PARAMETER_STATUS => {
            header.body_len <= wire::MAX_INSPECTED_MESSAGE
        }
        backend::READY_FOR_QUERY => header.body_len == 1,
        _ => false,
    }
}

/// What a server message was, to the door.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    /// A ReadyForQuery.
    Ready,
    /// A ParameterStatus saying the server no longer takes writes, in a session that
    /// must be on the primary: it ends the session, unrelayed.
    ReadOnly,
    Other,
}

/// Looks into a whole server message before it is relayed: counts fencegate's
/// rejections, records a ReadyForQuery's transaction status, and notices a server
/// turning read-only.
fn look_into(door: &Door, progress: &Progress, header: Header, body: &[u8]) -> Seen {
    if !inspected(header) {
        return Seen::Other;
    }
    match header.tag {
        backend::ERROR_RESPONSE => {
            count_rejection(door, body);
            Seen::Other
        }
        backend::PARAMETER_STATUS
            if door.upstream.primary_only() && wire::reports_read_only(body) =>
        {
            Seen::ReadOnly
        }
        backend::PARAMETER_STATUS => Seen::Other,
        _ => {
            progress.status.store(body[0], Ordering::Relaxed);
            progress.answered.fetch_add(1, Ordering::Relaxed);
            Seen::Ready
        }
    }
}

/// Ends a session whose server (on host `host`) turned read-only: counted, logged, and
/// the client told.
async fn not_primary<W: AsyncWrite + Unpin>(
    door: &Door,
    client: &mut BufWriter<W>,
    host: usize,
) -> Result<Ending, WireError> {
    door.not_primary(host, "session");
    refuse(client, NOT_PRIMARY_SQLSTATE, NOT_PRIMARY).await?;
    Ok(Ending::NotPrimary)
}

/// After a ReadyForQuery: the gateway is shutting down, the session is idle and the
/// server has sent nothing more, so the session closes now.
fn closes_now<R: AsyncRead>(door: &Door, progress: &Progress, upstream: &BufReader<R>) -> bool {
    door.shutdown.is_cancelled() && progress.idle() && upstream.buffer().is_empty()
}

/// Tells the client why its session ends, and counts it.
async fn tell_protocol_error<W: AsyncWrite + Unpin>(
    door: &Door,
    client: &mut BufWriter<W>,
    error: &ProtocolError,
) -> Result<Ending, WireError> {
    door.metrics().pg_protocol_error();
    tracing::info!(%error, "Postgres client broke the protocol; its session is closed");
    refuse(client, "08P01", &format!("fencegate: {error}")).await?;
    Ok(Ending::ProtocolError)
}

/// Counts and logs a fencegate rejection that the server sent (a stale token, or one
/// its issuer never issued) — if the fence's proof says the fence made it; a `ZF001` or
/// `ZF005` that the client's own SQL raised is counted apart.
fn count_rejection(door: &Door, body: &[u8]) {
    let Some(code) = error_code(body) else {
        return;
    };
    let detail = || {
        wire::error_fields(body)
            .find(|(field, _)| *field == b'D')
            .and_then(|(_, value)| std::str::from_utf8(value).ok())
    };
    if let Some(reported) = Reported::read(code, detail(), door.proof_key()) {
        door.coordinator
            .db_refusal(&reported, None, crate::coordinator::Door::Postgres);
    }
}

/// The SQLSTATE of an ErrorResponse body.
pub(super) fn error_code(body: &[u8]) -> Option<&[u8]> {
    wire::error_fields(body)
        .find(|(field, _)| *field == b'C')
        .map(|(_, code)| code)
}

/// Writes a whole message.
pub(super) async fn forward<W: AsyncWrite + Unpin>(
    out: &mut W,
    header: Header,
    body: &[u8],
) -> std::io::Result<()> {
    let header = Header {
        body_len: body.len(),
        ..header
    };
    out.write_all(&header.encode()).await?;
    out.write_all(body).await
}

/// Copies a message body of `header.body_len` bytes through the buffers; false if the
/// reader ended first. Never flushes (unlike `tokio::io::copy_buf`, which flushes at the
/// end of every body): the writer's buffer batches messages, and each direction
/// flushes when it has nothing more to read.
async fn copy_body<R, W>(from: &mut R, to: &mut W, header: Header) -> std::io::Result<bool>
where
    R: AsyncBufRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut left = header.body_len;
    while left > 0 {
        let available = from.fill_buf().await?;
        if available.is_empty() {
            return Ok(false);
        }
        let chunk = available.len().min(left);
        to.write_all(&available[..chunk]).await?;
        from.consume(chunk);
        left -= chunk;
    }
    Ok(true)
}

/// Sends a FATAL error and flushes: the last thing the client hears.
pub(super) async fn refuse<W: AsyncWrite + Unpin>(
    client: &mut BufWriter<W>,
    code: &str,
    text: &str,
) -> std::io::Result<()> {
    client.write_all(&wire::fatal(code, text)).await?;
    client.flush().await
}
