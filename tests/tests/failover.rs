//! Database failover: a throwaway primary with a streaming standby, promoted after the
//! primary is killed, behind a gateway whose URL names both servers
//! (`target_session_attrs=read-write`).
//!
//! - Asynchronous replication loses the last commits, fences included: the gateway
//!   notices the fence below the token it saw committed, restores it (so another
//!   gateway refuses the older term), counts it and logs it.
//! - Synchronous replication loses nothing that was acknowledged.

use std::time::{Duration, Instant};

use fencegate_tests::cluster::Cluster;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::proxy::Proxy;

const WAIT: Duration = Duration::from_secs(20);

/// A primary that lets its standby replicate without a password, and the standby,
/// streaming through a proxy the test can cut.
async fn primary_and_standby(synchronous: bool) -> (Cluster, Proxy, Cluster) {
    let mut builder = Cluster::builder()
        .hba("host replication postgres 127.0.0.1/32 trust")
        .hba("host all all 127.0.0.1/32 scram-sha-256");
    if synchronous {
        builder = builder.setting("synchronous_standby_names", "*");
    }
    let primary = builder.start().await;
    let replication = Proxy::start(primary.addr()).await;
    let standby = primary.standby(replication.addr()).await;
    (primary, replication, standby)
}

/// The gateway's URL: both servers, the writable one chosen.
fn url(primary: &Cluster, standby: &Cluster) -> String {
    format!(
        "postgres://postgres:{}@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.password(),
        primary.port(),
        standby.port()
    )
}

/// A gateway on whichever of the two servers is writable.
async fn gateway_on(primary: &Cluster, standby: &Cluster) -> Gateway {
    Gateway::builder()
        .database(&url(primary, standby))
        .args(&["--pg-listen", "off", "--backend-timeout", "2s"])
        .spawn()
        .await
}

async fn fence_on(cluster: &Cluster, resource: &str) -> Option<i64> {
    cluster
        .client()
        .await
        .query_opt(
            "SELECT highest FROM fencegate.fences WHERE resource = $1",
            &[&resource],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// Waits until the standby has replayed everything the primary has written so far,
/// then checks that `resource`'s fence is at `token` there. Waiting on the WAL
/// position rather than polling the fence also covers the gateway's start-up schema,
/// which the standby may not have replayed yet either.
async fn replicated(primary: &Cluster, standby: &Cluster, resource: &str, token: i64) {
    let written: String = primary
        .client()
        .await
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let standby_client = standby.client().await;
    let started = Instant::now();
    loop {
        let replayed: bool = standby_client
            .query_one(
                "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)",
                &[&written],
            )
            .await
            .unwrap()
            .get(0);
        if replayed {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the standby never replayed up to {written}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fence_on(standby, resource).await, Some(token));
}

#[tokio::test]
async fn after_an_asynchronous_failover_the_lost_fence_is_restored() {
    let (mut primary, replication, standby) = primary_and_standby(false).await;
    let gateway = gateway_on(&primary, &standby).await;
    let client = gateway.client();
    assert_eq!(client.put("orders", "o-1", 5, "term 5").await.status, 201);
    replicated(&primary, &standby, "orders", 5).await;

    // Replication stops; term 7 writes, acknowledged by the primary alone.
    replication.cut();
    assert_eq!(client.put("orders", "o-1", 7, "term 7").await.status, 200);
    primary.kill().await;
    standby.promote().await;
    assert_eq!(
        fence_on(&standby, "orders").await,
        Some(5),
        "the promoted standby lost the fence of term 7"
    );

    // The gateway reconnects to the new primary, finds the fence behind what it saw
    // committed, and raises it back.
    let started = Instant::now();
    loop {
        let _ = client
            .try_request(http::Method::GET, "/readyz", &[], "")
            .await;
        if client.metric("fencegate_fence_regressions_total").await == Some(1.0) {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the gateway never noticed the lost fence: {:#?}",
            gateway.logs().iter().rev().take(8).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(fence_on(&standby, "orders").await, Some(7));
    let logged = gateway.events(
        "fence behind a token this gateway saw committed: the database lost committed \
         transactions (failover to an asynchronous standby?); acknowledged writes of this \
         resource may be lost. The fence is restored, so older terms stay out",
    );
    assert_eq!(logged.len(), 1, "{:?}", gateway.logs());
    assert_eq!(logged[0]["fields"]["seen"], 7);
    assert_eq!(logged[0]["fields"]["found"], 5);

    // A gateway that never saw term 7 now refuses the terms before it, as the first
    // one does; term 7 writes again.
    let fresh = gateway_on(&primary, &standby).await;
    let late = fresh.client().put("orders", "o-1", 6, "term 6").await;
    assert_eq!(
        (late.status, late.error_code().as_str()),
        (409, "stale_token")
    );
    assert_eq!(client.put("orders", "o-1", 6, "term 6").await.status, 409);
    // Term 7's acknowledged write itself was lost with the primary: that is what
    // asynchronous replication means, and why the gateway says so.
    let (value, _, _) = client.read_object("orders", "o-1").await.unwrap();
    assert_eq!(value, b"term 5");
    assert_eq!(
        client.put("orders", "o-1", 7, "term 7 again").await.status,
        200
    );
}

#[tokio::test]
async fn after_a_synchronous_failover_nothing_acknowledged_is_lost() {
    let (mut primary, replication, standby) = primary_and_standby(true).await;
    let gateway = gateway_on(&primary, &standby).await;
    let client = gateway.client();
    for (token, key) in [(5, "a"), (6, "b"), (7, "c")] {
        let reply = client.put("orders", key, token, "acknowledged").await;
        assert_eq!(reply.status, 201, "{:?}", reply.json());
    }
    // Replication stops: a commit can no longer be acknowledged, so the write is
    // answered as unknown, never as applied.
    replication.cut();
    let waiting = client.put("orders", "d", 8, "never acknowledged").await;
    assert_eq!(
        (waiting.status, waiting.json()["write_applied"].clone()),
        (503, serde_json::Value::Null),
        "{:?}",
        waiting.json()
    );
    primary.kill().await;
    standby.promote().await;
    assert_eq!(fence_on(&standby, "orders").await, Some(7));
    for key in ["a", "b", "c"] {
        let started = Instant::now();
        loop {
            match client
                .try_request(
                    http::Method::GET,
                    &fencegate_tests::http::kv_path("orders", key),
                    &[],
                    "",
                )
                .await
            {
                Ok(reply) if reply.status == 200 => {
                    assert_eq!(&reply.body[..], b"acknowledged");
                    break;
                }
                _ => {}
            }
            assert!(
                started.elapsed() < WAIT,
                "{key} is not readable after the failover"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    assert_eq!(
        client.metric("fencegate_fence_regressions_total").await,
        Some(0.0),
        "nothing acknowledged was lost, so no fence is behind"
    );
}
