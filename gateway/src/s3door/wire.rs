//! What crosses the S3 door's wire besides the operations themselves: the writer's
//! token, a request body read within its bounds, the headers of a physical object, and
//! the gateway's errors as S3 error documents.

use bytes::{Bytes, BytesMut};
use fencegate_proto::headers::Fencing;
use fencegate_proto::Token;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use s3s::dto::{StreamingBlob, Timestamp};
use s3s::{S3Error, S3ErrorCode, S3Result};

use super::layout::Intent;
use super::upstream::UpstreamError;
use crate::coordinator::BodyMemory;
use crate::error::ApiError;

/// The metadata name (`x-amz-meta-fencing-token`) a writer's token may come in.
pub const TOKEN_METADATA: &str = "fencing-token";

/// The headers of an upload's physical object: its content type and user metadata.
pub(super) fn object_headers(intent: &Intent) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if let Some(content_type) = &intent.content_type {
        if let Ok(value) = HeaderValue::from_str(content_type) {
            headers.insert(http::header::CONTENT_TYPE, value);
        }
    }
    for (name, value) in &intent.metadata {
        let name = HeaderName::from_bytes(format!("x-amz-meta-{name}").as_bytes());
        let value = HeaderValue::from_str(value);
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.insert(name, value);
        }
    }
    headers
}

/// The writer's token: `x-amz-meta-fencing-token` or the `Fencing-Token` header; both
/// present and different is refused.
pub(super) fn token_of(
    headers: &HeaderMap,
    metadata: Option<&s3s::dto::Metadata>,
) -> S3Result<Fencing> {
    let from_metadata = metadata
        .and_then(|metadata| metadata.get(TOKEN_METADATA))
        .map(|value| Token::parse(value.as_bytes()));
    let from_header = match Fencing::from_headers(headers) {
        Ok(fencing) => Some(Ok(fencing)),
        Err(fencegate_proto::ProtoError::MissingToken) => None,
        Err(error) => Some(Err(error)),
    };
    let invalid = |e: &dyn std::fmt::Display| {
        S3Error::with_message(S3ErrorCode::InvalidArgument, format!("fencing token: {e}"))
    };
    match (from_metadata, from_header) {
        (None, None) => Err(S3Error::with_message(
            S3ErrorCode::Custom("MissingFencingToken".into()),
            "a write through the S3 door needs a fencing token: send it as the object \
             metadata fencing-token (x-amz-meta-fencing-token) or the Fencing-Token header",
        )
        .with_status(StatusCode::BAD_REQUEST)),
        (Some(Err(e)), _) => Err(invalid(&e)),
        (_, Some(Err(e))) => Err(invalid(&e)),
        (Some(Ok(token)), None) => Ok(Fencing {
            token,
            holder: None,
        }),
        (None, Some(Ok(fencing))) => Ok(fencing),
        (Some(Ok(token)), Some(Ok(fencing))) if token == fencing.token => Ok(fencing),
        (Some(Ok(token)), Some(Ok(fencing))) => Err(invalid(&format!(
            "the metadata says {token} and the Fencing-Token header {}",
            fencing.token
        ))),
    }
}

trait WithStatus {
    fn with_status(self, status: StatusCode) -> Self;
}

impl WithStatus for S3Error {
    fn with_status(mut self, status: StatusCode) -> S3Error {
        self.set_status_code(status);
        self
    }
}

/// The S3 error answering `error`, with the stale token's own code and header.
pub(super) fn s3_error_of(error: ApiError) -> S3Error {
    let message = error.to_string();
    match &error {
        ApiError::Stale { highest, .. } => {
            let mut s3 =
                S3Error::with_message(S3ErrorCode::Custom("StaleFencingToken".into()), message)
                    .with_status(StatusCode::CONFLICT);
            let mut headers = HeaderMap::new();
            headers.insert(
                HeaderName::from_static("fencing-highest"),
                HeaderValue::from(highest.get()),
            );
            s3.set_headers(headers);
            s3
        }
        ApiError::Forbidden { .. } | ApiError::Unauthenticated => {
            S3Error::with_message(S3ErrorCode::AccessDenied, message)
        }
        ApiError::Proto(_) => S3Error::with_message(S3ErrorCode::InvalidArgument, message),
        ApiError::Overloaded(_)
        | ApiError::ShuttingDown
        | ApiError::NotSynchronouslyReplicated
        | ApiError::IssuerUnavailable { .. }
        | ApiError::Store(crate::store::StoreError::Unavailable { .. }) => {
            S3Error::with_message(S3ErrorCode::SlowDown, message)
                .with_status(StatusCode::SERVICE_UNAVAILABLE)
        }
        ApiError::Store(crate::store::StoreError::Internal(_)) => {
            S3Error::with_message(S3ErrorCode::InternalError, message)
        }
        _ => {
            let code = error.code();
            let status =
                StatusCode::from_u16(code.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let name = pascal_case(code.as_str());
            S3Error::with_message(S3ErrorCode::Custom(name.into()), message).with_status(status)
        }
    }
}

/// The answer to a transaction refused as stale: its first stale member's, as a single
/// write's would be.
pub(super) fn stale_error(members: Vec<crate::store::txn::StaleMember>) -> S3Error {
    match members.into_iter().next() {
        Some(member) => s3_error_of(ApiError::Stale {
            resource: member.resource,
            presented: member.presented,
            highest: member.highest,
        }),
        None => S3Error::with_message(
            S3ErrorCode::InternalError,
            "a stale outcome without a member",
        ),
    }
}

/// `token_not_issued` → `TokenNotIssued`: the gateway's error codes in S3's style.
fn pascal_case(code: &str) -> String {
    code.split('_')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect()
}

pub(super) fn upstream_failed(error: &UpstreamError) -> S3Error {
    tracing::warn!(%error, "S3 upstream request failed");
    S3Error::with_message(
        S3ErrorCode::ServiceUnavailable,
        format!("the upstream object store failed ({error}); nothing was made visible, retry"),
    )
    .with_status(StatusCode::SERVICE_UNAVAILABLE)
}

/// Reads a PUT body into memory, refusing one above `limit`, and claims the memory it
/// takes from the gateway's body budget (`--max-body-memory`, the client's share);
/// [`super::service::S3Door::read_body`] keeps the claim with the body.
pub(super) async fn read_body(
    body: Option<StreamingBlob>,
    limit: usize,
    memory: &mut BodyMemory,
) -> S3Result<Bytes> {
    use futures_util::StreamExt;
    let Some(mut body) = body else {
        return Ok(Bytes::new());
    };
    let mut read = BytesMut::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| {
            S3Error::with_message(
                S3ErrorCode::IncompleteBody,
                format!("the body could not be read: {e}"),
            )
        })?;
        if read.len() + chunk.len() > limit {
            return Err(S3Error::with_message(
                S3ErrorCode::EntityTooLarge,
                format!(
                    "a single PUT through the door takes at most {limit} bytes \
                     (--s3-max-object); larger objects go as multipart uploads"
                ),
            ));
        }
        memory
            .grow_to(read.len() + chunk.len())
            .map_err(|overload| {
                S3Error::with_message(
                    S3ErrorCode::SlowDown,
                    ApiError::Overloaded(overload).to_string(),
                )
                .with_status(StatusCode::SERVICE_UNAVAILABLE)
            })?;
        read.extend_from_slice(&chunk);
    }
    Ok(read.freeze())
}

pub(super) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

pub(super) fn timestamp(ms: i64) -> Timestamp {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0).unsigned_abs());
    Timestamp::from(at)
}

/// The ETag as S3's DTO has it (the value without quotes).
pub(super) fn etag(text: &str) -> s3s::dto::ETag {
    s3s::dto::ETag::Strong(text.trim_matches('"').to_owned())
}
