//! fencegate-lease's fenced client against the real gateway: the fence is advanced on
//! acquisition, a stale rejection ends the term and is never retried, a transport
//! failure is, error answers are decoded from the contract, and the lease metrics count
//! what happened. More on resends in `client_retries.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_lease::{
    Elector, FencedClient, LeaseMetrics, LossReason, PostgresStore, Term, WriteError,
};
use fencegate_proto::headers::Precondition;
use fencegate_proto::{ErrorCode, ObjectKey, ResourceName, Token};
use fencegate_tests::deployment::{Backend, Deployment};
use fencegate_tests::http::metric_value;
use fencegate_tests::lease::{lost, steady_timing, PATIENCE};
use tokio_util::sync::CancellationToken;

const LEASE: &str = "invoice-sweeper";

fn token(value: u64) -> Token {
    Token::new(value).unwrap()
}

/// One series of the registry, e.g. `fencegate_lease_is_leader{lease="x"}`.
fn metric(registry: &prometheus::Registry, series: &str) -> Option<f64> {
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .expect("metrics encode");
    metric_value(&text, series)
}

/// The leader's fence is advanced to its epoch before its code runs; its writes carry
/// the token; once a newer term has written, the next write is rejected as stale with
/// presented and highest decoded, the term ends with `stale_rejection`, and nothing
/// more is sent under it.
#[tokio::test]
async fn a_stale_rejection_ends_the_term() {
    let deployment = Deployment::start(Backend::Postgres).await;
    let (db, gateway) = (deployment.db(), &deployment.gateway);
    let client = FencedClient::new(&gateway.url()).unwrap();
    let resource = ResourceName::new("invoices").unwrap();
    let key = ObjectKey::new("invoice-001/reminder").unwrap();
    let registry = prometheus::Registry::new();
    let store = PostgresStore::new(&db.url(), "leader_lease", true).unwrap();
    let elector = Elector::new(store, LEASE, "node-a", steady_timing())
        .unwrap()
        .advance_fences(client.clone(), vec![resource.clone()])
        .with_metrics(LeaseMetrics::register(&registry).unwrap());
    let mut events = elector.subscribe();
    let shutdown = CancellationToken::new();

    // What the leading code saw, in order.
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let (log, probe, gateway_client) = (Arc::clone(&seen), gateway.client(), client.clone());
    let (res, k) = (resource.clone(), key.clone());
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            elector
                .run(shutdown, move |term: Term| {
                    let (log, probe, client, resource, key) = (
                        Arc::clone(&log),
                        probe.clone(),
                        gateway_client.clone(),
                        res.clone(),
                        k.clone(),
                    );
                    async move {
                        let fence = probe.fence("invoices").await.json()["highest"].as_u64();
                        log.lock()
                            .unwrap()
                            .push(format!("fence at start: {fence:?}"));
                        let first = client
                            .put(&term, &resource, &key, "first", Precondition::None)
                            .await
                            .unwrap();
                        log.lock()
                            .unwrap()
                            .push(format!("first write: token {}", first.token));
                        // A newer term writes (here: a fence advance straight to the gateway).
                        assert_eq!(probe.advance("invoices", 7).await.status, 200);
                        match client
                            .put(&term, &resource, &key, "second", Precondition::None)
                            .await
                        {
                            Err(WriteError::Stale {
                                presented,
                                highest,
                                resource,
                            }) => log.lock().unwrap().push(format!(
                                "stale: {resource} presented {presented} highest {highest:?}"
                            )),
                            other => panic!("expected a stale rejection, got {other:?}"),
                        }
                        log.lock()
                            .unwrap()
                            .push(format!("live after rejection: {}", term.is_live()));
                        match client
                            .put(&term, &resource, &key, "third", Precondition::None)
                            .await
                        {
                            Err(WriteError::TermOver { epoch, reason }) => log
                                .lock()
                                .unwrap()
                                .push(format!("not sent: epoch {epoch} {reason:?}")),
                            other => panic!("expected the write not to be sent, got {other:?}"),
                        }
                    }
                })
                .await
        }
    });

    assert_eq!(lost(&mut events).await, LossReason::StaleRejection);
    shutdown.cancel();
    run.await.unwrap();

    assert_eq!(
        *seen.lock().unwrap(),
        [
            "fence at start: Some(1)",
            "first write: token 1",
            "stale: invoices presented 1 highest Some(Token(7))",
            "live after rejection: false",
            "not sent: epoch 1 Some(StaleRejection)",
        ]
    );
    // Exactly one stale write reached the gateway: no retry with the same token.
    let probe = gateway.client();
    assert_eq!(
        probe
            .metric("fencegate_stale_rejections_total{resource=\"invoices\"}")
            .await,
        Some(1.0)
    );
    assert_eq!(
        db.object("invoices", "invoice-001/reminder").await,
        Some((b"first".to_vec(), 1, 1))
    );

    let value = |series: &str| metric(&registry, series);
    assert_eq!(
        value(
            "fencegate_lease_transitions_total{lease=\"invoice-sweeper\",transition=\"acquired\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        value("fencegate_lease_transitions_total{lease=\"invoice-sweeper\",transition=\"lost\"}"),
        Some(1.0)
    );
    assert_eq!(
        value("fencegate_lease_lost_total{lease=\"invoice-sweeper\",reason=\"stale_rejection\"}"),
        Some(1.0)
    );
    assert_eq!(
        value("fencegate_lease_lost_total{lease=\"invoice-sweeper\",reason=\"replaced\"}"),
        Some(0.0)
    );
    assert_eq!(
        value("fencegate_lease_is_leader{lease=\"invoice-sweeper\"}"),
        Some(0.0)
    );
    assert_eq!(
        value("fencegate_lease_epoch{lease=\"invoice-sweeper\"}"),
        Some(1.0)
    );
}

/// Error answers other than stale are decoded from the contract and leave the term
/// live: a failed precondition is not a loss of authority.
#[tokio::test]
async fn other_refusals_are_decoded_and_keep_the_term() {
    let deployment = Deployment::start(Backend::Postgres).await;
    let (db, gateway) = (deployment.db(), &deployment.gateway);
    let client = FencedClient::new(&gateway.url()).unwrap();
    let resource = ResourceName::new("invoices").unwrap();
    let key = ObjectKey::new("invoice 2/reminder?").unwrap();
    let store = PostgresStore::new(&db.url(), "leader_lease", true).unwrap();
    let elector = Elector::new(store, LEASE, "node-a", steady_timing()).unwrap();
    let result = Arc::new(Mutex::new(None));
    let out = Arc::clone(&result);
    tokio::time::timeout(
        PATIENCE,
        elector.run(CancellationToken::new(), move |term| {
            let (client, resource, key, out) = (
                client.clone(),
                resource.clone(),
                key.clone(),
                Arc::clone(&out),
            );
            async move {
                let created = client
                    .put(&term, &resource, &key, "v1", Precondition::MustNotExist)
                    .await
                    .unwrap();
                let again = client
                    .put(&term, &resource, &key, "v1", Precondition::MustNotExist)
                    .await;
                let read = client.get(&resource, &key).await.unwrap();
                let missing = client
                    .get(&resource, &ObjectKey::new("nope").unwrap())
                    .await
                    .unwrap();
                *out.lock().unwrap() = Some((
                    created.version,
                    again.map_err(|e| e.code()),
                    read,
                    missing,
                    term.is_live(),
                ));
            }
        }),
    )
    .await
    .expect("run returns when the leading code returns");
    let (version, again, read, missing, live) = result.lock().unwrap().take().unwrap();
    assert_eq!(version, 1);
    assert_eq!(again.unwrap_err(), Some(ErrorCode::VersionMismatch));
    let read = read.expect("the object exists");
    assert_eq!(
        (&read.value[..], read.version, read.token),
        (&b"v1"[..], 1, token(1))
    );
    assert_eq!(missing, None);
    assert!(live, "a version mismatch does not end the term");
}

/// A transport failure is retried, with the same token and the same Idempotency-Key,
/// for every write, conditional or not: each is applied once when the network is back.
#[tokio::test]
async fn writes_are_resent_after_a_transport_failure() {
    let deployment = Deployment::start(Backend::Postgres).await;
    let (db, gateway) = (deployment.db(), &deployment.gateway);
    let network = fencegate_tests::proxy::Proxy::start(gateway.addr()).await;
    let client = FencedClient::new(&format!("http://{}", network.addr()))
        .unwrap()
        .with_retries(5);
    let resource = ResourceName::new("invoices").unwrap();
    let store = PostgresStore::new(&db.url(), "leader_lease", true).unwrap();
    let elector = Elector::new(store, LEASE, "node-a", steady_timing()).unwrap();
    let network = Arc::new(tokio::sync::Mutex::new(Some(network)));
    let outcome = Arc::new(Mutex::new(None));
    let (out, net) = (Arc::clone(&outcome), Arc::clone(&network));
    tokio::time::timeout(
        PATIENCE,
        elector.run(CancellationToken::new(), move |term| {
            let (client, resource, out, net) = (
                client.clone(),
                resource.clone(),
                Arc::clone(&out),
                Arc::clone(&net),
            );
            async move {
                net.lock().await.as_ref().unwrap().cut();
                // The network comes back while the writes are being resent.
                let restore = tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    let proxy = net.lock().await.take().unwrap();
                    proxy.restore().await
                });
                let plain_key = ObjectKey::new("plain").unwrap();
                let plain = client
                    .put(&term, &resource, &plain_key, "x", Precondition::None)
                    .await;
                let versioned_key = ObjectKey::new("versioned").unwrap();
                let versioned = client
                    .put(
                        &term,
                        &resource,
                        &versioned_key,
                        "y",
                        Precondition::MustNotExist,
                    )
                    .await;
                let _proxy = restore.await.unwrap();
                *out.lock().unwrap() = Some((
                    plain.map(|w| (w.token, w.version)),
                    versioned.map(|w| (w.token, w.version)),
                ));
            }
        }),
    )
    .await
    .expect("run returns when the leading code returns");
    let (plain, versioned) = outcome.lock().unwrap().take().unwrap();
    assert_eq!(
        plain.expect("the unconditional write was resent and accepted"),
        (token(1), 1)
    );
    assert_eq!(
        versioned.expect("the versioned write was resent and accepted"),
        (token(1), 1)
    );
    assert_eq!(
        db.object("invoices", "plain").await,
        Some((b"x".to_vec(), 1, 1))
    );
    assert_eq!(
        db.object("invoices", "versioned").await,
        Some((b"y".to_vec(), 1, 1))
    );
}

/// With the default timing scaled to a 6 s lease (renew every 2 s, retry a failed
/// renewal every 0.2 s, each try abandoned after 0.4 s, step down 5.2 s after the last
/// renewal was sent), a hosted lease rides out a gateway that stops answering for 4.2 s
/// right after a renewal — past the step-down at two thirds of the lease (4 s) — and
/// keeps its term; stopped for longer than the deadline, the term ends with
/// `renew_deadline`, on the holder's clock, and not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hosted_lease_rides_out_an_outage_shorter_than_its_budget() {
    use fencegate_lease::{GatewayStore, Transition};
    use fencegate_tests::lease::next_transition;
    use tokio::time::Instant;

    let deployment = Deployment::start(Backend::Postgres).await;
    let gateway = &deployment.gateway;
    let config = fencegate_lease::LeaseConfig::with_lease(Duration::from_secs(6));
    let store = GatewayStore::new(FencedClient::new(&gateway.url()).unwrap());
    let elector = Elector::new(store, LEASE, "node-a", config).unwrap();
    let mut events = elector.subscribe();
    let shutdown = CancellationToken::new();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            elector
                .run(shutdown, |term: Term| async move { term.cancelled().await })
                .await
        }
    });
    let signal = |name: &str| {
        let status = std::process::Command::new("kill")
            .args([name, &gateway.pid().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill {name}");
    };
    let renewed = |t: &Transition| matches!(t, Transition::Renewed { .. });
    next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await;

    // A pause of 4.2 s just after a renewal: the term lasts.
    next_transition(&mut events, PATIENCE, renewed).await;
    signal("-STOP");
    tokio::time::sleep(Duration::from_millis(4200)).await;
    signal("-CONT");
    let after = next_transition(&mut events, Duration::from_secs(6), |t| {
        renewed(t) || matches!(t, Transition::Lost { .. })
    })
    .await;
    assert!(
        renewed(&after),
        "the term ended in a 4.2 s outage: {after:?}"
    );

    // A pause past the deadline: the term ends, at the deadline.
    let Transition::Renewed { deadline, .. } =
        next_transition(&mut events, PATIENCE, renewed).await
    else {
        unreachable!()
    };
    signal("-STOP");
    let reason = lost(&mut events).await;
    let ended = Instant::now();
    signal("-CONT");
    assert_eq!(reason, LossReason::RenewDeadline);
    assert!(ended >= deadline, "stepped down before its deadline");
    assert!(
        ended - deadline < Duration::from_millis(500),
        "stepped down {:?} after its deadline",
        ended - deadline
    );
    shutdown.cancel();
    let _ = run.await;
}
