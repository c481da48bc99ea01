//! The S3 door's keys (`--s3-keys-file`): access key id → identity and secret.
//!
//! SigV4 is an HMAC over the request, so the server needs each secret itself, unlike
//! the bearer keys of `--auth-file`, of which the gateway keeps only hashes. The
//! secrets therefore live in a file of their own, readable by the gateway's user only;
//! the grants of each identity come from `--auth-file`, by name.
//!
//! ```toml
//! [[key]]
//! access_key_id = "FGORDERSWRITER01"
//! secret = "…"
//! identity = "orders-writer"
//! ```

use std::collections::HashMap;
use std::path::Path;

use s3s::auth::{S3Auth, SecretKey};
use s3s::{s3_error, S3Result};
use serde::Deserialize;

/// One access key of the S3 door.
#[derive(Debug)]
struct Key {
    secret: String,
    identity: String,
}

/// The keys in force, by access key id.
#[derive(Debug, Default)]
pub struct S3Keys {
    by_id: HashMap<String, Key>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    key: Vec<KeyEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyEntry {
    access_key_id: String,
    secret: String,
    identity: String,
}

/// Shortest secret the door accepts: 128 bits of base64.
const MIN_SECRET_LEN: usize = 22;

impl S3Keys {
    /// Reads and checks a keys file.
    pub fn load(path: &Path) -> Result<S3Keys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("could not read --s3-keys-file {}: {e}", path.display()))?;
        S3Keys::parse(&text).map_err(|e| format!("--s3-keys-file {}: {e}", path.display()))
    }

    /// Parses a keys file's text.
    pub fn parse(text: &str) -> Result<S3Keys, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut by_id = HashMap::new();
        for entry in file.key {
            let id = entry.access_key_id;
            if id.is_empty() || !id.bytes().all(|b| b.is_ascii_alphanumeric()) {
                return Err(format!(
                    "access key id {id:?} must be non-empty ASCII letters and digits"
                ));
            }
            if entry.secret.len() < MIN_SECRET_LEN {
                return Err(format!(
                    "the secret of access key id {id:?} is shorter than {MIN_SECRET_LEN} characters"
                ));
            }
            if entry.identity.is_empty() {
                return Err(format!("access key id {id:?} names no identity"));
            }
            let key = Key {
                secret: entry.secret,
                identity: entry.identity,
            };
            if by_id.insert(id.clone(), key).is_some() {
                return Err(format!("access key id {id:?} is listed twice"));
            }
        }
        if by_id.is_empty() {
            return Err("the file lists no key: the S3 door would refuse every request".into());
        }
        Ok(S3Keys { by_id })
    }

    /// The identity an access key id authenticates.
    pub fn identity(&self, access_key_id: &str) -> Option<&str> {
        self.by_id
            .get(access_key_id)
            .map(|key| key.identity.as_str())
    }

    /// Every identity a key names.
    pub fn identities(&self) -> impl Iterator<Item = &str> {
        self.by_id.values().map(|key| key.identity.as_str())
    }
}

/// The keys as s3s's signature check asks for them.
pub struct KeyLookup(pub std::sync::Arc<S3Keys>);

#[async_trait::async_trait]
impl S3Auth for KeyLookup {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<SecretKey> {
        match self.0.by_id.get(access_key) {
            Some(key) => Ok(SecretKey::from(key.secret.as_str())),
            None => Err(s3_error!(
                InvalidAccessKeyId,
                "the access key id is not one the gateway knows"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &str = "0123456789abcdefghijklmnop";

    #[test]
    fn a_key_names_its_identity() {
        let keys = S3Keys::parse(&format!(
            "[[key]]\naccess_key_id = \"AK1\"\nsecret = \"{SECRET}\"\nidentity = \"orders\"\n"
        ))
        .unwrap();
        assert_eq!(keys.identity("AK1"), Some("orders"));
        assert_eq!(keys.identity("AK2"), None);
    }

    #[test]
    fn bad_files_are_refused() {
        for (text, says) in [
            ("", "lists no key"),
            (
                "[[key]]\naccess_key_id = \"AK1\"\nsecret = \"short\"\nidentity = \"o\"\n",
                "shorter",
            ),
            (
                &format!(
                    "[[key]]\naccess_key_id = \"A/K\"\nsecret = \"{SECRET}\"\nidentity = \"o\"\n"
                ),
                "ASCII letters",
            ),
            (
                &format!(
                    "[[key]]\naccess_key_id = \"AK\"\nsecret = \"{SECRET}\"\nidentity = \"o\"\n\
                     [[key]]\naccess_key_id = \"AK\"\nsecret = \"{SECRET}\"\nidentity = \"p\"\n"
                ),
                "twice",
            ),
            (
                &format!(
                    "[[key]]\naccess_key_id = \"AK\"\nsecret = \"{SECRET}\"\nidentity = \"\"\n"
                ),
                "no identity",
            ),
        ] {
            let error = S3Keys::parse(text).unwrap_err();
            assert!(error.contains(says), "{text:?}: {error}");
        }
    }
}
