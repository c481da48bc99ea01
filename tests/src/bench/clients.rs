//! The clients the load generator drives: one per concurrent writer.
//!
//! - [`Writer::Direct`]: the gateway's own fenced-write statement ([`statements::FENCED_PUT`]),
//!   prepared and run through a deadpool pool configured as the gateway configures its
//!   own (same size, same recycling), so that the baseline is what a careful user would
//!   write by hand.
//! - [`Writer::Http1`]: one HTTP/1.1 keep-alive connection per writer.
//! - [`Writer::H2`]: one stream at a time on an HTTP/2 connection shared by all writers.
//!
//! Every call reports whether the answer was the expected one; a transport failure is
//! counted as an unexpected answer and the HTTP/1.1 writer reconnects.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use deadpool_postgres::Pool;
use fencegate_gateway::store::postgres::statements;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpStream;

/// One write, as the workload describes it.
pub struct Call<'a> {
    pub resource: &'a str,
    pub key: &'a str,
    pub token: u64,
    pub value: &'a Bytes,
    /// The statuses that count as the expected answer (ignored by the direct writer,
    /// which expects the statement to return its row).
    pub expect: &'a [StatusCode],
}

/// A connection pool configured as the gateway's own.
pub fn direct_pool(url: &str, size: usize) -> Result<Pool, String> {
    let url = fencegate_gateway::pgtls::parse(url).map_err(|e| format!("{e}"))?;
    Ok(fencegate_gateway::store::postgres::new_pool(url.config, &url.tls, size).into_inner())
}

pub enum Writer {
    Direct(Pool),
    Http1 {
        addr: SocketAddr,
        sender: Option<http1::SendRequest<Full<Bytes>>>,
    },
    H2 {
        /// `http://host:port`, for the absolute URIs HTTP/2 requests carry.
        base: Arc<str>,
        sender: http2::SendRequest<Full<Bytes>>,
    },
}

impl Writer {
    pub async fn http1(addr: SocketAddr) -> Result<Writer, String> {
        Ok(Writer::Http1 {
            addr,
            sender: Some(connect_http1(addr).await?),
        })
    }

    /// `count` writers sharing one new HTTP/2 connection.
    pub async fn h2(addr: SocketAddr, count: usize) -> Result<Vec<Writer>, String> {
        let stream = connect_tcp(addr).await?;
        let (sender, connection) = http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .map_err(|e| format!("h2 handshake: {e}"))?;
        tokio::spawn(connection);
        let base: Arc<str> = format!("http://{addr}").into();
        Ok((0..count)
            .map(|_| Writer::H2 {
                base: Arc::clone(&base),
                sender: sender.clone(),
            })
            .collect())
    }

    /// Performs one write; `Ok(true)` if the answer was the expected one.
    pub async fn call(&mut self, call: &Call<'_>) -> Result<bool, String> {
        match self {
            Writer::Direct(pool) => {
                let client = pool.get().await.map_err(|e| e.to_string())?;
                let statement = client
                    .prepare_cached(statements::FENCED_PUT)
                    .await
                    .map_err(|e| e.to_string())?;
                let token = i64::try_from(call.token).map_err(|e| e.to_string())?;
                let row = client
                    .query_opt(
                        &statement,
                        &[&call.resource, &token, &call.key, &call.value.as_ref()],
                    )
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(row.is_some())
            }
            Writer::Http1 { addr, sender } => {
                let mut live = match sender.take() {
                    Some(live) if !live.is_closed() => live,
                    _ => connect_http1(*addr).await?,
                };
                let result = async {
                    live.ready().await.map_err(|e| e.to_string())?;
                    let request = put(&kv_path(call.resource, call.key), call)?;
                    let response = live
                        .send_request(request)
                        .await
                        .map_err(|e| e.to_string())?;
                    finish(response, call.expect).await
                }
                .await;
                if result.is_ok() {
                    *sender = Some(live);
                }
                result
            }
            Writer::H2 { base, sender } => {
                sender.ready().await.map_err(|e| e.to_string())?;
                let uri = format!("{base}{}", kv_path(call.resource, call.key));
                let response = sender
                    .send_request(put(&uri, call)?)
                    .await
                    .map_err(|e| e.to_string())?;
                finish(response, call.expect).await
            }
        }
    }
}

/// `POST /v1/fences/{resource}/advance` on an HTTP/2 connection: fills the fence cache
/// without writing objects.
pub async fn advance(writer: &mut Writer, resource: &str, token: u64) -> Result<(), String> {
    let Writer::H2 { base, sender } = writer else {
        return Err("advance is sent over HTTP/2 only".into());
    };
    sender.ready().await.map_err(|e| e.to_string())?;
    let request = Request::builder()
        .method(Method::POST)
        .uri(format!(
            "{base}{}",
            fencegate_tests::http::advance_path(resource)
        ))
        .header("fencing-token", token)
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    match finish(response, &[StatusCode::OK, StatusCode::NO_CONTENT]).await? {
        true => Ok(()),
        false => Err(format!("advance of {resource} to {token} was refused")),
    }
}

use fencegate_tests::http::kv_path;

fn put(uri: &str, call: &Call<'_>) -> Result<Request<Full<Bytes>>, String> {
    Request::builder()
        .method(Method::PUT)
        .uri(uri)
        .header(http::header::HOST, "127.0.0.1")
        .header("fencing-token", call.token)
        .body(Full::new(call.value.clone()))
        .map_err(|e| e.to_string())
}

/// Reads the whole answer (as a client must, to reuse the connection).
async fn finish(
    response: http::Response<hyper::body::Incoming>,
    expect: &[StatusCode],
) -> Result<bool, String> {
    let status = response.status();
    response
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?;
    Ok(expect.contains(&status))
}

async fn connect_tcp(addr: SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    // The gateway does the same on its side: small exchanges must not wait for Nagle.
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    Ok(stream)
}

async fn connect_http1(addr: SocketAddr) -> Result<http1::SendRequest<Full<Bytes>>, String> {
    let stream = connect_tcp(addr).await?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("http/1.1 handshake: {e}"))?;
    tokio::spawn(connection);
    Ok(sender)
}
