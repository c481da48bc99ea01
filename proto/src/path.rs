//! The API's paths.
//!
//! ```text
//! /v1/kv/{resource}/{key}        key: percent-decoded, may contain '/'
//! /v1/fences/{resource}
//! /v1/fences/{resource}/advance
//! /v1/sql/{resource}
//! /metrics  /healthz  /readyz  /v1/openapi.json
//! ```

use percent_encoding::percent_decode_str;

use crate::error::ProtoError;
use crate::names::{ObjectKey, ResourceName};

/// What a request path names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Object {
        resource: ResourceName,
        key: ObjectKey,
    },
    Fence {
        resource: ResourceName,
    },
    FenceAdvance {
        resource: ResourceName,
    },
    /// A fenced SQL transaction on the resource's fence.
    Sql {
        resource: ResourceName,
    },
    Metrics,
    Healthz,
    Readyz,
    /// The OpenAPI document of the API.
    OpenApi,
}

/// Why a path names nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("no such path")]
    NotFound,
    #[error(transparent)]
    Invalid(#[from] ProtoError),
}

impl Target {
    /// Parses the path of a request URI (without the query string).
    pub fn parse(path: &str) -> Result<Target, PathError> {
        match path {
            "/metrics" => return Ok(Target::Metrics),
            "/healthz" => return Ok(Target::Healthz),
            "/readyz" => return Ok(Target::Readyz),
            "/v1/openapi.json" => return Ok(Target::OpenApi),
            _ => {}
        }
        if let Some(rest) = path.strip_prefix("/v1/kv/") {
            let (resource, key) = rest.split_once('/').unwrap_or((rest, ""));
            let resource = resource_segment(resource)?;
            let key = decode(key)
                .ok_or(ProtoError::InvalidKey(
                    "the key has a '%' that is not followed by two hex digits",
                ))?
                .map_err(|_| ProtoError::InvalidKey("the key is not UTF-8 once percent-decoded"))?;
            return Ok(Target::Object {
                resource,
                key: ObjectKey::new(key)?,
            });
        }
        if let Some(rest) = path.strip_prefix("/v1/fences/") {
            return match rest.split_once('/') {
                None => Ok(Target::Fence {
                    resource: resource_segment(rest)?,
                }),
                Some((resource, "advance")) => Ok(Target::FenceAdvance {
                    resource: resource_segment(resource)?,
                }),
                Some(_) => Err(PathError::NotFound),
            };
        }
        if let Some(resource) = path.strip_prefix("/v1/sql/") {
            if resource.contains('/') {
                return Err(PathError::NotFound);
            }
            return Ok(Target::Sql {
                resource: resource_segment(resource)?,
            });
        }
        Err(PathError::NotFound)
    }
}

fn resource_segment(segment: &str) -> Result<ResourceName, ProtoError> {
    let decoded = decode(segment)
        .ok_or(ProtoError::InvalidResource(
            "a '%' that is not followed by two hex digits",
        ))?
        .map_err(|_| ProtoError::InvalidResource("not UTF-8 once percent-decoded"))?;
    ResourceName::new(decoded)
}

/// Percent-decodes `segment`; `None` if a `%` is not followed by two hex digits (which
/// lenient decoders pass through as they are, so that two readers of one path could
/// disagree).
fn decode(segment: &str) -> Option<Result<std::borrow::Cow<'_, str>, std::str::Utf8Error>> {
    let bytes = segment.as_bytes();
    let well_formed = bytes.iter().enumerate().all(|(at, &b)| {
        b != b'%'
            || bytes
                .get(at + 1..at + 3)
                .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    well_formed.then(|| percent_decode_str(segment).decode_utf8())
}

/// Percent-encodes a key for use in a `/v1/kv` path, keeping `/` as is.
pub fn encode_key(key: &str) -> String {
    use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
    // Everything that is not an unreserved character or '/' is encoded.
    const KEY: &AsciiSet = &CONTROLS
        .add(b' ')
        .add(b'"')
        .add(b'#')
        .add(b'%')
        .add(b'<')
        .add(b'>')
        .add(b'?')
        .add(b'`')
        .add(b'{')
        .add(b'}')
        .add(b'[')
        .add(b']')
        .add(b'\\')
        .add(b'^')
        .add(b'|')
        .add(b'+')
        .add(b'&')
        .add(b'=')
        .add(b';')
        .add(b',')
        .add(b':')
        .add(b'@')
        .add(b'$')
        .add(b'!')
        .add(b'\'')
        .add(b'(')
        .add(b')')
        .add(b'*');
    utf8_percent_encode(key, KEY).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn res(name: &str) -> ResourceName {
        ResourceName::new(name).unwrap()
    }

    #[test]
    fn known_paths() {
        assert_eq!(
            Target::parse("/v1/kv/orders/a/b%20c"),
            Ok(Target::Object {
                resource: res("orders"),
                key: ObjectKey::new("a/b c").unwrap()
            })
        );
        assert_eq!(
            Target::parse("/v1/fences/orders"),
            Ok(Target::Fence {
                resource: res("orders")
            })
        );
        assert_eq!(
            Target::parse("/v1/fences/orders/advance"),
            Ok(Target::FenceAdvance {
                resource: res("orders")
            })
        );
        assert_eq!(
            Target::parse("/v1/sql/sweeper"),
            Ok(Target::Sql {
                resource: res("sweeper")
            })
        );
        assert_eq!(Target::parse("/metrics"), Ok(Target::Metrics));
    }

    #[test]
    fn bad_paths() {
        assert_eq!(Target::parse("/"), Err(PathError::NotFound));
        assert_eq!(
            Target::parse("/v1/fences/orders/retreat"),
            Err(PathError::NotFound)
        );
        assert_eq!(Target::parse("/v1/sql/a/b"), Err(PathError::NotFound));
        assert!(matches!(
            Target::parse("/v1/sql/"),
            Err(PathError::Invalid(ProtoError::InvalidResource(_)))
        ));
        assert!(matches!(
            Target::parse("/v1/kv/orders"),
            Err(PathError::Invalid(ProtoError::InvalidKey(_)))
        ));
        assert!(matches!(
            Target::parse("/v1/kv/orders/"),
            Err(PathError::Invalid(ProtoError::InvalidKey(_)))
        ));
        assert!(matches!(
            Target::parse("/v1/kv/or%20ders/k"),
            Err(PathError::Invalid(ProtoError::InvalidResource(_)))
        ));
        assert!(matches!(
            Target::parse("/v1/kv/orders/%ff"),
            Err(PathError::Invalid(ProtoError::InvalidKey(_)))
        ));
        assert!(matches!(
            Target::parse("/v1/kv/orders/a%00b"),
            Err(PathError::Invalid(ProtoError::InvalidKey(_)))
        ));
        for malformed in [
            "/v1/kv/orders/a%zzb",
            "/v1/kv/orders/a%2",
            "/v1/kv/orders/%",
        ] {
            assert!(
                matches!(
                    Target::parse(malformed),
                    Err(PathError::Invalid(ProtoError::InvalidKey(_)))
                ),
                "{malformed}"
            );
        }
        for malformed in ["/v1/fences/or%zzders", "/v1/fences/a%", "/v1/sql/%4"] {
            assert!(
                matches!(
                    Target::parse(malformed),
                    Err(PathError::Invalid(ProtoError::InvalidResource(_)))
                ),
                "{malformed}"
            );
        }
        for dots in [
            "/v1/fences/.",
            "/v1/fences/..",
            "/v1/kv/.../k",
            "/v1/sql/%2e%2e",
        ] {
            assert!(
                matches!(
                    Target::parse(dots),
                    Err(PathError::Invalid(ProtoError::InvalidResource(_)))
                ),
                "{dots}"
            );
        }
        assert!(Target::parse("/v1/fences/a..b").is_ok());
        assert!(Target::parse("/v1/kv/r/%25").is_ok());
    }

    proptest! {
        #[test]
        fn parsing_never_panics(path in "\\PC*") {
            let _ = Target::parse(&path);
        }

        #[test]
        fn encoded_keys_round_trip(key in "[^\\p{Cc}]{1,200}") {
            let path = format!("/v1/kv/r/{}", encode_key(&key));
            let parsed = Target::parse(&path);
            prop_assert_eq!(parsed, Ok(Target::Object { resource: res("r"), key: ObjectKey::new(key).unwrap() }));
        }
    }
}
