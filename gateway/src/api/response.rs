//! Responses: JSON bodies, and every error as its status, body and headers.

use bytes::Bytes;
use fencegate_proto::headers::{FENCING_HIGHEST, IDEMPOTENCY_REPLAYED};
use fencegate_proto::{ErrorCode, ResourceName, Token};
use http::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderName, HeaderValue, Response, StatusCode};

use super::Body;
use crate::error::ApiError;
use crate::store::txn::StoredAnswer;

/// A number as a header value, in one allocation (`HeaderValue::from(u64)` takes two).
pub fn number_value(number: u64) -> HeaderValue {
    HeaderValue::from_str(itoa::Buffer::new().format(number)).expect("digits are a valid header")
}

/// The `ETag` of an object version, as [`fencegate_proto::headers::etag`] writes it, in
/// one allocation.
pub fn etag_value(version: u64) -> HeaderValue {
    let mut digits = itoa::Buffer::new();
    let digits = digits.format(version).as_bytes();
    let mut quoted = [b'"'; 22]; // u64::MAX has 20 digits
    quoted[1..=digits.len()].copy_from_slice(digits);
    HeaderValue::from_bytes(&quoted[..digits.len() + 2]).expect("an etag is a valid header")
}

pub fn json_response<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Body> {
    // Room for the common answers (a write accepted, a stale rejection) in one allocation.
    let mut bytes = Vec::with_capacity(256);
    serde_json::to_writer(&mut bytes, body).expect("response bodies serialize");
    let mut response = Response::new(Body::whole(Bytes::from(bytes)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub fn error_response(error: &ApiError) -> Response<Body> {
    if let ApiError::Stored {
        answer, replayed, ..
    } = error
    {
        return respond(answer, *replayed);
    }
    let code = error.code();
    let status = StatusCode::from_u16(code.status()).expect("error codes carry valid statuses");
    let mut response = match error {
        ApiError::Stale {
            resource,
            presented,
            highest,
        } => {
            let body = stale_body(resource, *presented, *highest);
            let mut response = Response::new(Body::whole(Bytes::from(body)));
            *response.status_mut() = status;
            response
                .headers_mut()
                .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            response
        }
        _ => json_response(status, &error.body()),
    };
    match error {
        ApiError::Stale { highest, .. } => {
            response
                .headers_mut()
                .insert(FENCING_HIGHEST, number_value(highest.get()));
        }
        ApiError::MethodNotAllowed { allow } => {
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static(allow));
        }
        ApiError::Overloaded(_)
        | ApiError::ShuttingDown
        | ApiError::IdempotencyInFlight
        | ApiError::NotSynchronouslyReplicated
        | ApiError::IssuerUnavailable { .. } => {
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("1"));
        }
        ApiError::Unauthenticated => {
            response.headers_mut().insert(
                WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"fencegate\""),
            );
        }
        _ => {}
    }
    response
}

/// The body of a stale rejection — the answer a stale flood gets, many times a second —
/// written straight from its facts. None of them needs escaping in JSON: a resource
/// name is `[A-Za-z0-9._-]` ([`ResourceName`] holds no other), a token is digits, and
/// the rest is fixed ASCII text. The same bytes as `serde_json` gives for
/// `error.body()`, field for field (a test compares them).
fn stale_body(resource: &ResourceName, presented: Token, highest: Token) -> String {
    let mut number = itoa::Buffer::new();
    // The exact length: a body that fills its buffer becomes `Bytes` without a second
    // allocation.
    let digits = number.format(presented.get()).len() + number.format(highest.get()).len();
    let length = STALE_BODY_FIXED
        + crate::error::STALE_MESSAGE_FIXED
        + 2 * (resource.as_str().len() + digits);
    let mut body = String::with_capacity(length);
    body.push_str("{\"error\":\"");
    body.push_str(ErrorCode::StaleToken.as_str());
    body.push_str("\",\"message\":\"");
    crate::error::push_stale_message(&mut body, resource, presented, highest);
    body.push_str("\",\"resource\":\"");
    body.push_str(resource.as_str());
    body.push_str("\",\"presented\":");
    body.push_str(number.format(presented.get()));
    body.push_str(",\"highest\":");
    body.push_str(number.format(highest.get()));
    body.push('}');
    debug_assert_eq!(body.len(), length);
    body
}

/// The bytes of a stale body besides its message, resource name and numbers.
const STALE_BODY_FIXED: usize = "{\"error\":\"".len()
    + ErrorCode::StaleToken.as_str().len()
    + "\",\"message\":\"".len()
    + "\",\"resource\":\"".len()
    + "\",\"presented\":".len()
    + ",\"highest\":".len()
    + "}".len();

/// The response of a stored answer; marked as replayed if it is one.
pub fn respond(answer: &StoredAnswer, replayed: bool) -> Response<Body> {
    let mut response = Response::new(Body::whole(answer.body.clone()));
    *response.status_mut() =
        StatusCode::from_u16(answer.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for (name, value) in &answer.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            response.headers_mut().append(name, value);
        }
    }
    if replayed {
        response
            .headers_mut()
            .insert(IDEMPOTENCY_REPLAYED, HeaderValue::from_static("true"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use fencegate_proto::body::ErrorBody;
    use http_body_util::BodyExt;

    async fn body_of(response: Response<Body>) -> Vec<u8> {
        response
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes()
            .to_vec()
    }

    /// The stale body is written without `ErrorBody`: it must be the very bytes that
    /// `ErrorBody` gives, field for field and in the same order.
    #[test]
    fn number_and_etag_values_are_those_of_the_usual_constructors() {
        for n in [0, 1, 9, 10, 12_345, i64::MAX as u64, u64::MAX] {
            assert_eq!(number_value(n), HeaderValue::from(n));
            let etag = fencegate_proto::headers::etag(n);
            assert_eq!(etag_value(n), HeaderValue::from_str(&etag).unwrap());
        }
    }

    #[tokio::test]
    async fn a_stale_body_is_byte_for_byte_the_error_body() {
        for (name, presented, highest) in [
            ("orders", 1, 2),
            ("a-b_c.d", 41, 9_007_199_254_740_993),
            ("x", i64::MAX as u64 - 1, i64::MAX as u64),
            (&"r".repeat(200), 9, 10),
        ] {
            let error = ApiError::Stale {
                resource: ResourceName::new(name).unwrap(),
                presented: Token::new(presented).unwrap(),
                highest: Token::new(highest).unwrap(),
            };
            let body = stale_body(
                &ResourceName::new(name).unwrap(),
                Token::new(presented).unwrap(),
                Token::new(highest).unwrap(),
            );
            assert_eq!(body.capacity(), body.len(), "the body fills its buffer");
            let response = error_response(&error);
            assert_eq!(response.status(), StatusCode::CONFLICT);
            assert_eq!(
                response.headers()[FENCING_HIGHEST],
                highest.to_string().as_str()
            );
            let written = body_of(response).await;
            assert_eq!(
                String::from_utf8(written.clone()).unwrap(),
                serde_json::to_string(&error.body()).unwrap()
            );
            let read: ErrorBody = serde_json::from_slice(&written).unwrap();
            assert_eq!(read, error.body());
            assert_eq!(
                read.message,
                format!("stale fencing token {presented} for resource {name}: its highest accepted token is {highest}")
            );
        }
    }
}
