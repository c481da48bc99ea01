//! Stable error codes and the errors raised while parsing a request.
//!
//! The `error` field of every error body is one of [`ErrorCode`]'s strings. Codes
//! are part of the public contract: clients branch on them, dashboards count them.
//! Add new codes; never rename or repurpose one.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Every error the API answers with, with its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// 409: the presented token is below the highest accepted for the resource.
    StaleToken,
    /// 412: `If-Match` / `If-None-Match` did not hold.
    VersionMismatch,
    /// 428: a write without a `Fencing-Token` header.
    MissingToken,
    /// 400: the `Fencing-Token` header is not a decimal in `1..=i64::MAX`, or appears twice.
    InvalidToken,
    /// 400: the `Fencing-Holder` header is not short printable text.
    InvalidHolder,
    /// 400: `If-Match` / `If-None-Match` is not of a supported form.
    InvalidPrecondition,
    /// 400: the resource name is not 1–200 bytes of `[A-Za-z0-9._-]`.
    InvalidResource,
    /// 400: the key is not 1–1024 bytes of percent-decoded UTF-8 without control characters.
    InvalidKey,
    /// 400: the request body could not be read (the client stopped sending it).
    InvalidBody,
    /// 413: the body is larger than the gateway's `--max-body`.
    BodyTooLarge,
    /// 404: no such object, or no such path.
    NotFound,
    /// 405: the path exists but not with this method.
    MethodNotAllowed,
    /// 503: the backend could not be reached; the body says whether the write was applied.
    BackendUnavailable,
    /// 501: the endpoint needs a backend other than the one this gateway runs.
    NotSupportedByBackend,
    /// 500: a bug or an unexpected backend answer; nothing is known to have been applied.
    Internal,
    /// 400: a statement of a SQL transaction failed in the database (syntax, constraint,
    /// permission, statement timeout...); the body names the statement and the SQLSTATE.
    /// Nothing of the transaction was applied, the fence included.
    SqlError,
    /// 400: a SQL parameter does not fit the type the database expects for it.
    InvalidParam,
    /// 400: a SQL statement is not of a kind the gateway runs (transaction control,
    /// `SET`, `GRANT`, DDL without `--sql-allow-ddl`...); nothing was run.
    StatementNotAllowed,
    /// 400: a SQL parameter or result column has a type the gateway cannot convert.
    UnsupportedType,
    /// 400: more statements in one SQL transaction than `--sql-max-statements`.
    TooManyStatements,
    /// 403: SQL transactions are not enabled on this gateway (`--sql`).
    SqlDisabled,
    /// 503: the gateway has as many writes in flight, or as many request bodies in
    /// memory, as it is configured for; nothing was applied. Retry after `Retry-After`.
    Overloaded,
    /// 408: the request body did not arrive within `--body-timeout`; nothing was applied.
    BodyTimeout,
    /// 503: the gateway is shutting down and stopped reading this request; nothing was
    /// applied. Retry on another replica.
    ShuttingDown,
    /// 401: authentication is on and the request has no valid `Authorization: Bearer`
    /// key; nothing was done.
    Unauthenticated,
    /// 403: the caller's identity has no grant for this action on this resource; nothing
    /// was done.
    Forbidden,
    /// 409: the hosted lease is held by another holder and has not expired; the body
    /// names the holder and how long the lease has left.
    LeaseHeld,
    /// 409: renew or release of a hosted lease that this holder no longer holds at this
    /// token (it expired, or another holder took it): the term is over.
    LeaseLost,
    /// 403: the resource is bound to an issuer that never issued the presented token;
    /// nothing was applied and the fence did not move.
    TokenNotIssued,
    /// 403: the presented token was issued to another holder than the caller's identity;
    /// nothing was applied.
    TokenHolderMismatch,
    /// 409: the resource's fence is at the largest token, so no new term can start;
    /// an administrator must reset the fence.
    TokensExhausted,
    /// 409: a fence reset that does not lower the fence, or would lower it below a token
    /// that was issued or written with; nothing changed.
    ResetRefused,
    /// 400: the `Idempotency-Key` header is not 1–255 printable ASCII bytes, appears
    /// twice, or is sent to an endpoint that does not take one; nothing was applied.
    InvalidIdempotencyKey,
    /// 422: the `Idempotency-Key` was used before, by this identity, for a different
    /// request; nothing was applied. Use a new key for a new request.
    IdempotencyKeyReused,
    /// 409: a request with this `Idempotency-Key` is still being applied; retry after
    /// `Retry-After` to get its answer.
    IdempotencyInFlight,
    /// 400: a `/v1/txn` body that is not a valid transaction (an unknown operation, a
    /// resource with two tokens, an object written twice...); nothing was applied.
    InvalidTransaction,
    /// 400: more operations in one `/v1/txn` than `--txn-max-operations`.
    TooManyOperations,
    /// 503: the gateway runs with `--require-synchronous-replication` and the fence
    /// database has no synchronous standby streaming; nothing was applied. Retry after
    /// `Retry-After`.
    NotSynchronouslyReplicated,
    /// 503: the token is above every token this gateway knows the resource's issuer
    /// (etcd or ZooKeeper) issued, and the issuer cannot be asked now; nothing was
    /// applied. Tokens it already vouched for keep working.
    /// Retry after `Retry-After`.
    IssuerUnavailable,
    /// 429: a write with a new `Idempotency-Key`, while the answers stored under this
    /// identity's keys (or all identities') are at a bound of the gateway's; nothing
    /// was applied. Stored answers expire after `--idempotency-ttl`; a retry of a key
    /// already stored is answered as ever.
    IdempotencyQuotaExceeded,
}

impl ErrorCode {
    /// Every code, for documentation and for exhaustive tests.
    pub const ALL: [ErrorCode; 40] = [
        ErrorCode::StaleToken,
        ErrorCode::VersionMismatch,
        ErrorCode::MissingToken,
        ErrorCode::InvalidToken,
        ErrorCode::InvalidHolder,
        ErrorCode::InvalidPrecondition,
        ErrorCode::InvalidResource,
        ErrorCode::InvalidKey,
        ErrorCode::InvalidBody,
        ErrorCode::BodyTooLarge,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::BackendUnavailable,
        ErrorCode::NotSupportedByBackend,
        ErrorCode::Internal,
        ErrorCode::SqlError,
        ErrorCode::InvalidParam,
        ErrorCode::StatementNotAllowed,
        ErrorCode::UnsupportedType,
        ErrorCode::TooManyStatements,
        ErrorCode::SqlDisabled,
        ErrorCode::Overloaded,
        ErrorCode::BodyTimeout,
        ErrorCode::ShuttingDown,
        ErrorCode::Unauthenticated,
        ErrorCode::Forbidden,
        ErrorCode::LeaseHeld,
        ErrorCode::LeaseLost,
        ErrorCode::TokenNotIssued,
        ErrorCode::TokenHolderMismatch,
        ErrorCode::TokensExhausted,
        ErrorCode::ResetRefused,
        ErrorCode::InvalidIdempotencyKey,
        ErrorCode::IdempotencyKeyReused,
        ErrorCode::IdempotencyInFlight,
        ErrorCode::InvalidTransaction,
        ErrorCode::TooManyOperations,
        ErrorCode::NotSynchronouslyReplicated,
        ErrorCode::IssuerUnavailable,
        ErrorCode::IdempotencyQuotaExceeded,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::StaleToken => "stale_token",
            ErrorCode::VersionMismatch => "version_mismatch",
            ErrorCode::MissingToken => "missing_token",
            ErrorCode::InvalidToken => "invalid_token",
            ErrorCode::InvalidHolder => "invalid_holder",
            ErrorCode::InvalidPrecondition => "invalid_precondition",
            ErrorCode::InvalidResource => "invalid_resource",
            ErrorCode::InvalidKey => "invalid_key",
            ErrorCode::InvalidBody => "invalid_body",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::BackendUnavailable => "backend_unavailable",
            ErrorCode::NotSupportedByBackend => "not_supported_by_backend",
            ErrorCode::Internal => "internal",
            ErrorCode::SqlError => "sql_error",
            ErrorCode::InvalidParam => "invalid_param",
            ErrorCode::StatementNotAllowed => "statement_not_allowed",
            ErrorCode::UnsupportedType => "unsupported_type",
            ErrorCode::TooManyStatements => "too_many_statements",
            ErrorCode::SqlDisabled => "sql_disabled",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::BodyTimeout => "body_timeout",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Unauthenticated => "unauthenticated",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::LeaseHeld => "lease_held",
            ErrorCode::LeaseLost => "lease_lost",
            ErrorCode::TokenNotIssued => "token_not_issued",
            ErrorCode::TokenHolderMismatch => "token_holder_mismatch",
            ErrorCode::TokensExhausted => "tokens_exhausted",
            ErrorCode::ResetRefused => "reset_refused",
            ErrorCode::InvalidIdempotencyKey => "invalid_idempotency_key",
            ErrorCode::IdempotencyKeyReused => "idempotency_key_reused",
            ErrorCode::IdempotencyInFlight => "idempotency_in_flight",
            ErrorCode::InvalidTransaction => "invalid_transaction",
            ErrorCode::TooManyOperations => "too_many_operations",
            ErrorCode::NotSynchronouslyReplicated => "not_synchronously_replicated",
            ErrorCode::IssuerUnavailable => "issuer_unavailable",
            ErrorCode::IdempotencyQuotaExceeded => "idempotency_quota_exceeded",
        }
    }

    /// The HTTP status this code is always answered with.
    pub const fn status(self) -> u16 {
        match self {
            ErrorCode::StaleToken
            | ErrorCode::LeaseHeld
            | ErrorCode::LeaseLost
            | ErrorCode::TokensExhausted
            | ErrorCode::ResetRefused
            | ErrorCode::IdempotencyInFlight => 409,
            ErrorCode::IdempotencyKeyReused => 422,
            ErrorCode::IdempotencyQuotaExceeded => 429,
            ErrorCode::VersionMismatch => 412,
            ErrorCode::MissingToken => 428,
            ErrorCode::InvalidToken
            | ErrorCode::InvalidHolder
            | ErrorCode::InvalidPrecondition
            | ErrorCode::InvalidResource
            | ErrorCode::InvalidKey
            | ErrorCode::InvalidBody
            | ErrorCode::SqlError
            | ErrorCode::InvalidParam
            | ErrorCode::StatementNotAllowed
            | ErrorCode::UnsupportedType
            | ErrorCode::TooManyStatements
            | ErrorCode::InvalidIdempotencyKey
            | ErrorCode::InvalidTransaction
            | ErrorCode::TooManyOperations => 400,
            ErrorCode::SqlDisabled
            | ErrorCode::Forbidden
            | ErrorCode::TokenNotIssued
            | ErrorCode::TokenHolderMismatch => 403,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::BodyTooLarge => 413,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::BackendUnavailable
            | ErrorCode::Overloaded
            | ErrorCode::ShuttingDown
            | ErrorCode::NotSynchronouslyReplicated
            | ErrorCode::IssuerUnavailable => 503,
            ErrorCode::BodyTimeout => 408,
            ErrorCode::NotSupportedByBackend => 501,
            ErrorCode::Internal => 500,
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A request that does not follow the contract. The message is safe to show a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("this request needs a Fencing-Token header")]
    MissingToken,
    #[error("invalid Fencing-Token: {0}")]
    InvalidToken(&'static str),
    #[error("invalid Fencing-Holder: {0}")]
    InvalidHolder(&'static str),
    #[error("invalid precondition: {0}")]
    InvalidPrecondition(&'static str),
    #[error("invalid resource: {0}")]
    InvalidResource(&'static str),
    #[error("invalid key: {0}")]
    InvalidKey(&'static str),
    #[error("invalid Idempotency-Key: {0}")]
    InvalidIdempotencyKey(&'static str),
}

impl ProtoError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ProtoError::MissingToken => ErrorCode::MissingToken,
            ProtoError::InvalidToken(_) => ErrorCode::InvalidToken,
            ProtoError::InvalidHolder(_) => ErrorCode::InvalidHolder,
            ProtoError::InvalidPrecondition(_) => ErrorCode::InvalidPrecondition,
            ProtoError::InvalidResource(_) => ErrorCode::InvalidResource,
            ProtoError::InvalidKey(_) => ErrorCode::InvalidKey,
            ProtoError::InvalidIdempotencyKey(_) => ErrorCode::InvalidIdempotencyKey,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_serialize_as_their_strings() {
        for code in ErrorCode::ALL {
            let json = serde_json::to_string(&code).unwrap();
            assert_eq!(json, format!("\"{}\"", code.as_str()));
            assert_eq!(serde_json::from_str::<ErrorCode>(&json).unwrap(), code);
        }
    }
}
