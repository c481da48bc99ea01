//! The S3 door's upstream: path-style requests to an S3-compatible server, each signed
//! with the gateway's own credentials by `aws-sigv4` (the AWS SDKs' signer). A client's
//! signature is never forwarded.

use std::time::{Duration, SystemTime};

use aws_credential_types::Credentials;
use aws_sigv4::http_request::{
    sign, PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
    UriPathNormalizationMode,
};
use aws_sigv4::sign::v4;
use aws_smithy_runtime_api::client::identity::Identity;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};

/// What SigV4 leaves unencoded in a query value: the unreserved characters.
const QUERY_VALUE: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// What stays unencoded in an object key in a path: the unreserved characters and `/`.
const KEY_PATH: &AsciiSet = &QUERY_VALUE.remove(b'/');

/// The upstream's credentials and where it is.
#[derive(Clone)]
pub struct UpstreamOptions {
    /// `http://host:port`, no trailing slash.
    pub endpoint: String,
    pub access_key_id: String,
    pub secret_access_key: String,
    pub region: String,
    /// Longest an upstream request may take, body included.
    pub timeout: Duration,
}

/// Why an upstream request gave no answer the door can use.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    #[error("the upstream could not be reached: {0}")]
    Transport(String),
    #[error("the upstream did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the upstream answered {status}: {code}")]
    Answered { status: StatusCode, code: String },
}

/// A signed client of one upstream.
#[derive(Clone)]
pub struct Upstream {
    options: UpstreamOptions,
    identity: Identity,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// An upload that the upstream stored.
#[derive(Debug, Clone)]
pub struct Stored {
    /// The ETag as the upstream answered it, quotes included.
    pub etag: String,
}

/// How a conditional PUT ended.
#[derive(Debug)]
pub enum Conditional {
    Stored(Stored),
    /// 412: the condition did not hold.
    Refused,
}

impl Upstream {
    pub fn new(options: UpstreamOptions) -> Upstream {
        let identity = Credentials::new(
            &options.access_key_id,
            &options.secret_access_key,
            None,
            None,
            "fencegate-s3-upstream",
        )
        .into();
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        Upstream {
            options,
            identity,
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    /// PUTs `body` to a key that must not exist yet (`If-None-Match: *`), with the
    /// given headers (content type, user metadata).
    pub async fn put_new(
        &self,
        bucket: &str,
        key: &str,
        headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Conditional, UpstreamError> {
        let mut headers = headers.clone();
        headers.insert(http::header::IF_NONE_MATCH, HeaderValue::from_static("*"));
        let response = self
            .send(Method::PUT, &object_path(bucket, key), headers, body)
            .await?;
        match response.status() {
            StatusCode::OK => Ok(Conditional::Stored(Stored {
                etag: etag_of(response.headers()),
            })),
            StatusCode::PRECONDITION_FAILED => Ok(Conditional::Refused),
            _ => Err(answered(response).await),
        }
    }

    /// GETs an object, forwarding `range`; the answer is streamed to the caller.
    pub async fn get(
        &self,
        bucket: &str,
        key: &str,
        range: Option<&str>,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let mut headers = HeaderMap::new();
        if let Some(range) = range {
            let value = HeaderValue::from_str(range)
                .map_err(|_| UpstreamError::Transport("the range is not a header value".into()))?;
            headers.insert(http::header::RANGE, value);
        }
        let response = self
            .send(
                Method::GET,
                &object_path(bucket, key),
                headers,
                Bytes::new(),
            )
            .await?;
        match response.status() {
            StatusCode::OK | StatusCode::PARTIAL_CONTENT => Ok(response),
            _ => Err(answered(response).await),
        }
    }

    /// DELETEs an object; a missing one counts as deleted.
    pub async fn delete(&self, bucket: &str, key: &str) -> Result<(), UpstreamError> {
        let response = self
            .send(
                Method::DELETE,
                &object_path(bucket, key),
                HeaderMap::new(),
                Bytes::new(),
            )
            .await?;
        match response.status() {
            StatusCode::NO_CONTENT | StatusCode::OK | StatusCode::NOT_FOUND => Ok(()),
            _ => Err(answered(response).await),
        }
    }

    /// HEADs an object: its ETag (quotes included) and size; `None` if it is missing.
    pub async fn head(
        &self,
        bucket: &str,
        key: &str,
    ) -> Result<Option<(String, u64)>, UpstreamError> {
        let response = self
            .send(
                Method::HEAD,
                &object_path(bucket, key),
                HeaderMap::new(),
                Bytes::new(),
            )
            .await?;
        match response.status() {
            StatusCode::OK => {
                let size = response
                    .headers()
                    .get(http::header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0);
                Ok(Some((etag_of(response.headers()), size)))
            }
            StatusCode::NOT_FOUND => Ok(None),
            status => Err(UpstreamError::Answered {
                status,
                code: "no error code (HEAD)".into(),
            }),
        }
    }

    /// One page of the keys under `prefix`, with when each was last modified, and the
    /// continuation token of the next page if there is one.
    pub async fn list(
        &self,
        bucket: &str,
        prefix: &str,
        continuation: Option<&str>,
    ) -> Result<(Vec<(String, String)>, Option<String>), UpstreamError> {
        let mut params = vec![("list-type", "2".to_owned()), ("prefix", prefix.to_owned())];
        if let Some(token) = continuation {
            params.push(("continuation-token", token.to_owned()));
        }
        params.sort();
        let query: Vec<String> = params
            .iter()
            .map(|(name, value)| format!("{name}={}", utf8_percent_encode(value, QUERY_VALUE)))
            .collect();
        let path = format!("/{bucket}?{}", query.join("&"));
        let response = self
            .send(Method::GET, &path, HeaderMap::new(), Bytes::new())
            .await?;
        if response.status() != StatusCode::OK {
            return Err(answered(response).await);
        }
        let body = read_all(response).await?;
        let mut keys = Vec::new();
        for contents in body.split("<Contents>").skip(1) {
            if let (Some(key), Some(modified)) = (
                xml_value(contents, "Key"),
                xml_value(contents, "LastModified"),
            ) {
                keys.push((key, modified));
            }
        }
        let next = (xml_value(&body, "IsTruncated").as_deref() == Some("true"))
            .then(|| xml_value(&body, "NextContinuationToken"))
            .flatten();
        Ok((keys, next))
    }

    /// Starts a multipart upload of `key`; its upload id.
    pub async fn create_multipart(
        &self,
        bucket: &str,
        key: &str,
        headers: &HeaderMap,
    ) -> Result<String, UpstreamError> {
        let path = format!("{}?uploads", object_path(bucket, key));
        let response = self
            .send(Method::POST, &path, headers.clone(), Bytes::new())
            .await?;
        if response.status() != StatusCode::OK {
            return Err(answered(response).await);
        }
        let body = read_all(response).await?;
        xml_value(&body, "UploadId").ok_or_else(|| UpstreamError::Answered {
            status: StatusCode::OK,
            code: "an answer to CreateMultipartUpload without an UploadId".into(),
        })
    }

    /// Uploads one part; its ETag.
    pub async fn upload_part(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: Bytes,
    ) -> Result<String, UpstreamError> {
        let path = format!(
            "{}?partNumber={part_number}&uploadId={}",
            object_path(bucket, key),
            utf8_percent_encode(upload_id, QUERY_VALUE)
        );
        let response = self
            .send(Method::PUT, &path, HeaderMap::new(), body)
            .await?;
        match response.status() {
            StatusCode::OK => Ok(etag_of(response.headers())),
            _ => Err(answered(response).await),
        }
    }

    /// Completes a multipart upload from its parts, `(part number, ETag)` in order.
    /// S3 may answer 200 with an error document: that is a failure too.
    pub async fn complete_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: &[(i32, String)],
    ) -> Result<(), UpstreamError> {
        let path = format!(
            "{}?uploadId={}",
            object_path(bucket, key),
            utf8_percent_encode(upload_id, QUERY_VALUE)
        );
        let mut xml = String::from("<CompleteMultipartUpload>");
        for (number, etag) in parts {
            let etag = etag
                .replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;");
            xml.push_str(&format!(
                "<Part><PartNumber>{number}</PartNumber><ETag>{etag}</ETag></Part>"
            ));
        }
        xml.push_str("</CompleteMultipartUpload>");
        let response = self
            .send(Method::POST, &path, HeaderMap::new(), Bytes::from(xml))
            .await?;
        if response.status() != StatusCode::OK {
            return Err(answered(response).await);
        }
        let body = read_all(response).await?;
        match xml_value(&body, "Code") {
            Some(code) if body.contains("<Error>") => Err(UpstreamError::Answered {
                status: StatusCode::OK,
                code,
            }),
            _ => Ok(()),
        }
    }

    /// Aborts a multipart upload; one already gone counts as aborted.
    pub async fn abort_multipart(
        &self,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<(), UpstreamError> {
        let path = format!(
            "{}?uploadId={}",
            object_path(bucket, key),
            utf8_percent_encode(upload_id, QUERY_VALUE)
        );
        let response = self
            .send(Method::DELETE, &path, HeaderMap::new(), Bytes::new())
            .await?;
        match response.status() {
            StatusCode::NO_CONTENT | StatusCode::OK | StatusCode::NOT_FOUND => Ok(()),
            _ => Err(answered(response).await),
        }
    }

    /// Signs and sends one request, within the upstream timeout for its head.
    async fn send(
        &self,
        method: Method,
        path: &str,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<Response<Incoming>, UpstreamError> {
        let uri = format!("{}{path}", self.options.endpoint);
        let mut request = Request::builder()
            .method(method)
            .uri(&uri)
            .body(Full::new(body.clone()))
            .map_err(|e| UpstreamError::Transport(e.to_string()))?;
        *request.headers_mut() = headers;
        self.sign(&mut request, &body)?;
        let timeout = self.options.timeout;
        match tokio::time::timeout(timeout, self.client.request(request)).await {
            Ok(Ok(response)) => Ok(response),
            Ok(Err(error)) => Err(UpstreamError::Transport(error.to_string())),
            Err(_) => Err(UpstreamError::Timeout(timeout)),
        }
    }

    /// Signs `request` in place with the body's SHA-256.
    fn sign(&self, request: &mut Request<Full<Bytes>>, body: &[u8]) -> Result<(), UpstreamError> {
        let failed = |e: &dyn std::fmt::Display| UpstreamError::Transport(format!("signing: {e}"));
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        let params = v4::SigningParams::builder()
            .identity(&self.identity)
            .region(&self.options.region)
            .name("s3")
            .time(SystemTime::now())
            .settings(settings)
            .build()
            .map_err(|e| failed(&e))?
            .into();
        let headers = request
            .headers()
            .iter()
            .map(|(name, value)| Ok((name.as_str(), value.to_str()?)))
            .collect::<Result<Vec<_>, http::header::ToStrError>>()
            .map_err(|e| failed(&e))?;
        let uri = request.uri().to_string();
        let signable = SignableRequest::new(
            request.method().as_str(),
            &uri,
            headers.into_iter(),
            SignableBody::Bytes(body),
        )
        .map_err(|e| failed(&e))?;
        let (instructions, _) = sign(signable, &params)
            .map_err(|e| failed(&e))?
            .into_parts();
        instructions.apply_to_request_http1x(request);
        Ok(())
    }

    /// Checks that the upstream lets exactly one of `racers` concurrent
    /// `If-None-Match: *` PUTs of one fresh key win, and removes the key.
    pub async fn check_conditional_writes(
        &self,
        bucket: &str,
        racers: usize,
    ) -> Result<(), String> {
        let key = format!(".fencegate/conformance/{}", uuid::Uuid::new_v4());
        let puts = (0..racers).map(|racer| {
            let body = Bytes::from(format!("racer {racer}"));
            let key = key.as_str();
            async move { self.put_new(bucket, key, &HeaderMap::new(), body).await }
        });
        let outcomes = futures_util::future::join_all(puts).await;
        let mut won = 0;
        for outcome in outcomes {
            match outcome {
                Ok(Conditional::Stored(_)) => won += 1,
                Ok(Conditional::Refused) => {}
                Err(error) => {
                    return Err(format!(
                        "a conditional PUT to bucket {bucket:?} failed: {error}"
                    ))
                }
            }
        }
        let _ = self.delete(bucket, &key).await;
        if won == 1 {
            Ok(())
        } else {
            Err(format!(
                "{won} of {racers} concurrent PUTs with If-None-Match: * of one fresh key in \
                 bucket {bucket:?} succeeded, where exactly one must: this upstream does not \
                 honour conditional writes atomically, and the S3 door's write-once objects \
                 rest on them"
            ))
        }
    }
}

/// `/bucket/key`, the key percent-encoded but for its slashes.
fn object_path(bucket: &str, key: &str) -> String {
    format!("/{bucket}/{}", utf8_percent_encode(key, KEY_PATH))
}

fn etag_of(headers: &HeaderMap) -> String {
    headers
        .get(http::header::ETAG)
        .and_then(|value| value.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A whole (small) answer body as text, within the upstream timeout.
async fn read_all(response: Response<Incoming>) -> Result<String, UpstreamError> {
    let body = tokio::time::timeout(Duration::from_secs(30), response.into_body().collect())
        .await
        .map_err(|_| UpstreamError::Timeout(Duration::from_secs(30)))?
        .map_err(|e| UpstreamError::Transport(e.to_string()))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The text of the first `<tag>` element of an XML answer, unescaped.
fn xml_value(xml: &str, tag: &str) -> Option<String> {
    let (open, close) = (format!("<{tag}>"), format!("</{tag}>"));
    let start = xml.find(&open)? + open.len();
    let end = start + xml[start..].find(&close)?;
    Some(
        xml[start..end]
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&"),
    )
}

/// An upstream error answer, with its S3 `Code` if the body has one.
async fn answered(response: Response<Incoming>) -> UpstreamError {
    let status = response.status();
    let body = tokio::time::timeout(Duration::from_secs(5), response.into_body().collect())
        .await
        .ok()
        .and_then(Result::ok)
        .map(|collected| collected.to_bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&body);
    let code = text
        .split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map_or_else(|| "no error code".to_owned(), |(code, _)| code.to_owned());
    UpstreamError::Answered { status, code }
}
