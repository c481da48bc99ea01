//! Restarts, replicas and shutdown: the fence outlives every process.

use std::time::Duration;

use fencegate_tests::deployment::{Backend, Deployment};
use fencegate_tests::http::metric_value;
use fencegate_tests::{backend_tests, eventually};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

backend_tests! {
    /// The fence is durable and the cache is rebuilt lazily: after a restart, with a
    /// cold cache, 41 is still rejected because the store says 42.
    async fn restart_keeps_the_fence(deployment) {
        let mut deployment = deployment;
        let client = deployment.client();
        assert_eq!(client.put("orders", "o-1", 42, "from 42").await.status, 201);
        deployment.gateway.restart().await;

        let client = deployment.client();
        assert_eq!(metric_value(&client.metrics().await, "fencegate_fence_cache_entries"), Some(0.0));
        let stale = client.put("orders", "o-1", 41, "late").await;
        assert_eq!(stale.status, 409);
        assert_eq!(stale.json()["highest"], 42);
        assert_eq!(metric_value(&client.metrics().await, "fencegate_fence_cache_entries"), Some(1.0));
        assert_eq!(&client.get("orders", "o-1").await.body[..], b"from 42");
        assert_eq!(deployment.highest("orders").await, Some(42));
    }

    /// The signal handlers exist before the ready line: SIGTERM right after it is a
    /// clean shutdown, not death by signal.
    async fn sigterm_right_after_ready_exits_cleanly(deployment) {
        let mut deployment = deployment;
        let status = deployment.gateway.terminate().await;
        assert!(status.success(), "exit status {status}");
    }

    /// SIGTERM: a request still receiving its body is answered 503 shutting_down at
    /// once — nothing applied — new connections are refused, and the gateway exits 0
    /// without waiting for the slow client.
    async fn sigterm_stops_waiting_for_slow_bodies(deployment) {
        let mut deployment = deployment;
        let addr = deployment.gateway.addr();
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let head = "PUT /v1/kv/orders/slow HTTP/1.1\r\nhost: gw\r\nfencing-token: 5\r\ncontent-length: 10\r\n\r\n";
        slow.write_all(head.as_bytes()).await.unwrap();
        slow.write_all(b"0123").await.unwrap();
        // Let the gateway parse the head, so that the request is in its hands, half
        // received, when SIGTERM arrives.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = std::time::Instant::now();
        deployment.gateway.signal("TERM");
        let mut response = Vec::new();
        slow.read_to_end(&mut response).await.unwrap();
        let response = String::from_utf8_lossy(&response);
        assert!(response.starts_with("HTTP/1.1 503"), "{response}");
        assert!(response.contains("retry-after: 1") && response.contains("shutting_down"), "{response}");
        drop(slow);
        assert!(TcpStream::connect(addr).await.is_err(), "new connections are refused while shutting down");
        let status = deployment.gateway.wait().await;
        assert!(status.success(), "exit status {status}");
        assert!(started.elapsed() < Duration::from_secs(5), "shutdown took {:?}", started.elapsed());
        deployment.gateway = deployment.builder().spawn().await;
        assert_eq!(deployment.object("orders", "slow").await, None);
    }
}

/// SIGTERM lets a write that is already in the backend finish: its answer arrives, the
/// write is stored, and the gateway exits 0.
#[tokio::test]
async fn sigterm_finishes_writes_in_the_backend() {
    let db = fencegate_tests::db::TestDb::create().await;
    let network =
        fencegate_tests::proxy::Proxy::start(fencegate_tests::db::server_addr().await).await;
    let mut gateway = fencegate_tests::gateway::Gateway::builder()
        .database(&db.url_via(network.addr()))
        .spawn()
        .await;
    let client = gateway.client();
    network.hold_replies();
    let write = tokio::spawn(async move { client.put("orders", "in-backend", 5, "v").await });
    eventually(
        Duration::from_secs(5),
        "the write to reach the database",
        || async { network.held_reply_bytes() > 0 },
    )
    .await;
    gateway.signal("TERM");
    eventually(
        Duration::from_secs(10),
        "the gateway to start shutting down",
        || async {
            !gateway
                .events("shutting down: finishing requests in flight")
                .is_empty()
        },
    )
    .await;
    network.release_replies();
    let reply = write.await.unwrap();
    assert_eq!(reply.status, 201, "{:?}", reply.body);
    let status = gateway.wait().await;
    assert!(status.success(), "exit status {status}");
    assert_eq!(
        db.object("orders", "in-backend").await.map(|(v, ..)| v),
        Some(b"v".to_vec())
    );
}

/// Seed check across replicas: 42 through one gateway, then 41 through another whose
/// cache has never seen the resource: rejected by the database.
#[tokio::test]
async fn two_gateways_share_one_fence() {
    let deployment = Deployment::start(Backend::Postgres).await;
    let second = deployment.builder().spawn().await;
    let (one, two) = (deployment.client(), second.client());

    assert_eq!(one.put("orders", "o-1", 42, "via one").await.status, 201);
    let stale = two.put("orders", "o-1", 41, "via two").await;
    assert_eq!(stale.status, 409);
    assert_eq!(
        (
            stale.json()["presented"].as_u64(),
            stale.json()["highest"].as_u64()
        ),
        (Some(41), Some(42))
    );

    // And the other way round, with a warm cache on the first gateway that is now behind.
    assert_eq!(two.put("orders", "o-1", 43, "via two").await.status, 200);
    let behind = one.put("orders", "o-1", 42, "via one again").await;
    assert_eq!(behind.status, 409);
    assert_eq!(behind.json()["highest"], 43);
    assert_eq!(&one.get("orders", "o-1").await.body[..], b"via two");
}

/// A second gateway on a database whose schema is newer than it knows refuses to start.
#[tokio::test]
async fn refuses_a_schema_from_the_future() {
    let deployment = Deployment::start(Backend::Postgres).await;
    deployment
        .db()
        .client()
        .await
        .execute(
            "INSERT INTO fencegate.schema_migrations (version) VALUES (999)",
            &[],
        )
        .await
        .unwrap();
    let failure = deployment
        .builder()
        .try_spawn()
        .await
        .err()
        .expect("the gateway must not start");
    assert!(failure.status.is_some_and(|s| !s.success()), "{failure}");
    assert!(failure.logs.contains("schema version 999"), "{failure}");
}
