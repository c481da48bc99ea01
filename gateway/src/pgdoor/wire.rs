//! The Postgres wire format, as far as the door reads it: the start-up packets, the
//! header of every message, and the few messages whose content it looks at.
//!
//! Every length is checked against a cap before anything is allocated for it; message
//! bodies that the door only relays are never read into memory whole.

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};

/// The largest start-up packet: Postgres's own limit (`MAX_STARTUP_PACKET_LENGTH`).
pub(crate) const MAX_STARTUP_PACKET: usize = 10_000;

/// The largest message the door reads whole from the server: authentication requests,
/// errors, ReadyForQuery, BackendKeyData. Postgres's own errors are far smaller.
pub(crate) const MAX_INSPECTED_MESSAGE: usize = 1 << 20;

/// The largest message the client may send during authentication (a password or a
/// SASL response).
pub(crate) const MAX_AUTH_MESSAGE: usize = 64 << 10;

/// Request codes of the start-up packets that are not a StartupMessage.
pub(crate) const SSL_REQUEST: u32 = 80_877_103;
pub(crate) const GSSENC_REQUEST: u32 = 80_877_104;
pub(crate) const CANCEL_REQUEST: u32 = 80_877_102;

/// The first byte of a TLS handshake record: a client that starts TLS at once (libpq 17
/// `sslnegotiation=direct`).
pub(crate) const TLS_HANDSHAKE: u8 = 0x16;

/// The protocol's major version; minors are negotiated by the server.
pub(crate) const PROTOCOL_MAJOR: u32 = 3;

/// The SASL mechanism that binds to the TLS channel. Withdrawn by the door: the
/// client's TLS ends at the door, so the binding Postgres would check cannot match.
pub(crate) const SCRAM_PLUS: &[u8] = b"SCRAM-SHA-256-PLUS";

/// Message types a client may send after start-up.
pub(crate) mod frontend {
    pub(crate) const BIND: u8 = b'B';
    pub(crate) const CLOSE: u8 = b'C';
    pub(crate) const COPY_DATA: u8 = b'd';
    pub(crate) const COPY_DONE: u8 = b'c';
    pub(crate) const COPY_FAIL: u8 = b'f';
    pub(crate) const DESCRIBE: u8 = b'D';
    pub(crate) const EXECUTE: u8 = b'E';
    pub(crate) const FLUSH: u8 = b'H';
    pub(crate) const FUNCTION_CALL: u8 = b'F';
    pub(crate) const PARSE: u8 = b'P';
    /// PasswordMessage, SASLInitialResponse, SASLResponse, GSSResponse.
    pub(crate) const PASSWORD: u8 = b'p';
    pub(crate) const QUERY: u8 = b'Q';
    pub(crate) const SYNC: u8 = b'S';
    pub(crate) const TERMINATE: u8 = b'X';

    /// Every type a client may send once the session runs.
    pub(crate) const ALL: &[u8] = &[
        BIND,
        CLOSE,
        COPY_DATA,
        COPY_DONE,
        COPY_FAIL,
        DESCRIBE,
        EXECUTE,
        FLUSH,
        FUNCTION_CALL,
        PARSE,
        PASSWORD,
        QUERY,
        SYNC,
        TERMINATE,
    ];

    /// The messages each answered by exactly one ReadyForQuery.
    pub(crate) fn awaits_ready(tag: u8) -> bool {
        matches!(tag, QUERY | SYNC | FUNCTION_CALL)
    }
}

/// Message types of the server that the door looks into.
pub(crate) mod backend {
    pub(crate) const AUTHENTICATION: u8 = b'R';
    pub(crate) const BACKEND_KEY_DATA: u8 = b'K';
    pub(crate) const ERROR_RESPONSE: u8 = b'E';
    pub(crate) const PARAMETER_STATUS: u8 = b'S';
    pub(crate) const READY_FOR_QUERY: u8 = b'Z';
}

/// Authentication request codes (the first field of an `R` message).
pub(crate) mod auth {
    pub(crate) const OK: i32 = 0;
    pub(crate) const CLEARTEXT_PASSWORD: i32 = 3;
    pub(crate) const MD5_PASSWORD: i32 = 5;
    pub(crate) const SASL: i32 = 10;
    pub(crate) const SASL_CONTINUE: i32 = 11;
    pub(crate) const SASL_FINAL: i32 = 12;
}

/// A violation of the protocol by the client; the connection is closed after telling it.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProtocolError {
    #[error("start-up packet length {0} is outside 8..={MAX_STARTUP_PACKET}")]
    StartupLength(u32),
    #[error("unsupported frontend protocol {major}.{minor}: the door speaks 3.x")]
    Version { major: u32, minor: u32 },
    #[error("{what} of {len} bytes is longer than the {cap}-byte limit")]
    TooLong {
        what: &'static str,
        len: usize,
        cap: usize,
    },
    #[error("message length {0} is below the 4 bytes of the length itself")]
    ShortLength(u32),
    #[error("unexpected message type {:?}", char::from(*.0))]
    UnexpectedType(u8),
    #[error("malformed {0}")]
    Malformed(&'static str),
    #[error("invalid start-up packet layout: parameter {0:?} is sent more than once")]
    RepeatedParameter(String),
    #[error("{0} after TLS was set up")]
    SecondNegotiation(&'static str),
    #[error("direct TLS without ALPN protocol \"postgresql\"")]
    NoAlpn,
}

impl ProtocolError {
    /// The SQLSTATE the client is told, as Postgres would: an unsupported protocol
    /// version, else a protocol violation.
    pub(crate) fn sqlstate(&self) -> &'static str {
        match self {
            ProtocolError::Version { .. } => "0A000",
            _ => "08P01",
        }
    }
}

/// Why a connection ended early: the client broke the protocol, or a socket failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A start-up packet as the client sent it: a request code or protocol version, and
/// the rest.
#[derive(Debug)]
pub(crate) struct StartupPacket {
    /// The whole packet, length included, to forward unchanged.
    pub(crate) raw: Bytes,
    pub(crate) code: u32,
}

impl StartupPacket {
    /// The bytes after the code.
    pub(crate) fn body(&self) -> &[u8] {
        &self.raw[8..]
    }
}

/// Reads one start-up packet (length, code, rest), refusing lengths outside
/// `8..=MAX_STARTUP_PACKET` before allocating.
pub(crate) async fn read_startup<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<StartupPacket, WireError> {
    let len = stream.read_u32().await?;
    let size = usize::try_from(len).unwrap_or(usize::MAX);
    if !(8..=MAX_STARTUP_PACKET).contains(&size) {
        return Err(ProtocolError::StartupLength(len).into());
    }
    let mut raw = BytesMut::zeroed(size);
    raw[..4].copy_from_slice(&len.to_be_bytes());
    stream.read_exact(&mut raw[4..]).await?;
    let code = u32::from_be_bytes([raw[4], raw[5], raw[6], raw[7]]);
    Ok(StartupPacket {
        raw: raw.freeze(),
        code,
    })
}

/// A message header: its type and the length of the body that follows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Header {
    pub(crate) tag: u8,
    pub(crate) body_len: usize,
}

impl Header {
    /// The header as it goes on the wire.
    pub(crate) fn encode(self) -> [u8; 5] {
        let len = u32::try_from(self.body_len + 4).expect("lengths were checked on reading");
        let [a, b, c, d] = len.to_be_bytes();
        [self.tag, a, b, c, d]
    }
}

/// Reads a message header; `Ok(None)` at a clean end of stream. A body longer than
/// `cap` is refused before it is read.
pub(crate) async fn read_header<S: AsyncRead + Unpin>(
    stream: &mut S,
    cap: usize,
    what: &'static str,
) -> Result<Option<Header>, WireError> {
    let tag = match stream.read_u8().await {
        Ok(tag) => tag,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let len = stream.read_u32().await?;
    Ok(Some(Header::checked(tag, len, cap, what)?))
}

impl Header {
    /// The header of type `tag` and length field `len`, whose body must be at most `cap`
    /// bytes.
    fn checked(tag: u8, len: u32, cap: usize, what: &'static str) -> Result<Header, ProtocolError> {
        let body_len = usize::try_from(len)
            .unwrap_or(usize::MAX)
            .checked_sub(4)
            .ok_or(ProtocolError::ShortLength(len))?;
        if body_len > cap {
            return Err(ProtocolError::TooLong {
                what,
                len: body_len,
                cap,
            });
        }
        Ok(Header { tag, body_len })
    }
}

/// The messages that lie whole at the start of a read buffer, each header checked as
/// [`read_header`] checks it: the relay looks at them in place and passes them on in one
/// write. It stops at the first message the buffer holds only part of, and after the
/// first header that fails its check.
pub(crate) struct WholeMessages<'a> {
    buffer: &'a [u8],
    cap: usize,
    what: &'static str,
    /// Bytes of the messages yielded so far.
    read: usize,
    failed: bool,
}

impl<'a> WholeMessages<'a> {
    pub(crate) fn new(buffer: &'a [u8], cap: usize, what: &'static str) -> WholeMessages<'a> {
        WholeMessages {
            buffer,
            cap,
            what,
            read: 0,
            failed: false,
        }
    }

    /// The bytes of the messages yielded so far: whole messages, headers included.
    pub(crate) fn read(&self) -> usize {
        self.read
    }
}

impl<'a> Iterator for WholeMessages<'a> {
    /// A message's header and body, or the header's violation of the protocol.
    type Item = Result<(Header, &'a [u8]), ProtocolError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let rest = &self.buffer[self.read..];
        let &[tag, a, b, c, d, ..] = rest else {
            return None;
        };
        let header =
            match Header::checked(tag, u32::from_be_bytes([a, b, c, d]), self.cap, self.what) {
                Ok(header) => header,
                Err(error) => {
                    self.failed = true;
                    return Some(Err(error));
                }
            };
        let body = rest.get(5..5 + header.body_len)?;
        self.read += 5 + header.body_len;
        Some(Ok((header, body)))
    }
}

/// Reads the body of a message whose header was read (its length already checked).
pub(crate) async fn read_body<S: AsyncRead + Unpin>(
    stream: &mut S,
    header: Header,
) -> Result<Bytes, WireError> {
    let mut body = BytesMut::zeroed(header.body_len);
    stream.read_exact(&mut body).await?;
    Ok(body.freeze())
}

/// A whole message: header and body, ready to write.
pub(crate) fn message(tag: u8, body: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + body.len());
    out.put_slice(
        &Header {
            tag,
            body_len: body.len(),
        }
        .encode(),
    );
    out.put_slice(body);
    out.freeze()
}

/// An ErrorResponse of severity FATAL, as the door sends before closing a connection.
pub(crate) fn fatal(code: &str, text: &str) -> Bytes {
    let mut body = BytesMut::new();
    for (field, value) in [(b'S', "FATAL"), (b'V', "FATAL"), (b'C', code), (b'M', text)] {
        body.put_u8(field);
        // A NUL would end the field early; the door's own texts have none.
        body.put_slice(value.replace('\0', " ").as_bytes());
        body.put_u8(0);
    }
    body.put_u8(0);
    message(backend::ERROR_RESPONSE, &body)
}

/// The fields of an ErrorResponse or NoticeResponse body, by field type.
pub(crate) fn error_fields(body: &[u8]) -> impl Iterator<Item = (u8, &[u8])> {
    body.split(|b| *b == 0)
        .take_while(|field| !field.is_empty())
        .map(|field| (field[0], &field[1..]))
}

/// Whether a ParameterStatus body says the server does not take writes:
/// `in_hot_standby=on` (a standby) or `default_transaction_read_only=on`, the two
/// settings by which libpq's `target_session_attrs=read-write` judges a server of
/// Postgres 14 or later.
pub(crate) fn reports_read_only(body: &[u8]) -> bool {
    let mut fields = body.split(|b| *b == 0);
    let (Some(name), Some(value)) = (fields.next(), fields.next()) else {
        return false;
    };
    matches!(name, b"in_hot_standby" | b"default_transaction_read_only") && value == b"on"
}

/// The authentication request code of an `R` body.
pub(crate) fn auth_code(body: &[u8]) -> Option<i32> {
    Some(i32::from_be_bytes(body.get(..4)?.try_into().ok()?))
}

/// An AuthenticationSASL body without [`SCRAM_PLUS`] in its mechanism list; `None` if
/// the body is not a well-formed list.
pub(crate) fn without_channel_binding(body: &[u8]) -> Option<Bytes> {
    let list = body.get(4..)?;
    let (last, names) = list.split_last()?;
    if *last != 0 {
        return None;
    }
    let mut out = BytesMut::with_capacity(body.len());
    out.put_slice(&body[..4]);
    for name in names.split(|b| *b == 0).take_while(|name| !name.is_empty()) {
        if name != SCRAM_PLUS {
            out.put_slice(name);
            out.put_u8(0);
        }
    }
    out.put_u8(0);
    Some(out.freeze())
}

/// A cancel key: the process id and secret of BackendKeyData and CancelRequest. The
/// secret is 4 bytes in protocol 3.0, and up to 256 bytes from 3.2 on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CancelKey {
    pub(crate) pid: i32,
    pub(crate) secret: Bytes,
}

/// The longest cancel secret the protocol allows (3.2).
pub(crate) const MAX_CANCEL_SECRET: usize = 256;

impl CancelKey {
    /// The key of a BackendKeyData body, or of a CancelRequest after its code.
    pub(crate) fn parse(body: &[u8]) -> Option<CancelKey> {
        let pid = i32::from_be_bytes(body.get(..4)?.try_into().ok()?);
        let secret = &body[4..];
        if secret.is_empty() || secret.len() > MAX_CANCEL_SECRET {
            return None;
        }
        Some(CancelKey {
            pid,
            secret: Bytes::copy_from_slice(secret),
        })
    }

    /// This key as a BackendKeyData message.
    pub(crate) fn backend_key_data(&self) -> Bytes {
        let mut body = BytesMut::with_capacity(4 + self.secret.len());
        body.put_i32(self.pid);
        body.put_slice(&self.secret);
        message(backend::BACKEND_KEY_DATA, &body)
    }

    /// A CancelRequest start-up packet for this key.
    pub(crate) fn cancel_request(&self) -> Bytes {
        let len = 12 + self.secret.len();
        let mut out = BytesMut::with_capacity(len);
        out.put_u32(u32::try_from(len).expect("secrets are at most 256 bytes"));
        out.put_u32(CANCEL_REQUEST);
        out.put_i32(self.pid);
        out.put_slice(&self.secret);
        out.freeze()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_standby_or_a_read_only_default_reports_read_only() {
        assert!(reports_read_only(b"in_hot_standby\0on\0"));
        assert!(reports_read_only(b"default_transaction_read_only\0on\0"));
        assert!(!reports_read_only(b"in_hot_standby\0off\0"));
        assert!(!reports_read_only(b"default_transaction_read_only\0off\0"));
        assert!(!reports_read_only(b"application_name\0on\0"));
        assert!(!reports_read_only(b"in_hot_standby"));
    }

    #[tokio::test]
    async fn startup_lengths_are_checked_before_reading() {
        for len in [0u32, 7, 10_001, u32::MAX] {
            let mut input: &[u8] = &len.to_be_bytes();
            let error = read_startup(&mut input).await.unwrap_err();
            assert!(
                matches!(error, WireError::Protocol(ProtocolError::StartupLength(l)) if l == len),
                "{len}: {error:?}"
            );
        }
    }

    #[tokio::test]
    async fn headers_refuse_short_and_long_lengths() {
        let mut short: &[u8] = &[b'Q', 0, 0, 0, 3];
        assert!(matches!(
            read_header(&mut short, 100, "a message").await,
            Err(WireError::Protocol(ProtocolError::ShortLength(3)))
        ));
        let mut long: &[u8] = &[b'Q', 0, 0, 0, 105];
        assert!(matches!(
            read_header(&mut long, 100, "a message").await,
            Err(WireError::Protocol(ProtocolError::TooLong { len: 101, .. }))
        ));
        let mut end: &[u8] = &[];
        assert!(read_header(&mut end, 100, "a message")
            .await
            .unwrap()
            .is_none());
    }

    /// Messages as they go on the wire, one after another.
    fn wire(messages: &[(u8, &[u8])]) -> Vec<u8> {
        messages
            .iter()
            .flat_map(|(tag, body)| message(*tag, body).to_vec())
            .collect()
    }

    #[test]
    fn whole_messages_stop_where_the_buffer_holds_only_part_of_one() {
        let stream = wire(&[(b'T', b"row description"), (b'D', b"row"), (b'Z', b"I")]);
        let mut read = Vec::new();
        for end in 0..=stream.len() {
            let mut whole = WholeMessages::new(&stream[..end], 100, "a message");
            let found: Vec<(u8, Vec<u8>)> = whole
                .by_ref()
                .map(|message| {
                    let (header, body) = message.unwrap();
                    assert_eq!(header.body_len, body.len());
                    (header.tag, body.to_vec())
                })
                .collect();
            // Exactly the messages that end within the first `end` bytes.
            let expected = match end {
                0..=19 => 0,
                20..=27 => 1,
                28..=33 => 2,
                _ => 3,
            };
            assert_eq!(found.len(), expected, "{end} bytes");
            assert_eq!(whole.read(), [0, 20, 28, 34][expected], "{end} bytes");
            read.push(found);
        }
        assert_eq!(
            read.last().unwrap(),
            &[
                (b'T', b"row description".to_vec()),
                (b'D', b"row".to_vec()),
                (b'Z', b"I".to_vec())
            ]
        );
    }

    #[test]
    fn whole_messages_check_every_header_as_read_header_does() {
        let mut stream = wire(&[(b'Q', b"select 1")]);
        stream.extend_from_slice(&[b'Q', 0, 0, 0, 3]);
        stream.extend_from_slice(&wire(&[(b'S', b"")]));
        let mut whole = WholeMessages::new(&stream, 100, "a message");
        assert!(whole.next().unwrap().is_ok());
        assert!(matches!(
            whole.next(),
            Some(Err(ProtocolError::ShortLength(3)))
        ));
        assert!(whole.next().is_none(), "nothing after a bad header");
        assert_eq!(whole.read(), 13, "the bad header is not read");

        // A length above the cap is refused from its header, before its body arrives.
        let long = [b'd', 0, 0, 0, 105];
        let mut whole = WholeMessages::new(&long, 100, "a message");
        assert!(matches!(
            whole.next(),
            Some(Err(ProtocolError::TooLong {
                len: 101,
                cap: 100,
                ..
            }))
        ));
        assert_eq!(whole.read(), 0);
    }

    #[test]
    fn channel_binding_is_withdrawn() {
        let mut body = 10i32.to_be_bytes().to_vec();
        body.extend_from_slice(b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0");
        let stripped = without_channel_binding(&body).unwrap();
        let mut expected = 10i32.to_be_bytes().to_vec();
        expected.extend_from_slice(b"SCRAM-SHA-256\0\0");
        assert_eq!(&stripped[..], &expected[..]);
        assert_eq!(without_channel_binding(&body[..6]), None, "unterminated");
    }

    #[test]
    fn cancel_keys_round_trip() {
        let key = CancelKey {
            pid: 4242,
            secret: Bytes::from_static(&[1, 2, 3, 4]),
        };
        let request = key.cancel_request();
        assert_eq!(request.len(), 16);
        assert_eq!(
            u32::from_be_bytes(request[4..8].try_into().unwrap()),
            CANCEL_REQUEST
        );
        assert_eq!(CancelKey::parse(&request[8..]), Some(key.clone()));
        let data = key.backend_key_data();
        assert_eq!(data[0], backend::BACKEND_KEY_DATA);
        assert_eq!(CancelKey::parse(&data[5..]), Some(key));
        assert_eq!(CancelKey::parse(&[0, 0, 0, 1]), None, "no secret");
    }

    #[test]
    fn fatal_errors_read_back() {
        let error = fatal("08P01", "bad");
        let fields: Vec<(u8, &[u8])> = error_fields(&error[5..]).collect();
        assert!(fields.contains(&(b'C', b"08P01".as_slice())));
        assert!(fields.contains(&(b'M', b"bad".as_slice())));
    }
}
