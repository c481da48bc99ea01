//! A client of the gateway over TLS, on tokio-rustls and hyper's connection API.
//!
//! Each request opens a connection of its own: it handshakes with the certificate the
//! gateway serves at that moment, and a refused handshake is that request's error.
//! HTTP/2 or HTTP/1.1 is what ALPN settles on; the reply says which.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

use crate::http::Reply;

/// The name the test certificates are for ([`crate::tls::Certs`]).
const SERVER_NAME: &str = "localhost";

/// A TLS client of one gateway address.
#[derive(Clone)]
pub struct TlsClient {
    addr: SocketAddr,
    roots: Arc<RootCertStore>,
    config: Arc<ClientConfig>,
}

impl TlsClient {
    /// A client that trusts the CA certificates of `ca` (PEM) only, presents no
    /// certificate, and offers `h2` and `http/1.1`.
    pub fn new(addr: SocketAddr, ca: &Path) -> TlsClient {
        let mut roots = RootCertStore::empty();
        for cert in pem_certificates(ca) {
            roots.add(cert).expect("the CA certificate is usable");
        }
        let roots = Arc::new(roots);
        let config = builder(&roots).with_no_client_auth();
        TlsClient {
            addr,
            roots,
            config: Arc::new(config),
        }
        .alpn(&["h2", "http/1.1"])
    }

    /// Presents the client certificate `cert` with its key `key` (PEM) when asked.
    pub fn with_certificate(self, cert: &Path, key: &Path) -> TlsClient {
        let key =
            PrivateKeyDer::from_pem_file(key).unwrap_or_else(|e| panic!("{}: {e}", key.display()));
        let mut config = builder(&self.roots)
            .with_client_auth_cert(pem_certificates(cert), key)
            .expect("the client certificate and key match");
        config.alpn_protocols = self.config.alpn_protocols.clone();
        TlsClient {
            config: Arc::new(config),
            ..self
        }
    }

    /// Offers only `protocols` by ALPN.
    pub fn alpn(mut self, protocols: &[&str]) -> TlsClient {
        Arc::make_mut(&mut self.config).alpn_protocols = protocols
            .iter()
            .map(|protocol| protocol.as_bytes().to_vec())
            .collect();
        self
    }

    /// Sends a request on a new connection: the reply and the HTTP version it came
    /// in, or the handshake's or the exchange's error.
    pub async fn try_request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<(Reply, Version), String> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from(SERVER_NAME).expect("a valid name");
        let tls = TlsConnector::from(Arc::clone(&self.config))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let mut request = Request::builder()
            .method(method)
            .uri(format!("https://{SERVER_NAME}:{}{path}", self.addr.port()));
        if !h2 {
            request = request.header("host", SERVER_NAME);
        }
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(body.into()))
            .map_err(|e| e.to_string())?;
        let io = TokioIo::new(tls);
        let response = if h2 {
            let (mut sender, connection) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .map_err(|e| format!("{e:?}"))?;
            tokio::spawn(connection);
            sender.send_request(request).await
        } else {
            let (mut sender, connection) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| format!("{e:?}"))?;
            tokio::spawn(connection);
            sender.send_request(request).await
        }
        .map_err(|e| format!("{e:?}"))?;
        let version = response.version();
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{e:?}"))?
            .to_bytes();
        let reply = Reply {
            status,
            headers,
            body,
        };
        Ok((reply, version))
    }

    /// Sends a request on a new connection; panics if it fails.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Reply {
        match self.try_request(method, path, headers, body).await {
            Ok((reply, _)) => reply,
            Err(error) => panic!("request to https://{}{path} failed: {error}", self.addr),
        }
    }
}

fn builder(
    roots: &Arc<RootCertStore>,
) -> rustls::ConfigBuilder<ClientConfig, rustls::client::WantsClientCert> {
    ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("the ring provider has the default versions")
        .with_root_certificates(Arc::clone(roots))
}

fn pem_certificates(path: &Path) -> Vec<CertificateDer<'static>> {
    CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}
