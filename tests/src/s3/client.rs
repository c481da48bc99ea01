//! A small S3 client: path-style requests signed with SigV4 (`aws-sigv4`, the AWS SDKs'
//! own signer) and sent with hyper's client. Enough to pin what an upstream does;
//! answers are returned whole, errors included, for the test to judge.

use std::time::SystemTime;

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use bytes::Bytes;
use http::{Method, Request};
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

use crate::http::Reply;

/// The region requests are signed for; radosgw takes the one the signature names.
const REGION: &str = "us-east-1";

/// What SigV4 leaves unencoded in a query value: the unreserved characters.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// What stays unencoded in an object key in a path: the unreserved characters and `/`.
const KEY_PATH: &AsciiSet = &QUERY_VALUE.remove(b'/');

/// A client for one S3 endpoint, signing as one user.
#[derive(Clone)]
pub struct S3Client {
    endpoint: String,
    identity: Identity,
    /// Sign `UNSIGNED-PAYLOAD` instead of the body's SHA-256, as a proxy streaming a
    /// body it has not read yet would.
    unsigned_payload: bool,
    inner: hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
}

impl S3Client {
    /// A client for `endpoint` (`http://host:port`) signing with the given keys.
    pub fn new(endpoint: impl Into<String>, access_key: &str, secret_key: &str) -> S3Client {
        S3Client {
            endpoint: endpoint.into(),
            identity: Credentials::new(access_key, secret_key, None, None, "fencegate-tests")
                .into(),
            unsigned_payload: false,
            inner: {
                let mut connector = HttpConnector::new();
                connector.set_nodelay(true);
                hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build(connector)
            },
        }
    }

    /// This client, signing `UNSIGNED-PAYLOAD` instead of each body's hash.
    pub fn with_unsigned_payload(mut self) -> S3Client {
        self.unsigned_payload = true;
        self
    }

    /// Sends a signed request for `path_and_query` (already encoded); `Err` only for
    /// transport failures.
    pub async fn try_request_path(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Reply, String> {
        let body = body.into();
        let uri = format!("{}{path_and_query}", self.endpoint);
        let mut request = Request::builder().method(method.clone()).uri(&uri);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let mut request = request
            .body(Full::new(body.clone()))
            .map_err(|e| e.to_string())?;
        self.sign(&mut request, &body)?;
        crate::http::send(&self.inner, request).await
    }

    /// Sends a signed request; panics on a transport failure.
    pub async fn request_path(
        &self,
        method: Method,
        path_and_query: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        self.try_request_path(method, path_and_query, headers, body)
            .await
            .unwrap_or_else(|e| panic!("{} {path_and_query} failed: {e}", self.endpoint))
    }

    /// CreateBucket; panics unless it succeeds.
    pub async fn create_bucket(&self, bucket: &str) {
        let reply = self
            .request_path(Method::PUT, &format!("/{bucket}"), &[], "")
            .await;
        assert_eq!(reply.status, 200, "CreateBucket {bucket}: {}", text(&reply));
    }

    /// PutObject with extra headers (conditions, metadata).
    pub async fn put(
        &self,
        bucket: &str,
        key: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        self.request_path(Method::PUT, &object_path(bucket, key), headers, body)
            .await
    }

    /// PutObject, with the transport failure as an error (for races).
    pub async fn try_put(
        &self,
        bucket: &str,
        key: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Reply, String> {
        self.try_request_path(Method::PUT, &object_path(bucket, key), headers, body)
            .await
    }

    pub async fn get(&self, bucket: &str, key: &str) -> Reply {
        self.request_path(Method::GET, &object_path(bucket, key), &[], "")
            .await
    }

    pub async fn head(&self, bucket: &str, key: &str) -> Reply {
        self.request_path(Method::HEAD, &object_path(bucket, key), &[], "")
            .await
    }

    /// ListObjectsV2 with the given query parameters besides `list-type`, e.g.
    /// `[("prefix", "a/"), ("delimiter", "/")]`.
    pub async fn list(&self, bucket: &str, params: &[(&str, &str)]) -> Reply {
        let mut params = params.to_vec();
        params.push(("list-type", "2"));
        // SigV4 signs the query sorted by name; send it in that order too.
        params.sort();
        let query: Vec<String> = params
            .iter()
            .map(|(name, value)| format!("{name}={}", utf8_percent_encode(value, QUERY_VALUE)))
            .collect();
        self.request_path(
            Method::GET,
            &format!("/{bucket}?{}", query.join("&")),
            &[],
            "",
        )
        .await
    }

    /// Signs `request` in place: `x-amz-date`, `x-amz-content-sha256` (the body's
    /// SHA-256 or `UNSIGNED-PAYLOAD`), `authorization`.
    fn sign(&self, request: &mut Request<Full<Bytes>>, body: &[u8]) -> Result<(), String> {
        let mut settings = SigningSettings::default();
        // S3 signs the path as sent, and wants the payload's hash in a header.
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        let params = v4::SigningParams::builder()
            .identity(&self.identity)
            .region(REGION)
            .name("s3")
            .time(SystemTime::now())
            .settings(settings)
            .build()
            .map_err(|e| e.to_string())?
            .into();
        let headers = request
            .headers()
            .iter()
            .map(|(name, value)| Ok((name.as_str(), value.to_str()?)))
            .collect::<Result<Vec<_>, http::header::ToStrError>>()
            .map_err(|e| e.to_string())?;
        let uri = request.uri().to_string();
        let signable = SignableRequest::new(
            request.method().as_str(),
            &uri,
            headers.into_iter(),
            if self.unsigned_payload {
                SignableBody::UnsignedPayload
            } else {
                SignableBody::Bytes(body)
            },
        )
        .map_err(|e| e.to_string())?;
        let (instructions, _signature) = sign(signable, &params)
            .map_err(|e| e.to_string())?
            .into_parts();
        instructions.apply_to_request_http1x(request);
        Ok(())
    }
}

/// `/bucket/key`, the key percent-encoded but for its slashes.
pub fn object_path(bucket: &str, key: &str) -> String {
    format!("/{bucket}/{}", utf8_percent_encode(key, KEY_PATH))
}

/// The body as text, for failure messages.
pub fn text(reply: &Reply) -> String {
    String::from_utf8_lossy(&reply.body).into_owned()
}

/// The text of every `<tag>…</tag>` element in an XML answer, in order. The answers
/// read here (ListObjectsV2, errors) nest no element inside another of the same name.
pub fn xml_values(xml: &str, tag: &str) -> Vec<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let mut values = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find(&open) {
        let after = &rest[start + open.len()..];
        let Some(end) = after.find(&close) else { break };
        values.push(xml_unescape(&after[..end]));
        rest = &after[end + close.len()..];
    }
    values
}

/// The S3 error `Code` of an error answer, if it has one.
pub fn error_code(reply: &Reply) -> Option<String> {
    xml_values(&text(reply), "Code").into_iter().next()
}

fn xml_unescape(text: &str) -> String {
    text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}
