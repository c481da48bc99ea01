//! Responses: JSON bodies, and every error as its status, body and headers.

use bytes::Bytes;
use fencegate_proto::headers::FENCING_HIGHEST;
use http::header::{ALLOW, CONTENT_TYPE, RETRY_AFTER, WWW_AUTHENTICATE};
use http::{HeaderValue, Response, StatusCode};
use http_body_util::Full;

use crate::error::ApiError;

pub type Body = Full<Bytes>;

pub fn json_response<T: serde::Serialize>(status: StatusCode, body: &T) -> Response<Body> {
    let bytes = serde_json::to_vec(body).expect("response bodies serialize");
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
    let mut response = json_response(status, &error.body());
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
