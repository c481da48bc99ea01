//! Request headers: any names and values, repeated or not, give fencing facts and a
//! precondition, or a refusal — never a panic.
#![no_main]

use arbitrary::Arbitrary;
use fencegate_proto::headers::{Fencing, Precondition};
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

/// The headers that matter, plus any other, so that the fuzzer spends its time there.
const NAMES: [&str; 5] = ["fencing-token", "fencing-holder", "if-match", "if-none-match", "x-other"];

#[derive(Debug, Arbitrary)]
struct Header {
    name: u8,
    value: Vec<u8>,
}

fuzz_target!(|headers: Vec<Header>| {
    let mut map = HeaderMap::new();
    for header in headers {
        let name = HeaderName::from_static(NAMES[header.name as usize % NAMES.len()]);
        if let Ok(value) = HeaderValue::from_bytes(&header.value) {
            map.append(name, value);
        }
    }
    if let Ok(fencing) = Fencing::from_headers(&map) {
        assert!(fencing.token.get() >= 1);
        if let Some(holder) = &fencing.holder {
            assert!(holder.len() <= 256 && !holder.chars().any(char::is_control));
        }
    }
    let _ = Precondition::from_headers(&map);
});
