//! One logical write and its resends.
//!
//! A [`Keyed`] write is made once, with a fresh `Idempotency-Key`, and every attempt
//! sends the very same request: method, path, headers (the key among them) and body.
//! The gateway fingerprints the request and applies it at most once per key, so a
//! resend can never apply a write twice, and can never apply a different one.
//!
//! # Resends
//!
//! Before every attempt, each term the write is under must be live; then the attempt
//! is sent, and its answer decides:
//!
//! 1. a success is returned;
//! 2. an answer that leaves the write unapplied or in doubt ([`WriteError::resendable`])
//!    is followed, after a pause, by the next attempt, up to `retries` resends;
//! 3. any other answer is returned for the caller to act on: the caller, not this
//!    loop, ends the terms that a stale or refused token ends.
//!
//! The pause is the answer's `Retry-After` (at most [`MAX_RETRY_AFTER`]), or else a
//! backoff doubling from 50 ms to 3.2 s; it ends early when a term ends, and the next
//! check then reports [`WriteError::TermOver`].

use std::future::{poll_fn, Future};
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::headers::IDEMPOTENCY_KEY;
use fencegate_proto::ErrorCode;
use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderValue, Method, Request, Uri};
use http_body_util::Full;

use super::{refusal, FencedClient, WriteError};
use crate::term::Term;

/// The longest pause a `Retry-After` answer gets before its write is resent: a
/// gateway asking for more than this is not waited out.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(5);
/// The first pause before a resend; doubled for each further one.
const RETRY_BACKOFF: Duration = Duration::from_millis(50);
/// The backoff stops doubling after this many resends (50 ms × 2⁶ = 3.2 s).
const MAX_BACKOFF_DOUBLINGS: u32 = 6;

/// One logical write, as sent on every attempt: the same request, its
/// `Idempotency-Key` included.
pub(crate) struct Keyed {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
}

impl Keyed {
    /// A write of `method` to `path` with `headers` and `body`, under a fresh key.
    pub(crate) fn new(
        client: &FencedClient,
        method: Method,
        path: &str,
        mut headers: HeaderMap,
        body: Bytes,
    ) -> Result<Keyed, WriteError> {
        let uri = format!("{}{path}", client.base)
            .parse()
            .map_err(|_| WriteError::Protocol(format!("{path:?} does not make a URL")))?;
        headers.insert(IDEMPOTENCY_KEY, new_idempotency_key());
        if let Some(authorization) = &client.authorization {
            headers.insert(http::header::AUTHORIZATION, authorization.clone());
        }
        Ok(Keyed {
            method,
            uri,
            headers,
            body,
        })
    }

    /// A JSON `POST` to `path`, under a fresh key.
    pub(crate) fn json(
        client: &FencedClient,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<Keyed, WriteError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| WriteError::Protocol(format!("a body that does not encode: {e}")))?;
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        Keyed::new(client, Method::POST, path, headers, Bytes::from(body))
    }

    fn attempt(&self) -> Request<Full<Bytes>> {
        let mut request = Request::new(Full::new(self.body.clone()));
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = self.uri.clone();
        *request.headers_mut() = self.headers.clone();
        request
    }
}

/// A fresh `Idempotency-Key`: 128 random bits as 32 hex digits, so that no two logical
/// writes share one.
fn new_idempotency_key() -> HeaderValue {
    HeaderValue::from_str(&format!("{:032x}", rand::random::<u128>()))
        .expect("hex digits are a valid header value")
}

impl FencedClient {
    /// Sends `write` until it gets an answer to return, resending it (the same request,
    /// the same key) while the answer leaves it unapplied or in doubt and every one of
    /// `terms` is live. Returns the body of a success; any error answer as
    /// [`WriteError::Refused`], for the caller to act on.
    pub(crate) async fn send_keyed(
        &self,
        terms: &[&Term],
        write: &Keyed,
    ) -> Result<Bytes, WriteError> {
        let mut resends = 0;
        loop {
            if let Some(over) = terms.iter().find(|term| !term.is_live()) {
                return Err(WriteError::TermOver {
                    epoch: over.epoch(),
                    reason: over.loss_reason(),
                });
            }
            let (error, asked) = match self.send(write.attempt()).await {
                Ok((status, _, body)) if status.is_success() => return Ok(body),
                Ok((status, headers, body)) => {
                    (refusal(status, &headers, &body)?, retry_after(&headers))
                }
                Err(error) => (error, None),
            };
            if resends >= self.retries || !error.resendable() {
                return Err(error);
            }
            let pause =
                asked.unwrap_or(RETRY_BACKOFF * 2u32.pow(resends.min(MAX_BACKOFF_DOUBLINGS)));
            tracing::debug!(%error, resends, ?pause, "resending a write under its key");
            let _ = tokio::time::timeout(pause, any_ends(terms)).await;
            resends += 1;
        }
    }
}

impl WriteError {
    /// Whether the write may be resent under its key: the answer says it was not
    /// applied, or nobody knows (the list is in [`crate::client`]'s "Behavior").
    fn resendable(&self) -> bool {
        match self {
            WriteError::Transport(_) => true,
            WriteError::Refused { body, .. } => match body.error {
                ErrorCode::BackendUnavailable => {
                    matches!(body.write_applied, Some(None | Some(false)))
                }
                ErrorCode::Overloaded
                | ErrorCode::ShuttingDown
                | ErrorCode::IdempotencyInFlight => true,
                _ => false,
            },
            _ => false,
        }
    }
}

/// Completes as soon as one of `terms` ends.
async fn any_ends(terms: &[&Term]) {
    let mut ends: Vec<_> = terms
        .iter()
        .map(|term| Box::pin(term.cancelled()))
        .collect();
    poll_fn(|cx| {
        if ends.iter_mut().any(|end| end.as_mut().poll(cx).is_ready()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await
}

/// The pause an answer asks for (`Retry-After: <seconds>`), at most [`MAX_RETRY_AFTER`].
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds: u64 = headers
        .get(RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds).min(MAX_RETRY_AFTER))
}

#[cfg(test)]
mod tests {
    use fencegate_proto::body::ErrorBody;

    use super::*;

    fn refused(code: ErrorCode, write_applied: Option<Option<bool>>) -> WriteError {
        let mut body = ErrorBody::new(code, "x");
        body.write_applied = write_applied;
        WriteError::Refused {
            status: code.status(),
            body: Box::new(body),
        }
    }

    #[test]
    fn only_answers_that_leave_a_write_unapplied_or_in_doubt_are_resent() {
        let unavailable = ErrorCode::BackendUnavailable;
        for resent in [
            WriteError::Transport("reset".into()),
            refused(unavailable, Some(None)),
            refused(unavailable, Some(Some(false))),
            refused(ErrorCode::Overloaded, None),
            refused(ErrorCode::ShuttingDown, None),
            refused(ErrorCode::IdempotencyInFlight, None),
        ] {
            assert!(resent.resendable(), "{resent:?}");
        }
        for kept in [
            refused(unavailable, Some(Some(true))),
            refused(unavailable, None),
            refused(ErrorCode::StaleToken, None),
            refused(ErrorCode::VersionMismatch, None),
            refused(ErrorCode::IdempotencyKeyReused, None),
            refused(ErrorCode::TokenNotIssued, None),
            refused(ErrorCode::Internal, None),
            WriteError::Protocol("?".into()),
        ] {
            assert!(!kept.resendable(), "{kept:?}");
        }
    }

    #[test]
    fn retry_after_is_read_in_seconds_and_bounded() {
        let with = |value: &'static str| {
            let mut headers = HeaderMap::new();
            headers.insert(RETRY_AFTER, HeaderValue::from_static(value));
            retry_after(&headers)
        };
        assert_eq!(with("1"), Some(Duration::from_secs(1)));
        assert_eq!(with("3600"), Some(MAX_RETRY_AFTER));
        assert_eq!(with("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
    }

    #[test]
    fn keys_are_valid_and_fresh() {
        let keys: Vec<String> = (0..100)
            .map(|_| {
                let mut headers = HeaderMap::new();
                headers.insert(IDEMPOTENCY_KEY, new_idempotency_key());
                fencegate_proto::headers::idempotency_key(&headers)
                    .expect("a valid key")
                    .expect("a key")
            })
            .collect();
        assert!(keys.iter().all(|key| key.len() == 32));
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
    }
}
