//! A released lease's token stays bound to the identity that held it: with
//! `--issued-by gateway:...` and `--auth-file`, another identity presenting it is
//! refused with `403 token_holder_mismatch` on every replica and after restarts, on
//! both backends, while the holder's own writes with it are judged as before.

use std::path::PathBuf;

use fencegate_gateway::auth::{new_key, stored_hash};
use fencegate_tests::db::TestDb;
use fencegate_tests::deployment::DataDir;
use fencegate_tests::gateway::{Gateway, GatewayBuilder};
use fencegate_tests::http::{kv_path, Reply};
use http::Method;
use serde_json::{json, Value};

const RESOURCE: &str = "sweeper";

/// Two identities that may both lease and write `sweeper`, in an auth file removed at
/// the end.
struct Identities {
    node_a: String,
    node_b: String,
    file: PathBuf,
}

impl Identities {
    fn new() -> Identities {
        let (node_a, node_b) = (new_key(), new_key());
        let file = std::env::temp_dir().join(format!(
            "fencegate-holders-{}-{:08x}.toml",
            std::process::id(),
            rand::random::<u32>()
        ));
        let grants = r#"{ resources = ["sweeper"], actions = ["read", "write", "lease"] }"#;
        let mut text = String::new();
        for (name, key) in [("node-a", &node_a), ("node-b", &node_b)] {
            text.push_str(&format!(
                "[[identity]]\nname = {name:?}\nkeys = [{:?}]\ngrants = [{grants}]\n\n",
                stored_hash(key)
            ));
        }
        std::fs::write(&file, text).unwrap();
        Identities {
            node_a,
            node_b,
            file,
        }
    }

    /// A gateway builder with the auth file and `sweeper` bound to the gateway's leases.
    fn builder(&self) -> GatewayBuilder {
        Gateway::builder().args(&[
            "--auth-file",
            &self.file.display().to_string(),
            "--issued-by",
            "gateway:sweeper",
        ])
    }
}

impl Drop for Identities {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.file);
    }
}

async fn call(
    gateway: &Gateway,
    key: &str,
    method: Method,
    path: &str,
    token: Option<u64>,
    body: String,
) -> Reply {
    let bearer = format!("Bearer {key}");
    let token = token.map(|token| token.to_string());
    let mut headers = vec![
        ("content-type", "application/json"),
        ("authorization", bearer.as_str()),
    ];
    if let Some(token) = &token {
        headers.push(("fencing-token", token.as_str()));
    }
    gateway.client().request(method, path, &headers, body).await
}

async fn lease(gateway: &Gateway, key: &str, step: &str, body: Value) -> Reply {
    let path = format!("/v1/leases/{RESOURCE}/{step}");
    call(gateway, key, Method::POST, &path, None, body.to_string()).await
}

async fn put(gateway: &Gateway, key: &str, token: u64, value: &str) -> Reply {
    let path = kv_path(RESOURCE, "k");
    call(
        gateway,
        key,
        Method::PUT,
        &path,
        Some(token),
        value.to_owned(),
    )
    .await
}

/// node-a takes the lease, writes and releases it through `gateway`; returns the token.
async fn hold_and_release(gateway: &Gateway, ids: &Identities) -> u64 {
    let granted = lease(
        gateway,
        &ids.node_a,
        "acquire",
        json!({"holder": "node-a", "ttl_ms": 60_000}),
    )
    .await;
    assert_eq!(granted.status, 200, "{:?}", granted.json());
    let token = granted.json()["token"].as_u64().unwrap();
    let written = put(gateway, &ids.node_a, token, "a1").await;
    assert_eq!(written.status, 201, "{:?}", written.json());
    let released = lease(
        gateway,
        &ids.node_a,
        "release",
        json!({"holder": "node-a", "token": token}),
    )
    .await;
    assert_eq!(released.status, 200, "{:?}", released.json());
    let state = released.json();
    assert_eq!(
        (&state["held"], &state["holder"], &state["identity"]),
        (&json!(false), &Value::Null, &json!("node-a")),
        "released, and still bound to node-a: {state}"
    );
    token
}

/// Through `gateway`: node-b presenting the released `token` is refused and nothing
/// changes; node-a's own write with it is accepted, as it was before the release (the
/// token is still the lease's latest and the fence is at it). `expected` is the
/// object's value before, `written` node-a's new value.
async fn still_bound(
    gateway: &Gateway,
    ids: &Identities,
    token: u64,
    expected: &str,
    written: &str,
) {
    let borrowed = put(gateway, &ids.node_b, token, "b1").await;
    assert_eq!(
        (borrowed.status, borrowed.json()["error"].as_str()),
        (403, Some("token_holder_mismatch")),
        "{:?}",
        borrowed.json()
    );
    let read = call(
        gateway,
        &ids.node_a,
        Method::GET,
        &kv_path(RESOURCE, "k"),
        None,
        String::new(),
    )
    .await;
    assert_eq!(
        &read.body[..],
        expected.as_bytes(),
        "nothing refused was applied"
    );
    let own = put(gateway, &ids.node_a, token, written).await;
    assert_eq!(own.status, 200, "the holder's own write: {:?}", own.json());
}

/// Two gateways on one database: node-a's lease is taken and released through one,
/// and the other, which never saw the acquire, refuses node-b with node-a's token.
#[tokio::test]
async fn a_released_token_stays_bound_on_another_replica() {
    let db = TestDb::create().await;
    let ids = Identities::new();
    let one = ids.builder().database(&db.url()).spawn().await;
    let two = ids.builder().database(&db.url()).spawn().await;
    let token = hold_and_release(&one, &ids).await;
    still_bound(&two, &ids, token, "a1", "a2").await;
    still_bound(&one, &ids, token, "a2", "a3").await;
    let identity: Option<String> = db
        .client()
        .await
        .query_one(
            "SELECT identity FROM fencegate.leases WHERE resource = $1",
            &[&RESOURCE],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        identity.as_deref(),
        Some("node-a"),
        "kept in the lease's row"
    );
}

async fn bound_across_a_restart(mut gateway: Gateway, ids: &Identities) {
    let token = hold_and_release(&gateway, ids).await;
    gateway.restart().await;
    still_bound(&gateway, ids, token, "a1", "a2").await;
    // A new term by node-b replaces the binding: node-a's old token is now stale.
    let granted = lease(
        &gateway,
        &ids.node_b,
        "acquire",
        json!({"holder": "node-b", "ttl_ms": 60_000}),
    )
    .await;
    let next = granted.json()["token"].as_u64().unwrap();
    assert!(next > token, "{:?}", granted.json());
    assert_eq!(put(&gateway, &ids.node_b, next, "b1").await.status, 200);
    let late = put(&gateway, &ids.node_a, token, "a3").await;
    assert_eq!(late.status, 409, "{:?}", late.json());
}

#[tokio::test]
async fn a_released_token_stays_bound_after_a_restart_embedded() {
    let data = DataDir::create();
    let ids = Identities::new();
    let gateway = ids
        .builder()
        .arg("--data-dir")
        .arg(data.0.display().to_string())
        .spawn()
        .await;
    bound_across_a_restart(gateway, &ids).await;
}

#[tokio::test]
async fn a_released_token_stays_bound_after_a_restart_postgres() {
    let db = TestDb::create().await;
    let ids = Identities::new();
    let gateway = ids.builder().database(&db.url()).spawn().await;
    bound_across_a_restart(gateway, &ids).await;
}
