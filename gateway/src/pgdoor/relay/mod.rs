//! The message relay of a session once it is logged in: bytes streamed both ways, the
//! few messages the door must see looked into, and the session's endings — with no
//! knowledge of the door, its upstream or the coordinator. What the relay reports, and
//! the little it needs to know, go through an [`Observer`]; so the relay runs the same
//! over sockets, TLS streams or the in-memory pipes of its tests.
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
//! # What the relay reads
//!
//! From the client: message headers only, checked against the protocol's message types
//! and the observer's message cap. From the server ([`mod@to_client`]): ErrorResponse
//! (handed to the observer, which counts fencegate's rejections), ParameterStatus (a
//! server that turns read-only, when the session must be on the primary) and
//! ReadyForQuery (the transaction status, for a clean shutdown).

mod to_client;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

use tokio::io::{
    AsyncBufRead, AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter,
};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::wire::{self, frontend, Header, ProtocolError, WireError};
use to_client::to_client;

/// What the relay asks of, and tells, whoever runs it: the door in production, a
/// recorder in tests.
pub(crate) trait Observer: Sync {
    /// The largest message a client may send (`--pg-max-message`).
    fn max_message(&self) -> usize;
    /// The session must be on the primary: a server that turns read-only ends it.
    fn primary_only(&self) -> bool;
    /// Cancelled when the gateway shuts down: an idle session then ends at once, a busy
    /// one at its next ReadyForQuery that leaves it idle.
    fn shutdown(&self) -> &CancellationToken;
    /// Bytes passed from the client to the server.
    fn bytes_from_client(&self, bytes: usize);
    /// Bytes passed from the server to the client.
    fn bytes_to_client(&self, bytes: usize);
    /// The body of an ErrorResponse the server sent, before it is relayed.
    fn server_error(&self, body: &[u8]);
    /// The client broke the protocol; the relay tells it so and ends the session.
    fn protocol_error(&self, error: &ProtocolError);
    /// The server reported that it turned read-only in a session that must be on the
    /// primary; the relay tells the client and ends the session.
    fn not_primary(&self);
}

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

/// The largest message the server may send: Postgres's own limit is 1 GiB. Server
/// messages are streamed, never held whole, except the few small ones the relay reads.
pub(super) const MAX_SERVER_MESSAGE: usize = 1 << 30;

/// The SQLSTATE of the FATAL error that ends a session whose server is not, or no
/// longer, the primary: `08006` (connection_failure). Class 08 is what drivers and pools
/// take for "this connection is gone, open another" — which is the remedy, since the
/// door's next session goes to the primary. `25006` (read_only_sql_transaction) would
/// name the cause, but it is what the server itself sends for one refused statement on a
/// connection that stays usable, and pools do not drop a connection for it.
pub(super) const NOT_PRIMARY_SQLSTATE: &str = "08006";

/// The message of that error.
pub(super) const NOT_PRIMARY: &str =
    "the database server is not the primary (a failover may be under way); connect again";

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
        self.status.load(Ordering::Relaxed) == b'I' && !self.running()
    }
}

/// Streams messages both ways until one side ends the session; `status` is the
/// transaction status of the login's ReadyForQuery.
pub(super) async fn relay<CR, CW, UR, UW>(
    observer: &impl Observer,
    (client_read, client_write): (&mut BufReader<CR>, &mut BufWriter<CW>),
    (upstream_read, upstream_write): (&mut BufReader<UR>, &mut BufWriter<UW>),
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
        match from_client(observer, client_read, upstream_write, &progress).await {
            // The other direction tells the client, between two of the server's
            // messages, and ends the session.
            Err(WireError::Protocol(error)) => {
                let _ = failed.send(error);
                std::future::pending().await
            }
            other => other,
        }
    };
    let to_client = to_client(observer, upstream_read, client_write, &progress, failure);
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
    observer: &impl Observer,
    client: &mut BufReader<R>,
    upstream: &mut BufWriter<W>,
    progress: &Progress,
) -> Result<Ending, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let max_message = observer.max_message();
    loop {
        if client.buffer().is_empty() {
            upstream.flush().await?;
            if client.fill_buf().await?.is_empty() {
                return Ok(Ending::ClientClosed);
            }
        }
        // The messages already read whole: checked in place, passed on in one write.
        let mut whole = wire::WholeMessages::new(client.buffer(), max_message, "message");
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
            observer.bytes_from_client(passed);
        }
        match stop {
            Some(Ok(ending)) => {
                upstream.flush().await?;
                return Ok(ending);
            }
            // What the batch held before the offending message may go unsent: the
            // session ends.
            Some(Err(error)) => return Err(error),
            None if passed > 0 => continue,
            None => {}
        }
        // A message the buffer holds only part of: its header read, its body streamed.
        let Some(header) = wire::read_header(client, max_message, "message").await? else {
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
        observer.bytes_from_client(header.body_len + 5);
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
