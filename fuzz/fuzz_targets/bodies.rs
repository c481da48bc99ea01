//! Request and answer bodies: any bytes either deserialize or are refused, and what
//! deserializes serializes back to the same value.
#![no_main]

use fencegate_proto::body::{ErrorBody, FenceState, SqlRequest, WriteAccepted};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(request) = serde_json::from_slice::<SqlRequest>(data) {
        let again: SqlRequest = serde_json::from_value(serde_json::to_value(&request).unwrap()).unwrap();
        assert_eq!(again, request);
    }
    if let Ok(body) = serde_json::from_slice::<ErrorBody>(data) {
        let again: ErrorBody = serde_json::from_value(serde_json::to_value(&body).unwrap()).unwrap();
        assert_eq!(again, body);
    }
    if let Ok(state) = serde_json::from_slice::<FenceState>(data) {
        let again: FenceState = serde_json::from_value(serde_json::to_value(&state).unwrap()).unwrap();
        assert_eq!(again, state);
    }
    let _ = serde_json::from_slice::<WriteAccepted>(data);
});
