//! A throwaway certificate authority, server certificate and client certificates.
//!
//! [`Certs::generate`] runs the `openssl` command line into a fresh temp dir: a CA, and
//! a certificate for `localhost` and `127.0.0.1` signed by it, both P-256 and valid for
//! 30 days. Each call makes a new CA, so another call's [`Certs::ca`] is a wrong CA for
//! this one's certificate. [`Certs::client`] has the CA sign a client certificate for a
//! DNS name. The directory is removed when the value is dropped.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// Keys are P-256: quick to make, and served by rustls.
const KEY: &str = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes";

/// The extensions of the server certificate: what a verifying client checks (the
/// names, that it is no CA, that it is for a server).
const SERVER_EXTENSIONS: &str = "subjectAltName = DNS:localhost, IP:127.0.0.1
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
";

/// The extensions of a server certificate of [`Certs::server_for`], after its name.
const SERVER_BASICS: &str = "basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
";

/// The extensions of a client certificate: its name, no CA, for a client.
const CLIENT_EXTENSIONS: &str = "basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
";

/// PEM files of a CA and a server certificate it signed.
pub struct Certs {
    /// The CA's certificate: what a client trusts (`sslrootcert`).
    pub ca: PathBuf,
    /// The server's certificate (`--tls-cert`, `--pg-tls-cert`).
    pub cert: PathBuf,
    /// The server's private key, PKCS#8 (`--tls-key`, `--pg-tls-key`).
    pub key: PathBuf,
    dir: PathBuf,
}

impl Certs {
    /// Makes a new CA and server certificate; panics with openssl's output if it cannot.
    pub fn generate() -> Certs {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "fencegate-tls-{}-{}-{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let certs = Certs {
            ca: dir.join("ca.crt"),
            cert: dir.join("server.crt"),
            key: dir.join("server.key"),
            dir,
        };
        std::fs::write(certs.dir.join("server.ext"), SERVER_EXTENSIONS)
            .expect("the extensions file can be written");
        openssl(
            &certs.dir,
            &format!(
                "req -x509 -new -days 30 {KEY} -subj /CN=fencegate-test-CA \
                 -addext basicConstraints=critical,CA:TRUE \
                 -addext keyUsage=critical,keyCertSign,cRLSign -keyout ca.key -out ca.crt"
            ),
        );
        certs.sign("server", "localhost", "server.ext");
        certs
    }

    /// A client certificate for the DNS name `name` (subjectAltName), signed by this CA.
    pub fn client(&self, name: &str) -> ClientCert {
        let ext = format!("client-{name}.ext");
        std::fs::write(
            self.dir.join(&ext),
            format!("subjectAltName = DNS:{name}\n{CLIENT_EXTENSIONS}"),
        )
        .expect("the extensions file can be written");
        let stem = format!("client-{name}");
        self.sign(&stem, name, &ext);
        ClientCert {
            cert: self.dir.join(format!("{stem}.crt")),
            key: self.dir.join(format!("{stem}.key")),
        }
    }

    /// Another server certificate, signed by this CA, for the one name `san` (e.g.
    /// `DNS:localhost` or `IP:127.0.0.1`): for a server that must not pass for another.
    pub fn server_for(&self, san: &str) -> ClientCert {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let stem = format!("server-{}", NEXT.fetch_add(1, Ordering::Relaxed));
        let ext = format!("{stem}.ext");
        std::fs::write(
            self.dir.join(&ext),
            format!("subjectAltName = {san}\n{SERVER_BASICS}"),
        )
        .expect("the extensions file can be written");
        self.sign(&stem, "server", &ext);
        ClientCert {
            cert: self.dir.join(format!("{stem}.crt")),
            key: self.dir.join(format!("{stem}.key")),
        }
    }

    /// Makes `<stem>.key` and `<stem>.crt` for `/CN=<common_name>` with the extensions
    /// of file `ext`, signed by the CA.
    fn sign(&self, stem: &str, common_name: &str, ext: &str) {
        openssl(
            &self.dir,
            &format!("req -new {KEY} -subj /CN={common_name} -keyout {stem}.key -out {stem}.csr"),
        );
        // A random serial: certificates of one issuer must not share one.
        let serial = rand::random::<u64>() >> 1 | 1;
        openssl(
            &self.dir,
            &format!(
                "x509 -req -days 30 -in {stem}.csr -CA ca.crt -CAkey ca.key \
                 -set_serial {serial} -extfile {ext} -out {stem}.crt"
            ),
        );
    }
}

impl Drop for Certs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// PEM files of a certificate (a client's, or another server's) and its private key
/// (PKCS#8), in the directory of the [`Certs`] whose CA signed it (removed with it).
pub struct ClientCert {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Runs `openssl` in `dir` with `args` (split at whitespace); panics with its output if
/// it fails or is missing.
fn openssl(dir: &Path, args: &str) {
    let output = Command::new("openssl")
        .args(args.split_whitespace())
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run `openssl` (the tests make their certificates with it; install the openssl package): {e}")
        });
    assert!(
        output.status.success(),
        "openssl {args} failed with {}:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
}
