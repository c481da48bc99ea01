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
use fencegate_tests::http::{Client, Reply};
use fencegate_tests::proxy::Proxy;
use serde_json::{json, Value};

/// The first token of the epoch of timeline 2: the first a promoted standby mints.
const SECOND_EPOCH: u64 = (1 << 40) + 1;

/// The gateways' backend deadline (`--backend-timeout`), in seconds: how long one
/// attempt to connect to a server, or one statement, may take before the gateway gives
/// up on that server and tries again.
const BACKEND_TIMEOUT_S: u64 = 2;

/// How long a step of a failover may take here: the test promotes the standby itself,
/// so what is left is the gateway's attempts to reach it, each bounded by the backend
/// deadline — ten of them, for a machine busy with other work.
const WAIT: Duration = Duration::from_secs(10 * BACKEND_TIMEOUT_S);

/// `--backend-timeout` as the gateways take it.
fn backend_timeout() -> String {
    format!("{BACKEND_TIMEOUT_S}s")
}

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
        .args(&[
            "--pg-listen",
            "off",
            "--backend-timeout",
            &backend_timeout(),
        ])
        .spawn()
        .await
}

/// Acquires the hosted lease of `resource` for `holder`: its token.
async fn acquire(client: &Client, resource: &str, holder: &str) -> u64 {
    let reply = lease_step(
        client,
        resource,
        "acquire",
        json!({"holder": holder, "ttl_ms": 60_000}),
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.json());
    reply.json()["token"].as_u64().unwrap()
}

async fn lease_step(client: &Client, resource: &str, step: &str, body: Value) -> Reply {
    client
        .request(
            http::Method::POST,
            &format!("/v1/leases/{resource}/{step}"),
            &[("content-type", "application/json")],
            body.to_string(),
        )
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
    // The leases of `jobs` go through another gateway, which goes down with the
    // primary: no gateway left saw what it minted.
    let zone = gateway_on(&primary, &standby).await;
    // A third gateway, with its Postgres door, sees `billing` only.
    let doors = Gateway::builder()
        .database(&url(&primary, &standby))
        .args(&["--backend-timeout", &backend_timeout()])
        .spawn()
        .await;
    assert_eq!(
        doors.client().put("billing", "b", 3, "term 3").await.status,
        201
    );
    assert_eq!(client.put("orders", "o-1", 5, "term 5").await.status, 201);
    assert_eq!(acquire(&zone.client(), "jobs", "a").await, 1);
    replicated(&primary, &standby, "orders", 5).await;

    // Replication stops; term 7 writes, acknowledged by the primary alone, and the
    // lease of `jobs` passes to b with token 2, also on the primary alone.
    replication.cut();
    assert_eq!(client.put("orders", "o-1", 7, "term 7").await.status, 200);
    assert_eq!(
        doors.client().put("billing", "b", 4, "term 4").await.status,
        200
    );
    let released = lease_step(
        &zone.client(),
        "jobs",
        "release",
        json!({"holder": "a", "token": 1}),
    )
    .await;
    assert_eq!(released.status, 200, "{:?}", released.json());
    assert_eq!(acquire(&zone.client(), "jobs", "b").await, 2);
    drop(zone);
    primary.kill().await;
    // Read while it is still a standby: once promoted, the gateways audit it at once.
    assert_eq!(
        fence_on(&standby, "orders").await,
        Some(5),
        "the standby lost the fence of term 7"
    );
    assert_eq!(
        fence_on(&standby, "billing").await,
        Some(3),
        "the standby lost the fence of term 4"
    );
    standby.promote().await;

    // The first session the door opens on the new primary opens after the audit of
    // that server: the fence its gateway saw committed is already restored, and
    // counted.
    let door_url = format!(
        "postgres://postgres:{}@{}/postgres",
        primary.password(),
        doors.pg_addr()
    );
    let started = Instant::now();
    loop {
        match tokio_postgres::connect(&door_url, tokio_postgres::NoTls).await {
            Ok((session, connection)) => {
                tokio::spawn(connection);
                session.simple_query("SELECT 1").await.unwrap();
                break;
            }
            Err(error) => {
                assert!(
                    started.elapsed() < WAIT,
                    "the door never opened a session on the new primary: {error}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert_eq!(
        doors
            .client()
            .metric("fencegate_fence_regressions_total")
            .await,
        Some(1.0),
        "a door session opened on the new primary before its fences were audited"
    );
    assert_eq!(fence_on(&standby, "billing").await, Some(4));

    // The first write the gateway answers on the new primary comes after the audit of
    // that server: the fence it saw committed is already restored, and counted.
    let started = Instant::now();
    loop {
        let reply = client
            .put("elsewhere", "k", 1, "first on the new primary")
            .await;
        if reply.status == 201 {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the gateway never wrote on the new primary: {:?} {:#?}",
            reply.json(),
            gateway.logs().iter().rev().take(8).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        client.metric("fencegate_fence_regressions_total").await,
        Some(1.0),
        "a write was answered on the new primary before its fences were audited"
    );
    assert_eq!(fence_on(&standby, "orders").await, Some(7));
    let logged = gateway.events(
        "fence behind a token this gateway saw committed: the database lost committed \
         transactions (failover to an asynchronous standby?); acknowledged writes of this \
         resource may be lost. The fence is restored, so older terms stay out",
    );
    let orders: Vec<_> = logged
        .iter()
        .filter(|event| event["fields"]["resource"] == "orders")
        .collect();
    assert_eq!((logged.len(), orders.len()), (1, 1), "{:?}", gateway.logs());
    assert_eq!(orders[0]["fields"]["seen"], 7);
    assert_eq!(orders[0]["fields"]["found"], 5);

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

    // The promoted server lost token 2 of `jobs` (its lease and fence still say 1),
    // and no gateway that is left saw it: the next term's token is still above it,
    // because it is minted in the new timeline's epoch. Without epochs it would be 2
    // again: two holders with one token, both accepted.
    let lease: i64 = standby
        .client()
        .await
        .query_one(
            "SELECT token FROM fencegate.leases WHERE resource = 'jobs'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        lease, 1,
        "the promoted standby lost the second term of jobs"
    );
    assert_eq!(fence_on(&standby, "jobs").await, Some(1));
    let freed = lease_step(
        &fresh.client(),
        "jobs",
        "release",
        json!({"holder": "a", "token": 1}),
    )
    .await;
    assert_eq!(freed.status, 200, "{:?}", freed.json());
    assert_eq!(acquire(&fresh.client(), "jobs", "c").await, SECOND_EPOCH);
    assert_eq!(
        acquire(&fresh.client(), "jobs", "c").await,
        SECOND_EPOCH + 1
    );
    assert_eq!(
        fresh.client().metric("fencegate_backend_timeline").await,
        Some(2.0)
    );
}

#[tokio::test]
async fn after_a_synchronous_failover_nothing_acknowledged_is_lost() {
    let (mut primary, replication, standby) = primary_and_standby(true).await;
    let gateway = gateway_on(&primary, &standby).await;
    let client = gateway.client();
    assert_eq!(
        client
            .metric("fencegate_backend_synchronous_replication")
            .await,
        Some(1.0)
    );
    assert_eq!(
        client
            .metric("fencegate_backend_synchronous_standbys")
            .await,
        Some(1.0)
    );
    let ready = gateway.events("fencegate ready");
    let said = ready[0]["fields"]["replication"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(said.starts_with("synchronous ("), "{said}");
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
    // The gateway gave up on the commit without cancelling it: cancelling the wait
    // for the standby would have made term 8 visible on the primary although no
    // standby has it. It still waits, invisible.
    for _ in 0..3 {
        assert_eq!(fence_on(&primary, "orders").await, Some(7));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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

#[tokio::test]
async fn without_a_synchronous_standby_a_gateway_that_requires_one_refuses_writes() {
    let (primary, replication, standby) = primary_and_standby(true).await;
    let gateway = Gateway::builder()
        .database(&url(&primary, &standby))
        .args(&[
            "--backend-timeout",
            &backend_timeout(),
            "--require-synchronous-replication",
        ])
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(client.put("orders", "a", 1, "replicated").await.status, 201);
    assert_eq!(acquire(&client, "jobs", "a").await, 1);

    // The standby goes away: within a reading or two, every write is refused before
    // it reaches the database. (Those sent before that wait for the standby, and are
    // answered as unknown.)
    replication.cut();
    let started = Instant::now();
    let refused = loop {
        let reply = client.put("orders", "b", 1, "not replicated").await;
        if reply.status == 503 && reply.error_code() == "not_synchronously_replicated" {
            break reply;
        }
        assert!(
            started.elapsed() < WAIT,
            "writes are still taken: {} {:?}",
            reply.status,
            reply.json()
        );
    };
    assert_eq!(
        refused.json()["write_applied"],
        false,
        "{:?}",
        refused.json()
    );
    assert_eq!(refused.header("retry-after"), Some("1"));
    let lease = lease_step(
        &client,
        "jobs",
        "renew",
        json!({"holder": "a", "token": 1, "ttl_ms": 60_000}),
    )
    .await;
    assert_eq!(
        (lease.status, lease.error_code().as_str()),
        (503, "not_synchronously_replicated")
    );
    let advance = client.advance("elsewhere", 3).await;
    assert_eq!(
        (advance.status, advance.error_code().as_str()),
        (503, "not_synchronously_replicated")
    );
    assert_eq!(
        client
            .metric("fencegate_backend_synchronous_replication")
            .await,
        Some(0.0)
    );
    assert_eq!(
        client
            .metric("fencegate_backend_synchronous_standbys")
            .await,
        Some(0.0)
    );
    assert!(!gateway
        .events(
            "the fence database has no synchronous standby: a failover now may lose \
             acknowledged writes and fence raises"
        )
        .is_empty());
    assert_eq!(
        fence_on(&primary, "elsewhere").await,
        None,
        "the refused raise moved a fence"
    );
    // The door opens no session meanwhile.
    let door_url = format!(
        "postgres://postgres:{}@{}/postgres",
        primary.password(),
        gateway.pg_addr()
    );
    let error = tokio_postgres::connect(&door_url, tokio_postgres::NoTls)
        .await
        .err()
        .expect("the door refuses a session");
    assert_eq!(
        error.code().map(|code| code.code()),
        Some("57P03"),
        "{error}"
    );

    // The standby streams again: writes are taken again.
    let _replication = replication.restore().await;
    let started = Instant::now();
    loop {
        let reply = client.put("orders", "c", 1, "replicated again").await;
        if reply.status / 100 == 2 {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "writes are still refused: {} {:?}",
            reply.status,
            reply.json()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (session, connection) = tokio_postgres::connect(&door_url, tokio_postgres::NoTls)
        .await
        .expect("the door opens sessions again");
    tokio::spawn(connection);
    session.simple_query("SELECT 1").await.unwrap();
}
