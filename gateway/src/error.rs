//! API errors, and the one function that turns them into a status, a stable code and
//! a client-facing body.

use fencegate_proto::body::ErrorBody;
use fencegate_proto::path::PathError;
use fencegate_proto::{ErrorCode, ProtoError, ResourceName, Token};

use crate::store::StoreError;

/// The message of a stale rejection. Built piece by piece rather than formatted: it is
/// the answer to every request of a stale flood.
pub fn stale_message(resource: &ResourceName, presented: Token, highest: Token) -> String {
    let mut message = String::with_capacity(96 + resource.as_str().len());
    push_stale_message(&mut message, resource, presented, highest);
    message
}

/// The bytes of a stale message besides its resource name and numbers.
pub const STALE_MESSAGE_FIXED: usize = "stale fencing token ".len()
    + " for resource ".len()
    + ": its highest accepted token is ".len();

/// Appends [`stale_message`] to `out`.
pub fn push_stale_message(
    out: &mut String,
    resource: &ResourceName,
    presented: Token,
    highest: Token,
) {
    let mut number = itoa::Buffer::new();
    out.push_str("stale fencing token ");
    out.push_str(number.format(presented.get()));
    out.push_str(" for resource ");
    out.push_str(resource.as_str());
    out.push_str(": its highest accepted token is ");
    out.push_str(number.format(highest.get()));
}

/// Everything a request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error("{0}")]
    NotFound(&'static str),
    #[error("this path does not support the method")]
    MethodNotAllowed { allow: &'static str },
    #[error("the request body is larger than the limit of {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("the request body could not be read")]
    InvalidBody,
    #[error("the request body did not arrive within the body timeout; nothing was applied")]
    BodyTimeout,
    #[error("{}", match .0 {
        Overload::Writes => "the gateway has as many writes in flight as it takes; nothing was applied, retry later",
        Overload::BodyMemory => "the gateway holds as many request bodies in memory as it takes; nothing was applied, retry later",
        Overload::WritesShare => "this client has as many writes in flight as its share of the gateway allows (--max-client-share); nothing was applied, retry later",
        Overload::BodyShare => "this client's request bodies fill its share of the gateway's body memory (--max-client-share); nothing was applied, retry later",
        Overload::ResponseMemory => "the gateway holds as many answers waiting to be sent as it takes (--max-response-memory); retry later",
        Overload::PendingAnswers => "this connection has as many large answers not yet read as it may (--max-pending-answers); read them, or retry later",
    })]
    Overloaded(Overload),
    #[error("the gateway is shutting down; nothing was applied, retry on another replica")]
    ShuttingDown,
    #[error("the fence database has no synchronous standby streaming, and this gateway requires one (--require-synchronous-replication); nothing was applied, retry later")]
    NotSynchronouslyReplicated,
    /// The issuer of a resource's tokens could not be asked about a token above what
    /// this gateway knows it issued: refused, not guessed (fail closed).
    #[error("token {presented} of resource {resource} is above every token this gateway knows its issuer ({issuer}) issued, and the issuer cannot be reached to vouch for it; nothing was applied, retry later")]
    IssuerUnavailable {
        issuer: &'static str,
        resource: ResourceName,
        presented: Token,
    },
    #[error("this gateway requires `Authorization: Bearer <key>` with a key it knows, or a client certificate of an identity it knows")]
    Unauthenticated,
    /// A fence reset on a gateway with neither `--auth-file` nor `--admin-key-file`.
    #[error("fence resets need an administrator's credential: start the gateway with --auth-file (an identity with the admin action) or --admin-key-file")]
    NoAdminCredential,
    #[error("identity {identity:?} may not {} {}", .action.as_str(), .resource.as_ref().map_or_else(|| "here".to_owned(), |r| format!("resource {r}")))]
    Forbidden {
        identity: String,
        action: crate::auth::Action,
        resource: Option<ResourceName>,
    },
    #[error("{}", stale_message(resource, *presented, *highest))]
    Stale {
        resource: ResourceName,
        presented: Token,
        highest: Token,
    },
    #[error("the object's version does not match the precondition")]
    VersionMismatch { current: Option<u64> },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("this Idempotency-Key was used for a different request (another method, path, token, precondition or body); nothing was applied: use a new key for a new request")]
    IdempotencyKeyReused,
    #[error("a request with this Idempotency-Key is still being applied; retry with the same key after Retry-After to get its answer")]
    IdempotencyInFlight,
    #[error("{}", match .0 {
        crate::coordinator::AnswersFull::Identity => "the answers stored under this identity's Idempotency-Keys are at the gateway's bound (--idempotency-identity-max-records, --idempotency-identity-max-bytes); nothing was applied. Stored answers expire after --idempotency-ttl; a retry of a key already stored is answered as ever",
        crate::coordinator::AnswersFull::Store => "the answers stored under Idempotency-Keys are at the gateway's bound (--idempotency-max-bytes); nothing was applied. Stored answers expire after --idempotency-ttl; a retry of a key already stored is answered as ever",
    })]
    IdempotencyQuotaExceeded(crate::coordinator::AnswersFull),
    /// An error answer as stored with a keyed write (or rendered from a transaction's
    /// outcome), sent as it is: its status, headers and body.
    #[error("{}", .code.as_str())]
    Stored {
        code: ErrorCode,
        answer: Box<crate::store::txn::StoredAnswer>,
        replayed: bool,
    },
    /// An endpoint's own refusal, with the whole client-facing body (its code decides
    /// the status): how endpoint modules add errors without this enum knowing them.
    #[error("{}", .0.message)]
    Refused(Box<ErrorBody>),
}

impl From<crate::auth::Denial> for ApiError {
    fn from(denial: crate::auth::Denial) -> ApiError {
        match denial {
            crate::auth::Denial::Unauthenticated => ApiError::Unauthenticated,
            crate::auth::Denial::Forbidden {
                identity,
                action,
                resource,
            } => ApiError::Forbidden {
                identity,
                action,
                resource,
            },
        }
    }
}

impl From<Overload> for ApiError {
    fn from(overload: Overload) -> ApiError {
        ApiError::Overloaded(overload)
    }
}

impl From<PathError> for ApiError {
    fn from(error: PathError) -> ApiError {
        match error {
            PathError::NotFound => ApiError::NotFound("no such path"),
            PathError::Invalid(error) => ApiError::Proto(error),
        }
    }
}

impl ApiError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::Proto(error) => error.code(),
            ApiError::NotFound(_) => ErrorCode::NotFound,
            ApiError::MethodNotAllowed { .. } => ErrorCode::MethodNotAllowed,
            ApiError::BodyTooLarge { .. } => ErrorCode::BodyTooLarge,
            ApiError::InvalidBody => ErrorCode::InvalidBody,
            ApiError::BodyTimeout => ErrorCode::BodyTimeout,
            ApiError::Overloaded(_) => ErrorCode::Overloaded,
            ApiError::ShuttingDown => ErrorCode::ShuttingDown,
            ApiError::NotSynchronouslyReplicated => ErrorCode::NotSynchronouslyReplicated,
            ApiError::IssuerUnavailable { .. } => ErrorCode::IssuerUnavailable,
            ApiError::Unauthenticated => ErrorCode::Unauthenticated,
            ApiError::NoAdminCredential => ErrorCode::Forbidden,
            ApiError::Forbidden { .. } => ErrorCode::Forbidden,
            ApiError::Stale { .. } => ErrorCode::StaleToken,
            ApiError::VersionMismatch { .. } => ErrorCode::VersionMismatch,
            ApiError::Store(StoreError::Unavailable { .. }) => ErrorCode::BackendUnavailable,
            ApiError::Store(StoreError::Internal(_)) => ErrorCode::Internal,
            ApiError::IdempotencyKeyReused => ErrorCode::IdempotencyKeyReused,
            ApiError::IdempotencyInFlight => ErrorCode::IdempotencyInFlight,
            ApiError::IdempotencyQuotaExceeded(_) => ErrorCode::IdempotencyQuotaExceeded,
            ApiError::Stored { code, .. } => *code,
            ApiError::Refused(body) => body.error,
        }
    }

    /// The body a client sees. Internal details (SQL, addresses) stay in the logs.
    pub fn body(&self) -> ErrorBody {
        if let ApiError::Refused(body) = self {
            return (**body).clone();
        }
        if let ApiError::Stored { code, answer, .. } = self {
            return serde_json::from_slice(&answer.body)
                .unwrap_or_else(|_| ErrorBody::new(*code, code.as_str()));
        }
        let code = self.code();
        let mut body = ErrorBody::new(code, self.to_string());
        match self {
            ApiError::Stale {
                resource,
                presented,
                highest,
            } => {
                body.resource = Some(resource.clone());
                body.presented = Some(*presented);
                body.highest = Some(*highest);
            }
            ApiError::VersionMismatch { current } => {
                body.message = match current {
                    Some(version) => {
                        format!("the object is at version {version}; the precondition did not hold")
                    }
                    None => "the object does not exist; the precondition did not hold".to_owned(),
                };
                body.current = Some(*current);
            }
            ApiError::Store(StoreError::Unavailable { reason, applied }) => {
                body.message = match applied {
                    Some(false) => {
                        format!("the database is unavailable ({reason}); the write was not applied")
                    }
                    _ => format!(
                        "the database became unavailable ({reason}) after receiving the request; \
                         whether the write was applied is unknown: retry it with the same \
                         Idempotency-Key, which applies it at most once"
                    ),
                };
                body.write_applied = Some(*applied);
            }
            ApiError::NotSynchronouslyReplicated => body.write_applied = Some(Some(false)),
            ApiError::IssuerUnavailable {
                resource,
                presented,
                ..
            } => {
                body.write_applied = Some(Some(false));
                body.resource = Some(resource.clone());
                body.presented = Some(*presented);
            }
            ApiError::Store(StoreError::Internal(_)) => {
                body.message =
                    "an internal error occurred; nothing is known to have been applied".to_owned();
            }
            _ => {}
        }
        body
    }
}

/// Why a request was turned away before any work: the gateway is at one of its bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// `--max-writes-in-flight`.
    Writes,
    /// `--max-body-memory`.
    BodyMemory,
    /// The client's share of `--max-writes-in-flight`.
    WritesShare,
    /// The client's share of `--max-body-memory`.
    BodyShare,
    /// `--max-response-memory`.
    ResponseMemory,
    /// `--max-pending-answers` on one connection.
    PendingAnswers,
}

impl Overload {
    /// Every reason, as the `reason` label of `fencegate_limit_rejections_total`.
    pub const ALL: [Overload; 6] = [
        Overload::Writes,
        Overload::BodyMemory,
        Overload::WritesShare,
        Overload::BodyShare,
        Overload::ResponseMemory,
        Overload::PendingAnswers,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Overload::Writes => "writes",
            Overload::BodyMemory => "body_memory",
            Overload::WritesShare => "writes_share",
            Overload::BodyShare => "body_share",
            Overload::ResponseMemory => "response_memory",
            Overload::PendingAnswers => "pending_answers",
        }
    }
}
