//! Responses: JSON bodies, and every error as its status, body and headers.

use bytes::Bytes;
use fencegate_proto::headers::FENCING_HIGHEST;
use fencegate_proto::{ErrorCode, ResourceName, Token};
use http::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

use crate::error::ApiError;

pub type Body = Full<Bytes>;

pub fn json_response<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Body> {
    // Room for the common answers (a write accepted, a stale rejection) in one allocation.
    let mut bytes = Vec::with_capacity(256);
    serde_json::to_writer(&mut bytes, body).expect("response bodies serialize");
    let mut response = Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

pub fn error_response(error: &ApiError) -> Response<Body> {
    let code = error.code();
    let status = StatusCode::from_u16(code.status()).expect("error codes carry valid statuses");
    let mut response = match error {
        ApiError::Stale {
            resource,
            presented,
            highest,
        } => json_response(
            status,
            &StaleBody {
                error: code,
                message: crate::error::stale_message(resource, *presented, *highest),
                resource,
                presented: *presented,
                highest: *highest,
            },
        ),
        _ => json_response(status, &error.body()),
    };
    match error {
        ApiError::Stale { highest, .. } => {
            response
                .headers_mut()
                .insert(FENCING_HIGHEST, HeaderValue::from(highest.get()));
        }
        ApiError::MethodNotAllowed { allow } => {
            response
                .headers_mut()
                .insert(ALLOW, HeaderValue::from_static(allow));
        }
        ApiError::Overloaded(_) | ApiError::ShuttingDown => {
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
/// written straight from the error, without the intermediate [`ErrorBody`] and its
/// strings. The same JSON as `error.body()`, field for field (a test compares them).
///
/// [`ErrorBody`]: fencegate_proto::body::ErrorBody
#[derive(serde::Serialize)]
struct StaleBody<'a> {
    error: ErrorCode,
    message: String,
    resource: &'a ResourceName,
    presented: Token,
    highest: Token,
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
    #[tokio::test]
    async fn a_stale_body_is_byte_for_byte_the_error_body() {
        for (name, presented, highest) in [
            ("orders", 1, 2),
            ("a-b_c.d", 41, 9_007_199_254_740_993),
            ("x", i64::MAX as u64 - 1, i64::MAX as u64),
        ] {
            let error = ApiError::Stale {
                resource: ResourceName::new(name).unwrap(),
                presented: Token::new(presented).unwrap(),
                highest: Token::new(highest).unwrap(),
            };
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
