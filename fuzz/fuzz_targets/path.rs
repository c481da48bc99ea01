//! Request paths: any text either names a target or is refused; an object's key, encoded
//! again, names the same object.
#![no_main]

use fencegate_proto::path::{encode_key, Target};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|path: &str| {
    if let Ok(Target::Object { resource, key }) = Target::parse(path) {
        let again = format!("/v1/kv/{resource}/{}", encode_key(key.as_str()));
        assert_eq!(
            Target::parse(&again),
            Ok(Target::Object { resource, key }),
            "{again}"
        );
    }
});
