//! Writes sent with an `Idempotency-Key`: applied once, their answer stored in the same
//! transaction and replayed to every retry; a key reused for another request refused;
//! a retry while the first attempt runs told to wait; keys expire; per identity.

use std::time::Duration;

use fencegate_tests::backend_tests;
use fencegate_tests::http::{advance_path, kv_path, Client, Reply};
use http::Method;

async fn keyed_put(
    client: &Client,
    resource: &str,
    key: &str,
    token: u64,
    idem: &str,
    value: &str,
) -> Reply {
    let token = token.to_string();
    client
        .request(
            Method::PUT,
            &kv_path(resource, key),
            &[("fencing-token", &token), ("idempotency-key", idem)],
            value.to_owned(),
        )
        .await
}

fn replayed(reply: &Reply) -> bool {
    reply.header("idempotency-replayed") == Some("true")
}

backend_tests! {

/// A retry gets the first answer, byte for byte, and the object is written once; a
/// new key is a new write.
async fn a_retry_gets_the_stored_answer_and_applies_nothing(deployment) {
    let client = deployment.client();
    let first = keyed_put(&client, "orders", "o-1", 5, "order-1-attempt", "paid").await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert!(!replayed(&first), "a first attempt is not a replay");
    for _ in 0..3 {
        let retry = keyed_put(&client, "orders", "o-1", 5, "order-1-attempt", "paid").await;
        assert_eq!(retry.status, 201);
        assert!(replayed(&retry), "{:?}", retry.headers);
        assert_eq!(retry.body, first.body, "the very bytes of the first answer");
        assert_eq!(retry.header("etag"), Some("\"1\""));
        assert_eq!(retry.header("content-type"), Some("application/json"));
    }
    let (value, token, version) = deployment.object("orders", "o-1").await.unwrap();
    assert_eq!((value.as_slice(), token, version), (&b"paid"[..], 5, 1), "written once");

    let another = keyed_put(&client, "orders", "o-1", 5, "order-1-second", "paid").await;
    assert_eq!((another.status, replayed(&another)), (200, false));
    assert_eq!(another.json()["version"], 2);
    assert_eq!(client.metric("fencegate_idempotency_requests_total{outcome=\"replayed\"}").await, Some(3.0));
    assert_eq!(client.metric("fencegate_idempotency_requests_total{outcome=\"stored\"}").await, Some(2.0));
}

/// An accepted write's retry is answered from its record after a newer term began,
/// where the same write without a key would be stale; and a refusal stays a refusal
/// once the reason for it is gone.
async fn answers_do_not_change_with_the_state_after_them(deployment) {
    let client = deployment.client();
    assert_eq!(keyed_put(&client, "jobs", "j", 5, "k-accepted", "v").await.status, 201);
    assert_eq!(client.advance("jobs", 9).await.status, 200);
    let retry = keyed_put(&client, "jobs", "j", 5, "k-accepted", "v").await;
    assert_eq!((retry.status, replayed(&retry)), (201, true), "{:?}", retry.body);
    let unkeyed = client.put("jobs", "j", 5, "v").await;
    assert_eq!(unkeyed.error_code(), "stale_token");

    // A write that must create the object is refused while it exists...
    let must_create = |idem: &'static str| {
        let client = client.clone();
        async move {
            client
                .request(
                    Method::PUT,
                    &kv_path("jobs", "j"),
                    &[("fencing-token", "9"), ("if-none-match", "*"), ("idempotency-key", idem)],
                    "new",
                )
                .await
        }
    };
    let refused = must_create("k-refused").await;
    assert_eq!(refused.status, 412, "{:?}", refused.body);
    // ...and its retry stays refused once the object is gone, though it would now apply.
    assert_eq!(client.delete("jobs", "j", 9).await.status, 200);
    let retry = must_create("k-refused").await;
    assert_eq!((retry.status, replayed(&retry)), (412, true));
    assert_eq!(retry.body, refused.body);
    assert_eq!(deployment.object("jobs", "j").await, None, "the refusal applied nothing");

    // A stale write the fence cache knows stale is refused without a transaction and
    // stores nothing; its retry, stale for good, gets the same refusal.
    let stale = keyed_put(&client, "jobs", "j", 3, "k-stale", "late").await;
    assert_eq!(stale.error_code(), "stale_token");
    assert_eq!(stale.header("fencing-highest"), Some("9"));
    let again = keyed_put(&client, "jobs", "j", 3, "k-stale", "late").await;
    assert_eq!((again.status, replayed(&again), again.body.clone()), (409, false, stale.body.clone()));
    assert_eq!(again.header("fencing-highest"), Some("9"));
    assert_eq!(deployment.highest("jobs").await, Some(9));
    assert_eq!(client.metric("fencegate_idempotency_requests_total{outcome=\"stale\"}").await, Some(2.0));
}

/// A flood of stale keyed writes with fresh keys — what a paused old leader's client
/// sends, keying every write — is refused from the fence cache without a transaction:
/// nothing is stored for any of them, and an accepted write's retry is still answered
/// from its record.
async fn stale_keyed_writes_store_nothing(deployment) {
    let client = deployment.client();
    assert_eq!(keyed_put(&client, "feed", "f", 5, "accepted", "v").await.status, 201);
    assert_eq!(client.advance("feed", 6).await.status, 200);
    for n in 0..200 {
        let stale = keyed_put(&client, "feed", "f", 5, &format!("late-{n}"), "late").await;
        assert_eq!(stale.error_code(), "stale_token");
    }
    let retry = keyed_put(&client, "feed", "f", 5, "accepted", "v").await;
    assert_eq!((retry.status, replayed(&retry)), (201, true));
    assert_eq!(client.metric("fencegate_idempotency_requests_total{outcome=\"stale\"}").await, Some(200.0));
    assert_eq!(client.metric("fencegate_idempotency_requests_total{outcome=\"stored\"}").await, Some(1.0));
    assert_eq!(client.metric("fencegate_cache_rejections_total").await, Some(200.0));
    fencegate_tests::eventually(Duration::from_secs(5), "the stored answers counted", || async {
        client.metric("fencegate_idempotency_stored_records").await == Some(1.0)
    })
    .await;
}


/// The same key with any other request — another value, token, precondition, path or
/// method — is refused with 422 and applies nothing.
async fn a_key_reused_for_another_request_is_refused(deployment) {
    let client = deployment.client();
    assert_eq!(keyed_put(&client, "shards", "s", 4, "k", "a").await.status, 201);
    for (method, path, headers, body) in [
        (Method::PUT, kv_path("shards", "s"), vec![("fencing-token", "4")], "b"),
        (Method::PUT, kv_path("shards", "s"), vec![("fencing-token", "5")], "a"),
        (Method::PUT, kv_path("shards", "s"), vec![("fencing-token", "4"), ("if-match", "\"1\"")], "a"),
        (Method::PUT, kv_path("shards", "t"), vec![("fencing-token", "4")], "a"),
        (Method::DELETE, kv_path("shards", "s"), vec![("fencing-token", "4")], ""),
        (Method::POST, advance_path("shards"), vec![("fencing-token", "4")], ""),
    ] {
        let mut headers = headers;
        headers.push(("idempotency-key", "k"));
        let reply = client.request(method.clone(), &path, &headers, body).await;
        assert_eq!(reply.status, 422, "{method} {path} {headers:?}: {:?}", reply.body);
        assert_eq!(reply.error_code(), "idempotency_key_reused");
    }
    let (value, _, version) = deployment.object("shards", "s").await.unwrap();
    assert_eq!((value.as_slice(), version), (&b"a"[..], 1));
    assert_eq!(deployment.object("shards", "t").await, None);
    assert_eq!(deployment.highest("shards").await, Some(4));
    assert_eq!(client.metric("fencegate_idempotency_requests_total{outcome=\"key_reused\"}").await, Some(6.0));
}

/// A keyed advance and a keyed delete are replayed too.
async fn advances_and_deletes_are_replayed(deployment) {
    let client = deployment.client();
    let advance = |token: &'static str| {
        let client = client.clone();
        async move {
            client
                .request(Method::POST, &advance_path("queue"), &[("fencing-token", token), ("idempotency-key", "adv")], "")
                .await
        }
    };
    let first = advance("6").await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(client.advance("queue", 8).await.status, 200);
    let retry = advance("6").await;
    assert_eq!((retry.status, replayed(&retry), retry.body.clone()), (200, true, first.body.clone()));
    assert_eq!(deployment.highest("queue").await, Some(8));

    assert_eq!(client.put("queue", "item", 8, "x").await.status, 201);
    let delete = || {
        let client = client.clone();
        async move {
            client
                .request(Method::DELETE, &kv_path("queue", "item"), &[("fencing-token", "8"), ("idempotency-key", "del")], "")
                .await
        }
    };
    let first = delete().await;
    assert_eq!(first.json()["version"], 2);
    assert_eq!(client.put("queue", "item", 8, "y").await.json()["version"], 3);
    let retry = delete().await;
    assert_eq!((retry.status, replayed(&retry)), (200, true));
    assert_eq!(retry.json()["version"], 2);
    assert_eq!(client.get("queue", "item").await.status, 200, "the retry deleted nothing");
}

/// After `--idempotency-ttl` a key is free: the same request applies again, and the
/// expired answers are removed in the background.
async fn keys_expire(deployment) ["--idempotency-ttl", "1s"] {
    let client = deployment.client();
    assert_eq!(keyed_put(&client, "ttl", "k", 2, "once", "v").await.status, 201);
    assert!(replayed(&keyed_put(&client, "ttl", "k", 2, "once", "v").await));
    tokio::time::sleep(Duration::from_millis(1300)).await;
    let later = keyed_put(&client, "ttl", "k", 2, "once", "v").await;
    assert_eq!((later.status, replayed(&later)), (200, false), "{:?}", later.body);
    assert_eq!(later.json()["version"], 2);
    // Another key, left to expire, is removed by the cleanup.
    assert_eq!(keyed_put(&client, "ttl", "k2", 2, "left", "v").await.status, 201);
    fencegate_tests::eventually(Duration::from_secs(10), "the expired answer is removed", || {
        let client = client.clone();
        async move { client.metric("fencegate_idempotency_expired_total").await.unwrap_or(0.0) >= 1.0 }
    })
    .await;
}

/// Keys that are not 1–255 printable ASCII bytes, or sent twice, are refused before
/// anything is read or applied.
async fn invalid_keys_are_refused(deployment) {
    let client = deployment.client();
    let long = "k".repeat(256);
    for key in ["", long.as_str(), "tab\there"] {
        let reply = client
            .request(Method::PUT, &kv_path("bad", "k"), &[("fencing-token", "1"), ("idempotency-key", key)], "v")
            .await;
        assert_eq!(reply.status, 400, "{key:?}");
        assert_eq!(reply.error_code(), "invalid_idempotency_key");
    }
    let twice = client
        .request(Method::PUT, &kv_path("bad", "k"), &[("fencing-token", "1"), ("idempotency-key", "a"), ("idempotency-key", "a")], "v")
        .await;
    assert_eq!(twice.error_code(), "invalid_idempotency_key");
    assert_eq!(deployment.highest("bad").await, None);
}

/// A keyed write survives the gateway's kill -9: its answer was stored with it.
async fn answers_survive_a_crash(deployment) {
    let mut deployment = deployment;
    let first = keyed_put(&deployment.client(), "c", "k", 3, "crash", "v").await;
    assert_eq!(first.status, 201);
    deployment.gateway.kill().await;
    deployment.gateway = deployment.builder().spawn().await;
    let retry = keyed_put(&deployment.client(), "c", "k", 3, "crash", "v").await;
    assert_eq!((retry.status, replayed(&retry), retry.body.clone()), (201, true, first.body.clone()));
    assert_eq!(deployment.object("c", "k").await.unwrap().2, 1);
}

}

/// A retry while the first attempt still runs — here held on a fence lock — is told to
/// come back (409 with Retry-After), applies nothing, and then gets the first answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_while_the_first_attempt_runs_is_told_to_wait() {
    use fencegate_tests::deployment::{Backend, Deployment};
    let deployment = Deployment::start(Backend::Postgres).await;
    let client = deployment.client();
    assert_eq!(client.advance("held", 2).await.status, 200);
    let lock = deployment.db().lock_fence("held").await;
    let first = tokio::spawn({
        let client = client.clone();
        async move { keyed_put(&client, "held", "k", 2, "slow", "v").await }
    });
    // The first attempt has claimed its key and waits on the fence.
    let db = deployment.db();
    fencegate_tests::eventually(Duration::from_secs(5), "the first attempt waits on the fence lock", || async {
        db.value::<i64>("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%fencegate.fences%'").await == 1
    })
    .await;
    let retry = keyed_put(&client, "held", "k", 2, "slow", "v").await;
    assert_eq!(retry.status, 409, "{:?}", retry.body);
    assert_eq!(retry.error_code(), "idempotency_in_flight");
    assert_eq!(retry.header("retry-after"), Some("1"));
    drop(lock);
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, replayed(&first)),
        (201, false),
        "{:?}",
        first.body
    );
    let after = keyed_put(&client, "held", "k", 2, "slow", "v").await;
    assert_eq!((after.status, replayed(&after)), (201, true));
    assert_eq!(
        deployment.object("held", "k").await.unwrap().2,
        1,
        "applied once"
    );
    assert_eq!(
        client
            .metric("fencegate_idempotency_requests_total{outcome=\"in_flight\"}")
            .await,
        Some(1.0)
    );
}

/// Another replica on the same database answers a retry from the same record (an
/// embedded store has one gateway only: its file is locked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_replica_sees_the_record() {
    use fencegate_tests::deployment::{Backend, Deployment};
    let deployment = Deployment::start(Backend::Postgres).await;
    let other = deployment.builder().spawn().await;
    let first = keyed_put(&deployment.client(), "r", "k", 3, "k", "v").await;
    assert_eq!(first.status, 201);
    let retry = keyed_put(&other.client(), "r", "k", 3, "k", "v").await;
    assert_eq!(
        (retry.status, replayed(&retry), retry.body.clone()),
        (201, true, first.body.clone())
    );
    assert_eq!(deployment.object("r", "k").await.unwrap().2, 1);
}

/// A keyed `/v1/sql` transaction commits once: its answer is stored inside it (through
/// the gateway's key: the SQL login may not touch the record itself), a refusal is
/// stored after what its statements did is rolled back, and with `--sql-role` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_sql_transactions_commit_once() {
    use fencegate_tests::db::TestDb;
    use fencegate_tests::gateway::Gateway;
    let db = TestDb::create().await;
    db.execute("CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL); INSERT INTO counter VALUES (1, 0);")
        .await;
    let sql_login = db.create_role("sql", "LOGIN").await;
    let sql_role = db.create_role("sqlrole", "NOLOGIN").await;
    db.execute(&format!(
        "GRANT {sql_role} TO {sql_login};
         GRANT USAGE ON SCHEMA public TO {sql_role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {sql_role};"
    ))
    .await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.url_as(&sql_login))
        .args(&["--sql-role", &sql_role])
        .spawn()
        .await;
    let client = gateway.client();
    let send = |token: u64, idem: &'static str, statements: serde_json::Value| {
        let client = client.clone();
        async move {
            let token = token.to_string();
            client
                .request(
                    Method::POST,
                    "/v1/sql/counter",
                    &[("fencing-token", &token), ("idempotency-key", idem)],
                    statements.to_string(),
                )
                .await
        }
    };
    let bump = serde_json::json!({"statements": [{"sql": "UPDATE counter SET n = n + 1 WHERE id = 1 RETURNING n"}]});
    let first = send(3, "bump-1", bump.clone()).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    assert_eq!(first.json()["results"][0]["rows"][0][0], 1);
    let retry = send(3, "bump-1", bump.clone()).await;
    assert_eq!(
        (retry.status, replayed(&retry), retry.body.clone()),
        (200, true, first.body.clone())
    );
    assert_eq!(
        db.value::<i32>("SELECT n FROM counter").await,
        1,
        "committed once"
    );

    // A refusal after a statement that wrote: rolled back, stored, replayed.
    let failing = serde_json::json!({"statements": [
        {"sql": "UPDATE counter SET n = n + 1 WHERE id = 1"},
        {"sql": "INSERT INTO counter VALUES (1, 0)"}
    ]});
    let refused = send(3, "bump-2", failing.clone()).await;
    assert_eq!(
        (refused.status, refused.json()["sqlstate"].as_str()),
        (400, Some("23505")),
        "{:?}",
        refused.body
    );
    let again = send(3, "bump-2", failing).await;
    assert_eq!(
        (again.status, replayed(&again), again.body.clone()),
        (400, true, refused.body.clone())
    );
    assert_eq!(
        db.value::<i32>("SELECT n FROM counter").await,
        1,
        "the refused transaction wrote nothing"
    );

    // A stale write the fence cache knows stale is refused without a transaction; its
    // retry, stale for good, is refused the same way.
    assert_eq!(client.advance("counter", 9).await.status, 200);
    let stale = send(4, "bump-3", bump.clone()).await;
    assert_eq!(stale.error_code(), "stale_token");
    let stale_again = send(4, "bump-3", bump.clone()).await;
    assert_eq!((stale_again.status, replayed(&stale_again)), (409, false));
    assert_eq!(stale_again.body, stale.body);
    let reused = send(9, "bump-1", bump).await;
    assert_eq!(reused.error_code(), "idempotency_key_reused");
    assert_eq!(db.value::<i32>("SELECT n FROM counter").await, 1);
    // The login cannot read the records itself.
    let peek = client
        .sql("counter", 9, serde_json::json!({"statements": [{"sql": "SELECT count(*) FROM fencegate.idempotency"}]}))
        .await;
    assert_eq!(peek.status, 400, "{:?}", peek.body);
}

backend_tests! {

/// A keyed lease step is applied once: a retried acquire gets the first term's answer,
/// not a second term.
async fn keyed_lease_steps_are_applied_once(deployment) {
    let client = deployment.client();
    let acquire = |idem: &'static str, holder: &'static str| {
        let client = client.clone();
        async move {
            client
                .request(Method::POST, "/v1/leases/leader/acquire", &[("idempotency-key", idem)], serde_json::json!({"holder": holder, "ttl_ms": 60000}).to_string())
                .await
        }
    };
    let first = acquire("acq-1", "node-a").await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let token = first.json()["token"].as_u64().unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    let retry = acquire("acq-1", "node-a").await;
    assert_eq!((retry.status, replayed(&retry)), (200, true));
    // The same term, with the time it has left as of the retry, not of the first answer.
    let (first_state, retried) = (first.json(), retry.json());
    assert_eq!((&retried["token"], &retried["holder"], &retried["held"]), (&first_state["token"], &first_state["holder"], &serde_json::json!(true)));
    let (before, now) = (first_state["expires_in_ms"].as_u64().unwrap(), retried["expires_in_ms"].as_u64().unwrap());
    assert!(now + 300 <= before, "{now} ms left on the retry, {before} on the first answer");
    let held = acquire("acq-2", "node-b").await;
    assert_eq!(held.error_code(), "lease_held");
    assert_eq!(acquire("acq-2", "node-b").await.body, held.body, "a refusal is stored too");
    let lease = client.get_path("/v1/leases/leader").await.json();
    assert_eq!((lease["token"].as_u64(), lease["holder"].as_str()), (Some(token), Some("node-a")), "one term");
    assert_eq!(acquire("acq-1", "node-z").await.error_code(), "idempotency_key_reused");
}

}

/// The answers stored under keys are bounded per identity and in total: past its bound,
/// an identity's keyed writes with new keys are refused (429, nothing applied), while
/// its stored keys are replayed and its writes without a key apply; another identity
/// keys on until the total is reached, and then nobody's new key is taken.
async fn stored_answers_are_bounded(builder: fencegate_tests::gateway::GatewayBuilder) {
    use fencegate_tests::auth_file::AuthFile;
    let (a, b) = (
        fencegate_gateway::auth::new_key(),
        fencegate_gateway::auth::new_key(),
    );
    let grant = r#"{ resources = ["*"], actions = ["read", "write", "metrics"] }"#;
    let auth = AuthFile::new(&[("a", &a, grant), ("b", &b, grant)]);
    let gateway = builder
        .args(&["--auth-file", &auth.path()])
        .args(&[
            "--idempotency-identity-max-records",
            "3",
            "--idempotency-max-bytes",
            "1KiB",
        ])
        .spawn()
        .await;
    let client = gateway.client();
    let put = |who: &str, key: &str, idem: Option<&str>| {
        let bearer = format!("Bearer {who}");
        let (client, key, idem) = (client.clone(), key.to_owned(), idem.map(str::to_owned));
        async move {
            let mut headers = vec![("fencing-token", "1"), ("authorization", bearer.as_str())];
            if let Some(idem) = &idem {
                headers.push(("idempotency-key", idem.as_str()));
            }
            client
                .request(Method::PUT, &kv_path("quota", &key), &headers, "v")
                .await
        }
    };
    let stored = |records: f64| {
        let (client, bearer) = (client.clone(), format!("Bearer {a}"));
        async move {
            fencegate_tests::eventually(
                Duration::from_secs(5),
                "the stored answers counted",
                || {
                    let (client, bearer) = (client.clone(), bearer.clone());
                    async move {
                        let metrics = client
                            .request(Method::GET, "/metrics", &[("authorization", &bearer)], "")
                            .await;
                        let text = String::from_utf8_lossy(&metrics.body).into_owned();
                        fencegate_tests::http::metric_value(
                            &text,
                            "fencegate_idempotency_stored_records",
                        ) >= Some(records)
                    }
                },
            )
            .await;
        }
    };
    for n in 0..3 {
        let idem = format!("a-{n}");
        assert_eq!(put(&a, &format!("a{n}"), Some(&idem)).await.status, 201);
    }
    stored(3.0).await;
    let refused = put(&a, "a3", Some("a-3")).await;
    assert_eq!(
        (refused.status, refused.error_code().as_str()),
        (429, "idempotency_quota_exceeded")
    );
    assert!(refused.json()["message"]
        .as_str()
        .unwrap()
        .contains("--idempotency-identity-max-records"));
    assert_eq!(
        put(&a, "a3", None).await.status,
        201,
        "a write without a key"
    );
    let retry = put(&a, "a0", Some("a-0")).await;
    assert_eq!(
        (retry.status, replayed(&retry)),
        (201, true),
        "a stored key is replayed"
    );

    // Identity b keys on, until the total is reached.
    let mut n = 0;
    loop {
        let reply = put(&b, &format!("b{n}"), Some(&format!("b-{n}"))).await;
        if reply.status == 429 {
            assert!(reply.json()["message"]
                .as_str()
                .unwrap()
                .contains("--idempotency-max-bytes"));
            break;
        }
        assert_eq!(reply.status, 201, "{:?}", reply.json());
        n += 1;
        assert!(n < 30, "the total bound was never met");
        stored(3.0 + n as f64).await;
    }
    assert!(
        n >= 1,
        "identity b stored {n} answers before the total was met"
    );
    let object = client
        .request(
            Method::GET,
            &kv_path("quota", "a3x"),
            &[("authorization", &format!("Bearer {b}"))],
            "",
        )
        .await;
    assert_eq!(object.status, 404);
}

#[tokio::test]
async fn stored_answers_are_bounded_postgres() {
    let db = fencegate_tests::db::TestDb::create().await;
    stored_answers_are_bounded(fencegate_tests::gateway::Gateway::builder().database(&db.url()))
        .await;
}

#[tokio::test]
async fn stored_answers_are_bounded_embedded() {
    let data = fencegate_tests::deployment::DataDir::create();
    let dir = data.0.display().to_string();
    stored_answers_are_bounded(
        fencegate_tests::gateway::Gateway::builder().args(&["--data-dir", &dir]),
    )
    .await;
}

/// A keyed `/v1/sql` answer is stored for every retry, so it is cut at
/// `--idempotency-max-answer` (as `--sql-max-response` cuts any); the same transaction
/// without a key is not.
#[tokio::test]
async fn a_keyed_sql_answer_is_cut_where_a_stored_answer_must_end() {
    use fencegate_tests::db::TestDb;
    use fencegate_tests::gateway::Gateway;
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .args(&["--idempotency-max-answer", "16KiB"])
        .spawn()
        .await;
    let client = gateway.client();
    let select = serde_json::json!({"statements": [
        {"sql": "SELECT n, repeat('x', 100) AS pad FROM generate_series(1, 1000) AS n"}
    ]})
    .to_string();
    let send = |idem: Option<&'static str>| {
        let (client, select) = (client.clone(), select.clone());
        async move {
            let mut headers = vec![("fencing-token", "1")];
            if let Some(idem) = idem {
                headers.push(("idempotency-key", idem));
            }
            client
                .request(Method::POST, "/v1/sql/r", &headers, select)
                .await
        }
    };
    let whole = send(None).await;
    assert_eq!(
        whole.json()["results"][0]["rows"].as_array().unwrap().len(),
        1000
    );
    let keyed = send(Some("big-select")).await;
    assert_eq!(keyed.status, 200, "{:?}", keyed.body);
    assert!(
        keyed.body.len() < 20 * 1024,
        "an answer of {} bytes",
        keyed.body.len()
    );
    assert_eq!(keyed.json()["results"][0]["truncated_by"], "bytes");
    let retry = send(Some("big-select")).await;
    assert_eq!(
        (replayed(&retry), retry.body.clone()),
        (true, keyed.body.clone())
    );
}

/// A fence reset takes no key: refused before anything is done.
#[tokio::test]
async fn a_reset_refuses_a_key() {
    use fencegate_tests::inprocess::{Api, InProcess};
    let gateway = InProcess::start(&[]).await;
    let reply = gateway
        .client()
        .request(
            Method::POST,
            "/v1/fences/r/reset",
            &[("idempotency-key", "k")],
            r#"{"to": 1, "reason": "x"}"#,
        )
        .await;
    assert_eq!(
        reply.error_code(),
        "invalid_idempotency_key",
        "{:?}",
        reply.body
    );
}
