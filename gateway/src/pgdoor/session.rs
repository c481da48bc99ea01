//! One client session: its own upstream connection (over TLS if `--database-url` asks,
//! see [`super::upstream`]), authentication relayed to Postgres, then messages streamed
//! both ways.
//!
//! The relay itself — streaming, and what it reads — is [`super::relay`]; the session
//! gives it the door's view ([`DoorObserver`]): the metrics, the fence's rejections, the
//! gateway's shutdown and the host to forget when it stops being the primary.
//!
//! # Ending
//!
//! A client that leaves — Terminate, a closed socket, a protocol error — takes its
//! upstream connection with it: the server sees the socket close and rolls back any
//! open transaction, releasing its locks. A server that goes away ends the session; so
//! does, with `target_session_attrs=read-write`, a server that reports
//! `default_transaction_read_only=on` or `in_hot_standby=on` mid-session: the door relays
//! nothing more from it and tells the client with FATAL `08006`
//! ([`super::relay::NOT_PRIMARY`]) in place of that ParameterStatus (the
//! server-to-client side of [`super::relay`]). The server sends it just before the
//! ReadyForQuery of the first statement it ran after the change: new transactions are
//! read-only from then on, and one left open is rolled back when the door closes the
//! connection (a COMMIT that the server completed stays committed; the client sees its
//! CommandComplete before the error). A client that itself sets
//! `default_transaction_read_only = on` is ended the same way (libpq's read-write check
//! cannot tell either); `BEGIN READ ONLY` is not reported and is fine.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::admission::{Authenticating, DoorRefusal};
use super::login::{authenticate, Ends, Login};
use super::relay::{self, refuse, Ending, Observer};
use super::startup::StartupMessage;
use super::upstream::UpstreamStream;
use super::wire::{self, ProtocolError, WireError};
use super::Door;
use crate::dbfence::Reported;

/// Buffer size of each direction's reader and writer: four per session, so 64 KiB a
/// session. Larger messages pass through them in pieces.
const BUFFER: usize = 16 << 10;

/// Runs a session from its StartupMessage to its end, on the two halves of the client's
/// stream; `authenticating` is held until the login is over.
pub(crate) async fn run<R, W>(
    door: &Door,
    (client_read, client_write): (R, W),
    startup: StartupMessage,
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
    startup: StartupMessage,
    deadline: Instant,
    authenticating: Authenticating,
) -> Result<Ending, WireError>
where
    CR: AsyncRead + Unpin + Send,
    CW: AsyncWrite + Unpin + Send,
{
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
    startup: StartupMessage,
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
        Some(timeout) => startup.with_parameter(
            "idle_in_transaction_session_timeout",
            &timeout.as_millis().max(1).to_string(),
        ),
        None => startup,
    };
    upstream_write.write_all(&startup.encode()).await?;
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
            let timeout = DoorRefusal::AuthTimeout;
            refuse(ends.client_write, timeout.sqlstate(), timeout.message()).await?;
            return Ok(Ending::LoginTimedOut);
        }
    };
    drop(authenticating);
    door.metrics().pg_session();
    let observer = DoorObserver { door, host };
    let ending = relay::relay(
        &observer,
        (ends.client_read, ends.client_write),
        (ends.upstream_read, ends.upstream_write),
        status,
    )
    .await;
    if let (Ok(Ending::ClientLeftRunning), Some((_, upstream))) = (&ending, &key) {
        // Closing the upstream socket ends an idle session at once, but a statement
        // that is running goes on until it next talks to the client: cancel it.
        door.cancel_upstream(host, upstream).await;
    }
    drop(key);
    ending
}

/// The door's view of one session's relay.
struct DoorObserver<'a> {
    door: &'a Door,
    /// The index of the session's host among the URL's.
    host: usize,
}

impl Observer for DoorObserver<'_> {
    fn max_message(&self) -> usize {
        self.door.max_message
    }

    fn primary_only(&self) -> bool {
        self.door.upstream.primary_only()
    }

    fn shutdown(&self) -> &CancellationToken {
        &self.door.shutdown
    }

    fn bytes_from_client(&self, bytes: usize) {
        self.door.metrics().pg_bytes_from_client(bytes);
    }

    fn bytes_to_client(&self, bytes: usize) {
        self.door.metrics().pg_bytes_to_client(bytes);
    }

    /// Counts and logs a fencegate rejection that the server sent (a stale token, or
    /// one its issuer never issued) — if the fence's proof says the fence made it; a
    /// `ZF001` or `ZF005` that the client's own SQL raised is counted apart.
    fn server_error(&self, body: &[u8]) {
        let Some(code) = relay::error_code(body) else {
            return;
        };
        let detail = || {
            wire::error_fields(body)
                .find(|(field, _)| *field == b'D')
                .and_then(|(_, value)| std::str::from_utf8(value).ok())
        };
        if let Some(reported) = Reported::read(code, detail(), self.door.proof_key()) {
            self.door.coordinator.db_refusal(
                &reported,
                None,
                crate::coordinator::FrontDoor::Postgres,
            );
        }
    }

    fn protocol_error(&self, error: &ProtocolError) {
        self.door.metrics().pg_protocol_error();
        tracing::info!(%error, "Postgres client broke the protocol; its session is closed");
    }

    fn not_primary(&self) {
        self.door.not_primary(self.host, "session");
    }
}
