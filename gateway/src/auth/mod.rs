//! Who may do what: identities, their keys, and their grants (`--auth-file`).
//!
//! Every request but `/healthz` names its identity with `Authorization: Bearer <key>`,
//! or — over TLS with `--tls-client-ca` — with a client certificate whose DNS name an
//! identity lists under `certificates`. The gateway stores no key, only its SHA-256
//! (keys are 256 random bits, so a fast hash is as strong as a slow one); `fencegate
//! key new` prints a key and the line to store. An identity's grants pair resource
//! patterns with actions; a request is allowed when one grant covers its resource and
//! its action.
//!
//! # Which credential counts
//!
//! A request with an `Authorization` header is decided by it alone: a known key
//! authenticates, anything else is refused, whatever certificate the connection
//! presented — a client whose key was retired hears so instead of quietly becoming
//! another identity. A request without one is authenticated by its connection's
//! verified client certificate, when one of the certificate's DNS names is listed by
//! exactly one identity. A name may be listed by one identity only (a file listing it
//! twice is refused), but one certificate may bear names of two identities: it is then
//! refused, rather than given either identity's grants.
//!
//! The file is read at start and again whenever it changes (checked every second):
//! keys are added and retired without a restart. A file that no longer parses is
//! refused with an error in the log, and the identities in force stay.
//!
//! ```toml
//! [[identity]]
//! name = "sweeper-node-a"
//! keys = ["sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"]
//! grants = [
//!   { resources = ["sweeper"], actions = ["read", "write", "advance"] },
//!   { resources = ["reports.*"], actions = ["read"] },
//! ]
//!
//! [[identity]]
//! name = "prometheus"
//! keys = ["sha256:..."]
//! grants = [{ resources = [], actions = ["metrics"] }]
//!
//! [[identity]]
//! name = "sweeper-node-b"
//! certificates = ["node-b.sweeper.internal"]
//! grants = [{ resources = ["sweeper"], actions = ["read", "write", "advance"] }]
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use base64::Engine;
use fencegate_proto::ResourceName;
use serde::Deserialize;

/// What a request does, for authorization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    /// Read objects and fences.
    Read,
    /// Put and delete objects.
    Write,
    /// Raise a fence without writing (`/v1/fences/{resource}/advance`).
    Advance,
    /// Fenced SQL transactions (`/v1/sql/{resource}`).
    Sql,
    /// Leases hosted by the gateway.
    Lease,
    /// `/metrics` and `/readyz`.
    Metrics,
    /// Administration: recovery of fences.
    Admin,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::Write => "write",
            Action::Advance => "advance",
            Action::Sql => "sql",
            Action::Lease => "lease",
            Action::Metrics => "metrics",
            Action::Admin => "admin",
        }
    }

    /// Whether the action concerns one resource (and grants must name it).
    fn on_resource(self) -> bool {
        !matches!(self, Action::Metrics | Action::Admin)
    }
}

/// A resource pattern of a grant: a name, a prefix ending in `*`, or `*` alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    Exact(String),
    Prefix(String),
}

impl Pattern {
    pub fn parse(text: &str) -> Result<Pattern, String> {
        match text.strip_suffix('*') {
            Some(prefix) if !prefix.contains('*') => Ok(Pattern::Prefix(prefix.to_owned())),
            None if !text.is_empty() && ResourceName::new(text).is_ok() => {
                Ok(Pattern::Exact(text.to_owned()))
            }
            _ => Err(format!(
                "resource pattern {text:?}: a resource name, or a prefix followed by one `*`"
            )),
        }
    }

    /// The name or prefix, and whether it is a prefix.
    pub fn parts(&self) -> (&str, bool) {
        match self {
            Pattern::Exact(name) => (name, false),
            Pattern::Prefix(prefix) => (prefix, true),
        }
    }

    pub fn matches(&self, resource: &str) -> bool {
        match self {
            Pattern::Exact(name) => name == resource,
            Pattern::Prefix(prefix) => resource.starts_with(prefix.as_str()),
        }
    }
}

/// One grant: these actions on resources matching these patterns.
#[derive(Debug, Clone)]
struct Grant {
    resources: Vec<Pattern>,
    actions: Vec<Action>,
}

/// An authenticated caller.
#[derive(Debug)]
pub struct Identity {
    pub name: String,
    grants: Vec<Grant>,
}

impl Identity {
    /// Whether this identity may do `action` (on `resource`, for actions on one).
    pub fn may(&self, action: Action, resource: Option<&ResourceName>) -> bool {
        self.grants.iter().any(|grant| {
            grant.actions.contains(&action)
                && (!action.on_resource()
                    || resource.is_some_and(|resource| {
                        grant
                            .resources
                            .iter()
                            .any(|pattern| pattern.matches(resource.as_str()))
                    }))
        })
    }
}

/// Why a request was not let through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// No `Authorization: Bearer` key, or one that no identity holds.
    Unauthenticated,
    /// The identity holds no grant for this action (on this resource).
    Forbidden {
        identity: String,
        action: Action,
        resource: Option<ResourceName>,
    },
}

/// The DNS names (subjectAltName) of the client certificate a connection presented.
///
/// Made only by the TLS layer, from a certificate that `--tls-client-ca` verified in
/// the handshake; carried to each of the connection's requests as an extension.
#[derive(Debug, Clone)]
pub struct ClientCertificate {
    /// Lowercase: DNS names compare without regard to case.
    dns_names: Arc<[String]>,
}

impl ClientCertificate {
    pub(crate) fn new<'a>(dns_names: impl IntoIterator<Item = &'a str>) -> ClientCertificate {
        ClientCertificate {
            dns_names: dns_names.into_iter().map(str::to_ascii_lowercase).collect(),
        }
    }

    /// The certificate's DNS names, lowercase.
    pub fn dns_names(&self) -> &[String] {
        &self.dns_names
    }
}

/// The identities in force, by the hash of each of their keys and by the certificate
/// names they list.
#[derive(Debug, Default)]
pub struct Identities {
    by_key: HashMap<[u8; 32], Arc<Identity>>,
    /// Lowercase DNS names; each listed by one identity only.
    by_certificate: HashMap<String, Arc<Identity>>,
    by_name: HashMap<String, Arc<Identity>>,
    count: usize,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    identity: Vec<IdentityEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IdentityEntry {
    name: String,
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default)]
    certificates: Vec<String>,
    #[serde(default)]
    grants: Vec<GrantEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GrantEntry {
    #[serde(default)]
    resources: Vec<String>,
    actions: Vec<Action>,
}

/// The prefix of a stored key hash.
const HASH_PREFIX: &str = "sha256:";

/// The prefix of every key `fencegate key new` makes, so that keys are recognisable in
/// a leaked file or a secret scanner.
const KEY_PREFIX: &str = "fgk_";

impl Identities {
    /// Parses an auth file's text.
    pub fn parse(text: &str) -> Result<Identities, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut by_key = HashMap::new();
        let mut by_certificate: HashMap<String, Arc<Identity>> = HashMap::new();
        let mut by_name = HashMap::new();
        for entry in &file.identity {
            if entry.name.is_empty() || by_name.contains_key(&entry.name) {
                return Err(format!(
                    "identity name {:?} is empty or used twice",
                    entry.name
                ));
            }
            let grants = entry
                .grants
                .iter()
                .map(|grant| {
                    Ok(Grant {
                        resources: grant
                            .resources
                            .iter()
                            .map(|pattern| Pattern::parse(pattern))
                            .collect::<Result<_, String>>()?,
                        actions: grant.actions.clone(),
                    })
                })
                .collect::<Result<Vec<_>, String>>()
                .map_err(|e| format!("identity {:?}: {e}", entry.name))?;
            let identity = Arc::new(Identity {
                name: entry.name.clone(),
                grants,
            });
            by_name.insert(entry.name.clone(), Arc::clone(&identity));
            for key in &entry.keys {
                let hash =
                    parse_hash(key).map_err(|e| format!("identity {:?}: {e}", entry.name))?;
                if by_key.insert(hash, Arc::clone(&identity)).is_some() {
                    return Err(format!(
                        "identity {:?}: a key hash is listed twice in the file",
                        entry.name
                    ));
                }
            }
            for name in &entry.certificates {
                let name = parse_certificate_name(name)
                    .map_err(|e| format!("identity {:?}: {e}", entry.name))?;
                if let Some(other) = by_certificate.insert(name.clone(), Arc::clone(&identity)) {
                    return Err(format!(
                        "certificate name {name:?} is listed by identity {:?} and by {:?}: \
                         a name may authenticate one identity only",
                        other.name, entry.name
                    ));
                }
            }
        }
        Ok(Identities {
            by_key,
            by_certificate,
            by_name,
            count: file.identity.len(),
        })
    }

    /// The identity named `name` (the S3 door's keys name their identity).
    pub fn by_name(&self, name: &str) -> Option<Arc<Identity>> {
        self.by_name.get(name).cloned()
    }

    /// The identity holding `key`.
    pub fn identify(&self, key: &str) -> Option<Arc<Identity>> {
        self.by_key.get(&hash(key)).cloned()
    }

    /// The identity whose listed name the certificate bears; `None` if it bears none,
    /// or names of more than one identity.
    pub fn identify_certificate(&self, certificate: &ClientCertificate) -> Option<Arc<Identity>> {
        let mut found: Option<&Arc<Identity>> = None;
        for name in certificate.dns_names() {
            if let Some(identity) = self.by_certificate.get(name) {
                match found {
                    Some(earlier) if !Arc::ptr_eq(earlier, identity) => return None,
                    _ => found = Some(identity),
                }
            }
        }
        found.cloned()
    }

    /// Whether any identity lists certificate names.
    pub fn lists_certificates(&self) -> bool {
        !self.by_certificate.is_empty()
    }

    /// How many identities there are.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

fn parse_hash(text: &str) -> Result<[u8; 32], String> {
    let hex = text.strip_prefix(HASH_PREFIX).ok_or_else(|| {
        format!("key {text:?} is not `sha256:<64 hex digits>` (store hashes, not keys)")
    })?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("key hash {text:?} is not 64 hex digits"));
    }
    let mut hash = [0u8; 32];
    for (i, byte) in hash.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex");
    }
    Ok(hash)
}

/// A name of `certificates`: a DNS name as certificates bear it, lowercase.
fn parse_certificate_name(text: &str) -> Result<String, String> {
    let valid = !text.contains('*')
        && text.parse::<std::net::IpAddr>().is_err()
        && rustls::pki_types::DnsName::try_from(text).is_ok();
    if !valid {
        return Err(format!(
            "certificate name {text:?} is not a DNS name such as node-a.internal \
             (wildcards and IP addresses are not matched)"
        ));
    }
    Ok(text.to_ascii_lowercase())
}

fn hash(key: &str) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, key.as_bytes());
    digest.as_ref().try_into().expect("SHA-256 is 32 bytes")
}

/// The stored form of `key`: `sha256:<hex>`.
pub fn stored_hash(key: &str) -> String {
    let hex: String = hash(key).iter().map(|b| format!("{b:02x}")).collect();
    format!("{HASH_PREFIX}{hex}")
}

/// A new random key: `fgk_` and 256 random bits in URL-safe base64.
pub fn new_key() -> String {
    let bytes: [u8; 32] = rand::random();
    format!(
        "{KEY_PREFIX}{}",
        base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
    )
}

/// The identities of `--auth-file`, reloaded when the file changes.
pub struct Authenticator {
    path: PathBuf,
    current: RwLock<Arc<Identities>>,
}

/// Why the auth file could not be loaded at start.
#[derive(Debug, thiserror::Error)]
#[error("--auth-file {path}: {reason}")]
pub struct AuthFileError {
    path: String,
    reason: String,
}

impl Authenticator {
    /// Loads `path`; fails if it cannot be read or parsed.
    pub fn load(path: &Path) -> Result<Authenticator, AuthFileError> {
        let identities = read(path).map_err(|reason| AuthFileError {
            path: path.display().to_string(),
            reason,
        })?;
        Ok(Authenticator {
            path: path.to_owned(),
            current: RwLock::new(Arc::new(identities)),
        })
    }

    /// The identities in force now.
    pub fn identities(&self) -> Arc<Identities> {
        Arc::clone(&self.current.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The identity of a request: by its `Authorization` header value if it has one,
    /// else by its connection's verified client certificate; see the module doc.
    pub fn authenticate(
        &self,
        authorization: Option<&[u8]>,
        certificate: Option<&ClientCertificate>,
    ) -> Result<Arc<Identity>, Denial> {
        let identities = self.identities();
        let Some(authorization) = authorization else {
            return certificate
                .and_then(|certificate| identities.identify_certificate(certificate))
                .ok_or(Denial::Unauthenticated);
        };
        let key = bearer(authorization).ok_or(Denial::Unauthenticated)?;
        identities.identify(key).ok_or(Denial::Unauthenticated)
    }

    /// Reloads the file whenever it changes; runs until the process ends.
    pub async fn watch(self: Arc<Self>) {
        crate::reload::on_change(vec![self.path.clone()], || match read(&self.path) {
            Ok(identities) => {
                tracing::info!(
                    path = %self.path.display(),
                    identities = identities.len(),
                    "auth file reloaded"
                );
                *self.current.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(identities);
            }
            Err(reason) => tracing::error!(
                path = %self.path.display(),
                %reason,
                "auth file not reloaded; the identities in force stay"
            ),
        })
        .await
    }
}

/// The key of an `Authorization: Bearer <key>` header value.
fn bearer(authorization: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(authorization).ok()?;
    let (scheme, key) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
}

/// The administrator's key of a gateway without `--auth-file` (`--admin-key-file`):
/// the file holds its hash, as `fencegate key new` prints it.
pub struct AdminKey([u8; 32]);

impl AdminKey {
    pub fn load(path: &Path) -> Result<AdminKey, AuthFileError> {
        let failed = |reason: String| AuthFileError {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| failed(e.to_string()))?;
        parse_hash(text.trim()).map(AdminKey).map_err(failed)
    }

    /// Whether an `Authorization` header value carries this key.
    pub fn admits(&self, authorization: Option<&[u8]>) -> bool {
        authorization
            .and_then(bearer)
            .is_some_and(|key| hash(key) == self.0)
    }
}

fn read(path: &Path) -> Result<Identities, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    Identities::parse(&text)
}

#[cfg(test)]
mod tests;
