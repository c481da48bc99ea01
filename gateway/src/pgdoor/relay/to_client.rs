//! The server-to-client direction of a session: everything relayed, and the few
//! messages the door looks into read whole where they lie — ErrorResponse (fencegate's
//! stale rejections are counted), ParameterStatus (a server turning read-only, with
//! `target_session_attrs=read-write`), ReadyForQuery (the transaction status, for a
//! clean shutdown). See [`super`] for the buffering.

use std::sync::atomic::Ordering;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::oneshot;

use super::super::wire::{self, backend, Header, ProtocolError, WireError};
use super::{
    copy_body, forward, refuse, Ending, Observer, Progress, MAX_SERVER_MESSAGE, NOT_PRIMARY,
    NOT_PRIMARY_SQLSTATE,
};

/// Server to client: everything relayed, errors, ParameterStatus and ReadyForQuery
/// looked into; a client's protocol error, the gateway's shutdown of an idle session or
/// a server that turns read-only ends it with a FATAL error between two messages.
pub(super) async fn to_client<R, W>(
    observer: &impl Observer,
    upstream: &mut BufReader<R>,
    client: &mut BufWriter<W>,
    progress: &Progress,
    mut failure: oneshot::Receiver<ProtocolError>,
) -> Result<Ending, WireError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Made once: each new wait on a cancellation token takes a lock to register.
    let mut shutdown = std::pin::pin!(observer.shutdown().cancelled());
    let mut shutting_down = false;
    loop {
        if let Ok(error) = failure.try_recv() {
            return tell_protocol_error(observer, client, &error).await;
        }
        if upstream.buffer().is_empty() {
            client.flush().await?;
            tokio::select! {
                biased;
                error = &mut failure => {
                    if let Ok(error) = error {
                        return tell_protocol_error(observer, client, &error).await;
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
            match look_into(observer, progress, header, body) {
                ServerMessage::ReadOnly => {
                    read_only = true;
                    break;
                }
                ServerMessage::Ready => ready = true,
                ServerMessage::Other => {}
            }
            passed = whole.read();
        }
        if passed > 0 {
            client.write_all(&upstream.buffer()[..passed]).await?;
            upstream.consume(passed);
            observer.bytes_to_client(passed);
        }
        if read_only {
            return not_primary(observer, client).await;
        }
        if passed > 0 {
            if ready && closes_now(observer, progress, upstream) {
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
            let seen = look_into(observer, progress, header, &body);
            if seen == ServerMessage::ReadOnly {
                return not_primary(observer, client).await;
            }
            observer.bytes_to_client(header.body_len + 5);
            forward(client, header, &body).await?;
            if seen == ServerMessage::Ready && closes_now(observer, progress, upstream) {
                refuse(client, "57P01", "fencegate is shutting down").await?;
                return Ok(Ending::Shutdown);
            }
        } else {
            observer.bytes_to_client(header.body_len + 5);
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
enum ServerMessage {
    /// A ReadyForQuery.
    Ready,
    /// A ParameterStatus saying the server no longer takes writes, in a session that
    /// must be on the primary: it ends the session, unrelayed.
    ReadOnly,
    Other,
}

/// Looks into a whole server message before it is relayed: hands an error to the
/// observer, records a ReadyForQuery's transaction status, and notices a server turning
/// read-only.
fn look_into(
    observer: &impl Observer,
    progress: &Progress,
    header: Header,
    body: &[u8],
) -> ServerMessage {
    if !inspected(header) {
        return ServerMessage::Other;
    }
    match header.tag {
        backend::ERROR_RESPONSE => {
            observer.server_error(body);
            ServerMessage::Other
        }
        backend::PARAMETER_STATUS if observer.primary_only() && wire::reports_read_only(body) => {
            ServerMessage::ReadOnly
        }
        backend::PARAMETER_STATUS => ServerMessage::Other,
        _ => {
            progress.status.store(body[0], Ordering::Relaxed);
            progress.answered.fetch_add(1, Ordering::Relaxed);
            ServerMessage::Ready
        }
    }
}

/// Ends a session whose server turned read-only: the observer told, and the client.
async fn not_primary<W: AsyncWrite + Unpin>(
    observer: &impl Observer,
    client: &mut BufWriter<W>,
) -> Result<Ending, WireError> {
    observer.not_primary();
    refuse(client, NOT_PRIMARY_SQLSTATE, NOT_PRIMARY).await?;
    Ok(Ending::NotPrimary)
}

/// After a ReadyForQuery: the gateway is shutting down, the session is idle and the
/// server has sent nothing more, so the session closes now.
fn closes_now<R: AsyncRead>(
    observer: &impl Observer,
    progress: &Progress,
    upstream: &BufReader<R>,
) -> bool {
    observer.shutdown().is_cancelled() && progress.idle() && upstream.buffer().is_empty()
}

/// Tells the client why its session ends, and the observer.
async fn tell_protocol_error<W: AsyncWrite + Unpin>(
    observer: &impl Observer,
    client: &mut BufWriter<W>,
    error: &ProtocolError,
) -> Result<Ending, WireError> {
    observer.protocol_error(error);
    refuse(client, error.sqlstate(), &format!("fencegate: {error}")).await?;
    Ok(Ending::ProtocolError)
}
