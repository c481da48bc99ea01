//! The database goes away mid-test: writes get 503 quickly, nothing is half-applied,
//! and the gateway recovers by itself.

use std::time::Duration;

use fencegate_tests::db::{server_addr, TestDb};
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::metric_value;
use fencegate_tests::proxy::Proxy;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_outage_answers_503_and_recovers() {
    let db = TestDb::create().await;
    let network = Proxy::start(server_addr().await).await;
    let url = db.url_via(network.addr());
    let gateway = Gateway::builder()
        .database(&url)
        .arg("--backend-timeout")
        .arg("1s")
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(client.put("orders", "o-1", 1, "before").await.status, 201);

    network.cut();
    for (attempt, token) in [2u64, 3, 4].into_iter().enumerate() {
        let reply = tokio::time::timeout(
            Duration::from_secs(10),
            client.put("orders", "o-1", token, "during"),
        )
        .await
        .unwrap_or_else(|_| {
            panic!("attempt {attempt}: a write during the outage must be answered, not hang")
        });
        assert_eq!(reply.status, 503, "attempt {attempt}: {:?}", reply.body);
        let body = reply.json();
        assert_eq!(body["error"], "backend_unavailable");
        // Either certainly not applied, or unknown if the connection died under it.
        assert!(
            body["write_applied"] == false || body["write_applied"].is_null(),
            "{body}"
        );
    }
    assert_eq!(
        client
            .request(http::Method::GET, "/readyz", &[], "")
            .await
            .status,
        503
    );
    // Each failed write is logged with what it was, without a span to carry it.
    let failed = gateway.events("request failed");
    assert!(failed.len() >= 3, "{failed:?}");
    for event in &failed[..3] {
        let fields = &event["fields"];
        assert_eq!(
            (
                &fields["code"],
                &fields["method"],
                &fields["route"],
                &fields["path"]
            ),
            (
                &serde_json::json!("backend_unavailable"),
                &serde_json::json!("PUT"),
                &serde_json::json!("kv_put"),
                &serde_json::json!("/v1/kv/orders/o-1")
            ),
            "{event}"
        );
    }
    let metrics = client.metrics().await;
    assert_eq!(metric_value(&metrics, "fencegate_backend_ready"), Some(0.0));
    assert!(
        metric_value(&metrics, "fencegate_backend_errors_total{kind=\"connect\"}").unwrap_or(0.0)
            >= 1.0,
        "{metrics}"
    );
    // Nothing of the outage's writes reached the database.
    assert_eq!(
        db.object("orders", "o-1").await,
        Some((b"before".to_vec(), 1, 1))
    );
    assert_eq!(db.highest("orders").await, Some(1));

    let network = network.restore().await;
    eventually(
        Duration::from_secs(15),
        "the gateway to accept writes again",
        || async { client.put("orders", "o-1", 5, "after").await.status == 200 },
    )
    .await;
    assert_eq!(
        client
            .request(http::Method::GET, "/readyz", &[], "")
            .await
            .status,
        200
    );
    assert_eq!(
        metric_value(&client.metrics().await, "fencegate_backend_ready"),
        Some(1.0)
    );
    assert_eq!(
        db.object("orders", "o-1").await,
        Some((b"after".to_vec(), 5, 2))
    );
    drop(network);
}
