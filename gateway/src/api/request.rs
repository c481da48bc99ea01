//! A request as the handlers see it, and reading what it carries: fencing headers, and
//! a body within its limits (size, time, memory).

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::headers::Fencing;
use fencegate_proto::ResourceName;
use http::header::{CONTENT_LENGTH, EXPECT};
use http::request::Parts;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::{Body as _, Incoming};
use tokio::sync::OwnedSemaphorePermit;

use crate::coordinator::Coordinator;
use crate::error::ApiError;

/// Unread bodies up to this size are read and discarded after an early answer, keeping
/// the connection open; see the module doc.
pub const DRAIN_LIMIT: u64 = 64 * 1024;

/// A request as handlers see it: its head, and its body until a handler reads it.
pub struct Req {
    pub head: Parts,
    body: Option<Incoming>,
    /// The body was read only in part: the connection cannot carry another request.
    broken: bool,
    /// The authenticated caller's name; `None` when authentication is off.
    pub identity: Option<String>,
}

/// A request body in memory, and the room it takes under `--max-body-memory`.
pub struct ReadBody {
    pub bytes: Bytes,
    _memory: OwnedSemaphorePermit,
}

impl Req {
    pub fn new(request: Request<Incoming>) -> Req {
        let (head, body) = request.into_parts();
        Req {
            head,
            body: Some(body),
            broken: false,
            identity: None,
        }
    }

    /// Before the answer (HTTP/1.x): deals with a body no handler read, and says whether
    /// the connection can carry another request.
    pub async fn keeps_connection(&mut self, coordinator: &Coordinator) -> bool {
        if let Some(body) = self.body.take() {
            let asks_to_continue = self.head.headers.contains_key(EXPECT);
            self.broken |= !unread(coordinator, body, asks_to_continue).await;
        }
        !self.broken
    }
}

/// How long an answer waits for a small unread body before it leaves the rest to a
/// task of its own. A body that follows its head at once — nearly every one — is read
/// here, on the connection's own task: no task to spawn, schedule and wake per request.
const INLINE_DRAIN: Duration = Duration::from_millis(2);

/// Deals with a body no handler read (HTTP/1.x); false if the connection must close.
/// A client that asked to continue sends no body unless asked, so it is not waited for.
async fn unread(coordinator: &Coordinator, body: Incoming, asks_to_continue: bool) -> bool {
    if body.is_end_stream() {
        return true;
    }
    match body.size_hint().exact() {
        Some(length) if length <= DRAIN_LIMIT => {
            let mut drained = body.collect();
            if !asks_to_continue {
                // Looked at once before any timer is set: most often the body is whole.
                let now = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut drained).poll(cx)));
                if let Poll::Ready(read) = now.await {
                    return read.is_ok();
                }
                if let Ok(read) = tokio::time::timeout(INLINE_DRAIN, &mut drained).await {
                    // Read whole; or broken, and then the connection must close.
                    return read.is_ok();
                }
            }
            let timeout = coordinator.body_timeout();
            tokio::spawn(async move {
                // Dropping the body early (timeout, error) makes the server close the
                // connection, which is then the right thing to do.
                let _ = tokio::time::timeout(timeout, drained).await;
            });
            true
        }
        _ => false,
    }
}

/// Reads a write's fencing headers, recording the resource and the presented token in
/// the request's span.
pub fn fencing_of(request: &Req, resource: &ResourceName) -> Result<Fencing, ApiError> {
    let span = tracing::Span::current();
    span.record("resource", resource.as_str());
    let fencing = Fencing::from_headers(&request.head.headers)?;
    span.record("presented", fencing.token.get());
    Ok(fencing)
}

/// Reads the whole body, refusing more than `--max-body` bytes, a body that takes
/// longer than `--body-timeout`, and — without waiting — one that does not fit in
/// `--max-body-memory` now. The memory stays taken while the result lives.
pub async fn read_body(coordinator: &Coordinator, request: &mut Req) -> Result<ReadBody, ApiError> {
    let limit = coordinator.max_body();
    let declared = request
        .head
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let reserved = declared.map_or(limit, |length| length as usize);
    let memory = coordinator.body_permit(reserved)?;
    let Some(body) = request.body.take() else {
        return Err(ApiError::InvalidBody);
    };
    // From here the body is being read: if it stops part-way, the connection goes too.
    request.broken = true;
    let read = tokio::select! {
        read = tokio::time::timeout(coordinator.body_timeout(), collect(body, reserved, limit)) => read,
        () = coordinator.shutdown().cancelled() => return Err(ApiError::ShuttingDown),
    };
    let bytes = read.map_err(|_| ApiError::BodyTimeout)??;
    request.broken = false;
    Ok(ReadBody {
        bytes,
        _memory: memory,
    })
}

/// Reads `body` into one buffer of `expected` bytes (its Content-Length, if it has
/// one): one allocation, no copy once read.
async fn collect(mut body: Incoming, expected: usize, limit: usize) -> Result<Bytes, ApiError> {
    let mut buffer = bytes::BytesMut::with_capacity(expected.min(limit));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|_| ApiError::InvalidBody)?;
        if let Ok(data) = frame.into_data() {
            if buffer.len() + data.len() > limit {
                return Err(ApiError::BodyTooLarge { limit });
            }
            buffer.extend_from_slice(&data);
        }
    }
    Ok(buffer.freeze())
}
