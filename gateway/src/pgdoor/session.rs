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
//! ([`super::login::NOT_PRIMARY`]) in place of that ParameterStatus
//! ([`super::to_client`]). The server sends it just before the ReadyForQuery of the
//! first statement it ran after the change: new transactions are read-only from then on,
//! and one left open is rolled back when the door closes the connection (a COMMIT that
//! the server completed stays committed; the client sees its CommandComplete before the
//! error). A client that itself sets
//! `default_transaction_read_only = on` is ended the same way (libpq's read-write check
//! cannot tell either); `BEGIN READ ONLY` is not reported and is fine.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::admission::{Authenticating, Refusal};
use super::login::{authenticate, Login};
use super::to_client::to_client;
use super::upstream::UpstreamStream;
use super::wire::{self, frontend, Header, ProtocolError, StartupPacket, WireError};
use super::Door;

/// Buffer size of each direction's reader and writer: four per session, so 64 KiB a
/// session. Larger messages pass through them in pieces.
const BUFFER: usize = 16 << 10;

/// The largest message the server may send: Postgres's own limit is 1 GiB. Server
/// messages are streamed, never held whole, except the few small ones the door reads.
pub(super) const MAX_SERVER_MESSAGE: usize = 1 << 30;

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
pub(super) struct Progress {
    /// Messages sent that each get one ReadyForQuery (Query, Sync, FunctionCall).
    asked: AtomicU64,
    /// ReadyForQuery messages relayed.
    pub(super) answered: AtomicU64,
    /// The latest transaction status: `I` idle, `T` in a transaction, `E` failed one.
    pub(super) status: AtomicU8,
}

impl Progress {
    /// Something asked is not answered yet.
    fn running(&self) -> bool {
        self.asked.load(Ordering::Relaxed) != self.answered.load(Ordering::Relaxed)
    }

    pub(super) fn idle(&self) -> bool {
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
pub(super) async fn copy_body<R, W>(
    from: &mut R,
    to: &mut W,
    header: Header,
) -> std::io::Result<bool>
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
