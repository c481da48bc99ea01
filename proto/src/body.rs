//! JSON bodies.

use serde::{Deserialize, Deserializer, Serialize};

use crate::error::ErrorCode;
use crate::names::{ObjectKey, ResourceName};
use crate::token::Token;

/// The answer to an accepted `PUT` or `DELETE` on `/v1/kv`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteAccepted {
    pub resource: ResourceName,
    pub key: ObjectKey,
    pub token: Token,
    /// The object's version after this write. Starts at 1 and rises by one per
    /// accepted write of the key; a delete is a write (it leaves a tombstone), so
    /// versions never repeat for a key and `If-Match` cannot be fooled by a
    /// delete-and-recreate. A delete of an object that does not exist changes no
    /// version and answers the current one (0 if the key was never written).
    pub version: u64,
}

/// The answer of `GET /v1/fences/{resource}` and of an accepted advance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FenceState {
    pub resource: ResourceName,
    /// `None` (JSON `null`) if the resource has never accepted a write.
    pub highest: Option<Token>,
}

/// Every error answer: a stable code, a sentence for humans, and the facts of the
/// rejection where there are some.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource: Option<ResourceName>,
    /// The token the rejected request presented (`stale_token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presented: Option<Token>,
    /// The highest accepted token of the resource (`stale_token`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub highest: Option<Token>,
    /// The object's current version, `null` if it does not exist (`version_mismatch`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub current: Option<Option<u64>>,
    /// Whether the write was applied (`backend_unavailable`): `false` when it
    /// certainly was not, `null` when the database went away after receiving it.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "present"
    )]
    pub write_applied: Option<Option<bool>>,
}

impl ErrorBody {
    pub fn new(error: ErrorCode, message: impl Into<String>) -> ErrorBody {
        ErrorBody {
            error,
            message: message.into(),
            resource: None,
            presented: None,
            highest: None,
            current: None,
            write_applied: None,
        }
    }
}

/// Distinguishes a field that is present but `null` from one that is absent.
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_and_absent_fields_differ() {
        let mut body = ErrorBody::new(ErrorCode::VersionMismatch, "x");
        body.current = Some(None);
        let json = serde_json::to_value(&body).unwrap();
        assert_eq!(json["current"], serde_json::Value::Null);
        assert!(json.as_object().unwrap().contains_key("current"));
        assert!(!json.as_object().unwrap().contains_key("presented"));
        assert_eq!(serde_json::from_value::<ErrorBody>(json).unwrap(), body);
    }
}
