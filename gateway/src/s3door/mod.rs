//! The S3 door: the gateway speaks the S3 API in front of an S3-compatible upstream,
//! so that a writer keeps its S3 SDK and changes only the endpoint (docs/s3.md).
//!
//! - [`keys`]: the access keys clients sign with, and their identities;
//! - [`layout`]: resources of keys, write-once physical keys and the mapping rows;
//! - [`upstream`]: the signed client of the upstream;
//! - [`service`]: the S3 operations.
//!
//! The S3 protocol — routing, XML, error documents, and the verification of SigV4
//! signatures (header, presigned, and aws-chunked streaming uploads) — is `s3s`'s.

mod batch;
pub mod collector;
pub mod keys;
pub mod layout;
mod listing;
mod multipart;
pub mod service;
pub mod upstream;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::config::{Listen, S3Args};
use crate::coordinator::Coordinator;
use keys::S3Keys;
use layout::Resources;
use service::{Peer, S3Door};
use upstream::{Upstream, UpstreamOptions};

/// Concurrent conditional PUTs of the start-up check.
const CONFORMANCE_RACERS: usize = 8;

/// Why the S3 door did not start.
#[derive(Debug, thiserror::Error)]
#[error("the S3 door: {0}")]
pub struct S3StartError(pub String);

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct UpstreamCredentials {
    access_key_id: String,
    secret_access_key: String,
}

/// The upstream's credentials: the file, or the environment.
fn upstream_credentials(args: &S3Args) -> Result<UpstreamCredentials, S3StartError> {
    match &args.s3_upstream_credentials_file {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| {
                S3StartError(format!(
                    "could not read --s3-upstream-credentials-file {}: {e}",
                    path.display()
                ))
            })?;
            toml::from_str(&text).map_err(|e| {
                S3StartError(format!(
                    "--s3-upstream-credentials-file {}: {e}",
                    path.display()
                ))
            })
        }
        None => {
            let var = |name: &str| {
                std::env::var(name).map_err(|_| {
                    S3StartError(format!(
                        "no upstream credentials: give --s3-upstream-credentials-file, or set \
                         AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY ({name} is not set)"
                    ))
                })
            };
            Ok(UpstreamCredentials {
                access_key_id: var("AWS_ACCESS_KEY_ID")?,
                secret_access_key: var("AWS_SECRET_ACCESS_KEY")?,
            })
        }
    }
}

/// Binds the door's listener and builds the door, or `None` with `--s3-listen off`.
/// Unless told not to, checks first that the upstream's conditional writes are atomic
/// in every bucket the door serves.
pub async fn open(
    args: &S3Args,
    coordinator: &Arc<Coordinator>,
) -> Result<Option<S3Listener>, S3StartError> {
    let Listen::On(addr) = args.s3_listen else {
        return Ok(None);
    };
    let need = |what: &str| S3StartError(format!("--s3-listen needs {what}"));
    let endpoint = args
        .s3_upstream
        .as_deref()
        .ok_or_else(|| need("--s3-upstream"))?;
    if !endpoint.starts_with("http://") || endpoint.parse::<http::Uri>().is_err() {
        return Err(S3StartError(format!(
            "--s3-upstream {endpoint:?} must be an http:// URL such as http://127.0.0.1:7480"
        )));
    }
    let keys_path = args
        .s3_keys_file
        .as_deref()
        .ok_or_else(|| need("--s3-keys-file"))?;
    if args.s3_buckets.is_empty() {
        return Err(need("--s3-bucket (the buckets it serves)"));
    }
    for bucket in &args.s3_buckets {
        layout::check_bucket(bucket).map_err(|e| S3StartError(format!("--s3-bucket {e}")))?;
    }
    if args.s3_tls_cert.is_none() && !args.s3_insecure_cleartext && !addr.ip().is_loopback() {
        return Err(S3StartError(format!(
            "--s3-listen {addr} is reachable from other hosts, and without --s3-tls-cert \
             object bytes would cross the network in cleartext: give --s3-tls-cert and \
             --s3-tls-key, listen on a loopback address, or pass --s3-insecure-cleartext"
        )));
    }
    if args.s3_gc_interval.is_zero() {
        return Err(S3StartError("--s3-gc-interval must be above zero".into()));
    }
    let keys = Arc::new(S3Keys::load(keys_path).map_err(S3StartError)?);
    if let Some(auth) = coordinator.authenticator() {
        let identities = auth.identities();
        if let Some(missing) = keys
            .identities()
            .find(|name| identities.by_name(name).is_none())
        {
            return Err(S3StartError(format!(
                "--s3-keys-file names identity {missing:?}, which --auth-file does not list"
            )));
        }
    }
    let resources = Resources::new(args.s3_resources.clone()).map_err(S3StartError)?;
    let credentials = upstream_credentials(args)?;
    let upstream = Upstream::new(UpstreamOptions {
        endpoint: endpoint.trim_end_matches('/').to_owned(),
        access_key_id: credentials.access_key_id,
        secret_access_key: credentials.secret_access_key,
        region: args.s3_region.clone(),
        timeout: args.s3_upstream_timeout,
    });
    if !args.s3_skip_conformance_check {
        for bucket in &args.s3_buckets {
            upstream
                .check_conditional_writes(bucket, CONFORMANCE_RACERS)
                .await
                .map_err(|e| {
                    S3StartError(format!(
                        "{e} (checked at start; --s3-skip-conformance-check skips the check)"
                    ))
                })?;
        }
    }
    let tls = crate::tls::Tls::start(crate::tls::TlsFiles::s3(args))
        .map_err(|e| S3StartError(e.to_string()))?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| S3StartError(format!("could not listen on {addr} (--s3-listen): {e}")))?;
    let door = S3Door {
        coordinator: Arc::clone(coordinator),
        upstream,
        resources,
        keys: Arc::clone(&keys),
        buckets: args.s3_buckets.iter().cloned().collect(),
        max_object: args.s3_max_object,
    };
    let mut places: Vec<(String, fencegate_proto::ResourceName)> = args
        .s3_resources
        .iter()
        .map(|rule| (rule.bucket.clone(), rule.resource.clone()))
        .chain(args.s3_buckets.iter().filter_map(|bucket| {
            let resource = fencegate_proto::ResourceName::new(bucket.as_str()).ok()?;
            Some((bucket.clone(), resource))
        }))
        .collect();
    places.sort();
    places.dedup();
    let collector = collector::Collector {
        coordinator: Arc::clone(coordinator),
        upstream: door.upstream.clone(),
        places,
        options: collector::CollectorOptions {
            interval: args.s3_gc_interval,
            grace: args.s3_gc_grace,
            upload_max_age: args.s3_upload_max_age,
        },
    };
    tokio::spawn(collector.run(coordinator.shutdown().clone()));
    let mut builder = s3s::service::S3ServiceBuilder::new(door);
    builder.set_auth(keys::KeyLookup(keys));
    Ok(Some(S3Listener {
        listener,
        service: Arc::new(builder.build()),
        coordinator: Arc::clone(coordinator),
        tls,
    }))
}

/// The door's listener, its service and its TLS, if it has a certificate.
pub struct S3Listener {
    pub listener: TcpListener,
    service: Arc<s3s::service::S3Service>,
    coordinator: Arc<Coordinator>,
    tls: Option<Arc<crate::tls::Tls>>,
}

/// Longest a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves the door's connections — over TLS only, with a certificate — until
/// `shutdown`, then gives those still open `grace` to finish. Each handshake runs in
/// its connection's own task, within `HANDSHAKE_TIMEOUT`.
pub async fn serve(door: S3Listener, shutdown: CancellationToken, grace: Duration) {
    let S3Listener {
        listener,
        service,
        coordinator,
        tls,
    } = door;
    let builder = auto::Builder::new(TokioExecutor::new());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    while let Some((stream, peer)) = crate::accept::next(&listener, &shutdown, "s3").await {
        let (service, coordinator) = (Arc::clone(&service), Arc::clone(&coordinator));
        let handler =
            hyper::service::service_fn(move |mut request: http::Request<hyper::body::Incoming>| {
                let (service, coordinator) = (Arc::clone(&service), Arc::clone(&coordinator));
                request.extensions_mut().insert(Peer(peer.ip()));
                async move {
                    let (started, method) = (std::time::Instant::now(), request.method().clone());
                    let answer = service.call(request.map(s3s::Body::from)).await;
                    let status = answer
                        .as_ref()
                        .map_or(500, |answer| answer.status().as_u16());
                    coordinator
                        .metrics()
                        .s3_answered(method.as_str(), status, started.elapsed());
                    answer
                }
            });
        let (builder, watcher, tls) = (builder.clone(), graceful.watcher(), tls.clone());
        tokio::spawn(async move {
            let served = match tls {
                None => {
                    let connection = builder.serve_connection(TokioIo::new(stream), handler);
                    watcher.watch(connection.into_owned()).await
                }
                Some(tls) => {
                    let handshake = tls.acceptor().accept(stream);
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
                        Ok(Ok(stream)) => {
                            let connection =
                                builder.serve_connection(TokioIo::new(stream), handler);
                            watcher.watch(connection.into_owned()).await
                        }
                        Ok(Err(error)) => {
                            tracing::debug!(%peer, %error, "S3 door: tls handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "S3 door: tls handshake not finished in time");
                            return;
                        }
                    }
                }
            };
            if let Err(error) = served {
                tracing::debug!(%error, "S3 door connection ended with an error");
            }
        });
    }
    crate::accept::drain(grace, graceful.shutdown(), "S3 door connections").await;
}
