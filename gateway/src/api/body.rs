//! Response bodies, and the memory of large ones while they wait for their client.
//!
//! Nearly every answer is small (an acceptance, a rejection) and is sent whole. A
//! larger one — an object read, a `/v1/sql` answer — lives in memory until its client
//! has read it, and a client that does not read (HTTP/1.1 with a full socket buffer, an
//! HTTP/2 stream whose window stays shut) would keep it there for good. So an answer
//! of more than [`PACE_FROM`] bytes is **paced**:
//!
//! - it is claimed under `--max-response-memory` before it is in memory (an object's
//!   value is claimed by its length before the store copies it out), and held until it
//!   is sent or its connection closes; past the budget the request is answered
//!   `503 overloaded` (`response_memory`) instead. An answer that a write produces
//!   (`/v1/sql`, a result set or its replay) is claimed before the write runs, at its
//!   bound (`--sql-max-response`), and the claim shrinks to the answer once it is
//!   known ([`ResponseBudget::reserve`]): a write is never applied and then refused
//!   room for its answer;
//! - its connection may have at most `--max-pending-answers` of them unsent at once;
//!   past that, `503 overloaded` (`pending_answers`): an HTTP/2 connection with many
//!   streams whose windows stay shut holds few answers, not hundreds;
//! - it is handed to the HTTP layer in chunks of [`CHUNK`] bytes, each only when the
//!   connection can send it, so that unsent bytes stay here, counted, rather than in
//!   the HTTP/2 layer's buffers;
//! - each chunk taken is progress ([`ConnState::answer_progressed`]): a connection
//!   whose paced answers make none for `--write-timeout` is closed (see
//!   [`crate::server`]), and their memory given back.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use hyper::body::{Frame, SizeHint};

use crate::error::Overload;
use crate::server::conn::ConnState;

/// Answers up to this size are sent whole, unclaimed.
pub const PACE_FROM: usize = 16 * 1024;

/// The bytes of a paced answer handed to the HTTP layer at a time.
pub const CHUNK: usize = 16 * 1024;

/// A response body; see the module doc.
pub struct Body(Sending);

enum Sending {
    /// Sent in one frame; `None` once taken.
    Whole(Option<Bytes>),
    Paced(Paced),
}

impl Body {
    /// A body sent whole.
    pub fn whole(bytes: impl Into<Bytes>) -> Body {
        Body(Sending::Whole(Some(bytes.into())))
    }

    /// The bytes not yet sent.
    pub fn len(&self) -> usize {
        match &self.0 {
            Sending::Whole(bytes) => bytes.as_ref().map_or(0, Bytes::len),
            Sending::Paced(paced) => paced.rest.len(),
        }
    }

    /// The bytes not yet sent, taken out of the body.
    pub fn into_bytes(self) -> Bytes {
        match self.0 {
            Sending::Whole(bytes) => bytes.unwrap_or_default(),
            Sending::Paced(paced) => paced.rest,
        }
    }

    /// Whether every byte has been sent.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `bytes`, paced in `room` if it has one (see [`ResponseBudget::room_for`]).
    pub fn in_room(bytes: Bytes, room: Option<Room>) -> Body {
        match room {
            None => Body::whole(bytes),
            Some(room) => Body(Sending::Paced(Paced { rest: bytes, room })),
        }
    }

    /// This body, sent in the room `reserved` for it (see [`ResponseBudget::reserve`]).
    pub fn in_reserved(self, reserved: Reserved) -> Body {
        let Sending::Whole(Some(bytes)) = self.0 else {
            return self;
        };
        let room = reserved.fit(bytes.len());
        Body::in_room(bytes, room)
    }
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let chunk = match &mut self.get_mut().0 {
            Sending::Whole(bytes) => bytes.take().filter(|bytes| !bytes.is_empty()),
            Sending::Paced(paced) => paced.next(),
        };
        Poll::Ready(chunk.map(|chunk| Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.len() as u64)
    }
}

/// A large answer on its way out; see the module doc.
struct Paced {
    rest: Bytes,
    room: Room,
}

impl Paced {
    fn next(&mut self) -> Option<Bytes> {
        if self.rest.is_empty() {
            return None;
        }
        let chunk = self.rest.split_to(self.rest.len().min(CHUNK));
        self.room.conn.answer_progressed();
        Some(chunk)
    }
}

/// A large answer's room: its bytes under the budget, its place among its connection's
/// pending answers. Both are given back when it is dropped — sent whole, or dropped
/// with its stream or connection.
pub struct Room {
    _claim: Claim,
    conn: Arc<ConnState>,
}

impl Drop for Room {
    fn drop(&mut self) {
        self.conn.answer_ended();
    }
}

/// The memory of paced answers not yet sent (`--max-response-memory`).
pub struct ResponseBudget {
    limit: usize,
    used: AtomicUsize,
    max_pending_per_connection: usize,
    gauge: prometheus::IntGauge,
}

impl ResponseBudget {
    pub fn new(
        limit: usize,
        max_pending_per_connection: usize,
        gauge: prometheus::IntGauge,
    ) -> Arc<ResponseBudget> {
        Arc::new(ResponseBudget {
            limit,
            used: AtomicUsize::new(0),
            max_pending_per_connection: max_pending_per_connection.max(1),
            gauge,
        })
    }

    /// Room for an answer of `bytes` on `conn`: `None` for a small one (sent whole,
    /// unclaimed); for a large one, its claim under the budget and its place among the
    /// connection's pending answers, or why there is none.
    pub fn room_for(
        self: &Arc<Self>,
        bytes: usize,
        conn: &Arc<ConnState>,
    ) -> Result<Option<Room>, Overload> {
        if bytes <= PACE_FROM {
            return Ok(None);
        }
        let claim = self.claim(bytes, self.limit)?;
        if !conn.answer_started(self.max_pending_per_connection) {
            return Err(Overload::PendingAnswers);
        }
        Ok(Some(Room {
            _claim: claim,
            conn: Arc::clone(conn),
        }))
    }

    /// Room for an answer of at most `bound` bytes that a write is about to produce,
    /// claimed before the write runs: refused then (`503 overloaded`, nothing applied)
    /// rather than after it committed. [`Reserved::fit`] shrinks it to the answer.
    pub fn reserve(
        self: &Arc<Self>,
        bound: usize,
        conn: &Arc<ConnState>,
    ) -> Result<Reserved, Overload> {
        let held = match bound <= PACE_FROM {
            true => None,
            false => {
                let claim = self.claim(bound, self.limit)?;
                if !conn.answer_reserved(self.max_pending_per_connection) {
                    return Err(Overload::PendingAnswers);
                }
                Some((claim, AnswerSlot(Arc::clone(conn))))
            }
        };
        Ok(Reserved {
            held,
            budget: Arc::clone(self),
            conn: Arc::clone(conn),
        })
    }

    /// Claims `bytes` if the bytes claimed stay at most `limit`.
    fn claim(self: &Arc<Self>, bytes: usize, limit: usize) -> Result<Claim, Overload> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                Some(used.saturating_add(bytes)).filter(|total| *total <= limit)
            })
            .map_err(|_| Overload::ResponseMemory)?;
        self.gauge.add(bytes as i64);
        Ok(Claim {
            budget: Arc::clone(self),
            bytes,
        })
    }

    /// The bytes claimed now.
    #[cfg(test)]
    fn used(&self) -> usize {
        self.used.load(Ordering::Acquire)
    }
}

/// Room claimed for an answer not produced yet; see [`ResponseBudget::reserve`]:
/// bytes under the budget and a place among its connection's answers, which does not
/// count as an answer making no progress while the write runs. Dropped unused, it
/// gives everything back.
pub struct Reserved {
    /// `None` when the bound is small enough to be sent whole.
    held: Option<(Claim, AnswerSlot)>,
    budget: Arc<ResponseBudget>,
    conn: Arc<ConnState>,
}

/// A connection's place for a reserved answer, given back when dropped.
struct AnswerSlot(Arc<ConnState>);

impl Drop for AnswerSlot {
    fn drop(&mut self) {
        self.0.reservation_ended();
    }
}

impl Reserved {
    /// The room for the answer of `bytes` it was reserved for: `None` for a small one
    /// (sent whole; everything is given back), else the claim resized to `bytes` and
    /// the answer started on its connection. An answer above the reservation — a
    /// stored answer replayed after `--sql-max-response` was lowered — has the rest
    /// claimed past the budget: the write it answers has committed.
    fn fit(self, bytes: usize) -> Option<Room> {
        if bytes <= PACE_FROM {
            return None;
        }
        let mut claim = match self.held {
            Some((claim, slot)) => {
                drop(slot);
                claim
            }
            None => self
                .budget
                .claim(0, usize::MAX)
                .expect("an unbounded claim succeeds"),
        };
        claim.resize(bytes);
        self.conn.answer_started(usize::MAX);
        Some(Room {
            _claim: claim,
            conn: self.conn,
        })
    }
}

/// Bytes claimed under the budget until dropped.
struct Claim {
    budget: Arc<ResponseBudget>,
    bytes: usize,
}

impl Claim {
    /// Claims `bytes` in place of what it holds: less is given back; more is claimed
    /// past the budget.
    fn resize(&mut self, bytes: usize) {
        let used = &self.budget.used;
        if bytes < self.bytes {
            used.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
        } else {
            used.fetch_add(bytes - self.bytes, Ordering::AcqRel);
        }
        self.budget.gauge.add(bytes as i64 - self.bytes as i64);
        self.bytes = bytes;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
        self.budget.gauge.sub(self.bytes as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use tokio_util::sync::CancellationToken;

    fn budget(limit: usize, per_connection: usize) -> Arc<ResponseBudget> {
        let gauge = prometheus::IntGauge::new("pending", "test").unwrap();
        ResponseBudget::new(limit, per_connection, gauge)
    }

    /// An answer of `size` bytes, given room as an object read's would be.
    fn answer(
        budget: &Arc<ResponseBudget>,
        conn: &Arc<ConnState>,
        size: usize,
    ) -> Result<Body, Overload> {
        let room = budget.room_for(size, conn)?;
        Ok(Body::in_room(Bytes::from(vec![7; size]), room))
    }

    #[tokio::test]
    async fn small_answers_are_sent_whole_and_claim_nothing() {
        let budget = budget(10, 1);
        let conn = ConnState::new(CancellationToken::new());
        let body = answer(&budget, &conn, PACE_FROM).unwrap();
        assert_eq!(budget.used(), 0);
        let frames = body.collect().await.unwrap().to_bytes();
        assert_eq!(frames.len(), PACE_FROM);
    }

    #[tokio::test]
    async fn a_large_answer_is_claimed_until_it_is_sent_in_chunks() {
        let budget = budget(1 << 20, 4);
        let conn = ConnState::new(CancellationToken::new());
        let size = 3 * CHUNK + 5;
        let mut body = answer(&budget, &conn, size).unwrap();
        assert_eq!(budget.used(), size);
        let mut chunks = Vec::new();
        while let Some(frame) = body.frame().await {
            chunks.push(frame.unwrap().into_data().unwrap().len());
        }
        assert_eq!(chunks, [CHUNK, CHUNK, CHUNK, 5]);
        assert_eq!(budget.used(), size, "held until the body is dropped");
        drop(body);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn past_the_budget_an_answer_is_refused() {
        let budget = budget(2 * PACE_FROM + 2, 8);
        let conn = ConnState::new(CancellationToken::new());
        let first = answer(&budget, &conn, PACE_FROM + 1).unwrap();
        let _second = answer(&budget, &conn, PACE_FROM + 1).unwrap();
        let refused = answer(&budget, &conn, PACE_FROM + 1);
        assert_eq!(refused.err(), Some(Overload::ResponseMemory));
        assert_eq!(budget.used(), 2 * PACE_FROM + 2, "a refusal claims nothing");
        drop(first);
        assert!(answer(&budget, &conn, PACE_FROM + 1).is_ok());
    }

    #[test]
    fn a_connection_holds_at_most_its_pending_answers() {
        let budget = budget(1 << 30, 2);
        let conn = ConnState::new(CancellationToken::new());
        let other = ConnState::new(CancellationToken::new());
        let first = answer(&budget, &conn, PACE_FROM + 1).unwrap();
        let _second = answer(&budget, &conn, PACE_FROM + 1).unwrap();
        assert_eq!(
            answer(&budget, &conn, PACE_FROM + 1).err(),
            Some(Overload::PendingAnswers)
        );
        assert_eq!(
            budget.used(),
            2 * (PACE_FROM + 1),
            "the refused claim is given back"
        );
        let _elsewhere = answer(&budget, &other, PACE_FROM + 1).unwrap();
        drop(first);
        assert!(answer(&budget, &conn, PACE_FROM + 1).is_ok());
    }

    /// An answer a write produces is claimed at its bound before the write runs —
    /// refused then, past the budget — and the claim shrinks to the answer.
    #[test]
    fn an_answer_is_reserved_at_its_bound_and_shrinks_to_fit() {
        let bound = 4 * PACE_FROM;
        let budget = budget(bound + PACE_FROM, 8);
        let conn = ConnState::new(CancellationToken::new());
        let reserved = budget.reserve(bound, &conn).unwrap();
        assert_eq!(budget.used(), bound);
        assert_eq!(
            budget.reserve(bound, &conn).err(),
            Some(Overload::ResponseMemory),
            "no room for a second answer at its bound"
        );
        let body = Body::whole(vec![0; 2 * PACE_FROM]).in_reserved(reserved);
        assert!(matches!(body.0, Sending::Paced(_)));
        assert_eq!(budget.used(), 2 * PACE_FROM, "shrunk to the answer");
        drop(body);
        assert_eq!(budget.used(), 0);

        // A small answer gives its reservation back at once, and its connection's slot.
        let small_conn = ConnState::new(CancellationToken::new());
        let small =
            Body::whole(vec![0; 10]).in_reserved(budget.reserve(bound, &small_conn).unwrap());
        assert!(matches!(small.0, Sending::Whole(_)));
        assert_eq!(budget.used(), 0);
        drop(budget.reserve(bound, &conn).unwrap());
        assert_eq!(
            budget.used(),
            0,
            "an unused reservation gives everything back"
        );
    }
}
