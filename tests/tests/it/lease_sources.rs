//! Lease sources people already run: the lease client's etcd and ZooKeeper stores, and
//! the gateway checking tokens against them (`--issued-by etcd:...`,
//! `--issued-by zookeeper:...`), against real servers the tests start.
//!
//! Needs etcd/etcdctl and ZooKeeper with Java (Debian: etcd-server, etcd-client,
//! zookeeperd); fails, never skips, without them.

use std::sync::Arc;
use std::time::Duration;

use fencegate_gateway::auth::new_key;
use fencegate_lease::store::{etcd, zookeeper};
use fencegate_lease::{
    Elector, EtcdStore, LeaseConfig, LeaseStore, LossReason, Transition, ZooKeeperStore,
};
use fencegate_proto::Token;
use fencegate_tests::auth_file::AuthFile;
use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{fence_path, kv_path, metric_value, Client, Reply};
use fencegate_tests::lease::{next_term, next_transition, spawn_elector, Sweeper, PATIENCE};
use fencegate_tests::sources::{Etcd, ZooKeeper};
use http::Method;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const LEASE: &str = "sweep-eu";
/// What each writer identity may do.
const SWEEP_GRANTS: &str =
    r#"{ resources = ["sweep-*"], actions = ["read", "write", "advance", "metrics"] }"#;
/// etcd's shortest lease with its default election timeout.
const ETCD_TTL: Duration = Duration::from_secs(2);
/// The ZooKeeper sessions of the stores: short, so that expiry is quick, but long
/// enough that a loaded machine does not expire them by accident.
const SESSION: Duration = Duration::from_secs(4);

async fn etcd_store(etcd: &Etcd) -> EtcdStore {
    EtcdStore::connect(&etcd.endpoints(), etcd::DEFAULT_PREFIX)
        .await
        .expect("valid etcd settings")
}

fn zookeeper_store(zookeeper: &ZooKeeper) -> ZooKeeperStore {
    ZooKeeperStore::new(&zookeeper.connect(), zookeeper::DEFAULT_PREFIX, SESSION)
        .expect("valid ZooKeeper settings")
}

/// A gateway with `flags` on a fresh database, and the database (kept for the test).
async fn start_gateway(flags: &[&str]) -> (TestDb, Gateway) {
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(flags)
        .spawn()
        .await;
    (db, gateway)
}

/// Acquires `lease` for `holder`, retrying until it is free (`PATIENCE` at most).
async fn acquire_when_free(store: &impl LeaseStore, holder: &str, ttl: Duration) -> Token {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match store.acquire(LEASE, holder, ttl).await {
            Ok(Some(token)) => return token,
            Ok(None) | Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("{holder} never acquired {LEASE}: {other:?}"),
        }
    }
}

/// A writer of one gateway, with the key of one identity (or none).
struct Writer {
    client: Client,
    key: Option<String>,
}

impl Writer {
    fn new(gateway: &Gateway, key: Option<&str>) -> Writer {
        Writer {
            client: gateway.client(),
            key: key.map(str::to_owned),
        }
    }

    async fn send(&self, method: Method, path: &str, token: Option<Token>, body: &str) -> Reply {
        let token = token.map(|token| token.to_string());
        let bearer = self.key.as_ref().map(|key| format!("Bearer {key}"));
        let mut headers = Vec::new();
        if let Some(token) = &token {
            headers.push(("fencing-token", token.as_str()));
        }
        if let Some(bearer) = &bearer {
            headers.push(("authorization", bearer.as_str()));
        }
        self.client
            .request(method, path, &headers, body.to_owned())
            .await
    }

    async fn put(&self, token: Token, value: &str) -> Reply {
        self.send(Method::PUT, &kv_path(LEASE, "k"), Some(token), value)
            .await
    }

    /// The fence's highest token as the store holds it.
    async fn highest(&self) -> Option<u64> {
        let reply = self.send(Method::GET, &fence_path(LEASE), None, "").await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.json()["highest"].as_u64()
    }

    /// One series of `/metrics` (0 if absent).
    async fn metric(&self, series: &str) -> f64 {
        let reply = self.send(Method::GET, "/metrics", None, "").await;
        assert_eq!(reply.status, 200, "{reply:?}");
        metric_value(&String::from_utf8_lossy(&reply.body), series).unwrap_or(0.0)
    }
}

fn above(token: Token, by: u64) -> Token {
    Token::new(token.get() + by).unwrap()
}

/// The token just below `token`: no election's, with etcd's and ZooKeeper's sparse
/// tokens.
fn below(token: Token) -> Token {
    Token::new(token.get() - 1).unwrap()
}

/// The etcd store: one holder at a time; terms rise; a holder that stops renewing
/// loses its key with its etcd lease (and learns it at once, not at its next renewal);
/// a takeover by the same identity is a new term; release frees the lease at once.
/// Through a gateway bound to etcd, the old term's late write is refused as stale.
#[tokio::test]
async fn etcd_terms_rise_and_a_paused_holders_late_write_is_refused() {
    let etcd = Etcd::start().await;
    let (_db, gateway) = start_gateway(&[
        "--issued-by",
        "etcd:sweep-*",
        "--etcd-endpoints",
        &etcd.endpoint(),
    ])
    .await;
    let writer = Writer::new(&gateway, None);
    let (a, b) = (etcd_store(&etcd).await, etcd_store(&etcd).await);

    let first = a
        .acquire(LEASE, "node-a", ETCD_TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(b.acquire(LEASE, "node-b", ETCD_TTL).await.unwrap(), None);
    assert!(a.renew(LEASE, "node-a", first, ETCD_TTL).await.unwrap());
    assert_eq!(writer.put(first, "a1").await.status, 201);

    // node-a stops renewing (a pause): its etcd lease expires, and so does its key.
    let lost = tokio::time::timeout(PATIENCE, a.lost(LEASE, "node-a", first)).await;
    assert!(lost.is_ok(), "node-a learns its term ended");
    let second = acquire_when_free(&b, "node-b", ETCD_TTL).await;
    assert!(second > first, "{second} > {first}");
    assert!(!a.renew(LEASE, "node-a", first, ETCD_TTL).await.unwrap());
    assert_eq!(writer.put(second, "b1").await.status, 200);
    let late = writer.put(first, "a-late").await;
    assert_eq!(late.error_code(), "stale_token", "{late:?}");

    // The same identity again (a restarted process): a new, higher term at once.
    let third = b
        .acquire(LEASE, "node-b", ETCD_TTL)
        .await
        .unwrap()
        .expect("ours");
    assert!(third > second);
    assert!(!b.renew(LEASE, "node-b", second, ETCD_TTL).await.unwrap());
    // Released: free at once for node-a, with a higher token.
    assert!(b.release(LEASE, "node-b", third).await.unwrap());
    let fourth = a
        .acquire(LEASE, "node-a", ETCD_TTL)
        .await
        .unwrap()
        .expect("free");
    assert!(fourth > third);
    assert_eq!(writer.put(fourth, "a2").await.status, 200);
    assert_eq!(
        writer.put(third, "b-late").await.error_code(),
        "stale_token"
    );
}

/// The elector on etcd: a revoked etcd lease ends the term at once (`session_lost`),
/// long before the next renewal is due.
#[tokio::test]
async fn etcd_a_revoked_lease_ends_the_term_at_once() {
    let etcd = Etcd::start().await;
    let store = Arc::new(etcd_store(&etcd).await);
    let config = LeaseConfig {
        lease_duration: Duration::from_secs(20),
        renew_interval: Duration::from_secs(8),
        renew_deadline: Duration::from_secs(15),
        retry_period: Duration::from_millis(100),
        renew_retry_period: Duration::from_millis(100),
        max_round_trip: Duration::from_secs(2),
    };
    let elector = Elector::new(Arc::clone(&store), LEASE, "node-a", config).unwrap();
    let mut events = elector.subscribe();
    let shutdown = CancellationToken::new();
    let (task, mut terms) = spawn_elector(elector, &shutdown);
    let term = next_term(&mut terms).await;

    let leases = etcd.etcdctl(&["lease", "list"]).await.unwrap();
    let id = leases
        .lines()
        .find_map(|line| {
            line.strip_prefix("id(")?
                .strip_suffix(")")
                .map(str::to_owned)
        })
        .or_else(|| leases.lines().nth(1).map(|line| line.trim().to_owned()))
        .unwrap_or_else(|| panic!("one lease in {leases:?}"));
    let revoked = Instant::now();
    etcd.etcdctl(&["lease", "revoke", &id]).await.unwrap();
    let loss = next_transition(
        &mut events,
        PATIENCE,
        |t| matches!(t, Transition::Lost { epoch, .. } if *epoch == term.epoch()),
    )
    .await;
    assert!(
        matches!(
            loss,
            Transition::Lost {
                reason: LossReason::SessionLost,
                ..
            }
        ),
        "{loss:?}"
    );
    assert!(
        revoked.elapsed() < Duration::from_secs(4),
        "the term ended {:?} after the revocation, not at the next renewal",
        revoked.elapsed()
    );
    shutdown.cancel();
    let _ = task.await;
}

/// `--issued-by etcd:...` with authentication: a forged token above the leader's is
/// refused (`token_not_issued`) without moving the fence; the leader's token presented
/// by another identity is refused (`token_holder_mismatch`); the holder writes.
#[tokio::test]
async fn etcd_refuses_tokens_it_did_not_issue_and_to_other_holders() {
    let etcd = Etcd::start().await;
    let (key_a, key_b) = (new_key(), new_key());
    let auth = AuthFile::new(&[
        ("node-a", &key_a, SWEEP_GRANTS),
        ("node-b", &key_b, SWEEP_GRANTS),
    ]);
    let (_db, gateway) = start_gateway(&[
        "--auth-file",
        &auth.path(),
        "--issued-by",
        "etcd:sweep-*",
        "--etcd-endpoints",
        &etcd.endpoint(),
    ])
    .await;
    let (a, b) = (
        Writer::new(&gateway, Some(&key_a)),
        Writer::new(&gateway, Some(&key_b)),
    );
    let store = etcd_store(&etcd).await;
    let token = store
        .acquire(LEASE, "node-a", ETCD_TTL)
        .await
        .unwrap()
        .expect("free");

    let forged = a.put(above(token, 1000), "x").await;
    assert_eq!(forged.error_code(), "token_not_issued", "{forged:?}");
    assert_eq!(forged.json()["issued"], serde_json::json!(token.get()));
    assert_eq!(a.highest().await, None);
    // Below the leader's: a revision no election issued, from an identity never
    // elected, before the leader's first write; and from the leader itself.
    for (writer, who) in [(&b, "node-b"), (&a, "node-a")] {
        let invented = writer.put(below(token), "x").await;
        assert_eq!(invented.error_code(), "stale_token", "{who}: {invented:?}");
        assert_eq!(invented.json()["highest"], serde_json::json!(token.get()));
    }
    assert_eq!(a.highest().await, None, "the fence did not move");

    let mismatch = b.put(token, "x").await;
    assert_eq!(
        mismatch.error_code(),
        "token_holder_mismatch",
        "{mismatch:?}"
    );
    assert_eq!(a.put(token, "a").await.status, 201);
    assert_eq!(
        a.metric("fencegate_token_refusals_total{reason=\"not_issued\"}")
            .await,
        1.0
    );
    assert_eq!(
        a.metric("fencegate_token_refusals_total{reason=\"earlier_term\"}")
            .await,
        2.0
    );
}

/// etcd unreachable: tokens the gateway already vouched for keep working, a token it
/// cannot vouch for is refused with 503 `issuer_unavailable` (fail closed), and once
/// etcd is back a new term is checked and accepted.
#[tokio::test]
async fn etcd_unreachable_fails_closed_and_recovers() {
    let mut etcd = Etcd::start().await;
    let (_db, gateway) = start_gateway(&[
        "--issued-by",
        "etcd:sweep-*",
        "--etcd-endpoints",
        &etcd.endpoint(),
        "--issuer-timeout",
        "1s",
    ])
    .await;
    let writer = Writer::new(&gateway, None);
    let store = etcd_store(&etcd).await;
    let first = store
        .acquire(LEASE, "node-a", ETCD_TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(writer.put(first, "a").await.status, 201);

    etcd.kill().await;
    assert_eq!(writer.put(first, "still").await.status, 200);
    let unknown = writer.put(above(first, 1), "x").await;
    assert_eq!(unknown.status, 503, "{unknown:?}");
    assert_eq!(unknown.error_code(), "issuer_unavailable");
    assert_eq!(unknown.header("retry-after"), Some("1"));
    assert_eq!(unknown.json()["write_applied"], serde_json::json!(false));
    assert_eq!(writer.highest().await, Some(first.get()));

    etcd.restart().await;
    // node-a's key went with its lease while etcd was down, or will expire: a new term.
    let store = etcd_store(&etcd).await;
    let second = acquire_when_free(&store, "node-b", ETCD_TTL).await;
    assert!(second > first);
    let deadline = Instant::now() + PATIENCE;
    loop {
        let reply = writer.put(second, "b").await;
        if reply.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "never accepted after recovery: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// An etcd cluster restored from a snapshot without `--bump-revision` goes back to the
/// snapshot's revision, and hands a new leader a token below one it issued before: the
/// fence refuses that leader's writes as stale, and the gateway detects the restore
/// and counts it.
#[tokio::test]
async fn an_etcd_restore_without_bump_revision_is_detected() {
    let mut etcd = Etcd::start().await;
    let (_db, gateway) = start_gateway(&[
        "--issued-by",
        "etcd:sweep-*",
        "--etcd-endpoints",
        &etcd.endpoint(),
    ])
    .await;
    let writer = Writer::new(&gateway, None);
    let snapshot = etcd.snapshot().await;
    // Revisions move on after the snapshot: writes of other keys, then a term.
    for i in 0..20 {
        etcd.etcdctl(&["put", &format!("/other/{i}"), "x"])
            .await
            .unwrap();
    }
    let store = etcd_store(&etcd).await;
    let before = store
        .acquire(LEASE, "node-a", ETCD_TTL)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(writer.put(before, "a").await.status, 201);
    drop(store);

    etcd.restore(&snapshot).await;
    let store = etcd_store(&etcd).await;
    let after = acquire_when_free(&store, "node-b", ETCD_TTL).await;
    assert!(
        after < before,
        "the restored cluster issues {after}, below {before}"
    );
    let refused = writer.put(after, "b").await;
    assert_eq!(refused.error_code(), "stale_token", "{refused:?}");

    let series = "fencegate_issuer_regressions_total{issuer=\"etcd\"}";
    let deadline = Instant::now() + PATIENCE;
    while writer.metric(series).await < 1.0 {
        assert!(Instant::now() < deadline, "the restore was not detected");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let logged = gateway.logs().into_iter().any(|event| {
        event["fields"]["message"]
            .as_str()
            .is_some_and(|message| message.starts_with("etcd's revision went back"))
    });
    assert!(logged, "the restore is logged with what to do");
}

/// The ZooKeeper store: one holder at a time; the token is the node's czxid and rises
/// across terms and across a restart of the server (a new zxid epoch); the term's node
/// deleted (as its session's expiry deletes it) ends the term at once; release frees the
/// lease. (A holder's session expiring on the server is run by the sweeper test below:
/// its leader is killed with kill -9.)
#[tokio::test]
async fn zookeeper_terms_rise_and_a_deleted_node_ends_the_term() {
    let mut server = ZooKeeper::start().await;
    let (_db, gateway) = start_gateway(&[
        "--issued-by",
        "zookeeper:sweep-*",
        "--zookeeper-connect",
        &server.connect(),
    ])
    .await;
    let writer = Writer::new(&gateway, None);
    let (a, b) = (zookeeper_store(&server), zookeeper_store(&server));
    let first = a
        .acquire(LEASE, "node-a", SESSION)
        .await
        .unwrap()
        .expect("free");
    assert_eq!(b.acquire(LEASE, "node-b", SESSION).await.unwrap(), None);
    assert!(a.renew(LEASE, "node-a", first, SESSION).await.unwrap());
    assert_eq!(writer.put(first, "a1").await.status, 201);

    // node-a's node goes, as with its session's expiry (or an operator's delete).
    let (ended, ()) = tokio::join!(
        tokio::time::timeout(PATIENCE, a.lost(LEASE, "node-a", first)),
        delete_leader(&server)
    );
    assert!(ended.is_ok(), "node-a learns its term ended");
    assert!(!a.renew(LEASE, "node-a", first, SESSION).await.unwrap());
    let second = acquire_when_free(&b, "node-b", SESSION).await;
    assert!(second > first, "{second} > {first}");
    assert_eq!(writer.put(second, "b1").await.status, 200);
    assert_eq!(writer.put(first, "late").await.error_code(), "stale_token");

    // The server restarts (kill -9): zxids continue in a new epoch, above the old.
    assert!(b.release(LEASE, "node-b", second).await.unwrap());
    server.restart().await;
    let c = zookeeper_store(&server);
    let third = acquire_when_free(&c, "node-c", SESSION).await;
    assert!(third > second, "{:#x} > {:#x}", third.get(), second.get());
    assert!(
        third.get() >> 32 > second.get() >> 32,
        "a new zxid epoch: {:#x} after {:#x}",
        third.get(),
        second.get()
    );
    assert_eq!(writer.put(third, "c1").await.status, 200);
}

/// Deletes the leading node of the election, as its session's expiry would.
async fn delete_leader(server: &ZooKeeper) {
    let admin = zookeeper::connect(&server.connect(), Duration::from_secs(10))
        .await
        .expect("an admin session");
    let election = format!("{}/{LEASE}", zookeeper::DEFAULT_PREFIX);
    let leader = zookeeper::first_candidate(&admin, &election)
        .await
        .expect("the election is read")
        .expect("a leader");
    admin
        .delete(&leader.path, None)
        .await
        .expect("the leader's node is deleted");
}

/// `--issued-by zookeeper:...`: a forged token is refused without moving the fence; the
/// leader's token by another identity is refused; with ZooKeeper down, known tokens
/// work and unknown ones get 503 `issuer_unavailable`.
#[tokio::test]
async fn zookeeper_refuses_forged_tokens_and_fails_closed() {
    let mut server = ZooKeeper::start().await;
    let (key_a, key_b) = (new_key(), new_key());
    let auth = AuthFile::new(&[
        ("node-a", &key_a, SWEEP_GRANTS),
        ("node-b", &key_b, SWEEP_GRANTS),
    ]);
    let (_db, gateway) = start_gateway(&[
        "--auth-file",
        &auth.path(),
        "--issued-by",
        "zookeeper:sweep-*",
        "--zookeeper-connect",
        &server.connect(),
        "--issuer-timeout",
        "1s",
    ])
    .await;
    let (a, b) = (
        Writer::new(&gateway, Some(&key_a)),
        Writer::new(&gateway, Some(&key_b)),
    );
    let store = zookeeper_store(&server);
    let token = store
        .acquire(LEASE, "node-a", SESSION)
        .await
        .unwrap()
        .expect("free");
    let forged = a.put(above(token, 1), "x").await;
    assert_eq!(forged.error_code(), "token_not_issued", "{forged:?}");
    assert_eq!(a.highest().await, None);
    let invented = b.put(below(token), "x").await;
    assert_eq!(invented.error_code(), "stale_token", "{invented:?}");
    assert_eq!(a.highest().await, None);
    assert_eq!(
        b.put(token, "x").await.error_code(),
        "token_holder_mismatch"
    );
    assert_eq!(a.put(token, "a").await.status, 201);

    server.kill().await;
    assert_eq!(a.put(token, "still").await.status, 200);
    let unknown = a.put(above(token, 1), "x").await;
    assert_eq!(unknown.error_code(), "issuer_unavailable", "{unknown:?}");
    assert_eq!(
        a.metric("fencegate_token_refusals_total{reason=\"issuer_unavailable\"}")
            .await,
        1.0
    );

    // Back: the forged token is judged again, and refused as not issued.
    server.restart().await;
    let deadline = Instant::now() + PATIENCE;
    loop {
        let reply = a.put(above(token, 1), "x").await;
        if reply.error_code() == "token_not_issued" {
            break;
        }
        assert_eq!(reply.error_code(), "issuer_unavailable", "{reply:?}");
        assert!(Instant::now() < deadline, "ZooKeeper never vouched again");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(a.put(token, "again").await.status, 200);
}

/// The seed's invoice sweeper (`lease-client/examples/invoice-sweeper.rs`) electing
/// through etcd and through ZooKeeper, two processes each, writing through a gateway
/// that checks every term's token against the election: the leader sweeps; killed
/// (kill -9: no release, its etcd lease or ZooKeeper session left to expire), it is
/// replaced by the other with a higher token, whose reminders are written.
#[tokio::test]
async fn the_invoice_sweeper_elects_through_etcd_and_zookeeper() {
    let etcd = Etcd::start().await;
    sweepers_take_over(
        &["--store", "etcd", "--etcd-endpoints", &etcd.endpoint()],
        &[
            "--issued-by",
            "etcd:invoices",
            "--etcd-endpoints",
            &etcd.endpoint(),
        ],
    )
    .await;
    drop(etcd);
    let zookeeper = ZooKeeper::start().await;
    sweepers_take_over(
        &[
            "--store",
            "zookeeper",
            "--zookeeper-connect",
            &zookeeper.connect(),
        ],
        &[
            "--issued-by",
            "zookeeper:invoices",
            "--zookeeper-connect",
            &zookeeper.connect(),
        ],
    )
    .await;
}

async fn sweepers_take_over(store: &[&str], issuer: &[&str]) {
    let (_db, gateway) = start_gateway(issuer).await;
    let mut args: Vec<String> = [
        "--gateway",
        &gateway.url(),
        "--lease",
        "invoices",
        "--resource",
        "invoices",
        "--lease-duration",
        "2s",
        "--sweep-interval",
        "50ms",
    ]
    .iter()
    .map(|arg| (*arg).to_owned())
    .collect();
    args.extend(store.iter().map(|arg| (*arg).to_owned()));
    let sweepers = [
        Sweeper::spawn("node-a", &args),
        Sweeper::spawn("node-b", &args),
    ];
    let epoch = |event: &fencegate_tests::lease::Event| event.field("epoch").as_u64().unwrap();
    let deadline = Instant::now() + PATIENCE;
    let (leader, first) = loop {
        if let Some((i, event)) = sweepers.iter().enumerate().find_map(|(i, sweeper)| {
            Some((
                i,
                sweeper
                    .events_named("reminder written")
                    .into_iter()
                    .next()?,
            ))
        }) {
            break (i, epoch(&event));
        }
        assert!(Instant::now() < deadline, "no sweeper wrote a reminder");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    sweepers[leader].signal("KILL");
    let follower = &sweepers[1 - leader];
    let taken = follower
        .wait_for("reminder written", PATIENCE, |event| epoch(event) > first)
        .await;
    assert!(epoch(&taken) > first);
}
