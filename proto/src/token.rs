//! The fencing token.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::ProtoError;

/// A fencing token: the ownership epoch a write was issued under.
///
/// Tokens rise with every lease acquisition. The gateway accepts a write for a
/// resource iff its token is at least the highest token it has accepted for that
/// resource. The range `1..=i64::MAX` is the range of a Postgres `bigint` without
/// zero, which is reserved for "never written".
///
/// In JSON bodies a token is a number. JSON Schema counts `42.0` as the integer 42, so
/// an integral number written with a fraction is read as that integer — up to 2^53,
/// above which such a number may already stand for another integer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(into = "u64")]
pub struct Token(u64);

/// The largest integer that a JSON number with a fraction or exponent is taken as: the
/// largest below which every integer has a double of its own.
const EXACT_IN_A_DOUBLE: f64 = 9_007_199_254_740_992.0;

impl<'de> Deserialize<'de> for Token {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Token, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Token;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a fencing token: an integer from 1 to 9223372036854775807")
            }

            fn visit_u64<E: serde::de::Error>(self, value: u64) -> Result<Token, E> {
                Token::new(value).map_err(E::custom)
            }

            fn visit_i64<E: serde::de::Error>(self, value: i64) -> Result<Token, E> {
                let value =
                    u64::try_from(value).map_err(|_| E::custom("the token must be at least 1"))?;
                self.visit_u64(value)
            }

            fn visit_f64<E: serde::de::Error>(self, value: f64) -> Result<Token, E> {
                if value.fract() != 0.0 || !(1.0..=EXACT_IN_A_DOUBLE).contains(&value) {
                    return Err(E::custom(
                        "the token must be an integer from 1 to 9223372036854775807 \
                         (written without a fraction above 2^53)",
                    ));
                }
                self.visit_u64(value as u64)
            }
        }
        // `any`: inside a tagged enum the number arrives buffered, and only `any` passes
        // a buffered float on to `visit_f64`.
        deserializer.deserialize_any(Visitor)
    }
}

impl Token {
    /// The largest token: `9223372036854775807`.
    pub const MAX: Token = Token(i64::MAX as u64);

    /// Returns the token for `value`, or an error if it is zero or above [`Token::MAX`].
    pub fn new(value: u64) -> Result<Token, ProtoError> {
        if value == 0 {
            return Err(ProtoError::InvalidToken("the token must be at least 1"));
        }
        if value > Token::MAX.0 {
            return Err(ProtoError::InvalidToken(
                "the token must be at most 9223372036854775807",
            ));
        }
        Ok(Token(value))
    }

    /// Parses a header value: ASCII decimal digits only, no sign, no spaces.
    pub fn parse(text: &[u8]) -> Result<Token, ProtoError> {
        if text.is_empty() {
            return Err(ProtoError::InvalidToken("the token is empty"));
        }
        if !text.iter().all(u8::is_ascii_digit) {
            return Err(ProtoError::InvalidToken(
                "the token must be a decimal integer",
            ));
        }
        // Leading zeros carry no value; skip them so that only the digits that count
        // are checked against the range.
        let digits = match text.iter().position(|&b| b != b'0') {
            Some(first) => &text[first..],
            None => return Token::new(0),
        };
        if digits.len() > 19 {
            return Err(ProtoError::InvalidToken(
                "the token must be at most 9223372036854775807",
            ));
        }
        let value = digits
            .iter()
            .fold(0u64, |acc, &d| acc * 10 + u64::from(d - b'0'));
        Token::new(value)
    }

    pub fn get(self) -> u64 {
        self.0
    }

    /// The token as a Postgres `bigint`; lossless by construction.
    pub fn as_i64(self) -> i64 {
        self.0 as i64
    }
}

impl TryFrom<u64> for Token {
    type Error = ProtoError;
    fn try_from(value: u64) -> Result<Token, ProtoError> {
        Token::new(value)
    }
}

impl From<Token> for u64 {
    fn from(token: Token) -> u64 {
        token.0
    }
}

impl FromStr for Token {
    type Err = ProtoError;
    fn from_str(s: &str) -> Result<Token, ProtoError> {
        Token::parse(s.as_bytes())
    }
}

impl fmt::Display for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The rule stated plainly: non-empty ASCII digits whose value is in 1..=i64::MAX.
    fn reference(text: &[u8]) -> Option<u64> {
        let text = std::str::from_utf8(text).ok()?;
        if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let value: u128 = text.parse().ok()?;
        (1..=i64::MAX as u128)
            .contains(&value)
            .then_some(value as u64)
    }

    #[test]
    fn json_numbers_that_are_integers() {
        let read = |text: &str| serde_json::from_str::<Token>(text).map(Token::get);
        assert_eq!(read("42").unwrap(), 42);
        assert_eq!(read("42.0").unwrap(), 42);
        assert_eq!(read("4.2e1").unwrap(), 42);
        assert_eq!(read("9223372036854775807").unwrap(), i64::MAX as u64);
        assert_eq!(read("9007199254740992.0").unwrap(), 1 << 53);
        for bad in [
            "0",
            "-1",
            "0.0",
            "42.5",
            "9007199254740994.0",
            "9223372036854775808",
            "1e300",
            "\"42\"",
            "null",
        ] {
            assert!(read(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn accepts_the_full_range() {
        assert_eq!(Token::parse(b"1").unwrap().get(), 1);
        assert_eq!(Token::parse(b"0042").unwrap().get(), 42);
        assert_eq!(Token::parse(b"9223372036854775807").unwrap(), Token::MAX);
    }

    #[test]
    fn rejects_everything_else() {
        for bad in [
            &b""[..],
            b"0",
            b"000",
            b"-1",
            b"+1",
            b" 1",
            b"1.0",
            b"0x10",
            b"9223372036854775808",
            b"99999999999999999999999",
            b"1e3",
        ] {
            assert!(
                Token::parse(bad).is_err(),
                "{:?} was accepted",
                String::from_utf8_lossy(bad)
            );
        }
    }

    proptest! {
        #[test]
        fn round_trips_every_valid_value(value in 1u64..=i64::MAX as u64) {
            let parsed = Token::parse(value.to_string().as_bytes()).unwrap();
            prop_assert_eq!(parsed.get(), value);
        }

        #[test]
        fn agrees_with_a_reference_parser(text in proptest::collection::vec(any::<u8>(), 0..24)) {
            prop_assert_eq!(Token::parse(&text).ok().map(Token::get), reference(&text));
        }
    }
}
