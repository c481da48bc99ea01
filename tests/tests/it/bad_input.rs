//! Every error code, each from a request that provokes it; none of them changes anything.

use fencegate_tests::api_tests;
use http::Method;

struct Case {
    name: &'static str,
    method: Method,
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn case(
    name: &'static str,
    method: Method,
    path: &str,
    headers: &[(&'static str, &str)],
    status: u16,
    code: &'static str,
) -> Case {
    Case {
        name,
        method,
        path: path.to_owned(),
        headers: headers.iter().map(|(n, v)| (*n, (*v).to_owned())).collect(),
        body: b"value".to_vec(),
        status,
        code,
    }
}

fn cases() -> Vec<Case> {
    use Method as M;
    let token = |t: &'static str| vec![("fencing-token", t)];
    let mut cases = vec![
        case(
            "no token",
            M::PUT,
            "/v1/kv/res/k",
            &[],
            428,
            "missing_token",
        ),
        case(
            "no token on delete",
            M::DELETE,
            "/v1/kv/res/k",
            &[],
            428,
            "missing_token",
        ),
        case(
            "no token on advance",
            M::POST,
            "/v1/fences/res/advance",
            &[],
            428,
            "missing_token",
        ),
        case(
            "non-decimal token",
            M::PUT,
            "/v1/kv/res/k",
            &token("abc"),
            400,
            "invalid_token",
        ),
        case(
            "zero token",
            M::PUT,
            "/v1/kv/res/k",
            &token("0"),
            400,
            "invalid_token",
        ),
        case(
            "negative token",
            M::PUT,
            "/v1/kv/res/k",
            &token("-1"),
            400,
            "invalid_token",
        ),
        case(
            "fractional token",
            M::PUT,
            "/v1/kv/res/k",
            &token("1.5"),
            400,
            "invalid_token",
        ),
        case(
            "token out of range",
            M::PUT,
            "/v1/kv/res/k",
            &token("9223372036854775808"),
            400,
            "invalid_token",
        ),
        case(
            "two tokens",
            M::PUT,
            "/v1/kv/res/k",
            &[("fencing-token", "1"), ("fencing-token", "2")],
            400,
            "invalid_token",
        ),
        case(
            "bad token on advance",
            M::POST,
            "/v1/fences/res/advance",
            &token("x"),
            400,
            "invalid_token",
        ),
        case(
            "resource with a space",
            M::PUT,
            "/v1/kv/bad%20res/k",
            &token("1"),
            400,
            "invalid_resource",
        ),
        case(
            "resource with a slash in fences",
            M::GET,
            "/v1/fences/a%2Fb",
            &[],
            400,
            "invalid_resource",
        ),
        case(
            "empty key",
            M::PUT,
            "/v1/kv/res/",
            &token("1"),
            400,
            "invalid_key",
        ),
        case(
            "key that is not UTF-8",
            M::PUT,
            "/v1/kv/res/%ff",
            &token("1"),
            400,
            "invalid_key",
        ),
        case(
            "key with NUL",
            M::PUT,
            "/v1/kv/res/a%00b",
            &token("1"),
            400,
            "invalid_key",
        ),
        case(
            "weak etag",
            M::PUT,
            "/v1/kv/res/k",
            &[("fencing-token", "1"), ("if-match", "W/\"1\"")],
            400,
            "invalid_precondition",
        ),
        case(
            "if-none-match with a tag",
            M::PUT,
            "/v1/kv/res/k",
            &[("fencing-token", "1"), ("if-none-match", "\"1\"")],
            400,
            "invalid_precondition",
        ),
        case(
            "missing object",
            M::GET,
            "/v1/kv/res/k",
            &[],
            404,
            "not_found",
        ),
        case(
            "unknown path",
            M::GET,
            "/v2/kv/res/k",
            &[],
            404,
            "not_found",
        ),
        case(
            "unknown fence action",
            M::POST,
            "/v1/fences/res/retreat",
            &token("1"),
            404,
            "not_found",
        ),
        case(
            "post to an object",
            M::POST,
            "/v1/kv/res/k",
            &token("1"),
            405,
            "method_not_allowed",
        ),
        case(
            "delete a fence",
            M::DELETE,
            "/v1/fences/res",
            &token("1"),
            405,
            "method_not_allowed",
        ),
        case(
            "get an advance",
            M::GET,
            "/v1/fences/res/advance",
            &[],
            405,
            "method_not_allowed",
        ),
    ];
    let long_resource = format!("/v1/kv/{}/k", "r".repeat(201));
    cases.push(case(
        "resource of 201 bytes",
        M::PUT,
        &long_resource,
        &token("1"),
        400,
        "invalid_resource",
    ));
    let long_key = format!("/v1/kv/res/{}", "k".repeat(1025));
    cases.push(case(
        "key of 1025 bytes",
        M::PUT,
        &long_key,
        &token("1"),
        400,
        "invalid_key",
    ));
    let long_holder = "h".repeat(257);
    let mut holder = case(
        "holder of 257 bytes",
        M::PUT,
        "/v1/kv/res/k",
        &token("1"),
        400,
        "invalid_holder",
    );
    holder.headers.push(("fencing-holder", long_holder));
    cases.push(holder);
    let mut large = case(
        "body over --max-body",
        M::PUT,
        "/v1/kv/res/k",
        &token("1"),
        413,
        "body_too_large",
    );
    large.body = vec![b'x'; 17];
    cases.push(large);
    cases
}

api_tests! {
    async fn every_error_code_and_nothing_changes(gateway) ["--max-body", "16"] {
        let client = gateway.client();
        for case in cases() {
            let headers: Vec<(&str, &str)> = case.headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let reply = client.request(case.method.clone(), &case.path, &headers, case.body.clone()).await;
            assert_eq!(reply.status, case.status, "{}: {:?}", case.name, reply.body);
            let body = reply.json();
            assert_eq!(body["error"], case.code, "{}: {body}", case.name);
            assert!(body["message"].as_str().is_some_and(|m| !m.is_empty()), "{}: no message", case.name);
            if case.status == 405 {
                assert!(reply.header("allow").is_some(), "{}: no Allow header", case.name);
            }
        }
        // Nothing was written, and no fence was raised.
        assert_eq!(client.fence("res").await.json()["highest"], serde_json::Value::Null);
        assert_eq!(gateway.highest("res").await, None);
        assert_eq!(client.get("res", "k").await.status, 404);
        // A body at the limit is fine.
        assert_eq!(client.put("res", "k", 1, "0123456789abcdef").await.status, 201);
    }
}
