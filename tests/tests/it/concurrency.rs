//! Many writers with random tokens racing on one resource: every acknowledged write
//! must be consistent with the fence.

use fencegate_tests::api_tests;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::Client;
use rand::Rng;
use tokio::task::JoinSet;

const WRITERS: usize = 32;
const WRITES_EACH: usize = 8;
const MAX_TOKEN: u64 = 40;

/// One write's answer: (presented token, status, body).
type Answer = (u64, u16, serde_json::Value);

/// `WRITERS` concurrent writers, each sending `WRITES_EACH` puts of one key with
/// random tokens, spread over `clients` (one per gateway).
async fn race(clients: &[Client]) -> Vec<Answer> {
    let mut writers = JoinSet::new();
    for writer in 0..WRITERS {
        let client = clients[writer % clients.len()].clone();
        writers.spawn(async move {
            let mut answers = Vec::new();
            for i in 0..WRITES_EACH {
                let token = rand::rng().random_range(1..=MAX_TOKEN);
                let reply = client
                    .put("contended", "row", token, format!("w{writer}-{i}-t{token}"))
                    .await;
                answers.push((token, reply.status, reply.json()));
            }
            answers
        });
    }
    writers.join_all().await.into_iter().flatten().collect()
}

/// Checks the race's answers against each other and returns the accepted writes as
/// (version, token), in version order.
fn check(answers: &[Answer]) -> Vec<(u64, u64)> {
    let mut accepted = Vec::new();
    for (token, status, body) in answers {
        match status {
            200 | 201 => {
                assert_eq!(body["token"].as_u64(), Some(*token), "{body}");
                accepted.push((body["version"].as_u64().unwrap(), *token));
            }
            409 => {
                assert_eq!(body["presented"].as_u64(), Some(*token), "{body}");
                assert!(
                    body["highest"].as_u64().unwrap() > *token,
                    "rejected below its highest: {body}"
                );
            }
            other => panic!("unexpected status {other}: {body}"),
        }
    }
    accepted.sort();
    // Versions of one key are its commit order: 1, 2, ..., n with no gaps or repeats.
    let versions: Vec<u64> = accepted.iter().map(|(version, _)| *version).collect();
    assert_eq!(
        versions,
        (1..=accepted.len() as u64).collect::<Vec<_>>(),
        "versions must be 1..=n"
    );
    // No write was acknowledged after a higher token had been acknowledged.
    for pair in accepted.windows(2) {
        assert!(
            pair[0].1 <= pair[1].1,
            "token {} committed after token {}",
            pair[1].1,
            pair[0].1
        );
    }
    accepted
}

api_tests! {
    async fn concurrent_writers_with_random_tokens(gateway) {
        let answers = race(&[gateway.client()]).await;
        let accepted = check(&answers);
        let (last_version, last_token) = accepted.last().cloned().expect("at least one write is accepted");
        assert_eq!(gateway.highest("contended").await, Some(last_token), "the durable fence is the highest accepted token");
        let (_, token, version) = gateway.object("contended", "row").await.expect("the object exists");
        assert_eq!((token, version), (last_token, last_version), "the stored object is the last accepted write");
    }
}

/// Invariant 5: two gateway processes on one database are as safe as one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_racing_on_one_database() {
    let deployment = fencegate_tests::deployment::Deployment::start(
        fencegate_tests::deployment::Backend::Postgres,
    )
    .await;
    let second: Gateway = deployment.builder().spawn().await;
    let answers = race(&[deployment.client(), second.client()]).await;
    let accepted = check(&answers);
    let (last_version, last_token) = accepted
        .last()
        .cloned()
        .expect("at least one write is accepted");
    assert_eq!(deployment.highest("contended").await, Some(last_token));
    let (_, token, version) = deployment
        .object("contended", "row")
        .await
        .expect("the object exists");
    assert_eq!((token, version), (last_token, last_version));
}
