//! `POST /v1/txn`: operations on several resources, all or nothing — one stale member,
//! one failed precondition, refuse it whole; a checked resource holds its term until
//! the commit; concurrent transactions in opposite orders neither deadlock nor lose an
//! update, next to group-committed single writes.

use std::time::Duration;

use fencegate_tests::backend_tests;
use fencegate_tests::http::{Client, Reply};
use http::Method;
use serde_json::{json, Value};

async fn txn(client: &Client, operations: Value) -> Reply {
    client
        .request(
            Method::POST,
            "/v1/txn",
            &[("content-type", "application/json")],
            json!({ "operations": operations }).to_string(),
        )
        .await
}

async fn keyed_txn(client: &Client, idem: &str, operations: Value) -> Reply {
    client
        .request(
            Method::POST,
            "/v1/txn",
            &[("idempotency-key", idem)],
            json!({ "operations": operations }).to_string(),
        )
        .await
}

/// The check of both `one_stale_member_refuses_all` tests: one stale resource refuses
/// the whole transaction, every stale one is named, nothing is written, no fence moves,
/// each stale resource is counted and logged.
async fn stale_member_refuses_all(deployment: fencegate_tests::deployment::Deployment) {
    let client = deployment.client();
    assert_eq!(client.advance("b", 9).await.status, 200);
    assert_eq!(client.advance("c", 4).await.status, 200);
    let reply = txn(
        &client,
        json!([
            {"op": "put", "resource": "a", "key": "k", "token": 5, "value": "v"},
            {"op": "put", "resource": "b", "key": "k", "token": 5, "value": "v"},
            {"op": "advance", "resource": "c", "token": 3},
            {"op": "put", "resource": "d", "key": "k", "token": 5, "value": "v"}
        ]),
    )
    .await;
    assert_eq!(reply.status, 409, "{:?}", reply.body);
    let body = reply.json();
    assert_eq!(body["error"], "stale_token");
    assert_eq!(
        body["stale"],
        json!([
            {"resource": "b", "presented": 5, "highest": 9},
            {"resource": "c", "presented": 3, "highest": 4}
        ])
    );
    assert_eq!(
        (body["resource"].as_str(), body["highest"].as_u64()),
        (Some("b"), Some(9))
    );
    assert_eq!(reply.header("fencing-highest"), Some("9"));
    for resource in ["a", "d"] {
        assert_eq!(deployment.object(resource, "k").await, None, "{resource}");
        assert_eq!(
            deployment.highest(resource).await,
            None,
            "{resource}'s fence did not move"
        );
    }
    assert_eq!(
        (deployment.highest("b").await, deployment.highest("c").await),
        (Some(9), Some(4))
    );
    assert_eq!(
        client
            .metric("fencegate_stale_rejections_total{resource=\"b\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        client
            .metric("fencegate_stale_rejections_total{resource=\"c\"}")
            .await,
        Some(1.0)
    );
    let logged = deployment.gateway.events("stale write rejected");
    let resources: Vec<&str> = logged
        .iter()
        .filter_map(|e| e["fields"]["resource"].as_str())
        .collect();
    assert_eq!(resources, ["b", "c"]);
}

backend_tests! {

/// Every kind of operation, and what each answers.
async fn operations_apply_together_and_answer_each(deployment) {
    let client = deployment.client();
    assert_eq!(client.put("jobs", "done", 3, "x").await.status, 201);
    let reply = txn(&client, json!([
        {"op": "put", "resource": "jobs", "key": "j-1", "token": 3, "value": "running"},
        {"op": "put", "resource": "queue", "key": "q", "token": 7, "value_base64": "AAEC"},
        {"op": "delete", "resource": "jobs", "key": "done", "token": 3, "if_match": 1},
        {"op": "advance", "resource": "shard-2", "token": 4},
        {"op": "check", "resource": "owner", "token": 2}
    ])).await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.json(), json!({"results": [
        {"op": "put", "resource": "jobs", "token": 3, "key": "j-1", "version": 1, "created": true},
        {"op": "put", "resource": "queue", "token": 7, "key": "q", "version": 1, "created": true},
        {"op": "delete", "resource": "jobs", "token": 3, "key": "done", "version": 2},
        {"op": "advance", "resource": "shard-2", "token": 4},
        {"op": "check", "resource": "owner", "token": 2}
    ]}));
    assert_eq!(deployment.object("queue", "q").await.unwrap().0, vec![0, 1, 2]);
    assert_eq!(deployment.object("jobs", "done").await, None);
    assert_eq!(deployment.highest("shard-2").await, Some(4));
    assert_eq!(deployment.highest("queue").await, Some(7));
    assert_eq!(deployment.highest("owner").await.unwrap_or(1), 1, "a check raises nothing");
    // The fence cache learnt the committed tokens: a stale single write is refused.
    assert_eq!(client.put("queue", "q", 6, "late").await.error_code(), "stale_token");
    // A check of an object's version.
    let checked = txn(&client, json!([
        {"op": "check", "resource": "queue", "token": 7, "key": "q", "version": 1},
        {"op": "check", "resource": "jobs", "token": 3, "key": "nothing", "version": 0}
    ])).await;
    assert_eq!(checked.status, 200, "{:?}", checked.body);
    assert_eq!(checked.json()["results"][0]["version"], 1);
}

/// One stale resource refuses the whole transaction: every stale one is named, nothing
/// is written, no fence moves, each stale resource is counted and logged. Refused by the
/// gateway's cache of fences, which saw the advances.
async fn one_stale_member_refuses_all(deployment) {
    stale_member_refuses_all(deployment).await;
}

/// The same, refused by the store itself: on Postgres, by the transaction's statement
/// in its write group.
async fn one_stale_member_refuses_all_in_the_store(deployment) ["--no-cache-rejections"] {
    stale_member_refuses_all(deployment).await;
}

/// A failed precondition refuses the whole transaction and names its operation.
async fn a_failed_precondition_refuses_all(deployment) {
    let client = deployment.client();
    assert_eq!(client.put("b", "k", 2, "one").await.status, 201);
    let reply = txn(&client, json!([
        {"op": "put", "resource": "a", "key": "k", "token": 5, "value": "v"},
        {"op": "put", "resource": "b", "key": "k", "token": 5, "value": "v", "if_match": 3}
    ])).await;
    assert_eq!(reply.status, 412, "{:?}", reply.body);
    let body = reply.json();
    assert_eq!((body["error"].as_str(), body["operation"].as_u64(), body["current"].as_u64()), (Some("version_mismatch"), Some(1), Some(1)));
    assert_eq!(deployment.object("a", "k").await, None);
    assert_eq!(deployment.highest("a").await, None);
    assert_eq!(deployment.highest("b").await, Some(2), "b's fence did not move to 5");
    let (value, _, version) = deployment.object("b", "k").await.unwrap();
    assert_eq!((value.as_slice(), version), (&b"one"[..], 1));
    // A check of an object at another version refuses too.
    let checked = txn(&client, json!([
        {"op": "advance", "resource": "a", "token": 6},
        {"op": "check", "resource": "b", "token": 2, "key": "k", "version": 0}
    ])).await;
    assert_eq!((checked.status, checked.json()["operation"].as_u64()), (412, Some(1)));
    assert_eq!(deployment.highest("a").await, None);
}

/// Bad transactions are refused before anything is applied, with the operation at fault.
async fn bad_transactions_are_refused(deployment) ["--txn-max-operations", "3", "--txn-max-bytes", "2KiB"] {
    let client = deployment.client();
    let cases = [
        (json!([]), "invalid_transaction", None),
        (json!([{"op": "put", "resource": "a", "key": "k", "token": 1, "value": "v"},
                {"op": "advance", "resource": "a", "token": 2}]), "invalid_transaction", Some(1)),
        (json!([{"op": "put", "resource": "a", "key": "k", "token": 1, "value": "v"},
                {"op": "delete", "resource": "a", "key": "k", "token": 1}]), "invalid_transaction", Some(1)),
        (json!([{"op": "put", "resource": "a", "key": "k", "token": 1}]), "invalid_transaction", Some(0)),
        (json!([{"op": "put", "resource": "a", "key": "k", "token": 1, "value_base64": "%%%"}]), "invalid_transaction", Some(0)),
        (json!([{"op": "check", "resource": "a", "token": 1, "key": "k"}]), "invalid_transaction", Some(0)),
        (json!([{"op": "move", "resource": "a", "token": 1}]), "invalid_transaction", None),
        (json!([{"op": "advance", "resource": "bad name", "token": 1}]), "invalid_transaction", None),
        (json!([{"op": "advance", "resource": "a", "token": 0}]), "invalid_transaction", None),
        (json!([{"op": "advance", "resource": "a", "token": 1}, {"op": "advance", "resource": "b", "token": 1},
                {"op": "advance", "resource": "c", "token": 1}, {"op": "advance", "resource": "d", "token": 1}]), "too_many_operations", Some(3)),
    ];
    for (operations, code, operation) in cases {
        let reply = txn(&client, operations.clone()).await;
        assert_eq!(reply.status, 400, "{operations}: {:?}", reply.body);
        assert_eq!(reply.error_code(), code, "{operations}");
        assert_eq!(reply.json()["operation"].as_u64(), operation, "{operations}");
    }
    let large = txn(&client, json!([{"op": "put", "resource": "a", "key": "k", "token": 1, "value": "v".repeat(3000)}])).await;
    assert_eq!(large.error_code(), "body_too_large");
    let not_json = client.request(Method::POST, "/v1/txn", &[], "{").await;
    assert_eq!(not_json.error_code(), "invalid_transaction");
    let get = client.request(Method::GET, "/v1/txn", &[], "").await;
    assert_eq!(get.status, 405);
    for resource in ["a", "b", "c", "d"] {
        assert_eq!(deployment.highest(resource).await, None, "{resource}");
    }
}

/// A keyed transaction is applied once and its answer replayed.
async fn a_keyed_transaction_is_applied_once(deployment) {
    let client = deployment.client();
    let operations = json!([
        {"op": "put", "resource": "a", "key": "k", "token": 2, "value": "v"},
        {"op": "put", "resource": "b", "key": "k", "token": 3, "value": "v"}
    ]);
    let first = keyed_txn(&client, "move-1", operations.clone()).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let retry = keyed_txn(&client, "move-1", operations.clone()).await;
    assert_eq!((retry.status, retry.header("idempotency-replayed"), retry.body.clone()), (200, Some("true"), first.body.clone()));
    assert_eq!(deployment.object("b", "k").await.unwrap().2, 1);
    let other = keyed_txn(&client, "move-1", json!([{"op": "advance", "resource": "a", "token": 2}])).await;
    assert_eq!(other.error_code(), "idempotency_key_reused");
    // A keyed refusal is stored, and what its transaction did before the refusal is not.
    let refused_ops = json!([
        {"op": "put", "resource": "c", "key": "k", "token": 4, "value": "v"},
        {"op": "put", "resource": "b", "key": "k", "token": 3, "value": "w", "if_match": 7}
    ]);
    let refused = keyed_txn(&client, "move-2", refused_ops.clone()).await;
    assert_eq!(refused.error_code(), "version_mismatch");
    assert_eq!(deployment.highest("c").await, None, "a refusal leaves no fence behind");
    assert_eq!(deployment.object("c", "k").await, None);
    let again = keyed_txn(&client, "move-2", refused_ops).await;
    assert_eq!((again.status, again.header("idempotency-replayed")), (412, Some("true")));
    // A member the fence cache knows stale refuses the transaction without one: nothing
    // is stored, and the retry is refused the same way.
    let stale_ops = json!([
        {"op": "put", "resource": "c", "key": "k", "token": 4, "value": "v"},
        {"op": "advance", "resource": "b", "token": 2}
    ]);
    let stale = keyed_txn(&client, "move-3", stale_ops.clone()).await;
    assert_eq!(stale.error_code(), "stale_token");
    assert_eq!(deployment.highest("c").await, None);
    let again = keyed_txn(&client, "move-3", stale_ops).await;
    assert_eq!((again.status, again.header("idempotency-replayed"), again.body.clone()), (409, None, stale.body.clone()));
}

/// Transactions over the same resources in opposite orders, and single writes of them
/// alongside (group-committed), all finish: no deadlock; and each transaction that read a
/// version and wrote on it is counted once: no lost update.
async fn concurrent_transactions_neither_deadlock_nor_lose_updates(deployment) {
    let client = deployment.client();
    assert_eq!(client.put("x", "n", 1, "0").await.status, 201);
    assert_eq!(client.put("y", "n", 1, "0").await.status, 201);
    let mut tasks = Vec::new();
    for worker in 0..8u64 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut applied = 0u64;
            for round in 0..15u64 {
                // Read both versions, then write both on them.
                let vx = client.get("x", "n").await.header("etag").unwrap().trim_matches('"').parse::<u64>().unwrap();
                let vy = client.get("y", "n").await.header("etag").unwrap().trim_matches('"').parse::<u64>().unwrap();
                let (first, second) = if worker % 2 == 0 { (("x", vx), ("y", vy)) } else { (("y", vy), ("x", vx)) };
                let reply = txn(&client, json!([
                    {"op": "put", "resource": first.0, "key": "n", "token": 1, "value": format!("{worker}.{round}"), "if_match": first.1},
                    {"op": "put", "resource": second.0, "key": "n", "token": 1, "value": format!("{worker}.{round}"), "if_match": second.1}
                ])).await;
                match reply.status {
                    200 => applied += 1,
                    412 => {}
                    other => panic!("transaction answered {other}: {:?}", reply.body),
                }
                let single = client.put("z", &format!("w{worker}"), 1, "s").await;
                assert!(single.status == 200 || single.status == 201, "{:?}", single.body);
            }
            applied
        }));
    }
    let mut applied = 0;
    for task in tasks {
        applied += tokio::time::timeout(Duration::from_secs(60), task).await.expect("no deadlock").unwrap();
    }
    assert!(applied > 0);
    let (_, _, vx) = deployment.object("x", "n").await.unwrap();
    let (_, _, vy) = deployment.object("y", "n").await.unwrap();
    assert_eq!((vx, vy), (1 + applied, 1 + applied), "every applied transaction wrote both, once");
    let (x, _, _) = deployment.object("x", "n").await.unwrap();
    let (y, _, _) = deployment.object("y", "n").await.unwrap();
    assert_eq!(x, y, "both objects hold the last transaction's value");
}

}

/// A resource only checked holds its term until the commit: a newer term's advance of it
/// waits for the transaction rather than slipping in between its check and its commit
/// (the checked-but-not-written trap). The transaction is held after its check by a lock
/// on a resource it writes, which sorts after the checked one: in a write group (whose
/// lane waits for the lock as long as the test holds it), or in a transaction of its
/// own, where a group gives up on the lock at once and `waiting_in` tells its statement.
async fn checked_resource_held_until_commit(lock_timeout: &str, waiting_in: &str) {
    use fencegate_tests::deployment::{Backend, Deployment};
    let deployment = Deployment::start_with(Backend::Postgres, |builder| {
        builder.arg("--write-lock-timeout").arg(lock_timeout)
    })
    .await;
    let client = deployment.client();
    assert_eq!(client.advance("a-owner", 5).await.status, 200);
    assert_eq!(client.advance("b-data", 5).await.status, 200);
    let lock = deployment.db().lock_fence("b-data").await;
    let held = tokio::spawn({
        let client = client.clone();
        async move {
            txn(
                &client,
                json!([
                    {"op": "put", "resource": "b-data", "key": "k", "token": 5, "value": "v"},
                    {"op": "check", "resource": "a-owner", "token": 5}
                ]),
            )
            .await
        }
    });
    let db = deployment.db();
    let waiting = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'fencegate' \
         AND datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%{waiting_in}%'"
    );
    fencegate_tests::eventually(
        Duration::from_secs(5),
        "the transaction waits on b-data after checking a-owner",
        || async { db.value::<i64>(&waiting).await >= 1 },
    )
    .await;
    let newer = tokio::spawn({
        let client = client.clone();
        async move { client.advance("a-owner", 6).await }
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(
        !newer.is_finished(),
        "the newer term's advance must wait for the transaction's commit"
    );
    drop(lock);
    let held = held.await.unwrap();
    assert_eq!(held.status, 200, "{:?}", held.body);
    assert_eq!(newer.await.unwrap().status, 200);
    assert_eq!(deployment.highest("a-owner").await, Some(6));
    assert_eq!(deployment.object("b-data", "k").await.unwrap().1, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_resource_cannot_move_before_the_commit_of_a_group() {
    checked_resource_held_until_commit(
        "60s",
        "unnest($1::text[]) WITH ORDINALITY AS u(resource, n)",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checked_resource_cannot_move_before_the_commit_of_a_transaction_alone() {
    checked_resource_held_until_commit("1ms", "VALUES ($1, 1, ''txn'')").await;
}

/// With authentication, every operation needs its own grant; one missing refuses all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_operation_needs_its_grant() {
    use fencegate_gateway::auth::{new_key, stored_hash};
    use fencegate_tests::deployment::DataDir;
    use fencegate_tests::inprocess::{Api, InProcess};
    let dir = DataDir::create();
    let key = new_key();
    let file = dir.0.join("auth.toml");
    std::fs::write(
        &file,
        format!(
            "[[identity]]\nname = \"mover\"\nkeys = [{:?}]\ngrants = [{{ resources = [\"src\"], actions = [\"write\", \"read\"] }}, {{ resources = [\"dst\"], actions = [\"read\"] }}]\n",
            stored_hash(&key)
        ),
    )
    .unwrap();
    let gateway = InProcess::start(&["--auth-file", &file.display().to_string()]).await;
    let client = gateway.client();
    let bearer = format!("Bearer {key}");
    let send = |operations: Value| {
        let (client, bearer) = (client.clone(), bearer.clone());
        async move {
            client
                .request(
                    Method::POST,
                    "/v1/txn",
                    &[("authorization", &bearer)],
                    json!({ "operations": operations }).to_string(),
                )
                .await
        }
    };
    let refused = send(json!([
        {"op": "put", "resource": "src", "key": "k", "token": 1, "value": "refused"},
        {"op": "put", "resource": "dst", "key": "k", "token": 1, "value": "v"}
    ]))
    .await;
    assert_eq!(refused.status, 403, "{:?}", refused.body);
    assert_eq!(refused.json()["error"], "forbidden");
    let allowed = send(json!([
        {"op": "put", "resource": "src", "key": "k", "token": 1, "value": "v"},
        {"op": "check", "resource": "dst", "token": 1}
    ]))
    .await;
    assert_eq!(allowed.status, 200, "{:?}", allowed.body);
    let read = client
        .request(
            Method::GET,
            "/v1/kv/src/k",
            &[("authorization", &bearer)],
            "",
        )
        .await;
    assert_eq!(&read.body[..], b"v", "{:?}", read.body);
    assert_eq!(
        read.header("etag"),
        Some("\"1\""),
        "only the allowed transaction wrote"
    );
}
