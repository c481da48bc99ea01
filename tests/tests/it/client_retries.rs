//! fencegate-lease's fenced client against the real gateway: every logical write has
//! its own `Idempotency-Key`, the same on every attempt, so a write whose answer was
//! lost, refused as unavailable or told to wait is resent and applied once; a
//! transaction of several terms ends exactly the stale ones; a term already over sends
//! nothing.

use std::time::Duration;

use fencegate_lease::{
    Elector, FencedClient, GatewayStore, LeaseStore, LossReason, PostgresStore, Term, WriteError,
};
use fencegate_proto::body::TxnOpKind;
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ObjectKey, ResourceName, Token};
use fencegate_tests::db::{server_addr, TestDb};
use fencegate_tests::deployment::{Backend, Deployment};
use fencegate_tests::eventually;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::Client;
use fencegate_tests::inprocess::{Api, InProcess};
use fencegate_tests::lease::{next_term, spawn_elector, steady_timing, PATIENCE};
use fencegate_tests::proxy::Proxy;
use tokio_util::sync::CancellationToken;

fn resource(name: &str) -> ResourceName {
    ResourceName::new(name).unwrap()
}

fn key(name: &str) -> ObjectKey {
    ObjectKey::new(name).unwrap()
}

/// Leads `lease` through `store` as `node-a` until `shutdown`; the first term.
async fn lead<S: LeaseStore>(store: S, lease: &str, shutdown: &CancellationToken) -> Term {
    let elector = Elector::new(store, lease, "node-a", steady_timing()).unwrap();
    let (_elector, mut terms) = spawn_elector(elector, shutdown);
    next_term(&mut terms).await
}

/// A term of the lease the gateway at `url` hosts for `name`; the lease mints its token
/// and raises the fence of the resource of the same name to it.
async fn hosted(url: &str, name: &str, shutdown: &CancellationToken) -> Term {
    let store = GatewayStore::new(FencedClient::new(url).unwrap());
    lead(store, name, shutdown).await
}

/// What became of keyed writes, from `fencegate_idempotency_requests_total`.
async fn idempotency(client: &Client, outcome: &str) -> f64 {
    let series = format!("fencegate_idempotency_requests_total{{outcome=\"{outcome}\"}}");
    client.metric(&series).await.unwrap_or(0.0)
}

/// Requests the gateway answered on `route`, whatever the outcome.
async fn answered(client: &Client, route: &str) -> f64 {
    let label = format!("route=\"{route}\"");
    client
        .metrics()
        .await
        .lines()
        .filter(|line| line.starts_with("fencegate_requests_total{") && line.contains(&label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Closes every connection through `network` and waits until its port refuses new
/// ones, so that it can listen again.
async fn cut(network: &Proxy) {
    network.cut();
    let addr = network.addr();
    eventually(
        PATIENCE,
        "the proxy's port to refuse connections",
        || async move { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
}

/// The gateway applied the write and answered; the answer is lost with the connection.
/// The client resends the same request under the same key, and the gateway answers
/// from its record: one application. The next write is a new one, with a new key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_whose_answer_is_lost_is_resent_and_applied_once() {
    let gateway = InProcess::start(&[]).await;
    let shutdown = CancellationToken::new();
    let term = hosted(&gateway.url(), "orders", &shutdown).await;
    let network = Proxy::start(gateway.addr()).await;
    let client = FencedClient::new(&format!("http://{}", network.addr()))
        .unwrap()
        .with_retries(5);

    network.hold_replies();
    let put = tokio::spawn({
        let (client, term) = (client.clone(), term.clone());
        async move {
            client
                .put(
                    &term,
                    &resource("orders"),
                    &key("o-1"),
                    "paid",
                    Precondition::None,
                )
                .await
        }
    });
    eventually(PATIENCE, "the gateway's answer to be held", || async {
        network.held_reply_bytes() > 0
    })
    .await;
    cut(&network).await;
    network.release_replies();
    let network = network.restore().await;

    let accepted = tokio::time::timeout(PATIENCE, put)
        .await
        .expect("the resent write is answered")
        .unwrap()
        .expect("the write is resent and answered from its record");
    assert_eq!((accepted.token, accepted.version), (term.epoch(), 1));
    let probe = gateway.client();
    assert_eq!(idempotency(&probe, "stored").await, 1.0);
    assert_eq!(
        idempotency(&probe, "replayed").await,
        1.0,
        "the resend was replayed"
    );
    assert_eq!(
        gateway.object("orders", "o-1").await,
        Some((b"paid".to_vec(), term.epoch().get(), 1)),
        "applied once"
    );

    // The same put again is another logical write: applied, not replayed.
    let again = client
        .put(
            &term,
            &resource("orders"),
            &key("o-1"),
            "paid",
            Precondition::None,
        )
        .await
        .unwrap();
    assert_eq!(again.version, 2);
    assert_eq!(idempotency(&probe, "replayed").await, 1.0);
    assert!(term.is_live());
    shutdown.cancel();
    drop(network);
}

/// The same for a transaction: its answer lost, it is resent under its key and applied
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_whose_answer_is_lost_is_resent_and_applied_once() {
    let gateway = InProcess::start(&[]).await;
    let shutdown = CancellationToken::new();
    let jobs = hosted(&gateway.url(), "jobs", &shutdown).await;
    let queue = hosted(&gateway.url(), "queue", &shutdown).await;
    let network = Proxy::start(gateway.addr()).await;
    let client = FencedClient::new(&format!("http://{}", network.addr()))
        .unwrap()
        .with_retries(5);

    network.hold_replies();
    let txn = tokio::spawn(
        client
            .txn()
            .put(
                &jobs,
                &resource("jobs"),
                &key("j-1"),
                "running",
                Precondition::None,
            )
            .put(
                &queue,
                &resource("queue"),
                &key("q-1"),
                "taken",
                Precondition::None,
            )
            .send(),
    );
    eventually(PATIENCE, "the gateway's answer to be held", || async {
        network.held_reply_bytes() > 0
    })
    .await;
    cut(&network).await;
    network.release_replies();
    let network = network.restore().await;

    let results = tokio::time::timeout(PATIENCE, txn)
        .await
        .expect("the resent transaction is answered")
        .unwrap()
        .expect("the transaction is resent and answered from its record");
    assert_eq!(
        results
            .iter()
            .map(|result| (result.version, result.created))
            .collect::<Vec<_>>(),
        [(Some(1), true), (Some(1), true)]
    );
    let probe = gateway.client();
    assert_eq!(idempotency(&probe, "replayed").await, 1.0);
    assert_eq!(gateway.object("jobs", "j-1").await.unwrap().2, 1);
    assert_eq!(gateway.object("queue", "q-1").await.unwrap().2, 1);
    shutdown.cancel();
    drop(network);
}

/// The database stops answering: the gateway answers `503 backend_unavailable` (not
/// applied, or in doubt), and the client resends the write under its key until the
/// database is back; the write is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_refused_as_unavailable_is_resent_until_the_database_is_back() {
    let db = TestDb::create().await;
    let network = Proxy::start(server_addr().await).await;
    let gateway = Gateway::builder()
        .database(&db.url_via(network.addr()))
        .args(&["--backend-timeout", "1s"])
        .spawn()
        .await;
    // The lease is kept on the database directly: the outage is the gateway's only.
    let shutdown = CancellationToken::new();
    let store = PostgresStore::new(&db.url(), "leader_lease", true).unwrap();
    let term = lead(store, "invoice-sweeper", &shutdown).await;
    let client = FencedClient::new(&gateway.url()).unwrap().with_retries(20);

    network.hold_replies();
    let put = tokio::spawn({
        let (client, term) = (client.clone(), term.clone());
        async move {
            client
                .put(
                    &term,
                    &resource("orders"),
                    &key("o-1"),
                    "paid",
                    Precondition::None,
                )
                .await
        }
    });
    let probe = gateway.client();
    let unavailable = "fencegate_requests_total{outcome=\"backend_unavailable\",route=\"kv_put\"}";
    eventually(
        PATIENCE,
        "the write to be refused as unavailable",
        || async { probe.metric(unavailable).await.unwrap_or(0.0) >= 1.0 },
    )
    .await;
    cut(&network).await;
    network.release_replies();
    let network = network.restore().await;

    let accepted = tokio::time::timeout(Duration::from_secs(60), put)
        .await
        .expect("the write is answered once the database is back")
        .unwrap()
        .expect("the write is resent until it is applied");
    assert_eq!((accepted.token, accepted.version), (term.epoch(), 1));
    assert_eq!(
        db.object("orders", "o-1").await,
        Some((b"paid".to_vec(), term.epoch().get() as i64, 1)),
        "applied once"
    );
    assert!(probe.metric(unavailable).await.unwrap() >= 1.0);
    assert!(term.is_live());
    shutdown.cancel();
    drop(network);
}

/// The answer of a write is lost while the gateway still applies it (it waits on its
/// fence's lock): the resend is told `409 idempotency_in_flight`, waits `Retry-After`,
/// and once the first attempt commits gets its answer from the record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resend_while_the_first_attempt_runs_waits_for_its_answer() {
    let deployment = Deployment::start(Backend::Postgres).await;
    let shutdown = CancellationToken::new();
    let term = hosted(&deployment.gateway.url(), "held", &shutdown).await;
    let lock = deployment.db().lock_fence("held").await;
    let network = Proxy::start(deployment.gateway.addr()).await;
    let client = FencedClient::new(&format!("http://{}", network.addr()))
        .unwrap()
        .with_retries(10);

    let put = tokio::spawn({
        let (client, term) = (client.clone(), term.clone());
        async move {
            client
                .put(&term, &resource("held"), &key("k"), "v", Precondition::None)
                .await
        }
    });
    let db = deployment.db();
    eventually(
        PATIENCE,
        "the first attempt to wait on the fence lock",
        || async { db.lock_waiters().await == 1 },
    )
    .await;
    cut(&network).await;
    let network = network.restore().await;
    let probe = deployment.client();
    eventually(PATIENCE, "a resend to be told to wait", || async {
        idempotency(&probe, "in_flight").await >= 1.0
    })
    .await;
    assert!(!put.is_finished(), "the client waits and resends");
    drop(lock);

    let accepted = tokio::time::timeout(PATIENCE, put)
        .await
        .expect("the write is answered once the first attempt committed")
        .unwrap()
        .expect("the resend gets the first attempt's answer");
    assert_eq!((accepted.token, accepted.version), (term.epoch(), 1));
    assert_eq!(idempotency(&probe, "replayed").await, 1.0);
    assert_eq!(deployment.object("held", "k").await.unwrap().2, 1);
    shutdown.cancel();
    drop(network);
}

/// Every kind of operation under the terms of two resources, applied together; each
/// answers its result, in order; bytes that are not text arrive intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_applies_every_operation_under_its_term() {
    let gateway = InProcess::start(&[]).await;
    let shutdown = CancellationToken::new();
    let (jobs, queue) = (resource("jobs"), resource("queue"));
    let jobs_term = hosted(&gateway.url(), "jobs", &shutdown).await;
    let queue_term = hosted(&gateway.url(), "queue", &shutdown).await;
    let client = FencedClient::new(&gateway.url()).unwrap();
    let job = key("job-7");
    let queued = client
        .put(
            &queue_term,
            &queue,
            &job,
            "waiting",
            Precondition::MustNotExist,
        )
        .await
        .unwrap();
    assert_eq!(queued.version, 1);

    let results = client
        .txn()
        .delete(&queue_term, &queue, &job, Precondition::Version(1))
        .put(
            &jobs_term,
            &jobs,
            &job,
            "running",
            Precondition::MustNotExist,
        )
        .put(
            &jobs_term,
            &jobs,
            &key("blob"),
            vec![0xff, 0x00, 0x80],
            Precondition::None,
        )
        .advance(&queue_term, &queue)
        .check(&queue_term, &queue)
        .check_version(&jobs_term, &jobs, &key("nothing"), 0)
        .send()
        .await
        .unwrap();
    let summary: Vec<_> = results
        .iter()
        .map(|r| {
            (
                r.op,
                r.resource.as_str(),
                r.token,
                r.key.as_ref().map(ObjectKey::as_str),
                r.version,
                r.created,
            )
        })
        .collect();
    let (j, q) = (jobs_term.epoch(), queue_term.epoch());
    assert_eq!(
        summary,
        [
            (TxnOpKind::Delete, "queue", q, Some("job-7"), Some(2), false),
            (TxnOpKind::Put, "jobs", j, Some("job-7"), Some(1), true),
            (TxnOpKind::Put, "jobs", j, Some("blob"), Some(1), true),
            (TxnOpKind::Advance, "queue", q, None, None, false),
            (TxnOpKind::Check, "queue", q, None, None, false),
            (TxnOpKind::Check, "jobs", j, Some("nothing"), Some(0), false),
        ]
    );
    assert_eq!(gateway.object("queue", "job-7").await, None);
    assert_eq!(
        gateway.object("jobs", "job-7").await,
        Some((b"running".to_vec(), j.get(), 1))
    );
    assert_eq!(
        gateway.object("jobs", "blob").await.unwrap().0,
        vec![0xff, 0x00, 0x80]
    );

    // A failed precondition names the operation at fault, applies nothing and ends no
    // term.
    let refused = client
        .txn()
        .put(&queue_term, &queue, &key("next"), "x", Precondition::None)
        .put(&jobs_term, &jobs, &job, "again", Precondition::MustNotExist)
        .send()
        .await;
    match refused {
        Err(WriteError::Refused { status: 412, body }) => assert_eq!(body.operation, Some(1)),
        other => panic!("expected a version mismatch, got {other:?}"),
    }
    assert_eq!(gateway.object("queue", "next").await, None);
    assert!(jobs_term.is_live() && queue_term.is_live());
    shutdown.cancel();
}

/// Newer terms have begun on two of three resources: the transaction is refused whole,
/// once (never resent), and exactly the terms of the stale resources end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_transaction_ends_the_terms_of_the_stale_resources() {
    let gateway = InProcess::start(&[]).await;
    let shutdown = CancellationToken::new();
    let (a, b, c) = (resource("a"), resource("b"), resource("c"));
    let a_term = hosted(&gateway.url(), "a", &shutdown).await;
    let b_term = hosted(&gateway.url(), "b", &shutdown).await;
    let c_term = hosted(&gateway.url(), "c", &shutdown).await;
    let probe = gateway.client();
    // Newer terms begin on b and c.
    assert_eq!(probe.advance("b", 50).await.status, 200);
    assert_eq!(probe.advance("c", 60).await.status, 200);
    let client = FencedClient::new(&gateway.url()).unwrap().with_retries(5);

    let refused = client
        .txn()
        .put(&a_term, &a, &key("k"), "v", Precondition::None)
        .put(&b_term, &b, &key("k"), "v", Precondition::None)
        .check(&c_term, &c)
        .send()
        .await;
    match refused {
        Err(WriteError::Stale {
            resource,
            presented,
            highest,
        }) => assert_eq!(
            (resource.as_str(), presented, highest),
            ("b", b_term.epoch(), Some(Token::new(50).unwrap()))
        ),
        other => panic!("expected a stale rejection, got {other:?}"),
    }
    assert!(a_term.is_live(), "a was not stale: its term goes on");
    assert_eq!(b_term.loss_reason(), Some(LossReason::StaleRejection));
    assert_eq!(c_term.loss_reason(), Some(LossReason::StaleRejection));
    assert_eq!(
        answered(&probe, "txn").await,
        1.0,
        "a stale transaction is never resent"
    );
    assert_eq!(gateway.object("a", "k").await, None, "nothing was applied");
    shutdown.cancel();
}

/// A term already over: neither a transaction that includes it nor a single write under
/// it is sent; the live term's writes in that transaction are not applied either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_term_already_over_sends_nothing() {
    let gateway = InProcess::start(&[]).await;
    let (a, b) = (resource("a"), resource("b"));
    let a_shutdown = CancellationToken::new();
    let a_term = hosted(&gateway.url(), "a", &a_shutdown).await;
    let b_shutdown = CancellationToken::new();
    let b_term = hosted(&gateway.url(), "b", &b_shutdown).await;
    b_shutdown.cancel();
    tokio::time::timeout(PATIENCE, b_term.cancelled())
        .await
        .expect("the term ends when its elector stops");
    let client = FencedClient::new(&gateway.url()).unwrap();
    let probe = gateway.client();

    let txn = client
        .txn()
        .put(&a_term, &a, &key("k"), "v", Precondition::None)
        .put(&b_term, &b, &key("k"), "v", Precondition::None)
        .send()
        .await;
    let put = client
        .put(&b_term, &b, &key("k"), "v", Precondition::None)
        .await;
    let advance = client.advance(&b_term, &b).await;
    for outcome in [txn.map(|_| ()), put.map(|_| ()), advance.map(|_| ())] {
        match outcome {
            Err(WriteError::TermOver { epoch, reason }) => {
                assert_eq!(
                    (epoch, reason),
                    (b_term.epoch(), Some(LossReason::Shutdown))
                )
            }
            other => panic!("expected the write not to be sent, got {other:?}"),
        }
    }
    for route in ["txn", "kv_put", "fence_advance"] {
        assert_eq!(
            answered(&probe, route).await,
            0.0,
            "nothing reached {route}"
        );
    }
    assert_eq!(gateway.object("a", "k").await, None);
    assert!(a_term.is_live());
    a_shutdown.cancel();
}
