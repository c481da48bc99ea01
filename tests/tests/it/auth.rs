//! Authentication and authorization (`--auth-file`): every route but `/healthz` needs
//! a key of a known identity and a grant for its action on its resource; refusals
//! change nothing; keys rotate without a restart; a gateway reachable from other hosts
//! does not start without authentication unless told it is insecure.

use std::path::PathBuf;
use std::time::Duration;

use fencegate_gateway::auth::{new_key, stored_hash};
use fencegate_tests::deployment::DataDir;
use fencegate_tests::gateway::{binary, Gateway};
use fencegate_tests::http::{kv_path, Client, Reply};
use fencegate_tests::inprocess::{Api, InProcess};
use http::Method;

/// A directory for one test's auth file, removed at the end.
struct AuthDir(PathBuf);

impl AuthDir {
    fn new() -> AuthDir {
        let dir = std::env::temp_dir().join(format!(
            "fencegate-auth-{}-{:08x}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        AuthDir(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("auth.toml")
    }

    /// Writes the file: `identities` as `(name, keys, grants in TOML)`.
    fn write(&self, identities: &[(&str, &[&str], &str)]) {
        let mut text = String::new();
        for (name, keys, grants) in identities {
            let hashes: Vec<String> = keys
                .iter()
                .map(|key| format!("{:?}", stored_hash(key)))
                .collect();
            text.push_str(&format!(
                "[[identity]]\nname = {name:?}\nkeys = [{}]\ngrants = [{grants}]\n\n",
                hashes.join(", ")
            ));
        }
        // Written whole and renamed, as a secret store would, so that the gateway
        // never reads half a file.
        let partial = self.0.join("auth.toml.partial");
        std::fs::write(&partial, text).unwrap();
        std::fs::rename(&partial, self.file()).unwrap();
    }
}

impl Drop for AuthDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn call(
    client: &Client,
    method: Method,
    path: &str,
    key: Option<&str>,
    token: &str,
) -> Reply {
    let bearer = key.map(|key| format!("Bearer {key}"));
    let mut headers = vec![("fencing-token", token)];
    if let Some(bearer) = &bearer {
        headers.push(("authorization", bearer.as_str()));
    }
    let body = if path.starts_with("/v1/sql/") {
        r#"{"statements":[{"sql":"SELECT 1"}]}"#
    } else {
        "value"
    };
    client.request(method, path, &headers, body).await
}

/// Every route the gateway serves, with the action it needs, on `resource`.
fn routes(resource: &str) -> Vec<(Method, String)> {
    vec![
        (Method::PUT, kv_path(resource, "k")),
        (Method::DELETE, kv_path(resource, "k")),
        (Method::GET, kv_path(resource, "k")),
        (Method::GET, format!("/v1/fences/{resource}")),
        (Method::POST, format!("/v1/fences/{resource}/advance")),
        (Method::POST, format!("/v1/sql/{resource}")),
        (Method::GET, format!("/v1/leases/{resource}")),
        (Method::POST, format!("/v1/leases/{resource}/acquire")),
        (Method::POST, format!("/v1/fences/{resource}/reset")),
        (Method::GET, "/metrics".to_owned()),
        (Method::GET, "/readyz".to_owned()),
        (Method::GET, "/v1/openapi.json".to_owned()),
    ]
}

#[tokio::test]
async fn every_route_needs_a_key_and_a_grant_and_refusals_change_nothing() {
    let dir = AuthDir::new();
    let (writer, reader, monitor) = (new_key(), new_key(), new_key());
    dir.write(&[
        (
            "writer",
            &[&writer],
            r#"{ resources = ["sweeper"], actions = ["read", "write", "advance"] }"#,
        ),
        (
            "reader",
            &[&reader],
            r#"{ resources = ["sweep*"], actions = ["read"] }"#,
        ),
        ("monitor", &[&monitor], r#"{ actions = ["metrics"] }"#),
    ]);
    let file = dir.file().display().to_string();
    let gateway = InProcess::start(&["--auth-file", &file]).await;
    let client = gateway.client();
    let put = call(
        &client,
        Method::PUT,
        &kv_path("sweeper", "k"),
        Some(&writer),
        "5",
    )
    .await;
    assert_eq!(put.status, 201, "{:?}", put.json());

    // No key, an unknown key, a key in the wrong scheme: 401 on every route.
    let unknown = new_key();
    for (method, path) in routes("sweeper") {
        for key in [None, Some(unknown.as_str())] {
            let reply = call(&client, method.clone(), &path, key, "9223372036854775807").await;
            assert_eq!(
                (reply.status, reply.error_code().as_str()),
                (401, "unauthenticated"),
                "{method} {path} with {key:?}"
            );
            assert_eq!(
                reply.header("www-authenticate"),
                Some("Bearer realm=\"fencegate\"")
            );
        }
    }
    let basic = client
        .request(
            Method::GET,
            &kv_path("sweeper", "k"),
            &[("authorization", &format!("Basic {writer}"))],
            "",
        )
        .await;
    assert_eq!(basic.status, 401);
    // Even a path that does not exist says no more than 401.
    let nowhere = call(&client, Method::GET, "/v1/nowhere", None, "1").await;
    assert_eq!(nowhere.status, 401);
    assert_eq!(
        call(&client, Method::GET, "/healthz", None, "1")
            .await
            .status,
        200
    );

    // Known identities without the grant: 403.
    let forbidden = [
        (&reader, Method::PUT, kv_path("sweeper", "k")),
        (&reader, Method::DELETE, kv_path("sweeper", "k")),
        (
            &reader,
            Method::POST,
            "/v1/fences/sweeper/advance".to_owned(),
        ),
        (&reader, Method::POST, "/v1/sql/sweeper".to_owned()),
        (
            &reader,
            Method::POST,
            "/v1/leases/sweeper/acquire".to_owned(),
        ),
        (&writer, Method::POST, "/v1/leases/sweeper/renew".to_owned()),
        (&writer, Method::POST, "/v1/fences/sweeper/reset".to_owned()),
        (&monitor, Method::GET, "/v1/leases/sweeper".to_owned()),
        (&reader, Method::GET, "/metrics".to_owned()),
        (&reader, Method::GET, kv_path("orders", "k")),
        (&writer, Method::PUT, kv_path("sweeper-x", "k")),
        (&writer, Method::GET, "/readyz".to_owned()),
        (&monitor, Method::GET, kv_path("sweeper", "k")),
        (&monitor, Method::PUT, kv_path("sweeper", "k")),
    ];
    for (key, method, path) in forbidden {
        let reply = call(&client, method.clone(), &path, Some(key), "9").await;
        assert_eq!(
            (reply.status, reply.error_code().as_str()),
            (403, "forbidden"),
            "{method} {path}"
        );
    }

    // What the grants allow.
    let read = call(
        &client,
        Method::GET,
        &kv_path("sweeper", "k"),
        Some(&reader),
        "1",
    )
    .await;
    assert_eq!((read.status, &read.body[..]), (200, &b"value"[..]));
    let fence = call(
        &client,
        Method::GET,
        "/v1/fences/sweeper",
        Some(&reader),
        "1",
    )
    .await;
    assert_eq!(fence.status, 200);
    assert_eq!(
        call(&client, Method::GET, "/metrics", Some(&monitor), "1")
            .await
            .status,
        200
    );
    assert_eq!(
        call(&client, Method::GET, "/readyz", Some(&monitor), "1")
            .await
            .status,
        200
    );

    // Nothing the refused requests carried landed: not the forged top token, not the
    // reader's writes.
    let fence = call(
        &client,
        Method::GET,
        "/v1/fences/sweeper",
        Some(&reader),
        "1",
    )
    .await;
    assert_eq!(fence.json()["highest"], 5, "{:?}", fence.json());
    let lease = call(
        &client,
        Method::GET,
        "/v1/leases/sweeper",
        Some(&reader),
        "1",
    )
    .await;
    assert_eq!(
        (lease.json()["held"].clone(), lease.json()["token"].clone()),
        (serde_json::json!(false), serde_json::Value::Null),
        "no refused lease step took the lease"
    );
    assert_eq!(read.header("etag"), Some("\"1\""));
    let again = call(
        &client,
        Method::GET,
        &kv_path("sweeper", "k"),
        Some(&reader),
        "1",
    )
    .await;
    assert_eq!(
        (again.header("etag"), again.header("fencing-token")),
        (Some("\"1\""), Some("5"))
    );
    let other = call(
        &client,
        Method::GET,
        "/v1/fences/sweeper-x",
        Some(&reader),
        "1",
    )
    .await;
    assert_eq!(
        other.json()["highest"],
        serde_json::Value::Null,
        "{:?}",
        other.json()
    );
    let metrics = call(&client, Method::GET, "/metrics", Some(&monitor), "1").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("fencegate_requests_total{outcome=\"unauthenticated\",route=\"kv_put\"} 2"),
        "{text}"
    );
}

/// The log line of a stale rejection names the identity that sent it: at the default
/// log level, requests have no span to carry it.
#[tokio::test]
async fn a_stale_rejection_is_logged_with_its_identity() {
    let dir = AuthDir::new();
    let (leader, old_leader) = (new_key(), new_key());
    let grant = r#"{ resources = ["sweeper"], actions = ["write", "advance"] }"#;
    dir.write(&[
        ("leader", &[&leader], grant),
        ("old-leader", &[&old_leader], grant),
    ]);
    let data = DataDir::create();
    let gateway = Gateway::builder()
        .arg("--auth-file")
        .arg(dir.file().to_string_lossy())
        .arg("--data-dir")
        .arg(data.0.to_string_lossy())
        .spawn()
        .await;
    let client = gateway.client();
    let path = kv_path("sweeper", "k");
    let put = call(&client, Method::PUT, &path, Some(&leader), "5").await;
    assert_eq!(put.status, 201);
    let stale = call(&client, Method::PUT, &path, Some(&old_leader), "4").await;
    assert_eq!(stale.status, 409);
    let advance = "/v1/fences/sweeper/advance";
    let stale = call(&client, Method::POST, advance, Some(&old_leader), "3").await;
    assert_eq!(stale.status, 409);
    let events = gateway.events("stale write rejected");
    let logged: Vec<(&str, u64)> = events
        .iter()
        .map(|event| {
            let fields = &event["fields"];
            (
                fields["identity"].as_str().unwrap_or("(none)"),
                fields["presented"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(logged, [("old-leader", 4), ("old-leader", 3)], "{events:?}");
}

#[tokio::test]
async fn keys_rotate_without_a_restart_while_writers_keep_writing() {
    let dir = AuthDir::new();
    let (old, new) = (new_key(), new_key());
    let grant = r#"{ resources = ["sweeper"], actions = ["read", "write"] }"#;
    dir.write(&[("writer", &[&old], grant)]);
    let file = dir.file().display().to_string();
    let gateway = InProcess::start(&["--auth-file", &file]).await;
    let mut writer = Writer {
        client: gateway.client(),
        written: 0,
    };

    // Both keys for a while: the new one starts working within a few seconds, and the
    // old one never stops.
    dir.write(&[("writer", &[&old, &new], grant)]);
    writer
        .until(&old, &new, 201, "the new key takes effect")
        .await;

    // The old key retired: refused within a few seconds, while the new one goes on.
    dir.write(&[("writer", &[&new], grant)]);
    writer
        .until(&new, &old, 401, "the old key is retired")
        .await;

    // A file that no longer parses changes nothing: the keys in force stay.
    std::fs::write(dir.file(), "[[identity]]\nname = ").unwrap();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(writer.put(&new).await, 201);
    assert_eq!(writer.put(&old).await, 401);
}

/// A writer putting one new object after another.
struct Writer {
    client: Client,
    written: u64,
}

impl Writer {
    async fn put(&mut self, key: &str) -> u16 {
        self.written += 1;
        let path = kv_path("sweeper", &format!("k{}", self.written));
        call(&self.client, Method::PUT, &path, Some(key), "1")
            .await
            .status
    }

    /// Writes with `steady` (which must keep working) and `changing`, until `changing`
    /// gets `status`; panics after 10 s.
    async fn until(&mut self, steady: &str, changing: &str, status: u16, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            assert_eq!(self.put(steady).await, 201, "{steady} keeps working");
            if self.put(changing).await == status {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

#[tokio::test]
async fn a_gateway_reachable_from_other_hosts_needs_authentication_or_a_word_that_it_is_insecure() {
    let data = DataDir::create();
    let data_dir = data.0.display().to_string();
    let open = Gateway::builder()
        .args(&["--data-dir", &data_dir])
        .listen("0.0.0.0:0".parse().unwrap())
        .try_spawn()
        .await
        .err()
        .expect("no start on 0.0.0.0 without --auth-file");
    assert!(open.logs.contains("--auth-file"), "{}", open.logs);
    assert!(open.logs.contains("--insecure-no-auth"), "{}", open.logs);

    let insecure = Gateway::builder()
        .args(&["--data-dir", &data_dir])
        .listen("0.0.0.0:0".parse().unwrap())
        .arg("--insecure-no-auth")
        .spawn()
        .await;
    assert_eq!(insecure.client().get_path("/healthz").await.status, 200);
    drop(insecure);

    let dir = AuthDir::new();
    std::fs::write(
        dir.file(),
        "[[identity]]\nname = \"a\"\nkeys = [\"fgk_plain\"]\n",
    )
    .unwrap();
    let bad = Gateway::builder()
        .args(&["--data-dir", &data_dir])
        .arg("--auth-file")
        .arg(dir.file().display().to_string())
        .try_spawn()
        .await
        .err()
        .expect("no start with an auth file that stores a key in the clear");
    assert!(bad.logs.contains("store hashes"), "{}", bad.logs);
}

/// `fencegate key new` prints a key and its hash; `fencegate key hash` gives the same
/// hash for the key; a gateway with that hash takes the key.
#[tokio::test]
async fn the_key_commands_make_keys_the_gateway_takes() {
    let made = tokio::process::Command::new(binary())
        .args(["key", "new"])
        .output()
        .await
        .unwrap();
    assert!(made.status.success());
    let printed = String::from_utf8(made.stdout).unwrap();
    let field = |name: &str| {
        printed
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .map(|value| value.trim().to_owned())
            .unwrap_or_else(|| panic!("no {name:?} in {printed}"))
    };
    let (key, hash) = (field("key:"), field("hash:"));
    assert!(key.starts_with("fgk_"), "{key}");

    let mut hashing = tokio::process::Command::new(binary())
        .args(["key", "hash"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use tokio::io::AsyncWriteExt;
    let mut stdin = hashing.stdin.take().unwrap();
    stdin
        .write_all(format!("{key}\n").as_bytes())
        .await
        .unwrap();
    drop(stdin);
    let hashed = hashing.wait_with_output().await.unwrap();
    assert_eq!(String::from_utf8(hashed.stdout).unwrap().trim(), hash);

    let dir = AuthDir::new();
    std::fs::write(
        dir.file(),
        format!(
            "[[identity]]\nname = \"ops\"\nkeys = [{hash:?}]\ngrants = [{{ actions = [\"metrics\"] }}]\n"
        ),
    )
    .unwrap();
    let data = DataDir::create();
    let gateway = Gateway::builder()
        .args(&["--data-dir", &data.0.display().to_string()])
        .arg("--auth-file")
        .arg(dir.file().display().to_string())
        .spawn()
        .await;
    let reply = gateway
        .client()
        .request(
            Method::GET,
            "/metrics",
            &[("authorization", &format!("Bearer {key}"))],
            "",
        )
        .await;
    assert_eq!(reply.status, 200);
}
