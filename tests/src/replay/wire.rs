//! Requests on raw connections: one connection per labelled request (the proxy's
//! rules apply per connection), and pipelined batches for floods.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::proxy::{parse_response, LABEL_HEADER};

/// How long any one exchange may take before it counts as a hang.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// A request to the gateway.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Request {
    /// A fenced `PUT` of `value`, labelled for the proxy.
    pub fn put(path: &str, token: u64, holder: &str, label: &str, value: &str) -> Request {
        Request {
            method: "PUT".into(),
            path: path.into(),
            headers: vec![
                ("fencing-token".into(), token.to_string()),
                ("fencing-holder".into(), holder.into()),
                (LABEL_HEADER.into(), label.into()),
            ],
            body: value.into(),
        }
    }

    pub fn get(path: &str) -> Request {
        Request {
            method: "GET".into(),
            path: path.into(),
            headers: Vec::new(),
            body: String::new(),
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Request {
        self.headers.push((name.into(), value.into()));
        self
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(
            format!(
                "{} {} HTTP/1.1\r\nhost: fencegate\r\ncontent-length: {}\r\n",
                self.method,
                self.path,
                self.body.len()
            )
            .as_bytes(),
        );
        for (name, value) in &self.headers {
            out.extend_from_slice(format!("{name}: {value}\r\n").as_bytes());
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(self.body.as_bytes());
    }
}

/// An answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reply {
    pub status: u16,
    /// `ETag` of reads: the object's version, quoted.
    pub etag: Option<String>,
    /// `Fencing-Token` of reads: the token that wrote the object.
    pub token: Option<String>,
    /// `Idempotency-Replayed: true`: the answer of an earlier attempt with the same key.
    #[serde(default)]
    pub replayed: bool,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }

    /// A number field of the JSON body.
    pub fn field(&self, name: &str) -> Option<u64> {
        self.json().get(name).and_then(Value::as_u64)
    }
}

/// Sends `requests` pipelined on one new connection and reads their answers in order.
/// `Err` if the connection fails or closes before every answer arrived.
pub async fn send(addr: SocketAddr, requests: &[Request]) -> Result<Vec<Reply>, String> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let mut bytes = Vec::new();
        for request in requests {
            request.encode(&mut bytes);
        }
        stream
            .write_all(&bytes)
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut replies = Vec::with_capacity(requests.len());
        let mut buffer = Vec::new();
        let mut chunk = vec![0u8; 64 * 1024];
        while replies.len() < requests.len() {
            if let Some(response) = parse_response(&buffer) {
                buffer.drain(..response.len);
                replies.push(Reply {
                    status: response.status,
                    etag: response.header("etag"),
                    token: response.header("fencing-token"),
                    replayed: response.header("idempotency-replayed").as_deref() == Some("true"),
                    body: String::from_utf8_lossy(&response.body).into_owned(),
                });
                continue;
            }
            match stream.read(&mut chunk).await {
                Ok(0) => return Err("the connection closed without an answer".to_owned()),
                Err(e) => return Err(format!("receive: {e}")),
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
            }
        }
        Ok(replies)
    };
    tokio::time::timeout(PATIENCE, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {PATIENCE:?}")))
}

/// The bytes `requests` take on the wire, to know when a proxy holds all of them.
pub fn encoded_len(requests: &[Request]) -> usize {
    let mut bytes = Vec::new();
    for request in requests {
        request.encode(&mut bytes);
    }
    bytes.len()
}

/// Sends one request on a new connection.
pub async fn send_one(addr: SocketAddr, request: &Request) -> Result<Reply, String> {
    let mut replies = send(addr, std::slice::from_ref(request)).await?;
    Ok(replies.remove(0))
}
