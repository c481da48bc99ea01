//! The start of a connection: TLS, the requests that come before a StartupMessage, and
//! cancel requests.
//!
//! A client may, in this order: start TLS at once (a TLS ClientHello as its first
//! bytes, ALPN `postgresql`), or ask for it with SSLRequest (answered `S` and TLS when
//! the door has a certificate, else `N`); ask for GSSAPI encryption (always `N`: the
//! door has no Kerberos identity); then send a StartupMessage, or a CancelRequest
//! instead. Only one TLS negotiation per connection; a second SSLRequest inside TLS is a
//! protocol error.

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

use super::wire::{self, ProtocolError, StartupPacket, WireError};

/// What a client asked for once negotiation is over.
pub(crate) enum Hello {
    /// A StartupMessage, to forward to the server.
    Startup(StartupPacket),
    /// A CancelRequest: the key after the code.
    Cancel(wire::CancelKey),
}

/// The client's stream: plain TCP, or TLS ended by the door.
pub(crate) enum ClientStream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// Runs negotiation on a new connection: TLS if the client wants it and the door can,
/// then the start-up packets up to a StartupMessage or CancelRequest.
pub(crate) async fn negotiate(
    mut tcp: TcpStream,
    tls: Option<&TlsAcceptor>,
) -> Result<(ClientStream, Hello), WireError> {
    let mut first = [0u8; 1];
    if tcp.peek(&mut first).await? == 1 && first[0] == wire::TLS_HANDSHAKE {
        let Some(acceptor) = tls else {
            // No certificate: a TLS-only client cannot be served. Closing is all the
            // answer there is, as from a Postgres server without TLS.
            return Err(
                ProtocolError::Malformed("start-up packet (TLS without a certificate)").into(),
            );
        };
        let stream = acceptor.accept(tcp).await?;
        if stream.get_ref().1.alpn_protocol() != Some(crate::tls::POSTGRES_ALPN) {
            return Err(ProtocolError::NoAlpn.into());
        }
        let mut stream = Box::new(stream);
        let hello = packets(&mut *stream, None).await?.into_hello()?;
        return Ok((ClientStream::Tls(stream), hello));
    }
    match packets(&mut tcp, tls).await? {
        Step::Hello(hello) => Ok((ClientStream::Plain(tcp), hello)),
        Step::StartTls(acceptor) => {
            let mut stream = Box::new(acceptor.accept(tcp).await?);
            let hello = packets(&mut *stream, None).await?.into_hello()?;
            Ok((ClientStream::Tls(stream), hello))
        }
    }
}

enum Step<'a> {
    Hello(Hello),
    /// `S` was sent; the TLS handshake follows.
    StartTls(&'a TlsAcceptor),
}

impl Step<'_> {
    fn into_hello(self) -> Result<Hello, WireError> {
        match self {
            Step::Hello(hello) => Ok(hello),
            Step::StartTls(_) => Err(ProtocolError::SecondNegotiation("SSLRequest").into()),
        }
    }
}

/// Reads start-up packets until one that ends negotiation. `tls` is the acceptor if an
/// SSLRequest may still be granted; `None` inside TLS or without a certificate.
async fn packets<'a, S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    tls: Option<&'a TlsAcceptor>,
) -> Result<Step<'a>, WireError> {
    let mut ssl_answered = false;
    loop {
        let packet = wire::read_startup(stream).await?;
        match packet.code {
            wire::SSL_REQUEST => {
                if ssl_answered {
                    return Err(ProtocolError::SecondNegotiation("SSLRequest").into());
                }
                ssl_answered = true;
                if let Some(acceptor) = tls {
                    stream.write_all(b"S").await?;
                    stream.flush().await?;
                    return Ok(Step::StartTls(acceptor));
                }
                stream.write_all(b"N").await?;
                stream.flush().await?;
            }
            wire::GSSENC_REQUEST => {
                stream.write_all(b"N").await?;
                stream.flush().await?;
            }
            wire::CANCEL_REQUEST => {
                let key = wire::CancelKey::parse(packet.body())
                    .ok_or(ProtocolError::Malformed("CancelRequest"))?;
                return Ok(Step::Hello(Hello::Cancel(key)));
            }
            // A StartupMessage; the session refuses a version it does not speak.
            _ => return Ok(Step::Hello(Hello::Startup(packet))),
        }
    }
}
