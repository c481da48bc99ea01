//! Keyed writes under faults: an answer lost after the commit, a restart of the
//! database server, many writers retrying through cuts — each key applied exactly
//! once, and every retry answered as the first attempt was.

use std::time::Duration;

use fencegate_tests::cluster::Cluster;
use fencegate_tests::db::{server_addr, TestDb};
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{kv_path, Client, Reply};
use fencegate_tests::proxy::Proxy;
use http::Method;

async fn keyed_put(
    client: &Client,
    key: &str,
    token: u64,
    idem: &str,
    value: &str,
) -> Result<Reply, String> {
    let token = token.to_string();
    client
        .try_request(
            Method::PUT,
            &kv_path("orders", key),
            &[("fencing-token", &token), ("idempotency-key", idem)],
            value.to_owned(),
        )
        .await
}

/// The database commits a keyed write and its answer is lost on the way back: the
/// gateway can only say `write_applied: null`. The retry with the same key is answered
/// from the record — applied once — where a read-back could not have told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_lost_after_the_commit_is_replayed_not_applied_again() {
    let db = TestDb::create().await;
    let network = Proxy::start(server_addr().await).await;
    let gateway = Gateway::builder()
        .database(&db.url_via(network.addr()))
        .args(&["--backend-timeout", "2s"])
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(client.put("orders", "warm", 7, "x").await.status, 201);
    // Commits of objects take a moment (a deferred trigger), so that the answer can be
    // held once the server is committing.
    db.execute(
        "CREATE FUNCTION public.slow_commit() RETURNS trigger LANGUAGE plpgsql AS
             $$ BEGIN PERFORM pg_sleep(0.5); RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT OR UPDATE ON fencegate.objects
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.slow_commit();",
    )
    .await;
    let first = tokio::spawn({
        let client = client.clone();
        async move { keyed_put(&client, "o-1", 7, "pay-o-1", "paid").await }
    });
    eventually(Duration::from_secs(5), "the keyed write is committing", || async {
        db.value::<i64>("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND query = 'COMMIT' AND state = 'active' AND application_name = 'fencegate'")
            .await
            == 1
    })
    .await;
    network.hold_replies();
    let first = first.await.unwrap().expect("the gateway answers");
    assert_eq!(first.status, 503, "{:?}", first.body);
    assert_eq!(
        first.json()["write_applied"],
        serde_json::Value::Null,
        "in doubt"
    );
    assert!(first.json()["message"]
        .as_str()
        .unwrap()
        .contains("Idempotency-Key"));
    network.release_replies();
    db.execute("DROP TRIGGER slow_commit ON fencegate.objects")
        .await;

    let retry = keyed_put(&client, "o-1", 7, "pay-o-1", "paid")
        .await
        .unwrap();
    assert_eq!(retry.status, 201, "{:?}", retry.body);
    assert_eq!(
        retry.header("idempotency-replayed"),
        Some("true"),
        "the first attempt had committed"
    );
    assert_eq!(retry.json()["version"], 1);
    let version: i64 = db
        .value("SELECT version FROM fencegate.objects WHERE resource = 'orders' AND key = 'o-1'")
        .await;
    assert_eq!(version, 1, "applied once");
}

/// The record outlives a restart of the database server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_survive_a_database_restart() {
    let mut cluster = Cluster::builder().start().await;
    let gateway = Gateway::builder()
        .database(&cluster.url())
        .args(&["--backend-timeout", "2s"])
        .spawn()
        .await;
    let client = gateway.client();
    let first = keyed_put(&client, "o-2", 3, "restart", "v").await.unwrap();
    assert_eq!(first.status, 201);
    cluster.kill().await;
    cluster.start().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let retry = loop {
        match keyed_put(&client, "o-2", 3, "restart", "v").await {
            Ok(reply) if reply.status != 503 => break reply,
            _ if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => panic!("the gateway did not reach the restarted database: {other:?}"),
        }
    };
    assert_eq!(
        (retry.status, retry.header("idempotency-replayed")),
        (201, Some("true")),
        "{:?}",
        retry.body
    );
    assert_eq!(retry.body, first.body);
}

/// Writers retry every write until it has a definite answer, through a network that
/// is cut again and again; at the end each key was applied exactly once: the object's
/// version counts the keys, not the attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_through_cuts_apply_each_key_once() {
    let db = TestDb::create().await;
    let network = Proxy::start(server_addr().await).await;
    let gateway = Gateway::builder()
        .database(&db.url_via(network.addr()))
        .args(&["--backend-timeout", "1s"])
        .spawn()
        .await;
    let client = gateway.client();
    let writers = 4u64;
    let writes = 60u64;
    let mut tasks = Vec::new();
    for writer in 0..writers {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let mut attempts = 0u64;
            for write in 0..writes {
                let idem = format!("w{writer}-{write}");
                loop {
                    attempts += 1;
                    let reply = keyed_put(&client, &format!("k{writer}"), 5, &idem, &idem).await;
                    match reply {
                        Ok(reply) if reply.status == 200 || reply.status == 201 => break,
                        Ok(reply) if reply.status == 503 || reply.status == 409 => {
                            assert!(
                                reply.status == 503
                                    || reply.error_code() == "idempotency_in_flight",
                                "{:?}",
                                reply.body
                            );
                            tokio::time::sleep(Duration::from_millis(50)).await;
                        }
                        Ok(reply) => panic!("unexpected answer {}: {:?}", reply.status, reply.body),
                        Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                    }
                }
            }
            attempts
        }));
    }
    let mut network = network;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        network.cut();
        tokio::time::sleep(Duration::from_millis(150)).await;
        network = network.restore().await;
    }
    let mut attempts = 0;
    for task in tasks {
        attempts += tokio::time::timeout(Duration::from_secs(120), task)
            .await
            .expect("writers finish")
            .unwrap();
    }
    assert!(
        attempts > writers * writes,
        "the cuts made writers retry ({attempts} attempts)"
    );
    for writer in 0..writers {
        let version: i64 = db
            .value(&format!("SELECT version FROM fencegate.objects WHERE resource = 'orders' AND key = 'k{writer}'"))
            .await;
        assert_eq!(
            version as u64, writes,
            "writer {writer}: one application per key"
        );
    }
}
