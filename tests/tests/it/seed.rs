//! The source articles' timelines, through the real gateway and a real Postgres.

use std::time::Duration;

use fencegate_tests::http::{metric_value, Client};
use fencegate_tests::proxy::Proxy;
use fencegate_tests::{api_tests, backend_tests, eventually};
use http::Method;

backend_tests! {

/// Seed 002: 41 accepted, 42 accepted, 41 rejected with presented 41 / highest 42 —
/// answered, stored, counted and logged.
async fn tokens_41_42_41(deployment) {
    let gateway = &deployment.gateway;
    let client = gateway.client();

    let first = client
        .request(Method::PUT, "/v1/kv/orders/o-1", &[("fencing-token", "41"), ("fencing-holder", "node-a")], "from 41")
        .await;
    assert_eq!(first.status, 201, "{:?}", first.body);
    assert_eq!(first.json(), serde_json::json!({"resource": "orders", "key": "o-1", "token": 41, "version": 1}));

    let second = client.put("orders", "o-1", 42, "from 42").await;
    assert_eq!(second.status, 200);
    assert_eq!(second.json()["version"], 2);

    let stale = client
        .request(Method::PUT, "/v1/kv/orders/o-1", &[("fencing-token", "41"), ("fencing-holder", "node-a")], "late 41")
        .await;
    assert_eq!(stale.status, 409);
    assert_eq!(stale.header("fencing-highest"), Some("42"));
    let body = stale.json();
    assert_eq!(body["error"], "stale_token");
    assert_eq!((body["resource"].as_str(), body["presented"].as_u64(), body["highest"].as_u64()), (Some("orders"), Some(41), Some(42)));

    let read = client.get("orders", "o-1").await;
    assert_eq!(read.status, 200);
    assert_eq!(&read.body[..], b"from 42");
    assert_eq!(read.header("etag"), Some("\"2\""));
    assert_eq!(read.header("fencing-token"), Some("42"));
    assert_eq!(deployment.highest("orders").await, Some(42));
    assert_eq!(deployment.object("orders", "o-1").await, Some((b"from 42".to_vec(), 42, 2)));

    let metrics = client.metrics().await;
    let value = |series| metric_value(&metrics, series);
    assert_eq!(value("fencegate_stale_rejections_total{resource=\"orders\"}"), Some(1.0));
    assert_eq!(value("fencegate_last_rejected_token{resource=\"orders\"}"), Some(41.0));
    assert_eq!(value("fencegate_highest_token{resource=\"orders\"}"), Some(42.0));
    assert_eq!(value("fencegate_rejected_token_lag_sum"), Some(1.0));
    assert_eq!(value("fencegate_requests_total{outcome=\"stale_token\",route=\"kv_put\"}"), Some(1.0));

    let events = gateway.events("stale write rejected");
    assert_eq!(events.len(), 1, "{events:?}");
    let fields = &events[0]["fields"];
    assert_eq!(fields["resource"], "orders");
    assert_eq!(fields["key"], "o-1");
    assert_eq!(fields["presented"], 41);
    assert_eq!(fields["highest"], 42);
    assert_eq!(fields["holder"], "node-a");
    assert_eq!(fields["outcome"], "stale_token");
    assert_eq!(fields["rejections"], 1);
}

}

api_tests! {

/// Seed 002, delayed request: A's write(7) is sent, then held in the network while
/// B writes with 8; delivered afterwards, it is rejected with presented 7, highest 8.
async fn delayed_request_from_an_old_term_is_rejected(gateway) {
    let direct = gateway.client();
    let network = Proxy::start(gateway.addr()).await;
    let via_network = Client::new(format!("http://{}", network.addr()));

    // t0: A holds token 7 and has written before.
    assert_eq!(direct.put("ledger", "balance", 7, "a-0").await.status, 201);
    // t1: A sends write(7); the network holds it.
    network.hold();
    let delayed = tokio::spawn(async move { via_network.put("ledger", "balance", 7, "a-1 (delayed)").await });
    eventually(Duration::from_secs(5), "the delayed request to reach the network", || async {
        network.held_bytes() > 0
    })
    .await;
    // t3-t4: B acquires token 8 and writes; accepted.
    let b = direct.put("ledger", "balance", 8, "b-1").await;
    assert_eq!(b.status, 200);
    // t5: the delayed write(7) arrives.
    network.release();
    let late = delayed.await.unwrap();
    assert_eq!(late.status, 409);
    assert_eq!((late.json()["presented"].as_u64(), late.json()["highest"].as_u64()), (Some(7), Some(8)));
    assert_eq!(gateway.object("ledger", "balance").await, Some((b"b-1".to_vec(), 8, 2)));
}

/// The promise step: a new holder advances the fence before writing anything, and
/// the old term's writes are rejected at once; the advance itself writes no object.
async fn advance_fences_out_the_old_term_before_the_first_write(gateway) {
    let client = gateway.client();
    assert_eq!(client.put("jobs", "cursor", 7, "a").await.status, 201);

    let advanced = client.advance("jobs", 8).await;
    assert_eq!(advanced.status, 200);
    assert_eq!(advanced.json(), serde_json::json!({"resource": "jobs", "highest": 8}));
    assert_eq!(client.advance("jobs", 8).await.status, 200, "advancing to the same token is accepted");

    let old = client.put("jobs", "cursor", 7, "stale").await;
    assert_eq!(old.status, 409);
    assert_eq!(old.json()["highest"], 8);
    let old_advance = client.advance("jobs", 7).await;
    assert_eq!(old_advance.status, 409);
    assert_eq!(old_advance.json()["presented"], 7);

    assert_eq!(client.fence("jobs").await.json(), serde_json::json!({"resource": "jobs", "highest": 8}));
    assert_eq!(client.fence("never-written").await.json(), serde_json::json!({"resource": "never-written", "highest": null}));
    assert_eq!(gateway.object("jobs", "cursor").await, Some((b"a".to_vec(), 7, 1)));
}

/// Same token, ordered by If-Match; a failed precondition leaves the fence untouched.
async fn if_match_orders_writes_within_one_epoch(gateway) {
    let client = gateway.client();
    let put = |token: &'static str, condition: (&'static str, &'static str), value: &'static str| {
        let client = client.clone();
        async move {
            client
                .request(Method::PUT, "/v1/kv/accounts/acct-1", &[("fencing-token", token), condition], value)
                .await
        }
    };

    let created = put("5", ("if-match", "\"0\""), "v1").await;
    assert_eq!(created.status, 201);
    let again = put("5", ("if-none-match", "*"), "v1 again").await;
    assert_eq!(again.status, 412);
    assert_eq!(again.json()["error"], "version_mismatch");
    assert_eq!(again.json()["current"], 1);

    assert_eq!(put("5", ("if-match", "\"1\""), "v2").await.status, 200);
    let lost_race = put("5", ("if-match", "\"1\""), "v2 from the loser").await;
    assert_eq!(lost_race.status, 412);
    assert_eq!(lost_race.json()["current"], 2);

    // A newer term whose precondition fails must not raise the fence.
    let failed = put("9", ("if-match", "\"1\""), "never").await;
    assert_eq!(failed.status, 412);
    assert_eq!(gateway.highest("accounts").await, Some(5));
    assert_eq!(client.put("accounts", "acct-1", 6, "v3 from term 6").await.status, 200);

    // The fence is checked before the precondition.
    let stale = put("5", ("if-match", "\"3\""), "stale").await;
    assert_eq!(stale.status, 409);
    assert_eq!(gateway.object("accounts", "acct-1").await, Some((b"v3 from term 6".to_vec(), 6, 3)));
    let missing = client
        .request(Method::PUT, "/v1/kv/accounts/acct-2", &[("fencing-token", "6"), ("if-match", "*")], "x")
        .await;
    assert_eq!(missing.status, 412);
    assert_eq!(missing.json()["current"], serde_json::Value::Null);
}

/// Deletes leave a tombstone: versions keep rising, and a delete raises the fence even
/// when there is nothing to delete.
async fn deletes_raise_the_fence_and_keep_versions_rising(gateway) {
    let client = gateway.client();

    let nothing = client.delete("files", "a.txt", 3).await;
    assert_eq!(nothing.status, 200);
    assert_eq!(nothing.json()["version"], 0);
    assert_eq!(gateway.highest("files").await, Some(3));

    assert_eq!(client.put("files", "a.txt", 3, "one").await.json()["version"], 1);
    let deleted = client.delete("files", "a.txt", 4).await;
    assert_eq!(deleted.status, 200);
    assert_eq!(deleted.json(), serde_json::json!({"resource": "files", "key": "a.txt", "token": 4, "version": 2}));
    assert_eq!(client.get("files", "a.txt").await.status, 404);
    assert_eq!(client.get("files", "a.txt").await.error_code(), "not_found");
    assert_eq!(client.delete("files", "a.txt", 4).await.json()["version"], 2);

    let recreated = client.put("files", "a.txt", 4, "two").await;
    assert_eq!(recreated.status, 201, "re-created after a delete");
    assert_eq!(recreated.json()["version"], 3);
    assert_eq!(client.delete("files", "a.txt", 3).await.status, 409);
    assert_eq!(gateway.object("files", "a.txt").await, Some((b"two".to_vec(), 4, 3)));
}

/// A token fences only its own resource; keys of one resource share its fence.
async fn the_fence_scope_is_the_resource(gateway) {
    let client = gateway.client();
    assert_eq!(client.put("shard-a", "k", 100, "a").await.status, 201);
    assert_eq!(client.put("shard-b", "k", 1, "b").await.status, 201, "shard-a's token must not fence shard-b");
    assert_eq!(client.put("shard-a", "other-key", 99, "x").await.status, 409, "keys share their resource's fence");
    assert_eq!(client.put("shard-a", "nested/key with spaces", 100, "y").await.status, 201);
    assert_eq!(&client.get("shard-a", "nested/key with spaces").await.body[..], b"y");
}
}
