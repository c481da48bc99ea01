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

use bytes::{BufMut, Bytes, BytesMut};

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
        Greeting::Hello(hello) => Ok((ClientStream::Plain(tcp), hello)),
        Greeting::StartTls(acceptor) => {
            let mut stream = Box::new(acceptor.accept(tcp).await?);
            let hello = packets(&mut *stream, None).await?.into_hello()?;
            Ok((ClientStream::Tls(stream), hello))
        }
    }
}

/// What a client opened with: its first packet, or an SSLRequest the door accepted.
enum Greeting<'a> {
    Hello(Hello),
    /// `S` was sent; the TLS handshake follows.
    StartTls(&'a TlsAcceptor),
}

impl Greeting<'_> {
    fn into_hello(self) -> Result<Hello, WireError> {
        match self {
            Greeting::Hello(hello) => Ok(hello),
            Greeting::StartTls(_) => Err(ProtocolError::SecondNegotiation("SSLRequest").into()),
        }
    }
}

/// Reads start-up packets until one that ends negotiation. `tls` is the acceptor if an
/// SSLRequest may still be granted; `None` inside TLS or without a certificate.
async fn packets<'a, S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    tls: Option<&'a TlsAcceptor>,
) -> Result<Greeting<'a>, WireError> {
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
                    return Ok(Greeting::StartTls(acceptor));
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
                return Ok(Greeting::Hello(Hello::Cancel(key)));
            }
            // A StartupMessage; the session refuses a version it does not speak.
            _ => return Ok(Greeting::Hello(Hello::Startup(packet))),
        }
    }
}

/// Postgres's longest identifier, `NAMEDATALEN - 1` bytes: longer role and database
/// names in a StartupMessage are cut to it by the server.
const MAX_IDENTIFIER: usize = 63;

/// A StartupMessage as Postgres reads it: the protocol version and each parameter
/// once, in the client's order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StartupMessage {
    pub(crate) version: u32,
    parameters: Vec<(Vec<u8>, Vec<u8>)>,
}

impl StartupMessage {
    /// Reads `packet` as Postgres does (`ProcessStartupPacket`), refusing what Postgres
    /// refuses, a major version other than 3, and a parameter named twice.
    pub(crate) fn parse(packet: &StartupPacket) -> Result<StartupMessage, ProtocolError> {
        let version = packet.code;
        if version >> 16 != wire::PROTOCOL_MAJOR {
            return Err(ProtocolError::Version {
                major: version >> 16,
                minor: version & 0xffff,
            });
        }
        let mut parameters: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        let mut rest = packet.body();
        loop {
            let name = next_string(&mut rest)?;
            if name.is_empty() {
                break;
            }
            let value = next_string(&mut rest)?;
            if parameters.iter().any(|(seen, _)| seen == name) {
                return Err(ProtocolError::RepeatedParameter(
                    String::from_utf8_lossy(name).into_owned(),
                ));
            }
            parameters.push((name.to_vec(), value.to_vec()));
        }
        if !rest.is_empty() {
            return Err(ProtocolError::Malformed(
                "start-up packet (bytes after its terminator)",
            ));
        }
        Ok(StartupMessage {
            version,
            parameters,
        })
    }

    /// The value of parameter `name`, if the client sent it.
    pub(crate) fn parameter(&self, name: &str) -> Option<&[u8]> {
        self.parameters
            .iter()
            .find(|(key, _)| key == name.as_bytes())
            .map(|(_, value)| value.as_slice())
    }

    /// The role Postgres logs in: `user`, cut as the server cuts it (empty if absent,
    /// which the server refuses).
    pub(crate) fn user(&self) -> String {
        identifier(self.parameter("user").unwrap_or_default())
    }

    /// The database Postgres opens: `database`, else the role's name, cut as the server
    /// cuts it.
    pub(crate) fn database(&self) -> String {
        match self.parameter("database") {
            Some(database) if !database.is_empty() => identifier(database),
            _ => self.user(),
        }
    }

    /// The message with parameter `name` set to `value`, in place of the client's if
    /// it sent one. Postgres applies start-up parameters after `options`, so the value
    /// holds over any `-c` of the client's too (a client may still SET it later).
    pub(crate) fn with_parameter(mut self, name: &str, value: &str) -> StartupMessage {
        let value = value.as_bytes().to_vec();
        match self
            .parameters
            .iter_mut()
            .find(|(key, _)| key == name.as_bytes())
        {
            Some((_, old)) => *old = value,
            None => self.parameters.push((name.as_bytes().to_vec(), value)),
        }
        self
    }

    /// The message as it goes to the server.
    pub(crate) fn encode(&self) -> Bytes {
        let mut raw = BytesMut::with_capacity(256);
        raw.put_u32(0);
        raw.put_u32(self.version);
        for (name, value) in &self.parameters {
            for string in [name, value] {
                raw.put_slice(string);
                raw.put_u8(0);
            }
        }
        raw.put_u8(0);
        let len = u32::try_from(raw.len()).expect("a start-up packet is small");
        raw[..4].copy_from_slice(&len.to_be_bytes());
        raw.freeze()
    }
}

/// The next NUL-terminated string of a StartupMessage's body; Postgres refuses a
/// packet whose last string is not terminated.
fn next_string<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], ProtocolError> {
    let end = rest
        .iter()
        .position(|b| *b == 0)
        .ok_or(ProtocolError::Malformed(
            "start-up packet (a parameter without its terminator)",
        ))?;
    let string = &rest[..end];
    *rest = &rest[end + 1..];
    Ok(string)
}

/// A role or database name as Postgres keeps it: at most [`MAX_IDENTIFIER`] bytes.
fn identifier(name: &[u8]) -> String {
    String::from_utf8_lossy(&name[..name.len().min(MAX_IDENTIFIER)]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packet(body: &[u8]) -> StartupPacket {
        let mut raw = Vec::new();
        raw.extend_from_slice(&u32::try_from(4 + body.len()).unwrap().to_be_bytes());
        raw.extend_from_slice(body);
        StartupPacket {
            code: u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]),
            raw: raw.into(),
        }
    }

    fn parse(body: &[u8]) -> Result<StartupMessage, ProtocolError> {
        StartupMessage::parse(&packet(body))
    }

    #[test]
    fn parameters_read_back_and_the_doors_own_replace_the_clients() {
        let sent = b"\0\x03\0\0user\0alice\0options\0-c fencegate.token=7\0\0";
        let startup = parse(sent).unwrap();
        assert_eq!(startup.user(), "alice");
        assert_eq!(startup.database(), "alice", "the role's name by default");
        assert_eq!(
            startup.parameter("options"),
            Some(b"-c fencegate.token=7".as_slice())
        );
        assert_eq!(
            &startup.encode()[..],
            &packet(sent).raw[..],
            "forwarded as sent"
        );
        let pinned = startup.clone().with_parameter("statement_timeout", "5");
        let reread = parse(&pinned.encode()[4..]).unwrap();
        assert_eq!(reread.version, startup.version);
        assert_eq!(reread.parameter("statement_timeout"), Some(b"5".as_slice()));
        assert_eq!(
            reread.parameter("options"),
            Some(b"-c fencegate.token=7".as_slice())
        );

        let own = parse(b"\0\x03\0\0user\0bob\0statement_timeout\x000\0database\0app\0\0").unwrap();
        assert_eq!(own.database(), "app");
        let pinned = parse(&own.with_parameter("statement_timeout", "5").encode()[4..]).unwrap();
        assert_eq!(pinned.parameter("statement_timeout"), Some(b"5".as_slice()));
        assert_eq!(pinned.user(), "bob");
        assert_eq!(pinned.database(), "app");
    }

    #[test]
    fn a_parameter_sent_twice_is_refused() {
        for body in [
            b"\0\x03\0\0user\0alice\0database\0app\0user\0postgres\0\0".as_slice(),
            b"\0\x03\0\0database\0app\0user\0alice\0database\0postgres\0\0",
            b"\0\x03\0\0user\0alice\0options\0-c a=1\0options\0-c b=2\0\0",
            b"\0\x03\0\0user\0alice\0fencegate.token\x001\0fencegate.token\x002\0\0",
        ] {
            assert!(
                matches!(parse(body), Err(ProtocolError::RepeatedParameter(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn layouts_postgres_refuses_are_refused() {
        for body in [
            // A name without its value.
            b"\0\x03\0\0user\0alice\0database\0".as_slice(),
            // No terminator.
            b"\0\x03\0\0user\0alice\0",
            // Bytes after the terminator: a second user Postgres would not read, but
            // nothing is forwarded that the door did not judge.
            b"\0\x03\0\0user\0alice\0\0user\0postgres\0\0",
            // A string that never ends.
            b"\0\x03\0\0user\0alice",
        ] {
            assert!(
                matches!(parse(body), Err(ProtocolError::Malformed(_))),
                "{:?}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(matches!(
            parse(b"\0\x02\0\0user\0alice\0\0"),
            Err(ProtocolError::Version { major: 2, minor: 0 })
        ));
    }

    #[test]
    fn names_are_cut_as_postgres_cuts_them() {
        let long = "a".repeat(70);
        let body = format!("\0\x03\0\0user\0{long}\0\0");
        let startup = parse(body.as_bytes()).unwrap();
        assert_eq!(startup.user(), "a".repeat(63));
        assert_eq!(startup.database(), "a".repeat(63));
    }
}
