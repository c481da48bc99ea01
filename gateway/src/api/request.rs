//! A request as the handlers see it, and reading what it carries: fencing headers, and
//! a body within its limits (size, time, memory).

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::headers::Fencing;
use fencegate_proto::{ObjectKey, ResourceName};
use http::header::{CONTENT_LENGTH, EXPECT};
use http::request::Parts;
use http::Request;
use http_body_util::BodyExt;
use hyper::body::{Body as _, Incoming};

use crate::api::body::ResponseBudget;
use crate::coordinator::{
    BodyMemory, ClientKey, Coordinator, FencedRequest, FrontDoor, WritePermit,
};
use crate::error::ApiError;
use crate::server::conn::ConnState;

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
    /// The address the request came from.
    pub peer: IpAddr,
    /// Its connection, for the answers paced on it ([`crate::api::body`]).
    pub conn: Arc<ConnState>,
    /// The budget of answers waiting for their clients (`--max-response-memory`).
    pub responses: Arc<ResponseBudget>,
}

/// Whether a write carries an `Idempotency-Key`. A keyed write's token is decided by
/// the store alone, so that the retry of an accepted request gets its answer even
/// after a newer term began: the fence cache does not turn it away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idempotency {
    /// With an `Idempotency-Key`.
    Keyed,
    /// Without one.
    Unkeyed,
}

impl Idempotency {
    /// Keyed if the request carries `key`.
    pub fn of<K>(key: &Option<K>) -> Idempotency {
        match key {
            Some(_) => Idempotency::Keyed,
            None => Idempotency::Unkeyed,
        }
    }
}

/// A request body in memory, and the room it takes under `--max-body-memory`.
pub struct ReadBody {
    pub bytes: Bytes,
    _memory: BodyMemory,
}

impl Req {
    pub fn new(
        request: Request<Incoming>,
        peer: IpAddr,
        conn: Arc<ConnState>,
        responses: Arc<ResponseBudget>,
    ) -> Req {
        let (head, body) = request.into_parts();
        Req {
            head,
            body: Some(body),
            broken: false,
            identity: None,
            peer,
            conn,
            responses,
        }
    }

    /// The client this request counts against, for its shares of the bounds.
    pub fn client(&self, coordinator: &Coordinator) -> ClientKey {
        coordinator.client(self.identity.as_deref(), self.peer)
    }

    /// The checks before this request's write of `resource` (`key`, if one object),
    /// in their one order ([`Coordinator::admit`]); the permit is held until the write
    /// is done with.
    pub async fn admit_write(
        &self,
        coordinator: &Arc<Coordinator>,
        resource: &ResourceName,
        key: Option<&ObjectKey>,
        fencing: &Fencing,
        idempotency: Idempotency,
    ) -> Result<WritePermit, ApiError> {
        let entry = FencedRequest {
            resource,
            key,
            fencing,
            identity: self.identity.as_deref(),
            client: self.client(coordinator),
            keyed: idempotency == Idempotency::Keyed,
            door: FrontDoor::Http,
        };
        coordinator.admit(entry).await
    }

    /// Before an early answer over HTTP/2: reads and discards a small declared body the
    /// handlers left unread, so that the stream ends with the answer rather than a
    /// reset, which some clients take as a failure and lose the answer with.
    pub async fn drain_before_early_answer(&mut self, coordinator: &Coordinator) {
        let Some(body) = self.body.take() else {
            return;
        };
        if body.is_end_stream() {
            return;
        }
        if body
            .size_hint()
            .exact()
            .is_some_and(|length| length <= DRAIN_LIMIT)
        {
            let _ = tokio::time::timeout(coordinator.body_first_byte(), body.collect()).await;
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

/// Bodies of at most this size are claimed whole at once: they nearly always arrive
/// with their head. Larger ones claim memory as their bytes arrive.
const CLAIMED_AT_ONCE: usize = 16 * 1024;

/// Reads the whole body, refusing more than `--max-body` bytes, a body whose first byte
/// does not come within `--body-first-byte-timeout` or that takes longer than
/// `--body-timeout` in all, and — without waiting — one that does not fit in
/// `--max-body-memory` or its client's share of it. A large body's memory is claimed
/// when its first bytes arrive, so a client that declares a large body and sends
/// nothing holds none; it stays claimed while the result lives.
pub async fn read_body(coordinator: &Coordinator, request: &mut Req) -> Result<ReadBody, ApiError> {
    read_body_within(coordinator, request, coordinator.max_body()).await
}

/// As [`read_body`], with a limit of its own (at most `--max-body`).
pub async fn read_body_within(
    coordinator: &Coordinator,
    request: &mut Req,
    limit: usize,
) -> Result<ReadBody, ApiError> {
    let limit = limit.min(coordinator.max_body());
    let declared = request
        .head
        .headers
        .get(CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit as u64) {
        return Err(ApiError::BodyTooLarge { limit });
    }
    let declared = declared.map(|length| length as usize);
    let mut memory = coordinator.body_memory(request.client(coordinator));
    if let Some(length) = declared.filter(|length| *length <= CLAIMED_AT_ONCE) {
        memory.grow_to(length)?;
    }
    let Some(body) = request.body.take() else {
        return Err(ApiError::InvalidBody);
    };
    // From here the body is being read: if it stops part-way, the connection goes too.
    request.broken = true;
    let reading = collect(
        body,
        declared,
        limit,
        &mut memory,
        coordinator.body_first_byte(),
    );
    let read = tokio::select! {
        read = tokio::time::timeout(coordinator.body_timeout(), reading) => read,
        () = coordinator.shutdown().cancelled() => return Err(ApiError::ShuttingDown),
    };
    let bytes = read.map_err(|_| ApiError::BodyTimeout)??;
    request.broken = false;
    Ok(ReadBody {
        bytes,
        _memory: memory,
    })
}

/// Reads `body` into one buffer, claiming its memory before allocating it, as its
/// bytes come: the buffer grows by doubling, up to the declared length if there is one
/// (a small body is one allocation).
async fn collect(
    mut body: Incoming,
    declared: Option<usize>,
    limit: usize,
    memory: &mut BodyMemory,
    first_byte: Duration,
) -> Result<Bytes, ApiError> {
    let mut buffer = bytes::BytesMut::new();
    let first = match body.is_end_stream() {
        true => None,
        false => tokio::time::timeout(first_byte, body.frame())
            .await
            .map_err(|_| ApiError::BodyTimeout)?,
    };
    let mut next = first;
    while let Some(frame) = next {
        let frame = frame.map_err(|_| ApiError::InvalidBody)?;
        if let Ok(data) = frame.into_data() {
            let total = buffer.len() + data.len();
            if total > limit {
                return Err(ApiError::BodyTooLarge { limit });
            }
            if total > buffer.capacity() {
                // Room is claimed before it is allocated, and only as bytes come —
                // twice what the body has grown to, at least CLAIMED_AT_ONCE — never
                // by the length a client declares: one that declares much and sends
                // little holds little.
                let room = total
                    .max(2 * buffer.capacity())
                    .max(CLAIMED_AT_ONCE)
                    .min(declared.unwrap_or(limit).min(limit))
                    .max(total);
                memory.grow_to(room)?;
                buffer.reserve(room - buffer.len());
            }
            buffer.extend_from_slice(&data);
        }
        next = body.frame().await;
    }
    Ok(buffer.freeze())
}
