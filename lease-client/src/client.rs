//! Writes through the gateway under a term's fencing token.
//!
//! # Behavior
//!
//! - Every write carries `Fencing-Token: <term epoch>` and `Fencing-Holder: <holder>`;
//!   a transaction ([`FencedClient::txn`]) carries each operation's token in its body.
//! - Every logical write — a put, a delete, an advance, a transaction — gets its own
//!   `Idempotency-Key` (128 random bits as 32 hex digits), made once and sent on every
//!   attempt of that write: the gateway applies it at most once and answers a resend
//!   with the answer it stored (`Idempotency-Replayed: true`). A replayed answer is
//!   handled exactly like a fresh one.
//! - A write is not sent, nor resent, once its term has ended
//!   ([`WriteError::TermOver`]); a transaction, once the term of any of its operations
//!   has ended.
//! - A write is resent, with the same token and key, up to `retries` times
//!   ([`DEFAULT_RETRIES`]) and only while its terms are live, after an answer that says
//!   it was not applied or that nobody knows: a transport failure (no answer);
//!   `503 backend_unavailable` with `write_applied` `false` or `null` (in doubt);
//!   `503 overloaded` or `shutting_down`; `409 idempotency_in_flight` (an earlier
//!   attempt still runs). The pause before a resend is the answer's `Retry-After`, at
//!   most [`MAX_RETRY_AFTER`], or else 50 ms doubled per resend, at most 3.2 s; it ends
//!   early if a term ends. Any other answer is returned at once.
//! - `409 stale_token` ends the term with [`LossReason::StaleRejection`] and returns
//!   [`WriteError::Stale`] with the presented and highest tokens. The client never
//!   resends that write, and never fetches a newer token to push it through: a newer
//!   term decides afresh what to write. A stale transaction ends the term of every
//!   resource its answer names as stale, and returns [`WriteError::Stale`] for the
//!   first of them.
//! - `403 token_not_issued` / `token_holder_mismatch` end the term too
//!   ([`LossReason::TokenRefused`]): no write of it will ever be accepted.
//! - With [`FencedClient::with_key`], every request carries `Authorization: Bearer`.
//! - Error answers are decoded into the wire contract's [`ErrorBody`]; branching is on
//!   [`ErrorCode`], never on message text.

use std::time::Duration;

use bytes::Bytes;
use fencegate_proto::body::{ErrorBody, FenceState, WriteAccepted};
use fencegate_proto::headers::{
    etag, parse_etag, Precondition, FENCING_HIGHEST, FENCING_HOLDER, FENCING_TOKEN,
};
use fencegate_proto::path::Target;
use fencegate_proto::{ErrorCode, ObjectKey, ResourceName, Token};
use http::header::{ETAG, IF_MATCH, IF_NONE_MATCH};
use http::{HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::term::{LossReason, Term};
use crate::txn::TxnBuilder;

mod keyed;

pub(crate) use keyed::Keyed;
pub use keyed::MAX_RETRY_AFTER;

/// How long one request may take unless configured otherwise.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How many times a write is resent unless configured otherwise.
pub const DEFAULT_RETRIES: u32 = 2;

/// A write the gateway did not accept, or could not be asked.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A newer term has written to the resource; this term is over.
    #[error("stale token for {resource}: presented {presented}, highest accepted {highest:?}")]
    Stale {
        resource: ResourceName,
        presented: Token,
        highest: Option<Token>,
    },
    /// The term had already ended; nothing was sent.
    #[error("the term at epoch {epoch} has ended ({reason:?}); the write was not sent")]
    TermOver {
        epoch: Token,
        reason: Option<LossReason>,
    },
    /// Any other error answer (a precondition, a bad request, the backend down).
    #[error("the gateway refused the request ({}): {}", .body.error, .body.message)]
    Refused { status: u16, body: Box<ErrorBody> },
    /// No answer: connection refused or broken, or the request timed out.
    #[error("the gateway could not be reached: {0}")]
    Transport(String),
    /// An answer outside the contract.
    #[error("unexpected answer from the gateway: {0}")]
    Protocol(String),
}

impl WriteError {
    /// The contract's code, for answers that carried one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            WriteError::Stale { .. } => Some(ErrorCode::StaleToken),
            WriteError::Refused { body, .. } => Some(body.error),
            _ => None,
        }
    }
}

/// A stored object, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Object {
    pub value: Bytes,
    pub version: u64,
    /// The token of the term that wrote it.
    pub token: Token,
}

#[derive(Clone)]
pub struct FencedClient {
    base: String,
    http: hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
    timeout: Duration,
    retries: u32,
    /// `Authorization: Bearer <key>`, when the gateway authenticates.
    authorization: Option<HeaderValue>,
}

impl FencedClient {
    /// A client for the gateway at `base_url` (`http://host:port`; plain HTTP).
    pub fn new(base_url: &str) -> Result<FencedClient, WriteError> {
        let base = base_url.trim_end_matches('/').to_owned();
        let uri: Uri = base
            .parse()
            .map_err(|_| WriteError::Protocol(format!("{base_url:?} is not a URL")))?;
        if uri.scheme_str() != Some("http") || uri.host().is_none() {
            return Err(WriteError::Protocol(format!(
                "{base_url:?}: expected http://host:port"
            )));
        }
        let http = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
        Ok(FencedClient {
            base,
            http,
            timeout: DEFAULT_REQUEST_TIMEOUT,
            retries: DEFAULT_RETRIES,
            authorization: None,
        })
    }

    /// Authenticates every request with `key` (the gateway's `--auth-file`).
    pub fn with_key(mut self, key: &str) -> Result<FencedClient, WriteError> {
        let mut value = HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| WriteError::Protocol("the key is not a valid header value".into()))?;
        value.set_sensitive(true);
        self.authorization = Some(value);
        Ok(self)
    }

    /// Sets how long one request may take.
    pub fn with_timeout(mut self, timeout: Duration) -> FencedClient {
        self.timeout = timeout;
        self
    }

    /// Sets how many times a write is resent after an answer that leaves it unapplied
    /// or in doubt (see the module's "Behavior").
    pub fn with_retries(mut self, retries: u32) -> FencedClient {
        self.retries = retries;
        self
    }

    /// `PUT /v1/kv/{resource}/{key}` under `term`.
    pub async fn put(
        &self,
        term: &Term,
        resource: &ResourceName,
        key: &ObjectKey,
        value: impl Into<Bytes>,
        precondition: Precondition,
    ) -> Result<WriteAccepted, WriteError> {
        let path = kv_path(resource, key);
        let body = self
            .fenced(
                term,
                Method::PUT,
                &path,
                resource,
                precondition,
                value.into(),
            )
            .await?;
        decode(&body)
    }

    /// `DELETE /v1/kv/{resource}/{key}` under `term`.
    pub async fn delete(
        &self,
        term: &Term,
        resource: &ResourceName,
        key: &ObjectKey,
        precondition: Precondition,
    ) -> Result<WriteAccepted, WriteError> {
        let path = kv_path(resource, key);
        let body = self
            .fenced(
                term,
                Method::DELETE,
                &path,
                resource,
                precondition,
                Bytes::new(),
            )
            .await?;
        decode(&body)
    }

    /// `POST /v1/fences/{resource}/advance`: raises the resource's fence to the term's
    /// token, so that writes still in flight from older terms are rejected from now on.
    pub async fn advance(
        &self,
        term: &Term,
        resource: &ResourceName,
    ) -> Result<FenceState, WriteError> {
        let path = Target::FenceAdvance {
            resource: resource.clone(),
        }
        .path();
        let body = self
            .fenced(
                term,
                Method::POST,
                &path,
                resource,
                Precondition::None,
                Bytes::new(),
            )
            .await?;
        decode(&body)
    }

    /// A transaction (`POST /v1/txn`): operations on one or more resources, each under
    /// the term of its resource, applied all or none; see [`TxnBuilder`].
    pub fn txn(&self) -> TxnBuilder {
        TxnBuilder::new(self.clone())
    }

    /// `GET /v1/kv/{resource}/{key}`; `None` if there is no such object. Reads are not
    /// fenced.
    pub async fn get(
        &self,
        resource: &ResourceName,
        key: &ObjectKey,
    ) -> Result<Option<Object>, WriteError> {
        let mut request = Request::get(format!("{}{}", self.base, kv_path(resource, key)))
            .body(Full::new(Bytes::new()))
            .expect("a GET request is valid");
        self.authorize(&mut request);
        let response = self.send(request).await?;
        let (status, headers, body) = response;
        if status == StatusCode::OK {
            let version = headers
                .get(ETAG)
                .and_then(|v| parse_etag(v.as_bytes()).ok())
                .ok_or_else(|| WriteError::Protocol("an object without a valid ETag".into()))?;
            let token = headers
                .get(FENCING_TOKEN)
                .and_then(|v| Token::parse(v.as_bytes()).ok())
                .ok_or_else(|| WriteError::Protocol("an object without its token".into()))?;
            return Ok(Some(Object {
                value: body,
                version,
                token,
            }));
        }
        match refusal(status, &headers, &body)? {
            WriteError::Refused { body, .. } if body.error == ErrorCode::NotFound => Ok(None),
            other => Err(other),
        }
    }

    /// One fenced write of `resource` under `term`; a refusal that ends the term ends it.
    async fn fenced(
        &self,
        term: &Term,
        method: Method,
        path: &str,
        resource: &ResourceName,
        precondition: Precondition,
        body: Bytes,
    ) -> Result<Bytes, WriteError> {
        let mut headers = HeaderMap::new();
        headers.insert(FENCING_TOKEN, HeaderValue::from(term.epoch().get()));
        if let Ok(holder) = HeaderValue::from_str(term.holder()) {
            headers.insert(FENCING_HOLDER, holder);
        }
        let precondition = match precondition {
            Precondition::None => None,
            Precondition::MustNotExist => Some((IF_NONE_MATCH, HeaderValue::from_static("*"))),
            Precondition::MustExist => Some((IF_MATCH, HeaderValue::from_static("*"))),
            Precondition::Version(version) => Some((
                IF_MATCH,
                HeaderValue::from_str(&etag(version)).expect("an entity tag is a header value"),
            )),
        };
        if let Some((name, value)) = precondition {
            headers.insert(name, value);
        }
        let write = Keyed::new(self, method, path, headers, body)?;
        self.send_keyed(&[term], &write)
            .await
            .map_err(|error| match error {
                WriteError::Refused { body, .. } if body.error == ErrorCode::StaleToken => {
                    let presented = body.presented.unwrap_or(term.epoch());
                    end_stale(term, resource, presented, body.highest);
                    WriteError::Stale {
                        resource: body.resource.unwrap_or_else(|| resource.clone()),
                        presented,
                        highest: body.highest,
                    }
                }
                WriteError::Refused { ref body, .. } if refuses_the_token(body.error) => {
                    end_refused(term, resource, body.error);
                    error
                }
                error => error,
            })
    }

    fn authorize(&self, request: &mut Request<Full<Bytes>>) {
        if let Some(authorization) = &self.authorization {
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, authorization.clone());
        }
    }

    /// `POST {path}` with a JSON body, authenticated; for the lease store.
    pub(crate) async fn post_json(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<(StatusCode, http::HeaderMap, Bytes), WriteError> {
        let body = serde_json::to_vec(body)
            .map_err(|e| WriteError::Protocol(format!("a body that does not encode: {e}")))?;
        let mut request = Request::post(format!("{}{path}", self.base))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("a POST request is valid");
        self.authorize(&mut request);
        self.send(request).await
    }

    async fn send(
        &self,
        request: Request<Full<Bytes>>,
    ) -> Result<(StatusCode, http::HeaderMap, Bytes), WriteError> {
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| WriteError::Transport(e.to_string()))?;
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| WriteError::Transport(e.to_string()))?
                .to_bytes();
            Ok((parts.status, parts.headers, body))
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .unwrap_or_else(|_| {
                Err(WriteError::Transport(format!(
                    "no answer within {:?}",
                    self.timeout
                )))
            })
    }
}

/// Whether `code` says that the resource's issuer refuses the term's token for good.
pub(crate) fn refuses_the_token(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::TokenNotIssued | ErrorCode::TokenHolderMismatch
    )
}

/// Ends `term`: a newer one has written to `resource`. Logged once, with the facts.
pub(crate) fn end_stale(
    term: &Term,
    resource: &ResourceName,
    presented: Token,
    highest: Option<Token>,
) {
    if term.end(LossReason::StaleRejection) {
        tracing::warn!(
            lease = term.lease(),
            holder = term.holder(),
            resource = resource.as_str(),
            presented = presented.get(),
            highest = highest.map(Token::get),
            "write rejected as stale: leadership lost"
        );
    }
}

/// Ends `term`: the issuer of `resource` refuses its token. Logged once.
pub(crate) fn end_refused(term: &Term, resource: &ResourceName, code: ErrorCode) {
    if term.end(LossReason::TokenRefused) {
        tracing::warn!(
            lease = term.lease(),
            holder = term.holder(),
            resource = resource.as_str(),
            presented = term.epoch().get(),
            code = code.as_str(),
            "token refused by the resource's issuer: leadership lost"
        );
    }
}

fn kv_path(resource: &ResourceName, key: &ObjectKey) -> String {
    Target::Object {
        resource: resource.clone(),
        key: key.clone(),
    }
    .path()
}

pub(crate) fn decode<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, WriteError> {
    serde_json::from_slice(body)
        .map_err(|e| WriteError::Protocol(format!("a success body that does not decode: {e}")))
}

/// Decodes an error answer. `Err` only when it is outside the contract.
pub(crate) fn refusal(
    status: StatusCode,
    headers: &http::HeaderMap,
    body: &[u8],
) -> Result<WriteError, WriteError> {
    let mut error: ErrorBody = serde_json::from_slice(body)
        .map_err(|_| WriteError::Protocol(format!("status {status} without an error body")))?;
    if error.error == ErrorCode::StaleToken && error.highest.is_none() {
        error.highest = headers
            .get(FENCING_HIGHEST)
            .and_then(|v| Token::parse(v.as_bytes()).ok());
    }
    Ok(WriteError::Refused {
        status: status.as_u16(),
        body: Box::new(error),
    })
}
