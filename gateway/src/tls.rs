//! TLS on both listeners — HTTP (`--tls-cert`, `--tls-key`, `--tls-client-ca`) and the
//! Postgres door (`--pg-tls-cert`, `--pg-tls-key`) — loaded and reloaded one way.
//!
//! # Handshakes
//!
//! Each listener offers its own protocols by ALPN ([`Listener::alpn`]): HTTP/2 and
//! HTTP/1.1 (`h2`, `http/1.1`) on the HTTP listener, which with a certificate speaks
//! TLS only; `postgresql` on the door, as direct TLS (`sslnegotiation=direct`) requires.
//! With a client CA (HTTP only), clients *may* present a certificate: one
//! the CA signed (for client use) is verified and its DNS names travel with each of the
//! connection's requests ([`ClientCertificate`]), where the auth file may know them as
//! an identity; any other certificate fails the handshake; no certificate is fine, and
//! the request then needs a bearer key like any other.
//!
//! # Reloading
//!
//! The certificate, key and client CA are checked every second ([`crate::reload`]);
//! when one changed and all of them load, a new configuration takes the place of the
//! old one for the handshakes that follow. Connections already open keep the
//! certificate they were made with. A set that does not load — half written, a key
//! that does not match the certificate — is logged as an error and the configuration in
//! force stays; the next change tries again. Write the files whole and rename them
//! into place, as for the auth file.

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ServerConnection, WebPkiClientVerifier};
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

use crate::auth::ClientCertificate;
use crate::config::{DoorArgs, TlsArgs};

/// ALPN protocol name of Postgres (PostgreSQL 17 on), which a client over direct TLS
/// requires.
pub(crate) const POSTGRES_ALPN: &[u8] = b"postgresql";

/// Which listener a TLS configuration serves: its flags and its ALPN protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listener {
    Http,
    /// The Postgres door.
    Postgres,
    /// The S3 door.
    S3,
}

impl Listener {
    /// The flags of the certificate, the key and the client CA (the door takes none:
    /// its clients log in as database roles).
    fn flags(self) -> [&'static str; 3] {
        match self {
            Listener::Http => ["--tls-cert", "--tls-key", "--tls-client-ca"],
            Listener::Postgres => ["--pg-tls-cert", "--pg-tls-key", "(no client CA)"],
            Listener::S3 => ["--s3-tls-cert", "--s3-tls-key", "(no client CA)"],
        }
    }

    /// ALPN protocols offered, in the server's order of preference. A Postgres client
    /// over direct TLS must be offered `postgresql`; one after an SSLRequest sends no
    /// ALPN and is served all the same.
    fn alpn(self) -> Vec<Vec<u8>> {
        let protocols: &[&[u8]] = match self {
            Listener::Http | Listener::S3 => &[b"h2", b"http/1.1"],
            Listener::Postgres => &[POSTGRES_ALPN],
        };
        protocols.iter().map(|protocol| protocol.to_vec()).collect()
    }
}

/// The files of a listener's TLS.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub listener: Listener,
    /// PEM certificate chain, the server's own certificate first (`--tls-cert`).
    pub cert: PathBuf,
    /// PEM private key of that certificate (`--tls-key`).
    pub key: PathBuf,
    /// PEM CA certificates that sign client certificates (`--tls-client-ca`).
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// The HTTP listener's files, if `--tls-cert` is given.
    pub fn http(args: &TlsArgs) -> Option<TlsFiles> {
        let (cert, key) = args.tls_cert.clone().zip(args.tls_key.clone())?;
        Some(TlsFiles {
            listener: Listener::Http,
            cert,
            key,
            client_ca: args.tls_client_ca.clone(),
        })
    }

    /// The Postgres door's files, if `--pg-tls-cert` is given.
    pub fn postgres(args: &DoorArgs) -> Option<TlsFiles> {
        let (cert, key) = args.pg_tls_cert.clone().zip(args.pg_tls_key.clone())?;
        Some(TlsFiles {
            listener: Listener::Postgres,
            cert,
            key,
            client_ca: None,
        })
    }
}

impl TlsFiles {
    /// The S3 door's files, if `--s3-tls-cert` is given.
    pub fn s3(args: &crate::config::S3Args) -> Option<TlsFiles> {
        let (cert, key) = args.s3_tls_cert.clone().zip(args.s3_tls_key.clone())?;
        Some(TlsFiles {
            listener: Listener::S3,
            cert,
            key,
            client_ca: None,
        })
    }
}

/// Why the TLS files do not make a configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{flag} {path}: could not read it: {source}")]
    Read {
        flag: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{flag} {path} holds no PEM {what}")]
    Missing {
        flag: &'static str,
        path: String,
        what: &'static str,
    },
    #[error("{flag} {path}: {source}")]
    Pem {
        flag: &'static str,
        path: String,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{key_flag} {key} is not the key of the certificate in {cert_flag} {cert}")]
    KeyMismatch {
        cert_flag: &'static str,
        cert: String,
        key_flag: &'static str,
        key: String,
    },
    #[error("{flag} {path}: {reason}")]
    ClientCa {
        flag: &'static str,
        path: String,
        reason: String,
    },
    #[error("{cert_flag} and {key_flag} do not make a TLS configuration: {source}")]
    Rustls {
        cert_flag: &'static str,
        key_flag: &'static str,
        source: rustls::Error,
    },
}

/// A listener's TLS configuration in force, and the files it comes from.
pub struct Tls {
    files: TlsFiles,
    /// Replaced whole on reload; each handshake takes the one in force when it starts.
    current: RwLock<TlsAcceptor>,
}

impl Tls {
    /// Loads the files; fails if they do not make a configuration.
    pub fn load(files: TlsFiles) -> Result<Tls, TlsError> {
        let acceptor = acceptor(&files)?;
        Ok(Tls {
            files,
            current: RwLock::new(acceptor),
        })
    }

    /// Loads `files`, if a listener has them, and keeps reloading them for as long as
    /// the process runs.
    pub fn start(files: Option<TlsFiles>) -> Result<Option<Arc<Tls>>, TlsError> {
        let Some(files) = files else {
            return Ok(None);
        };
        let tls = Arc::new(Tls::load(files)?);
        tokio::spawn(Arc::clone(&tls).watch());
        Ok(Some(tls))
    }

    /// The acceptor for a new connection's handshake.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether clients may present a certificate (`--tls-client-ca`).
    pub fn verifies_clients(&self) -> bool {
        self.files.client_ca.is_some()
    }

    /// Reloads the configuration whenever one of its files changes; runs until the
    /// process ends.
    pub async fn watch(self: Arc<Self>) {
        let mut paths = vec![self.files.cert.clone(), self.files.key.clone()];
        paths.extend(self.files.client_ca.clone());
        crate::reload::on_change(paths, || match acceptor(&self.files) {
            Ok(acceptor) => {
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = acceptor;
                tracing::info!(
                    listener = ?self.files.listener,
                    cert = %self.files.cert.display(),
                    client_ca = self.files.client_ca.as_ref().map(|path| tracing::field::display(path.display())),
                    "tls certificate reloaded"
                );
            }
            Err(error) => tracing::error!(
                listener = ?self.files.listener,
                %error,
                "tls certificate not reloaded; the certificate in force stays"
            ),
        })
        .await
    }
}

/// The DNS names of the certificate the client presented, if it presented one. Only
/// a verifier lets a client present one, so it was verified in the handshake.
pub fn client_certificate(connection: &ServerConnection) -> Option<ClientCertificate> {
    let end_entity = connection.peer_certificates()?.first()?;
    // The verifier parsed this certificate a moment ago; it parses here too.
    let parsed = webpki::EndEntityCert::try_from(end_entity).ok()?;
    Some(ClientCertificate::new(parsed.valid_dns_names()))
}

fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let [cert_flag, key_flag, client_ca_flag] = files.listener.flags();
    let rustls_error = |source| TlsError::Rustls {
        cert_flag,
        key_flag,
        source,
    };
    let chain = certificates(cert_flag, &files.cert)?;
    let key =
        PrivateKeyDer::from_pem_slice(&read(key_flag, &files.key)?).map_err(
            |source| match source {
                rustls::pki_types::pem::Error::NoItemsFound => TlsError::Missing {
                    flag: key_flag,
                    path: files.key.display().to_string(),
                    what: "private key",
                },
                source => TlsError::Pem {
                    flag: key_flag,
                    path: files.key.display().to_string(),
                    source,
                },
            },
        )?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(rustls_error)?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(path) => {
            let client_ca = |reason: String| TlsError::ClientCa {
                flag: client_ca_flag,
                path: path.display().to_string(),
                reason,
            };
            let mut roots = RootCertStore::empty();
            for ca in certificates(client_ca_flag, path)? {
                roots.add(ca).map_err(|e| client_ca(e.to_string()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| client_ca(e.to_string()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder
        .with_single_cert(chain, key)
        .map_err(|error| match error {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                TlsError::KeyMismatch {
                    cert_flag,
                    cert: files.cert.display().to_string(),
                    key_flag,
                    key: files.key.display().to_string(),
                }
            }
            error => rustls_error(error),
        })?;
    config.alpn_protocols = files.listener.alpn();
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The PEM certificates of `path`; at least one.
fn certificates(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let display = || path.display().to_string();
    let certificates = CertificateDer::pem_slice_iter(&read(flag, path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            flag,
            path: display(),
            source,
        })?;
    if certificates.is_empty() {
        return Err(TlsError::Missing {
            flag,
            path: display(),
            what: "certificate",
        });
    }
    Ok(certificates)
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        flag,
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of PEM files for one test, removed at the end.
    struct Dir(PathBuf);

    impl Dir {
        fn new() -> Dir {
            let dir = std::env::temp_dir().join(format!(
                "fg-tls-{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Dir(dir)
        }

        fn file(&self, name: &str, text: &str) -> PathBuf {
            let path = self.0.join(name);
            std::fs::write(&path, text).unwrap();
            path
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// A throwaway self-signed certificate for `localhost` (a CA too), valid until 2126,
    /// its key, and another key: made for these tests with openssl, used nowhere else.
    const CERT: &str = r"-----BEGIN CERTIFICATE-----
MIIBlTCCATugAwIBAgIUVMx43Z6RZ+2z9S7Hu/8iXc1O7TswCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJbG9jYWxob3N0MCAXDTI2MTIwMzA4MDgxN1oYDzIxMjYxMTA5
MDgwODE3WjAUMRIwEAYDVQQDDAlsb2NhbGhvc3QwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAAR5q5pL+apLDDHeZ1x637F/kp1yTYTDRjZgobR/SJwMN6+uoBaHaigx
l7if0vvXTV2dT94rOU0pzFtw5YiGuVV5o2kwZzAdBgNVHQ4EFgQU3qISf683UlOF
NasDo9JG8AcbSv4wHwYDVR0jBBgwFoAU3qISf683UlOFNasDo9JG8AcbSv4wDwYD
VR0TAQH/BAUwAwEB/zAUBgNVHREEDTALgglsb2NhbGhvc3QwCgYIKoZIzj0EAwID
SAAwRQIgJIhtJ1LbyemPR4xouvGbyt/wx+rzkpcy7ikSyIRoh1oCIQCcUffNMI6r
24N016jl5WJs3RZy/xQo1v+aWig04fDjUA==
-----END CERTIFICATE-----
";
    const KEY: &str = r"-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgBTTlnHSts/qbNc67
a65wJh+2wJ3u3eNa/WqyXW3hy0qhRANCAAR5q5pL+apLDDHeZ1x637F/kp1yTYTD
RjZgobR/SJwMN6+uoBaHaigxl7if0vvXTV2dT94rOU0pzFtw5YiGuVV5
-----END PRIVATE KEY-----
";
    const OTHER_KEY: &str = r"-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg5tpRe0ezONCa/6k9
msTdWtHjhvp7bwKyHKuLACsQcNahRANCAATFLHuUpRBQac0gxh0gl3mOPO6+eONQ
Tf4tCCx5elijElo9mVgZk/ZNNqB+3RMXpkOzDXu+9w/Q5TMQgFv6hE+i
-----END PRIVATE KEY-----
";

    /// Each file's problem is named, with its flag and path; a good set loads, with or
    /// without a client CA.
    #[test]
    fn file_errors_name_the_flag_the_path_and_the_problem() {
        let dir = Dir::new();
        let cert = dir.file("cert.pem", CERT);
        let key = dir.file("key.pem", KEY);
        let other_key = dir.file("other.pem", OTHER_KEY);
        let empty = dir.file("empty.pem", "");
        let garbage = dir.file(
            "garbage.pem",
            "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
        );
        let missing = dir.0.join("missing.pem");
        // cert, key, client CA; the flag, the path and the problem the error names.
        type Case<'a> = (
            &'a PathBuf,
            &'a PathBuf,
            Option<&'a PathBuf>,
            &'a str,
            &'a PathBuf,
            &'a str,
        );
        let cases: [Case; 9] = [
            (
                &missing,
                &key,
                None,
                "--tls-cert",
                &missing,
                "could not read it",
            ),
            (
                &empty,
                &key,
                None,
                "--tls-cert",
                &empty,
                "holds no PEM certificate",
            ),
            (&garbage, &key, None, "--tls-cert", &garbage, ""),
            (
                &key,
                &key,
                None,
                "--tls-cert",
                &key,
                "holds no PEM certificate",
            ),
            (
                &cert,
                &missing,
                None,
                "--tls-key",
                &missing,
                "could not read it",
            ),
            (
                &cert,
                &cert,
                None,
                "--tls-key",
                &cert,
                "holds no PEM private key",
            ),
            (
                &cert,
                &other_key,
                None,
                "--tls-key",
                &other_key,
                "is not the key of",
            ),
            (
                &cert,
                &key,
                Some(&empty),
                "--tls-client-ca",
                &empty,
                "holds no PEM certificate",
            ),
            (&cert, &key, Some(&garbage), "--tls-client-ca", &garbage, ""),
        ];
        for (cert, key, client_ca, flag, path, problem) in cases {
            let files = TlsFiles {
                listener: Listener::Http,
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.cloned(),
            };
            let error = Tls::load(files).err().expect("refused").to_string();
            assert!(error.starts_with(flag), "{error}");
            assert!(error.contains(problem), "{error}");
            assert!(error.contains(&path.display().to_string()), "{error}");
        }
        for client_ca in [None, Some(cert.clone())] {
            let tls = Tls::load(TlsFiles {
                listener: Listener::Http,
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
            })
            .unwrap();
            assert_eq!(tls.verifies_clients(), client_ca.is_some());
        }
    }
}
