//! Header names and the parsing of the fencing and precondition headers.
//!
//! A header that appears more than once is an error, never "take the first": two
//! `Fencing-Token` values on one request mean the client is confused about which
//! term it writes under, and guessing would defeat the fence.

use http::header::{HeaderMap, HeaderName, IF_MATCH, IF_NONE_MATCH};

use crate::error::ProtoError;
use crate::token::Token;

/// The token of the lease term a write is issued under (request), or the token
/// that wrote an object (response of `GET /v1/kv`).
pub const FENCING_TOKEN: HeaderName = HeaderName::from_static("fencing-token");
/// Free-text identity of the writer, for logs (request).
pub const FENCING_HOLDER: HeaderName = HeaderName::from_static("fencing-holder");
/// The highest accepted token, on a `409 stale_token` answer.
pub const FENCING_HIGHEST: HeaderName = HeaderName::from_static("fencing-highest");

/// The client's name for one logical write, the same on every retry of it (request):
/// the gateway applies it once and answers every retry with the first answer.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `true` on an answer that was stored by an earlier attempt with the same
/// `Idempotency-Key` and is replayed, not applied again (response).
pub const IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// The longest `Idempotency-Key` value, in bytes.
pub const MAX_IDEMPOTENCY_KEY_LEN: usize = 255;

/// Reads `Idempotency-Key`: absent, or exactly once, 1–255 printable ASCII bytes
/// (`0x20..=0x7e`).
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ProtoError> {
    let Some(value) = single(headers, &IDEMPOTENCY_KEY)
        .map_err(|()| ProtoError::InvalidIdempotencyKey("the header appears more than once"))?
    else {
        return Ok(None);
    };
    if value.is_empty() {
        return Err(ProtoError::InvalidIdempotencyKey("the key is empty"));
    }
    if value.len() > MAX_IDEMPOTENCY_KEY_LEN {
        return Err(ProtoError::InvalidIdempotencyKey("longer than 255 bytes"));
    }
    if !value.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return Err(ProtoError::InvalidIdempotencyKey(
            "only printable ASCII characters are allowed",
        ));
    }
    Ok(Some(
        String::from_utf8(value.to_vec()).expect("printable ASCII is UTF-8"),
    ))
}

/// The longest `Fencing-Holder` value, in bytes.
pub const MAX_HOLDER_LEN: usize = 256;

/// The fencing headers of a write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fencing {
    pub token: Token,
    pub holder: Option<String>,
}

impl Fencing {
    /// Reads `Fencing-Token` (required, exactly once) and `Fencing-Holder` (optional).
    pub fn from_headers(headers: &HeaderMap) -> Result<Fencing, ProtoError> {
        let token = match single(headers, &FENCING_TOKEN)
            .map_err(|()| ProtoError::InvalidToken("the header appears more than once"))?
        {
            None => return Err(ProtoError::MissingToken),
            Some(value) => Token::parse(value)?,
        };
        let holder = single(headers, &FENCING_HOLDER)
            .map_err(|()| ProtoError::InvalidHolder("the header appears more than once"))?
            .map(parse_holder)
            .transpose()?;
        Ok(Fencing { token, holder })
    }
}

fn parse_holder(value: &[u8]) -> Result<String, ProtoError> {
    if value.len() > MAX_HOLDER_LEN {
        return Err(ProtoError::InvalidHolder("longer than 256 bytes"));
    }
    let text = std::str::from_utf8(value).map_err(|_| ProtoError::InvalidHolder("not UTF-8"))?;
    if text.chars().any(crate::names::is_forbidden_char) {
        return Err(ProtoError::InvalidHolder(
            "contains a control or bidirectional formatting character",
        ));
    }
    Ok(text.to_owned())
}

/// What a write requires of the object's current version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precondition {
    /// No precondition: the write applies whatever the object's state.
    #[default]
    None,
    /// `If-Match: "0"` or `If-None-Match: *`: the object must not exist.
    MustNotExist,
    /// `If-Match: *`: the object must exist, at any version.
    MustExist,
    /// `If-Match: "<n>"`, n >= 1: the object must exist at exactly this version.
    Version(u64),
}

impl Precondition {
    /// Reads `If-Match` and `If-None-Match`; at most one of them, at most once.
    pub fn from_headers(headers: &HeaderMap) -> Result<Precondition, ProtoError> {
        let if_match = single(headers, &IF_MATCH)
            .map_err(|()| ProtoError::InvalidPrecondition("If-Match appears more than once"))?;
        let if_none_match = single(headers, &IF_NONE_MATCH).map_err(|()| {
            ProtoError::InvalidPrecondition("If-None-Match appears more than once")
        })?;
        match (if_match, if_none_match) {
            (None, None) => Ok(Precondition::None),
            (Some(_), Some(_)) => Err(ProtoError::InvalidPrecondition(
                "send either If-Match or If-None-Match, not both",
            )),
            (None, Some(b"*")) => Ok(Precondition::MustNotExist),
            (None, Some(_)) => Err(ProtoError::InvalidPrecondition(
                "If-None-Match supports only '*' (the object must not exist)",
            )),
            (Some(b"*"), None) => Ok(Precondition::MustExist),
            (Some(value), None) => match parse_etag(value)? {
                0 => Ok(Precondition::MustNotExist),
                version => Ok(Precondition::Version(version)),
            },
        }
    }
}

/// The entity tag of an object version: the decimal version in double quotes.
pub fn etag(version: u64) -> String {
    format!("\"{version}\"")
}

/// Parses one strong entity tag holding a decimal version, such as `"3"`.
pub fn parse_etag(value: &[u8]) -> Result<u64, ProtoError> {
    let inner = value
        .strip_prefix(b"\"")
        .and_then(|v| v.strip_suffix(b"\""))
        .ok_or(ProtoError::InvalidPrecondition(
            "expected one quoted version such as \"3\" (weak tags and lists are not supported)",
        ))?;
    if inner.is_empty() || inner.len() > 19 || !inner.iter().all(u8::is_ascii_digit) {
        return Err(ProtoError::InvalidPrecondition(
            "the version must be a decimal integer",
        ));
    }
    std::str::from_utf8(inner)
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|&v| v <= i64::MAX as u64)
        .ok_or(ProtoError::InvalidPrecondition(
            "the version is out of range",
        ))
}

/// The value of a header that may appear at most once; `Err(())` if it appears twice.
fn single<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<Option<&'a [u8]>, ()> {
    let mut values = headers.get_all(name).iter();
    let first = values.next().map(|v| v.as_bytes());
    if values.next().is_some() {
        return Err(());
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use proptest::prelude::*;

    fn headers(pairs: &[(&HeaderName, &[u8])]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append((*name).clone(), HeaderValue::from_bytes(value).unwrap());
        }
        map
    }

    #[test]
    fn fencing_headers() {
        let ok = Fencing::from_headers(&headers(&[
            (&FENCING_TOKEN, b"41"),
            (&FENCING_HOLDER, b"node-a"),
        ]));
        assert_eq!(
            ok,
            Ok(Fencing {
                token: Token::new(41).unwrap(),
                holder: Some("node-a".into())
            })
        );
        assert_eq!(
            Fencing::from_headers(&HeaderMap::new()),
            Err(ProtoError::MissingToken)
        );
        let twice = headers(&[(&FENCING_TOKEN, b"41"), (&FENCING_TOKEN, b"42")]);
        assert!(matches!(
            Fencing::from_headers(&twice),
            Err(ProtoError::InvalidToken(_))
        ));
        let bad_holder = headers(&[(&FENCING_TOKEN, b"1"), (&FENCING_HOLDER, &[0xff, 0xfe])]);
        assert!(matches!(
            Fencing::from_headers(&bad_holder),
            Err(ProtoError::InvalidHolder(_))
        ));
    }

    #[test]
    fn idempotency_keys() {
        let parse = |pairs: &[(&HeaderName, &[u8])]| idempotency_key(&headers(pairs));
        assert_eq!(parse(&[]), Ok(None));
        assert_eq!(
            parse(&[(&IDEMPOTENCY_KEY, b"order 7/retry")]),
            Ok(Some("order 7/retry".into()))
        );
        let longest = vec![b'k'; 255];
        assert_eq!(
            parse(&[(&IDEMPOTENCY_KEY, &longest)]),
            Ok(Some("k".repeat(255)))
        );
        let too_long = vec![b'k'; 256];
        for bad in [&b""[..], &too_long, b"tab\there", &[0xc3, 0xa9]] {
            assert!(
                matches!(
                    parse(&[(&IDEMPOTENCY_KEY, bad)]),
                    Err(ProtoError::InvalidIdempotencyKey(_))
                ),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(parse(&[(&IDEMPOTENCY_KEY, b"a"), (&IDEMPOTENCY_KEY, b"a")]).is_err());
    }

    #[test]
    fn preconditions() {
        let parse = |pairs: &[(&HeaderName, &[u8])]| Precondition::from_headers(&headers(pairs));
        assert_eq!(parse(&[]), Ok(Precondition::None));
        assert_eq!(
            parse(&[(&IF_MATCH, b"\"0\"")]),
            Ok(Precondition::MustNotExist)
        );
        assert_eq!(
            parse(&[(&IF_NONE_MATCH, b"*")]),
            Ok(Precondition::MustNotExist)
        );
        assert_eq!(parse(&[(&IF_MATCH, b"*")]), Ok(Precondition::MustExist));
        assert_eq!(
            parse(&[(&IF_MATCH, b"\"7\"")]),
            Ok(Precondition::Version(7))
        );
        for bad in [
            &b"7"[..],
            b"W/\"7\"",
            b"\"7\", \"8\"",
            b"\"\"",
            b"\"-1\"",
            b"\"x\"",
        ] {
            assert!(
                parse(&[(&IF_MATCH, bad)]).is_err(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(parse(&[(&IF_NONE_MATCH, b"\"3\"")]).is_err());
        assert!(parse(&[(&IF_MATCH, b"\"1\""), (&IF_NONE_MATCH, b"*")]).is_err());
    }

    proptest! {
        #[test]
        fn header_parsing_never_panics(token in proptest::collection::vec(any::<u8>(), 0..40),
                                       etag in proptest::collection::vec(any::<u8>(), 0..40)) {
            let mut map = HeaderMap::new();
            if let Ok(v) = HeaderValue::from_bytes(&token) { map.append(FENCING_TOKEN, v.clone()); map.append(FENCING_HOLDER, v); }
            if let Ok(v) = HeaderValue::from_bytes(&etag) { map.append(IF_MATCH, v); }
            let _ = Fencing::from_headers(&map);
            let _ = Precondition::from_headers(&map);
        }

        #[test]
        fn etags_round_trip(version in 0u64..=i64::MAX as u64) {
            prop_assert_eq!(parse_etag(etag(version).as_bytes()), Ok(version));
        }
    }
}
