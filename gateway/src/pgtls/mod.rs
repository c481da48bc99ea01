//! TLS to Postgres: the `sslmode`, `sslrootcert`, `sslcert` and `sslkey` of a database
//! URL, as libpq reads them, turned into a rustls client configuration that every
//! upstream connection uses — the store's pools, the `/v1/sql` pool, the administrative
//! commands and the Postgres door.
//!
//! tokio-postgres knows only `sslmode` `disable`, `prefer` and `require`, and refuses
//! parameters it does not know, so [`parse`] takes these four out of the URL (either
//! form: `postgres://…?sslmode=verify-full` or `host=… sslmode=verify-full`) and hands
//! the rest to `tokio_postgres::Config`.
//!
//! # Behavior
//!
//! What the server's certificate must show, by `sslmode`:
//!
//! | sslmode | TLS | without `sslrootcert` | with `sslrootcert` |
//! |---|---|---|---|
//! | `disable` | never | — | — |
//! | `allow`, `prefer` (default) | if the server offers it | nothing | a chain to the roots |
//! | `require` | always | nothing | a chain to the roots |
//! | `verify-ca` | always | refused at start | a chain to the roots |
//! | `verify-full` | always | refused at start | a chain, and the host name |
//!
//! Where this differs from libpq:
//!
//! - `allow` tries TLS first, as `prefer` (libpq tries without TLS first).
//! - Only an `sslrootcert` given in the URL is read; libpq also looks for
//!   `~/.postgresql/root.crt`. The same goes for `sslcert` and `sslkey`, which must come
//!   together.
//! - `sslrootcert=system` (the system's CA certificates) needs `verify-full`, and is the
//!   default `sslmode` with it, as in libpq 16.
//! - A connection over a Unix socket never uses TLS, whatever the `sslmode` (as libpq).
//!
//! The handshake's signatures are checked in every mode: "nothing" means any
//! certificate is accepted, not that the session is not encrypted.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::{verify_server_cert_signed_by_trust_anchor, WebPkiServerVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::{Host, SslMode as Negotiation};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_rustls::TlsConnector;

use url::{split, Params};

mod url;

/// ALPN protocol name of Postgres; servers from PostgreSQL 17 on check it when the
/// client offers one, and need it for `sslnegotiation=direct`.
const ALPN: &[u8] = b"postgresql";

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(text: &str) -> Option<SslMode> {
        Some(match text {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// How tokio-postgres (and the door) negotiate: never, if offered, or always.
    fn negotiation(self) -> Negotiation {
        match self {
            SslMode::Disable => Negotiation::Disable,
            SslMode::Allow | SslMode::Prefer => Negotiation::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Negotiation::Require,
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a database URL's TLS settings cannot be used. Messages hold parameter names and
/// file paths, never the URL (which may hold a password).
#[derive(Debug, thiserror::Error)]
pub enum PgUrlError {
    #[error("{0}")]
    Parse(String),
    #[error(
        "sslmode \"{0}\" is not one of disable, allow, prefer, require, verify-ca, verify-full"
    )]
    SslMode(String),
    #[error(
        "sslmode={0} needs sslrootcert: a PEM file of the CA certificates to trust, or \
         `system` for the system's"
    )]
    NoRootCert(SslMode),
    #[error("sslrootcert=system needs sslmode=verify-full, not {0}")]
    WeakWithSystem(SslMode),
    #[error("sslcert and sslkey go together: give both or neither")]
    HalfClientCert,
    #[error("could not read {param} {path}: {source}")]
    Read {
        param: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{param} {path}: {reason}")]
    Pem {
        param: &'static str,
        path: String,
        reason: String,
    },
    #[error("sslrootcert=system: no CA certificates found on this system")]
    NoSystemRoots,
    #[error("the host name {0:?} cannot be checked against a TLS certificate")]
    ServerName(String),
    #[error("the TLS settings do not make a client configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A database URL, parsed: what tokio-postgres connects with, and how TLS is done.
#[derive(Clone)]
pub struct PgUrl {
    /// Everything but the TLS parameters, with `ssl_mode` set from `sslmode`.
    pub config: tokio_postgres::Config,
    pub tls: UpstreamTls,
}

/// How connections to one database do TLS; cheap to clone.
#[derive(Clone)]
pub struct UpstreamTls {
    mode: SslMode,
    /// Whether the chain is checked (with `sslrootcert`).
    verifies_chain: bool,
    /// Connections go over a Unix socket, where TLS is never used.
    unix_socket: bool,
    make: MakeRustlsConnect,
    connector: TlsConnector,
}

impl UpstreamTls {
    pub fn mode(&self) -> SslMode {
        self.mode
    }

    /// The connector tokio-postgres connects (and cancels) with.
    pub fn make_tls_connect(&self) -> MakeRustlsConnect {
        self.make.clone()
    }

    /// The same configuration, for a stream of the gateway's own (the door's).
    pub(crate) fn connector(&self) -> &TlsConnector {
        &self.connector
    }

    /// Whether TLS is tried (`prefer`) or required, or never used.
    pub(crate) fn negotiation(&self) -> Negotiation {
        if self.unix_socket {
            Negotiation::Disable
        } else {
            self.mode.negotiation()
        }
    }

    /// How connections go, for the start-up log, e.g. `over TLS (sslmode=verify-full:
    /// certificate and host name verified)`. `used` is what a connection found, if one
    /// was made: with `prefer`, the server decides.
    pub fn describe(&self, used: Option<bool>) -> String {
        if self.unix_socket {
            return "over a Unix socket, without TLS".to_owned();
        }
        let mode = self.mode;
        let checked = match (mode, self.verifies_chain) {
            (SslMode::VerifyFull, _) => "certificate and host name verified",
            (_, true) => "certificate chain verified",
            (_, false) => "certificate not verified",
        };
        match (self.negotiation(), used) {
            (Negotiation::Disable, _) => format!("without TLS (sslmode={mode})"),
            (_, Some(false)) => format!("without TLS (sslmode={mode}: the server offers none)"),
            (Negotiation::Prefer, None) => {
                format!("over TLS if the server offers it (sslmode={mode}: {checked})")
            }
            _ => format!("over TLS (sslmode={mode}: {checked})"),
        }
    }
}

/// Parses a database URL (`postgres://` or key=value form) and loads the files its TLS
/// settings name.
pub fn parse(url: &str) -> Result<PgUrl, PgUrlError> {
    let (rest, params) = split(url)?;
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|e: tokio_postgres::Error| PgUrlError::Parse(with_causes(&e)))?;
    let settings = Settings::from_params(&params)?;
    // With a `hostaddr`, connections go over TCP whatever the host.
    let unix_socket = config.get_hostaddrs().is_empty()
        && !config.get_hosts().is_empty()
        && config
            .get_hosts()
            .iter()
            .all(|host| !matches!(host, Host::Tcp(_)));
    let client = client_config(&settings)?;
    let tls = UpstreamTls {
        mode: settings.mode,
        verifies_chain: settings.roots.is_some(),
        unix_socket,
        make: MakeRustlsConnect::new(client.clone()),
        connector: TlsConnector::from(Arc::new(client)),
    };
    config.ssl_mode(tls.negotiation());
    if let Some(attrs) = params.target_session_attrs.as_deref() {
        config.target_session_attrs(session_attrs(attrs)?);
    }
    Ok(PgUrl { config, tls })
}

/// `target_session_attrs`: `any`, or a server that takes writes — `read-write`, or
/// libpq's `primary`, which for a gateway that writes means the same. The others
/// (`read-only`, `standby`, `prefer-standby`) would send writes to a standby.
fn session_attrs(value: &str) -> Result<tokio_postgres::config::TargetSessionAttrs, PgUrlError> {
    use tokio_postgres::config::TargetSessionAttrs;
    match value {
        "any" => Ok(TargetSessionAttrs::Any),
        "read-write" | "primary" => Ok(TargetSessionAttrs::ReadWrite),
        other => Err(PgUrlError::Parse(format!(
            "target_session_attrs={other} is not supported: use read-write (or primary) to \
             reach the primary of several hosts, or any"
        ))),
    }
}

/// The name a server's certificate is checked against for `host`.
pub(crate) fn server_name(host: &str) -> Result<ServerName<'static>, PgUrlError> {
    ServerName::try_from(host.to_owned()).map_err(|_| PgUrlError::ServerName(host.to_owned()))
}

/// An error and its causes, as one line.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// Where the CA certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Roots {
    File(PathBuf),
    System,
}

/// The TLS settings of a URL, checked against each other; no file read yet.
#[derive(Debug, PartialEq, Eq)]
struct Settings {
    mode: SslMode,
    /// The CA certificates the chain is checked against, if it is.
    roots: Option<Roots>,
    /// The host name is checked too (`verify-full`).
    check_name: bool,
    /// `sslcert` and `sslkey`.
    client_cert: Option<(PathBuf, PathBuf)>,
}

impl Settings {
    fn from_params(params: &Params) -> Result<Settings, PgUrlError> {
        let roots = params.sslrootcert.as_deref().map(|root| match root {
            "system" => Roots::System,
            path => Roots::File(path.into()),
        });
        let mode = match params.sslmode.as_deref() {
            Some(text) => SslMode::parse(text).ok_or_else(|| PgUrlError::SslMode(text.into()))?,
            None if roots == Some(Roots::System) => SslMode::VerifyFull,
            None => SslMode::Prefer,
        };
        if roots == Some(Roots::System) && mode != SslMode::VerifyFull {
            return Err(PgUrlError::WeakWithSystem(mode));
        }
        let roots = match (mode, roots) {
            // TLS is never used: there is nothing to check.
            (SslMode::Disable, _) => None,
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(PgUrlError::NoRootCert(mode))
            }
            (_, roots) => roots,
        };
        let client_cert = match (&params.sslcert, &params.sslkey) {
            (Some(cert), Some(key)) => Some((cert.into(), key.into())),
            (None, None) => None,
            _ => return Err(PgUrlError::HalfClientCert),
        };
        Ok(Settings {
            mode,
            roots,
            check_name: mode == SslMode::VerifyFull,
            client_cert,
        })
    }
}

/// The rustls configuration for `settings`: its verifier, its client certificate, ALPN.
fn client_config(settings: &Settings) -> Result<ClientConfig, PgUrlError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()?;
    let roots = settings.roots.as_ref().map(load_roots).transpose()?;
    let builder = match roots {
        Some(roots) if settings.check_name => builder.with_webpki_verifier(
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?,
        ),
        roots => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainOnly {
                roots: roots.map(Arc::new),
                provider,
            })),
    };
    let mut config = match &settings.client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = load_certs("sslcert", cert)?;
            let key = PrivateKeyDer::from_pem_slice(&read("sslkey", key)?).map_err(|e| {
                PgUrlError::Pem {
                    param: "sslkey",
                    path: key.display().to_string(),
                    reason: e.to_string(),
                }
            })?;
            builder.with_client_auth_cert(chain, key)?
        }
    };
    config.alpn_protocols = vec![ALPN.to_vec()];
    Ok(config)
}

fn read(param: &'static str, path: &Path) -> Result<Vec<u8>, PgUrlError> {
    std::fs::read(path).map_err(|source| PgUrlError::Read {
        param,
        path: path.display().to_string(),
        source,
    })
}

/// The PEM certificates of `path`; at least one.
fn load_certs(
    param: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, PgUrlError> {
    let pem = |reason: String| PgUrlError::Pem {
        param,
        path: path.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(&read(param, path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("holds no PEM certificate".to_owned()));
    }
    Ok(certs)
}

fn load_roots(roots: &Roots) -> Result<RootCertStore, PgUrlError> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::File(path) => {
            for cert in load_certs("sslrootcert", path)? {
                store.add(cert).map_err(|e| PgUrlError::Pem {
                    param: "sslrootcert",
                    path: path.display().to_string(),
                    reason: e.to_string(),
                })?;
            }
        }
        Roots::System => {
            // Unreadable entries are skipped, as every TLS client does; none at all is
            // an error.
            let found = rustls_native_certs::load_native_certs();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                return Err(PgUrlError::NoSystemRoots);
            }
        }
    }
    Ok(store)
}

/// The verifier of every mode but `verify-full`: with roots, the chain must lead to
/// one of them (any host name); without, any certificate is accepted. The handshake
/// signatures are checked either way, so the session is with the holder of the
/// certificate's key.
#[derive(Debug)]
struct ChainOnly {
    roots: Option<Arc<RootCertStore>>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            let cert = ParsedCertificate::try_from(end_entity)?;
            verify_server_cert_signed_by_trust_anchor(
                &cert,
                roots,
                intermediates,
                now,
                self.provider.signature_verification_algorithms.all,
            )?;
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests;
