//! Resource names and object keys.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::error::ProtoError;

/// The longest resource name, in bytes.
pub const MAX_RESOURCE_LEN: usize = 200;
/// The longest object key, in bytes, after percent-decoding.
pub const MAX_KEY_LEN: usize = 1024;

/// The fence scope: every key of a resource shares one highest token.
///
/// 1–200 bytes of `[A-Za-z0-9._-]`, not only dots, so it is safe in paths, logs and
/// metric labels.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ResourceName(String);

impl ResourceName {
    pub fn new(name: impl Into<String>) -> Result<ResourceName, ProtoError> {
        let name = name.into();
        if name.is_empty() {
            return Err(ProtoError::InvalidResource("the resource name is empty"));
        }
        if name.len() > MAX_RESOURCE_LEN {
            return Err(ProtoError::InvalidResource(
                "the resource name is longer than 200 bytes",
            ));
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
        {
            return Err(ProtoError::InvalidResource(
                "the resource name may contain only A-Z, a-z, 0-9, '.', '_' and '-'",
            ));
        }
        // `.` and `..` are path segments of their own to every URL library.
        if name.bytes().all(|b| b == b'.') {
            return Err(ProtoError::InvalidResource(
                "the resource name may not be only dots",
            ));
        }
        Ok(ResourceName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ResourceName {
    type Error = ProtoError;
    fn try_from(value: String) -> Result<Self, ProtoError> {
        ResourceName::new(value)
    }
}

impl From<ResourceName> for String {
    fn from(name: ResourceName) -> String {
        name.0
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `c` may not appear in a key or a holder's name: a control character (it
/// cannot be stored or logged faithfully), or a bidirectional formatting character
/// (it makes a log line or an operator's screen show text in another order than it
/// has: `U+061C`, `U+200E`, `U+200F`, `U+202A`–`U+202E`, `U+2066`–`U+2069`).
pub fn is_forbidden_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{061C}' | '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// The key of an object inside a resource: 1–1024 bytes of UTF-8, `/` allowed,
/// control and bidirectional formatting characters not ([`is_forbidden_char`]).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct ObjectKey(String);

impl ObjectKey {
    pub fn new(key: impl Into<String>) -> Result<ObjectKey, ProtoError> {
        let key = key.into();
        if key.is_empty() {
            return Err(ProtoError::InvalidKey("the key is empty"));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(ProtoError::InvalidKey("the key is longer than 1024 bytes"));
        }
        if key.chars().any(is_forbidden_char) {
            return Err(ProtoError::InvalidKey(
                "the key contains a control or bidirectional formatting character",
            ));
        }
        Ok(ObjectKey(key))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for ObjectKey {
    type Error = ProtoError;
    fn try_from(value: String) -> Result<Self, ProtoError> {
        ObjectKey::new(value)
    }
}

impl From<ObjectKey> for String {
    fn from(key: ObjectKey) -> String {
        key.0
    }
}

impl fmt::Display for ObjectKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_names() {
        assert!(ResourceName::new("invoice-sweeper").is_ok());
        assert!(ResourceName::new("a.B_9-z").is_ok());
        assert!(ResourceName::new("x".repeat(200)).is_ok());
        for bad in ["", "a/b", "a b", "ä", "a%20", &"x".repeat(201)] {
            assert!(ResourceName::new(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn object_keys() {
        assert!(ObjectKey::new("a/b/c").is_ok());
        assert!(ObjectKey::new("ünïcode key").is_ok());
        assert!(ObjectKey::new("k".repeat(1024)).is_ok());
        for bad in [
            "",
            "a\0b",
            "line\nbreak",
            "invoice\u{202E}fdp.exe",
            "a\u{2066}b",
            "a\u{200F}",
            &"k".repeat(1025),
        ] {
            assert!(ObjectKey::new(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
