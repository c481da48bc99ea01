//! Leases hosted by the gateway (`/v1/leases/{resource}`), issued tokens only
//! (`--issued-by`), and the recovery of a fence raised by a token nobody issued
//! (`POST /v1/fences/{resource}/reset`), on both backends and across two replicas.

use std::time::{Duration, Instant};

use fencegate_gateway::auth::new_key;
use fencegate_lease::{FencedClient, GatewayStore, LeaseStore};
use fencegate_tests::auth_file::AuthFile;
use fencegate_tests::db::TestDb;
use fencegate_tests::deployment::DataDir;
use fencegate_tests::fenced::detail_fields;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{kv_path, Client, Reply};
use http::Method;
use serde_json::{json, Value};

const MAX: &str = "9223372036854775807";

/// A caller of one gateway, with the key of one identity (or none).
struct Caller {
    client: Client,
    key: Option<String>,
}

impl Caller {
    fn new(gateway: &Gateway, key: Option<&str>) -> Caller {
        Caller {
            client: gateway.client(),
            key: key.map(str::to_owned),
        }
    }

    async fn call(&self, method: Method, path: &str, token: Option<&str>, body: &str) -> Reply {
        let bearer = self.key.as_ref().map(|key| format!("Bearer {key}"));
        let mut headers = vec![("content-type", "application/json")];
        if let Some(token) = token {
            headers.push(("fencing-token", token));
        }
        if let Some(bearer) = &bearer {
            headers.push(("authorization", bearer.as_str()));
        }
        self.client
            .request(method, path, &headers, body.to_owned())
            .await
    }

    async fn lease(&self, resource: &str, step: &str, body: Value) -> Reply {
        let path = format!("/v1/leases/{resource}/{step}");
        self.call(Method::POST, &path, None, &body.to_string())
            .await
    }

    async fn acquire(&self, resource: &str, holder: &str, ttl_ms: u64) -> Reply {
        self.lease(
            resource,
            "acquire",
            json!({"holder": holder, "ttl_ms": ttl_ms}),
        )
        .await
    }

    async fn put(&self, resource: &str, key: &str, token: &str, value: &str) -> Reply {
        self.call(Method::PUT, &kv_path(resource, key), Some(token), value)
            .await
    }

    async fn fence(&self, resource: &str) -> Value {
        let reply = self
            .call(Method::GET, &format!("/v1/fences/{resource}"), None, "")
            .await;
        assert_eq!(reply.status, 200, "{:?}", reply.json());
        reply.json()["highest"].clone()
    }

    async fn reset(&self, resource: &str, to: u64, reason: &str) -> Reply {
        let body = json!({"to": to, "reason": reason}).to_string();
        self.call(
            Method::POST,
            &format!("/v1/fences/{resource}/reset"),
            None,
            &body,
        )
        .await
    }
}

fn token_of(reply: &Reply) -> u64 {
    assert_eq!(reply.status, 200, "{:?}", reply.json());
    reply.json()["token"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {:?}", reply.json()))
}

/// The seed's timeline on the gateway's own leases: node-a leads and writes, renews,
/// pauses past its lease; node-b takes over with a higher token, which the fence has
/// before node-b writes anything; node-a's late write and renewal are refused.
async fn seed_timeline(gateway: &Gateway) {
    let caller = Caller::new(gateway, None);
    let ttl = 600;
    let a = token_of(&caller.acquire("sweeper", "node-a", ttl).await);
    assert_eq!(caller.fence("sweeper").await, json!(a));
    let note = caller.put("sweeper", "note", &a.to_string(), "a1").await;
    assert_eq!(note.status, 201, "{:?}", note.json());

    let held = caller.acquire("sweeper", "node-b", ttl).await;
    assert_eq!(
        (held.status, held.error_code().as_str()),
        (409, "lease_held")
    );
    assert_eq!(held.json()["holder"], "node-a");
    assert!(held.json()["expires_in_ms"].as_u64().unwrap() <= ttl);

    let renewed = caller
        .lease(
            "sweeper",
            "renew",
            json!({"holder": "node-a", "token": a, "ttl_ms": ttl}),
        )
        .await;
    assert_eq!(token_of(&renewed), a, "a renewal keeps the token");

    // node-a pauses past its lease; node-b takes over.
    tokio::time::sleep(Duration::from_millis(ttl + 200)).await;
    let state = caller
        .call(Method::GET, "/v1/leases/sweeper", None, "")
        .await;
    assert_eq!(state.json()["held"], false, "{:?}", state.json());
    let b = token_of(&caller.acquire("sweeper", "node-b", 5_000).await);
    assert!(b > a, "the new term's token {b} is above {a}");
    assert_eq!(
        caller.fence("sweeper").await,
        json!(b),
        "the fence has the new term's token before it writes"
    );

    // node-a wakes up: its late write and its renewal are refused.
    let late = caller.put("sweeper", "note", &a.to_string(), "a2").await;
    assert_eq!(
        (late.status, late.error_code().as_str()),
        (409, "stale_token")
    );
    assert_eq!(late.json()["highest"], json!(b));
    let renew = caller
        .lease(
            "sweeper",
            "renew",
            json!({"holder": "node-a", "token": a, "ttl_ms": ttl}),
        )
        .await;
    assert_eq!(
        (renew.status, renew.error_code().as_str()),
        (409, "lease_lost")
    );
    let written = caller.put("sweeper", "note", &b.to_string(), "b1").await;
    assert_eq!(written.status, 200, "{:?}", written.json());
    let note = caller
        .call(Method::GET, &kv_path("sweeper", "note"), None, "")
        .await;
    assert_eq!(&note.body[..], b"b1");

    // Release: free for the next holder, whose token is higher still.
    let released = caller
        .lease(
            "sweeper",
            "release",
            json!({"holder": "node-b", "token": b}),
        )
        .await;
    assert_eq!(released.status, 200, "{:?}", released.json());
    assert_eq!(released.json()["held"], false);
    let twice = caller
        .lease(
            "sweeper",
            "release",
            json!({"holder": "node-b", "token": b}),
        )
        .await;
    assert_eq!(twice.error_code(), "lease_lost");
    let c = token_of(&caller.acquire("sweeper", "node-c", ttl).await);
    assert!(c > b);

    // Bad requests change nothing.
    for body in [
        json!({"holder": "node-d"}),
        json!({"holder": "", "ttl_ms": 1000}),
        json!({"holder": "node-d", "ttl_ms": 1}),
        json!({"holder": "node-d", "ttl_ms": 1000, "token": 3}),
        json!({"holder": "node-d", "ttl_ms": 1000, "extra": true}),
    ] {
        let reply = caller.lease("sweeper", "acquire", body.clone()).await;
        assert_eq!(
            (reply.status, reply.error_code().as_str()),
            (400, "invalid_body"),
            "{body}"
        );
    }
    assert_eq!(caller.fence("sweeper").await, json!(c));
}

#[tokio::test]
async fn the_seed_timeline_on_gateway_leases_embedded() {
    let data = DataDir::create();
    let gateway = Gateway::builder()
        .arg("--data-dir")
        .arg(data.0.display().to_string())
        .spawn()
        .await;
    seed_timeline(&gateway).await;
}

#[tokio::test]
async fn the_seed_timeline_on_gateway_leases_postgres() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    seed_timeline(&gateway).await;
    // The lease's row holds the latest term.
    let row = db
        .client()
        .await
        .query_one(
            "SELECT holder, token FROM fencegate.leases WHERE resource = 'sweeper'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<String>>(0).as_deref(), Some("node-c"));
    let fence: i64 = db
        .client()
        .await
        .query_one(
            "SELECT highest FROM fencegate.fences WHERE resource = 'sweeper'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(row.get::<_, i64>(1), fence);
}

/// fencegate-lease's store for these leases: election from the gateway alone.
#[tokio::test]
async fn the_lease_client_elects_through_the_gateway() {
    let data = DataDir::create();
    let gateway = Gateway::builder()
        .arg("--data-dir")
        .arg(data.0.display().to_string())
        .spawn()
        .await;
    let store = GatewayStore::new(FencedClient::new(&gateway.url()).unwrap());
    let ttl = Duration::from_secs(5);
    let a = store.acquire("jobs", "node-a", ttl).await.unwrap();
    let a = a.expect("a free lease is granted");
    assert_eq!(store.acquire("jobs", "node-b", ttl).await.unwrap(), None);
    assert!(store.renew("jobs", "node-a", a, ttl).await.unwrap());
    assert!(!store.renew("jobs", "node-b", a, ttl).await.unwrap());
    // A restarted node-a takes its lease back at once, with a new token.
    let again = store.acquire("jobs", "node-a", ttl).await.unwrap().unwrap();
    assert!(again > a);
    assert!(!store.renew("jobs", "node-a", a, ttl).await.unwrap());
    assert!(store.release("jobs", "node-a", again).await.unwrap());
    assert!(!store.release("jobs", "node-a", again).await.unwrap());
    let b = store.acquire("jobs", "node-b", ttl).await.unwrap().unwrap();
    assert!(b > again);
    let invalid = store.acquire("no such/name", "node-b", ttl).await;
    assert!(invalid.is_err());
}

/// `--issued-by gateway:...` with authentication: forged tokens are refused without
/// moving the fence; the issued token is bound to the identity that took the lease.
#[tokio::test]
async fn only_issued_tokens_are_accepted_and_only_from_their_holder() {
    let (node_a, node_b, admin) = (new_key(), new_key(), new_key());
    let grants =
        r#"{ resources = ["sweeper", "free"], actions = ["read", "write", "advance", "lease"] }"#;
    let auth = AuthFile::new(&[
        ("node-a", &node_a, grants),
        ("node-b", &node_b, grants),
        ("ops", &admin, r#"{ actions = ["admin", "metrics"] }"#),
    ]);
    let data = DataDir::create();
    let gateway = Gateway::builder()
        .args(&[
            "--auth-file",
            &auth.path(),
            "--issued-by",
            "gateway:sweeper",
        ])
        .arg("--data-dir")
        .arg(data.0.display().to_string())
        .spawn()
        .await;
    let (a, b, ops) = (
        Caller::new(&gateway, Some(&node_a)),
        Caller::new(&gateway, Some(&node_b)),
        Caller::new(&gateway, Some(&admin)),
    );

    // Before any lease: nothing was issued.
    let forged = a.put("sweeper", "k", MAX, "x").await;
    assert_eq!(
        (forged.status, forged.error_code().as_str()),
        (403, "token_not_issued")
    );
    assert_eq!(a.fence("sweeper").await, Value::Null);

    let granted = a.acquire("sweeper", "node-a", 10_000).await;
    let token = token_of(&granted);
    assert_eq!(granted.json()["identity"], "node-a");
    assert_eq!(a.fence("sweeper").await, json!(token));
    let written = a.put("sweeper", "k", &token.to_string(), "a1").await;
    assert_eq!(written.status, 201, "{:?}", written.json());

    // One above what was issued, and the largest token: refused, fence unchanged.
    for forged in [(token + 1).to_string(), MAX.to_owned()] {
        let put = a.put("sweeper", "k", &forged, "x").await;
        assert_eq!(
            (put.status, put.error_code().as_str()),
            (403, "token_not_issued"),
            "{forged}"
        );
        assert_eq!(put.json()["issued"], json!(token));
        let advance = a
            .call(
                Method::POST,
                "/v1/fences/sweeper/advance",
                Some(&forged),
                "",
            )
            .await;
        assert_eq!(advance.error_code(), "token_not_issued");
    }
    assert_eq!(a.fence("sweeper").await, json!(token));

    // The current highest, read by another identity and presented as its own.
    let borrowed = b.put("sweeper", "k", &token.to_string(), "b1").await;
    assert_eq!(
        (borrowed.status, borrowed.error_code().as_str()),
        (403, "token_holder_mismatch")
    );
    // node-b cannot renew or release node-a's lease, nor take it while it is live.
    let renew = b
        .lease(
            "sweeper",
            "renew",
            json!({"holder": "node-a", "token": token, "ttl_ms": 1000}),
        )
        .await;
    assert_eq!(renew.error_code(), "lease_lost");
    let take = b.acquire("sweeper", "node-a", 1000).await;
    assert_eq!(take.error_code(), "lease_held");
    let object = a
        .call(Method::GET, &kv_path("sweeper", "k"), None, "")
        .await;
    assert_eq!(&object.body[..], b"a1", "nothing refused was applied");

    // An unbound resource takes any token, as before.
    assert_eq!(b.put("free", "k", "12", "x").await.status, 201);

    let metrics = ops.call(Method::GET, "/metrics", None, "").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    let count = |series: &str| fencegate_tests::http::metric_value(&text, series);
    assert_eq!(
        count(r#"fencegate_token_refusals_total{reason="not_issued"}"#),
        Some(5.0)
    );
    assert_eq!(
        count(r#"fencegate_token_refusals_total{reason="holder_mismatch"}"#),
        Some(1.0)
    );
    assert_eq!(
        count(r#"fencegate_lease_steps_total{outcome="granted",step="acquire"}"#),
        Some(1.0)
    );
    let refused = gateway.events("token refused by its issuer");
    assert!(
        refused
            .iter()
            .any(|event| event["fields"]["outcome"] == "holder_mismatch"
                && event["fields"]["identity"] == "node-b"),
        "{refused:?}"
    );
}

/// `--issued-by leader_lease:...`: the seed's own lease table is the issuer.
#[tokio::test]
async fn the_leader_lease_table_is_an_issuer() {
    let db = TestDb::create().await;
    db.execute(
        "CREATE TABLE leader_lease (name text PRIMARY KEY, holder text,
             epoch bigint NOT NULL DEFAULT 0,
             expires_at timestamptz NOT NULL DEFAULT '-infinity');
         INSERT INTO leader_lease VALUES ('sweep-eu', 'node-a', 3, now() + interval '1 minute');",
    )
    .await;
    // An unguarded table is refused: its electors could forge any epoch.
    let unguarded = Gateway::builder()
        .database(&db.url())
        .args(&["--issued-by", "leader_lease:sweep-*"])
        .try_spawn()
        .await
        .err()
        .expect("a gateway bound to an unguarded leader_lease table does not start");
    assert!(
        unguarded.logs.contains("table leader_lease is not guarded"),
        "{unguarded}"
    );
    let admin = fencegate_gateway::admin::connect(&db.url()).await.unwrap();
    fencegate_gateway::admin::guard_leader_lease(&admin, "leader_lease")
        .await
        .unwrap();
    let (node_a, node_b) = (new_key(), new_key());
    let grants = r#"{ resources = ["sweep-*"], actions = ["read", "write"] }"#;
    let auth = AuthFile::new(&[("node-a", &node_a, grants), ("node-b", &node_b, grants)]);
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&[
            "--auth-file",
            &auth.path(),
            "--issued-by",
            "leader_lease:sweep-*",
        ])
        .spawn()
        .await;
    let (a, b) = (
        Caller::new(&gateway, Some(&node_a)),
        Caller::new(&gateway, Some(&node_b)),
    );
    assert_eq!(a.put("sweep-eu", "k", "3", "a").await.status, 201);
    let ahead = a.put("sweep-eu", "k", "4", "x").await;
    assert_eq!(ahead.error_code(), "token_not_issued");
    assert_eq!(ahead.json()["issued"], json!(3));
    assert_eq!(
        b.put("sweep-eu", "k", "3", "x").await.error_code(),
        "token_holder_mismatch"
    );
    let unknown = a.put("sweep-us", "k", "1", "x").await;
    assert_eq!(unknown.error_code(), "token_not_issued");

    // node-b takes over in the table: its new token is asked for, and accepted.
    db.execute("UPDATE leader_lease SET holder = 'node-b', epoch = 4 WHERE name = 'sweep-eu'")
        .await;
    assert_eq!(b.put("sweep-eu", "k", "4", "b").await.status, 200);
    let late = a.put("sweep-eu", "k", "3", "late").await;
    assert_eq!(late.error_code(), "stale_token");
}

/// A fence raised by a token nobody issued, reset by an administrator through one
/// replica: the other replica follows, no older term gets in, and the reset is audited.
#[tokio::test]
async fn a_fence_reset_is_seen_by_every_replica() {
    let db = TestDb::create().await;
    let (writer, admin) = (new_key(), new_key());
    let auth = AuthFile::new(&[
        (
            "writer",
            &writer,
            r#"{ resources = ["orders"], actions = ["read", "write", "advance", "lease"] }"#,
        ),
        ("ops", &admin, r#"{ actions = ["admin", "metrics"] }"#),
    ]);
    let replica = || {
        Gateway::builder()
            .database(&db.url())
            .args(&["--auth-file", &auth.path()])
            .spawn()
    };
    let (one, two) = (replica().await, replica().await);
    let (w1, w2) = (
        Caller::new(&one, Some(&writer)),
        Caller::new(&two, Some(&writer)),
    );
    assert_eq!(w1.put("orders", "k", "5", "v5").await.status, 201);
    // The forged token: no object written with it, the fence at the largest token.
    let forged = w1
        .call(Method::POST, "/v1/fences/orders/advance", Some(MAX), "")
        .await;
    assert_eq!(forged.status, 200);
    for caller in [&w1, &w2] {
        // Both replicas now know the forged highest (and cache it).
        let stuck = caller.put("orders", "k", "5", "x").await;
        assert_eq!(stuck.error_code(), "stale_token");
    }
    let exhausted = w1.acquire("orders", "node-a", 1000).await;
    assert_eq!(
        (exhausted.status, exhausted.error_code().as_str()),
        (409, "tokens_exhausted")
    );

    // Only an administrator may reset, and not below a token written with.
    let denied = w1.reset("orders", 5, "forged").await;
    assert_eq!(denied.error_code(), "forbidden");
    let ops1 = Caller::new(&one, Some(&admin));
    let below = ops1.reset("orders", 4, "too far").await;
    assert_eq!(
        (below.status, below.error_code().as_str()),
        (409, "reset_refused")
    );
    assert_eq!(
        ops1.reset("orders", 5, "").await.error_code(),
        "invalid_body"
    );
    // A reason that would show in another order than it has (a right-to-left override)
    // is refused like a control character, before anything changes.
    assert_eq!(
        ops1.reset("orders", 5, "token \u{202E}never issued")
            .await
            .error_code(),
        "invalid_body"
    );
    let done = ops1
        .reset("orders", 5, "token 2^63-1 was never issued")
        .await;
    assert_eq!(done.status, 200, "{:?}", done.json());
    let generation = done.json()["generation"].as_u64().unwrap();
    assert_eq!(done.json()["from"], json!(MAX.parse::<u64>().unwrap()));

    // Replica one at once; replica two within its poll.
    assert_eq!(w1.put("orders", "k", "5", "v5b").await.status, 200);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let reply = w2.put("orders", "k", "5", "v5c").await;
        if reply.status == 200 {
            break;
        }
        assert_eq!(reply.error_code(), "stale_token");
        assert!(
            Instant::now() < deadline,
            "replica two never followed the reset"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ops2 = Caller::new(&two, Some(&admin));
    let metrics = ops2.call(Method::GET, "/metrics", None, "").await;
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert_eq!(
        fencegate_tests::http::metric_value(&text, "fencegate_fence_reset_generation"),
        Some(generation as f64)
    );
    // No older term gets in on either replica.
    for caller in [&w1, &w2] {
        assert_eq!(
            caller.put("orders", "k", "4", "old").await.error_code(),
            "stale_token"
        );
    }
    // A new term starts above the reset fence.
    let next = token_of(&w2.acquire("orders", "node-a", 1000).await);
    assert_eq!(next, 6);

    // The audit record, and the log line.
    let audit = db
        .client()
        .await
        .query_one(
            "SELECT identity, reason, from_token, to_token FROM fencegate.fence_resets",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(audit.get::<_, Option<String>>(0).as_deref(), Some("ops"));
    assert_eq!(audit.get::<_, String>(1), "token 2^63-1 was never issued");
    assert_eq!(audit.get::<_, i64>(2), i64::MAX);
    assert_eq!(audit.get::<_, i64>(3), 5);
    let logged = one.events("fence reset");
    assert_eq!(logged.len(), 1, "{logged:?}");
    assert_eq!(logged[0]["fields"]["identity"], "ops");
}

/// Resets cannot be walked below a term that a holder's raises pushed out of the raise
/// log, and a token an earlier reset declared forged is no floor, even once an object
/// carries it.
async fn reset_floors(gateway: &Gateway, writer: &str, admin: &str) {
    let (w, ops) = (
        Caller::new(gateway, Some(writer)),
        Caller::new(gateway, Some(admin)),
    );
    let advance = |token: u64| {
        let w = &w;
        async move {
            let reply = w
                .call(
                    Method::POST,
                    "/v1/fences/orders/advance",
                    Some(&token.to_string()),
                    "",
                )
                .await;
            assert_eq!(reply.status, 200, "{token}: {:?}", reply.json());
        }
    };
    // The current term advances to 7; a forger then raises 40 times, more than the 32
    // raises the log keeps.
    advance(7).await;
    for token in 8..=47 {
        advance(token).await;
    }
    // Each reset goes past the fence's token to the raise below it, down to the highest
    // raise the log let go of (15), never further.
    let mut fence = 47;
    loop {
        let reply = ops.reset("orders", fence - 1, "forged").await;
        if reply.status != 200 {
            assert_eq!(reply.error_code(), "reset_refused", "{:?}", reply.json());
            break;
        }
        fence -= 1;
        assert_eq!(
            w.put("orders", "k", "6", "old").await.error_code(),
            "stale_token",
            "at {fence}"
        );
    }
    assert_eq!(fence, 15);
    for below in [7, 6] {
        assert_eq!(
            ops.reset("orders", below, "forged").await.error_code(),
            "reset_refused"
        );
    }
    assert_eq!(w.fence("orders").await, json!(15));

    // A forged token written with, declared forged, then raised past again.
    assert_eq!(w.put("books", "k", "5", "v5").await.status, 201);
    assert_eq!(w.put("books", "forged", "9", "x").await.status, 201);
    let first = ops.reset("books", 5, "9 was never issued").await;
    assert_eq!(first.status, 200, "{:?}", first.json());
    let raised = w
        .call(Method::POST, "/v1/fences/books/advance", Some("10"), "")
        .await;
    assert_eq!(raised.status, 200);
    let second = ops.reset("books", 5, "10 was never issued").await;
    assert_eq!(second.status, 200, "{:?}", second.json());
    assert_eq!(w.fence("books").await, json!(5));
    assert_eq!(w.put("books", "k", "5", "v5b").await.status, 200);
}

fn reset_auth() -> (String, String, AuthFile) {
    let (writer, admin) = (new_key(), new_key());
    let auth = AuthFile::new(&[
        (
            "writer",
            &writer,
            r#"{ resources = ["*"], actions = ["read", "write", "advance"] }"#,
        ),
        ("ops", &admin, r#"{ actions = ["admin"] }"#),
    ]);
    (writer, admin, auth)
}

#[tokio::test]
async fn reset_floors_hold_past_the_raise_log_postgres() {
    let db = TestDb::create().await;
    let (writer, admin, auth) = reset_auth();
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&["--auth-file", &auth.path()])
        .spawn()
        .await;
    reset_floors(&gateway, &writer, &admin).await;
}

#[tokio::test]
async fn reset_floors_hold_past_the_raise_log_embedded() {
    let data = DataDir::create();
    let (writer, admin, auth) = reset_auth();
    let gateway = Gateway::builder()
        .args(&["--data-dir", &data.0.display().to_string()])
        .args(&["--auth-file", &auth.path()])
        .spawn()
        .await;
    reset_floors(&gateway, &writer, &admin).await;
}

/// The in-database fence refuses, like the HTTP API, a new term's token the gateway's
/// leases never issued: through the Postgres door, `fencegate.fence()` raises ZF005
/// and the fence does not move.
#[tokio::test]
async fn the_database_refuses_unissued_tokens_too() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&["--issued-by", "gateway:sweep*"])
        .spawn()
        .await;
    let writer = fencegate_tests::db::connect(&db.url_via(gateway.pg_addr())).await;
    let fence = |token: i64| {
        let writer = &writer;
        async move {
            writer
                .query_one("SELECT fencegate.fence('sweeper', $1)", &[&token])
                .await
        }
    };
    let forged = fence(i64::MAX)
        .await
        .expect_err("an unissued token is refused");
    let error = forged.as_db_error().expect("a database error");
    assert_eq!(error.code().code(), "ZF005", "{error:?}");
    assert_eq!(
        detail_fields(error),
        Some("resource=sweeper presented=9223372036854775807 issued=0")
    );
    let caller = Caller::new(&gateway, None);
    assert_eq!(caller.fence("sweeper").await, Value::Null);

    let token = token_of(&caller.acquire("sweeper", "node-a", 10_000).await);
    let token = i64::try_from(token).unwrap();
    assert_eq!(fence(token).await.unwrap().get::<_, i64>(0), token);
    let ahead = fence(token + 1)
        .await
        .expect_err("one above the lease is refused");
    assert_eq!(ahead.as_db_error().unwrap().code().code(), "ZF005");
    // Unbound resources are as before.
    writer
        .query_one("SELECT fencegate.fence('orders', 77)", &[])
        .await
        .unwrap();
    assert_eq!(caller.fence("sweeper").await, json!(token));
    // The door counted and logged both refusals it relayed.
    assert_eq!(
        gateway
            .client()
            .metric(r#"fencegate_token_refusals_total{reason="not_issued"}"#)
            .await,
        Some(2.0)
    );
    let logged = gateway.events("token refused by its issuer");
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert_eq!(logged[0]["fields"]["door"], "pg");
    assert_eq!(logged[0]["fields"]["presented"], json!(i64::MAX));
}
