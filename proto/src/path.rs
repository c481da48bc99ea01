//! The API's paths.
//!
//! ```text
//! /v1/kv/{resource}/{key}        key: percent-decoded, may contain '/'
//! /v1/fences/{resource}
//! /v1/fences/{resource}/advance
//! /v1/fences/{resource}/reset
//! /v1/sql/{resource}
//! /v1/leases/{resource}
//! /v1/leases/{resource}/{acquire|renew|release}
//! /v1/txn
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
    /// An administrator's reset of a fence raised by a token that was never issued.
    FenceReset {
        resource: ResourceName,
    },
    /// A fenced SQL transaction on the resource's fence.
    Sql {
        resource: ResourceName,
    },
    /// A lease hosted by the gateway, which fences the resource of the same name.
    Lease {
        resource: ResourceName,
    },
    /// A step of a hosted lease's life.
    LeaseStep {
        resource: ResourceName,
        step: LeaseStep,
    },
    /// One transaction of operations on several resources.
    Txn,
    Metrics,
    Healthz,
    Readyz,
    /// The OpenAPI document of the API.
    OpenApi,
}

/// What kind of target a path is for, told by its prefix alone: known even when the
/// path's resource or key is invalid (for metric labels and error answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Object,
    Fence,
    FenceAdvance,
    FenceReset,
    Sql,
    Lease,
    LeaseStep,
    Txn,
    Metrics,
    Healthz,
    Readyz,
    OpenApi,
}

/// What a `POST /v1/leases/{resource}/{step}` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseStep {
    Acquire,
    Renew,
    Release,
}

impl LeaseStep {
    pub const ALL: [LeaseStep; 3] = [LeaseStep::Acquire, LeaseStep::Renew, LeaseStep::Release];

    pub const fn as_str(self) -> &'static str {
        match self {
            LeaseStep::Acquire => "acquire",
            LeaseStep::Renew => "renew",
            LeaseStep::Release => "release",
        }
    }

    fn parse(segment: &str) -> Option<LeaseStep> {
        LeaseStep::ALL
            .into_iter()
            .find(|step| step.as_str() == segment)
    }
}

impl Family {
    /// The family of `path`, or `None` for a path the API does not have.
    pub fn of(path: &str) -> Option<Family> {
        match path {
            "/metrics" => return Some(Family::Metrics),
            "/healthz" => return Some(Family::Healthz),
            "/readyz" => return Some(Family::Readyz),
            "/v1/openapi.json" => return Some(Family::OpenApi),
            TXN => return Some(Family::Txn),
            _ => {}
        }
        if path.starts_with(KV) {
            return Some(Family::Object);
        }
        if let Some(rest) = path.strip_prefix(FENCES) {
            return Some(if rest.ends_with(ADVANCE) {
                Family::FenceAdvance
            } else if rest.ends_with(RESET) {
                Family::FenceReset
            } else {
                Family::Fence
            });
        }
        if let Some(rest) = path.strip_prefix(LEASES) {
            return Some(match rest.contains('/') {
                true => Family::LeaseStep,
                false => Family::Lease,
            });
        }
        path.starts_with(SQL).then_some(Family::Sql)
    }
}

const KV: &str = "/v1/kv/";
const FENCES: &str = "/v1/fences/";
const SQL: &str = "/v1/sql/";
const LEASES: &str = "/v1/leases/";
const TXN: &str = "/v1/txn";
const ADVANCE: &str = "/advance";
const RESET: &str = "/reset";

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
        match Family::of(path).ok_or(PathError::NotFound)? {
            Family::Metrics => return Ok(Target::Metrics),
            Family::Healthz => return Ok(Target::Healthz),
            Family::Readyz => return Ok(Target::Readyz),
            Family::OpenApi => return Ok(Target::OpenApi),
            Family::Txn => return Ok(Target::Txn),
            Family::Object
            | Family::Fence
            | Family::FenceAdvance
            | Family::FenceReset
            | Family::Sql
            | Family::Lease
            | Family::LeaseStep => {}
        }
        if let Some(rest) = path.strip_prefix(KV) {
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
        if let Some(rest) = path.strip_prefix(FENCES) {
            return match rest.split_once('/') {
                None => Ok(Target::Fence {
                    resource: resource_segment(rest)?,
                }),
                Some((resource, "advance")) => Ok(Target::FenceAdvance {
                    resource: resource_segment(resource)?,
                }),
                Some((resource, "reset")) => Ok(Target::FenceReset {
                    resource: resource_segment(resource)?,
                }),
                Some(_) => Err(PathError::NotFound),
            };
        }
        if let Some(rest) = path.strip_prefix(LEASES) {
            return match rest.split_once('/') {
                None => Ok(Target::Lease {
                    resource: resource_segment(rest)?,
                }),
                Some((resource, step)) => match LeaseStep::parse(step) {
                    Some(step) => Ok(Target::LeaseStep {
                        resource: resource_segment(resource)?,
                        step,
                    }),
                    None => Err(PathError::NotFound),
                },
            };
        }
        if let Some(resource) = path.strip_prefix(SQL) {
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

impl Target {
    /// The target's path: what [`Target::parse`] reads back as the same target.
    pub fn path(&self) -> String {
        match self {
            Target::Object { resource, key } => {
                format!("{KV}{resource}/{}", encode_key(key.as_str()))
            }
            Target::Fence { resource } => format!("{FENCES}{resource}"),
            Target::FenceAdvance { resource } => format!("{FENCES}{resource}{ADVANCE}"),
            Target::FenceReset { resource } => format!("{FENCES}{resource}{RESET}"),
            Target::Sql { resource } => format!("{SQL}{resource}"),
            Target::Lease { resource } => format!("{LEASES}{resource}"),
            Target::LeaseStep { resource, step } => {
                format!("{LEASES}{resource}/{}", step.as_str())
            }
            Target::Txn => TXN.to_owned(),
            Target::Metrics => "/metrics".to_owned(),
            Target::Healthz => "/healthz".to_owned(),
            Target::Readyz => "/readyz".to_owned(),
            Target::OpenApi => "/v1/openapi.json".to_owned(),
        }
    }

    pub fn family(&self) -> Family {
        match self {
            Target::Object { .. } => Family::Object,
            Target::Fence { .. } => Family::Fence,
            Target::FenceAdvance { .. } => Family::FenceAdvance,
            Target::FenceReset { .. } => Family::FenceReset,
            Target::Sql { .. } => Family::Sql,
            Target::Lease { .. } => Family::Lease,
            Target::LeaseStep { .. } => Family::LeaseStep,
            Target::Txn => Family::Txn,
            Target::Metrics => Family::Metrics,
            Target::Healthz => Family::Healthz,
            Target::Readyz => Family::Readyz,
            Target::OpenApi => Family::OpenApi,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.path())
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
        assert_eq!(
            Target::parse("/v1/fences/orders/reset"),
            Ok(Target::FenceReset {
                resource: res("orders")
            })
        );
        assert_eq!(
            Target::parse("/v1/leases/orders"),
            Ok(Target::Lease {
                resource: res("orders")
            })
        );
        assert_eq!(
            Target::parse("/v1/leases/orders/renew"),
            Ok(Target::LeaseStep {
                resource: res("orders"),
                step: LeaseStep::Renew
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
        assert_eq!(
            Target::parse("/v1/leases/a/steal"),
            Err(PathError::NotFound)
        );
        assert_eq!(
            Target::parse("/v1/leases/a/acquire/x"),
            Err(PathError::NotFound)
        );
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

    /// Text a key may be: no control or bidirectional formatting character.
    const KEY_TEXT: &str =
        "[^\\p{Cc}\u{061C}\u{200E}\u{200F}\u{202A}-\u{202E}\u{2066}-\u{2069}]{1,60}";

    fn targets() -> impl Strategy<Value = Target> {
        let resource = "[A-Za-z0-9._-]{1,40}"
            .prop_filter("not only dots", |name: &String| {
                !name.bytes().all(|b| b == b'.')
            })
            .prop_map(|name| ResourceName::new(name).unwrap());
        let key = KEY_TEXT.prop_map(|key| ObjectKey::new(key).unwrap());
        prop_oneof![
            (resource.clone(), key).prop_map(|(resource, key)| Target::Object { resource, key }),
            resource
                .clone()
                .prop_map(|resource| Target::Fence { resource }),
            resource
                .clone()
                .prop_map(|resource| Target::FenceAdvance { resource }),
            resource
                .clone()
                .prop_map(|resource| Target::FenceReset { resource }),
            resource
                .clone()
                .prop_map(|resource| Target::Lease { resource }),
            (
                resource.clone(),
                prop::sample::select(LeaseStep::ALL.to_vec())
            )
                .prop_map(|(resource, step)| Target::LeaseStep { resource, step }),
            resource.prop_map(|resource| Target::Sql { resource }),
            Just(Target::Metrics),
            Just(Target::Healthz),
            Just(Target::Readyz),
            Just(Target::Txn),
            Just(Target::OpenApi),
        ]
    }

    proptest! {
        #[test]
        fn parsing_never_panics(path in "\\PC*") {
            let _ = Target::parse(&path);
        }

        #[test]
        fn printed_paths_parse_back(target in targets()) {
            let path = target.path();
            prop_assert_eq!(Family::of(&path), Some(target.family()));
            prop_assert_eq!(Target::parse(&path), Ok(target));
        }

        #[test]
        fn encoded_keys_round_trip(key in "[^\\p{Cc}\u{061C}\u{200E}\u{200F}\u{202A}-\u{202E}\u{2066}-\u{2069}]{1,200}") {
            let path = format!("/v1/kv/r/{}", encode_key(&key));
            let parsed = Target::parse(&path);
            prop_assert_eq!(parsed, Ok(Target::Object { resource: res("r"), key: ObjectKey::new(key).unwrap() }));
        }
    }
}
