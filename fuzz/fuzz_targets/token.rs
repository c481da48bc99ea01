//! `Fencing-Token` values: any bytes either parse to a token that prints back as the
//! same canonical decimal, or are refused — never a panic.
#![no_main]

use fencegate_proto::Token;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(token) = Token::parse(data) {
        assert!(token.get() >= 1 && token.as_i64() > 0);
        let printed = token.to_string();
        assert_eq!(Token::parse(printed.as_bytes()).unwrap(), token);
        assert_eq!(printed.parse::<Token>().unwrap(), token);
    }
});
