//! HTTP/1.1 framing, just enough for the proxy's labelled requests: find a request's
//! label and its length, read one answer (`Content-Length` bodies only, which is what
//! the gateway sends).

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::TcpStream;

use super::{LABEL_HEADER, MAX_HEAD};

/// Reads the first bytes of a connection into `head`; if they start like an HTTP
/// request, reads on to the end of its head and returns the value of its
/// [`LABEL_HEADER`], if any.
pub(super) async fn sniff_label(from: &mut OwnedReadHalf, head: &mut Vec<u8>) -> Option<String> {
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
        let method_len = head.iter().take_while(|b| b.is_ascii_uppercase()).count();
        if method_len == 0 || (method_len < head.len() && head[method_len] != b' ') {
            return None;
        }
        if let Some(end) = find(head, b"\r\n\r\n") {
            return header_value(&head[..end], LABEL_HEADER);
        }
        if head.len() > MAX_HEAD {
            return None;
        }
    }
}

/// Sends `request` on a new connection to `target` and reads one answer: its status
/// and body, and its raw bytes.
pub(super) async fn exchange(
    target: SocketAddr,
    request: &[u8],
) -> Option<((u16, Vec<u8>), Vec<u8>)> {
    let mut server = TcpStream::connect(target).await.ok()?;
    server.write_all(request).await.ok()?;
    let mut raw = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    loop {
        if let Some(response) = parse_response(&raw) {
            raw.truncate(response.len);
            return Some(((response.status, response.body), raw));
        }
        match server.read(&mut chunk).await {
            Ok(0) | Err(_) => return None,
            Ok(n) => raw.extend_from_slice(&chunk[..n]),
        }
    }
}

/// The length of the complete request at the start of `bytes` (head and
/// `Content-Length` body), once its head has arrived.
pub(crate) fn request_len(bytes: &[u8]) -> Option<usize> {
    let end = find(bytes, b"\r\n\r\n")? + 4;
    let body = header_value(&bytes[..end], "content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    Some(end + body)
}

/// One complete HTTP/1.1 response with a `Content-Length` at the start of `bytes`.
pub(crate) fn parse_response(bytes: &[u8]) -> Option<Response> {
    let end = find(bytes, b"\r\n\r\n")? + 4;
    let head = &bytes[..end];
    let status = std::str::from_utf8(head.get(9..12)?).ok()?.parse().ok()?;
    let body_len = header_value(head, "content-length")
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    let body = bytes.get(end..end + body_len)?.to_vec();
    Some(Response {
        status,
        head: String::from_utf8_lossy(head).into_owned(),
        body,
        len: end + body_len,
    })
}

/// A response read by [`parse_response`].
pub(crate) struct Response {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
    /// Bytes it took, head and body.
    pub len: usize,
}

impl Response {
    /// The value of a header (case-insensitive).
    pub fn header(&self, name: &str) -> Option<String> {
        header_value(self.head.as_bytes(), name)
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The value of header `name` (case-insensitive) in an HTTP head.
pub(super) fn header_value(head: &[u8], name: &str) -> Option<String> {
    let text = String::from_utf8_lossy(head);
    text.split("\r\n").skip(1).find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.trim()
            .eq_ignore_ascii_case(name)
            .then(|| value.trim().to_owned())
    })
}
