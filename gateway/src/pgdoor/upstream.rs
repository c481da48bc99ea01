//! The door's leg to the server: a TCP connection to the host of `--database-url`, with
//! TLS as that URL's `sslmode` asks ([`crate::pgtls`]).
//!
//! # Ordering
//!
//! TLS comes first, the client's StartupMessage after: the door sends SSLRequest and,
//! on `S`, runs a TLS handshake of its own before the session relays a byte (with
//! `sslnegotiation=direct`, the handshake starts at once). On `N` the door goes on in
//! cleartext only if the `sslmode` allows it. The client's TLS, ended at the door, and
//! this one are independent sessions; cancel requests travel as sessions do.

use std::io;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::config::{Host, SslMode as Negotiation, SslNegotiation};
use tokio_rustls::client::TlsStream;

use super::wire;
use super::DoorStartError;
use crate::pgtls::{self, UpstreamTls};

/// Where upstream connections go, and how.
pub(crate) struct Upstream {
    /// The host of `--database-url`: the name a `verify-full` certificate must show.
    host: String,
    /// What the door connects to: the URL's `hostaddr` if it has one, else the host.
    addr: String,
    port: u16,
    tls: UpstreamTls,
    /// The name TLS checks; `None` when TLS is never used.
    server_name: Option<ServerName<'static>>,
    /// TLS at once, without SSLRequest (`sslnegotiation=direct`).
    direct: bool,
}

/// A connection to the server, in cleartext or over TLS.
pub(crate) enum UpstreamStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl Upstream {
    pub(crate) fn from_url(url: &str) -> Result<Upstream, DoorStartError> {
        let pgtls::PgUrl { config, tls } = pgtls::parse(url)?;
        let host = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => host.clone(),
            Some(_) => return Err(DoorStartError::UnixSocket),
            None => "localhost".to_owned(),
        };
        let addr = match config.get_hostaddrs().first() {
            Some(addr) => addr.to_string(),
            None => host.clone(),
        };
        let direct = config.get_ssl_negotiation() == SslNegotiation::Direct;
        let server_name = match tls.negotiation() {
            Negotiation::Disable => None,
            Negotiation::Prefer if direct => return Err(DoorStartError::WeakDirect),
            _ => Some(pgtls::server_name(&host)?),
        };
        Ok(Upstream {
            host,
            addr,
            port: config.get_ports().first().copied().unwrap_or(5432),
            tls,
            server_name,
            direct,
        })
    }

    /// Connects, and starts TLS if the `sslmode` asks for it and the server agrees.
    pub(crate) async fn connect(&self) -> io::Result<UpstreamStream> {
        let mut stream = TcpStream::connect((self.addr.as_str(), self.port)).await?;
        stream.set_nodelay(true)?;
        let Some(name) = &self.server_name else {
            return Ok(UpstreamStream::Plain(stream));
        };
        if !self.direct {
            let mut request = [0u8; 8];
            request[..4].copy_from_slice(&8u32.to_be_bytes());
            request[4..].copy_from_slice(&wire::SSL_REQUEST.to_be_bytes());
            stream.write_all(&request).await?;
            // One byte, unbuffered: nothing the server sends before the handshake may
            // be taken for part of the session.
            match stream.read_u8().await? {
                b'S' => {}
                b'N' if self.tls.negotiation() == Negotiation::Prefer => {
                    return Ok(UpstreamStream::Plain(stream))
                }
                b'N' => {
                    return Err(io::Error::other(format!(
                        "the database offers no TLS, and sslmode={} requires it",
                        self.tls.mode()
                    )))
                }
                other => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("the database answered SSLRequest with {other:#04x}"),
                    ))
                }
            }
        }
        let stream = self.tls.connector().connect(name.clone(), stream).await?;
        Ok(UpstreamStream::Tls(Box::new(stream)))
    }

    /// Sends a CancelRequest for `key`, over TLS if sessions use it, and waits for the
    /// server to close.
    pub(crate) async fn cancel(&self, key: &wire::CancelKey) -> io::Result<()> {
        match self.connect().await? {
            UpstreamStream::Plain(mut stream) => send_cancel(&mut stream, key).await,
            UpstreamStream::Tls(mut stream) => send_cancel(&mut *stream, key).await,
        }
    }
}

async fn send_cancel<S>(stream: &mut S, key: &wire::CancelKey) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(&key.cancel_request()).await?;
    stream.flush().await?;
    // The server reads the request and closes; wait for that, briefly.
    let mut rest = Vec::new();
    match stream.read_to_end(&mut rest).await {
        // A server may close its TLS without close_notify: the request was read.
        Err(error) if error.kind() != io::ErrorKind::UnexpectedEof => Err(error),
        _ => Ok(()),
    }
}

impl std::fmt::Display for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}
