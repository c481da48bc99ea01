//! A small HTTP client for the gateway's API, on hyper's client.

use bytes::Bytes;
use fencegate_proto::path::Target;
use fencegate_proto::{ObjectKey, ResourceName};
use http::{HeaderMap, Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

/// An answer, fully read.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    /// The body as JSON; panics if it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The `error` code of an error body.
    pub fn error_code(&self) -> String {
        self.json()["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error code in {:?}", self.json()))
            .to_owned()
    }
}

/// Sends `request` on `client` and reads the whole answer; an error if the transport
/// failed.
pub async fn send(
    client: &hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
) -> Result<Reply, String> {
    let response = client
        .request(request)
        .await
        .map_err(|e| format!("{e:?}"))?;
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    Ok(Reply {
        status,
        headers,
        body,
    })
}

/// A client bound to one gateway base URL, keeping connections alive.
#[derive(Clone)]
pub struct Client {
    base: String,
    inner: hyper_util::client::legacy::Client<HttpConnector, Full<Bytes>>,
}

impl Client {
    pub fn new(base: impl Into<String>) -> Client {
        let inner = hyper_util::client::legacy::Client::builder(TokioExecutor::new()).build_http();
        Client {
            base: base.into(),
            inner,
        }
    }

    /// A client that speaks cleartext HTTP/2 only (prior knowledge, h2c): all its
    /// requests share one connection as concurrent streams.
    pub fn new_h2(base: impl Into<String>) -> Client {
        let inner = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
            .http2_only(true)
            .build_http();
        Client {
            base: base.into(),
            inner,
        }
    }
    /// Sends a request; `Err` only for transport failures.
    pub async fn try_request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<Reply, String> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(body.into()))
            .map_err(|e| e.to_string())?;
        send(&self.inner, request).await
    }

    /// Sends a request; panics on a transport failure.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        let path = path.to_owned();
        self.try_request(method, &path, headers, body)
            .await
            .unwrap_or_else(|e| panic!("request to {}{path} failed: {e}", self.base))
    }

    pub async fn put(
        &self,
        resource: &str,
        key: &str,
        token: u64,
        value: impl Into<Bytes>,
    ) -> Reply {
        let token = token.to_string();
        self.request(
            Method::PUT,
            &kv_path(resource, key),
            &[("fencing-token", &token)],
            value,
        )
        .await
    }

    pub async fn delete(&self, resource: &str, key: &str, token: u64) -> Reply {
        let token = token.to_string();
        self.request(
            Method::DELETE,
            &kv_path(resource, key),
            &[("fencing-token", &token)],
            Bytes::new(),
        )
        .await
    }

    /// `GET path`, whatever the path.
    pub async fn get_path(&self, path: &str) -> Reply {
        self.request(Method::GET, path, &[], Bytes::new()).await
    }

    pub async fn get(&self, resource: &str, key: &str) -> Reply {
        self.request(Method::GET, &kv_path(resource, key), &[], Bytes::new())
            .await
    }

    pub async fn fence(&self, resource: &str) -> Reply {
        self.request(Method::GET, &fence_path(resource), &[], Bytes::new())
            .await
    }

    pub async fn advance(&self, resource: &str, token: u64) -> Reply {
        let token = token.to_string();
        self.request(
            Method::POST,
            &advance_path(resource),
            &[("fencing-token", &token)],
            Bytes::new(),
        )
        .await
    }

    /// `POST /v1/sql/{resource}` with `body` (JSON `{"statements": [...]}`).
    pub async fn sql(&self, resource: &str, token: u64, body: serde_json::Value) -> Reply {
        let token = token.to_string();
        let path = Target::Sql {
            resource: resource_name(resource),
        }
        .path();
        self.request(
            Method::POST,
            &path,
            &[("fencing-token", &token)],
            body.to_string(),
        )
        .await
    }

    /// The resource's highest token as the store holds it: `GET /v1/fences/{resource}`
    /// reads the store, not the fence cache.
    pub async fn read_highest(&self, resource: &str) -> Option<u64> {
        let reply = self.fence(resource).await;
        assert_eq!(reply.status, 200, "{:?}", reply.body);
        reply.json()["highest"].as_u64()
    }

    /// The stored object `(value, token, version)` as `GET` answers it.
    pub async fn read_object(&self, resource: &str, key: &str) -> Option<(Vec<u8>, u64, u64)> {
        let reply = self.get(resource, key).await;
        match reply.status {
            404 => None,
            200 => {
                let number = |name: &str| -> u64 {
                    let text = reply.header(name).expect("GET answers carry the header");
                    text.trim_matches('"').parse().expect("a decimal header")
                };
                Some((reply.body.to_vec(), number("fencing-token"), number("etag")))
            }
            other => panic!("reading {resource}/{key}: status {other}: {:?}", reply.body),
        }
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> String {
        let reply = self
            .request(Method::GET, "/metrics", &[], Bytes::new())
            .await;
        assert_eq!(reply.status, 200);
        String::from_utf8(reply.body.to_vec()).expect("metrics are UTF-8")
    }

    /// The value of one series, e.g. `fencegate_stale_rejections_total{resource="orders"}`.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        metric_value(&self.metrics().await, series)
    }

    /// As [`Client::metric`], with a transport failure as an error.
    pub async fn try_metric(&self, series: &str) -> Result<Option<f64>, String> {
        let reply = self
            .try_request(Method::GET, "/metrics", &[], Bytes::new())
            .await?;
        Ok(metric_value(&String::from_utf8_lossy(&reply.body), series))
    }
}

/// `/v1/kv/{resource}/{key}` with the key percent-encoded, as proto prints it. A test
/// that sends a name the API refuses writes its path out itself.
pub fn kv_path(resource: &str, key: &str) -> String {
    Target::Object {
        resource: resource_name(resource),
        key: ObjectKey::new(key).unwrap_or_else(|e| panic!("key {key:?}: {e}")),
    }
    .path()
}

/// `/v1/fences/{resource}`, as proto prints it.
pub fn fence_path(resource: &str) -> String {
    Target::Fence {
        resource: resource_name(resource),
    }
    .path()
}

/// `/v1/fences/{resource}/advance`, as proto prints it.
pub fn advance_path(resource: &str) -> String {
    Target::FenceAdvance {
        resource: resource_name(resource),
    }
    .path()
}

fn resource_name(resource: &str) -> ResourceName {
    ResourceName::new(resource).unwrap_or_else(|e| panic!("resource {resource:?}: {e}"))
}

/// Finds `series` (name and labels exactly as exported) in a text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            line.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        })
}
