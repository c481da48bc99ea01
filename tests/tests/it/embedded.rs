//! The embedded store: crash safety under kill -9, and refusing files it must not use.
//! (The API suites run against it too, through `backend_tests!`.)

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fencegate_tests::deployment::{Backend, DataDir, Deployment};
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::Client;
use http::Method;
use tokio::task::JoinSet;

const ROUNDS: usize = 4;
const WRITERS: usize = 16;

/// What one writer saw before the gateway died under it.
#[derive(Default)]
struct History {
    /// (version, value) of its latest acknowledged write.
    acked: Option<(u64, String)>,
    /// A write sent but not answered when the process died: it may or may not be there.
    in_flight: Option<String>,
    /// Values of writes that were rejected: none of them may ever be stored.
    rejected: Vec<String>,
    highest_acked_token: u64,
}

/// Writes until the gateway stops answering. Each writer owns one key; most writes
/// carry a fresh token from a shared counter, every fourth a stale one that must fail.
async fn write_until_killed(
    client: Client,
    writer: usize,
    round: usize,
    tokens: Arc<AtomicU64>,
) -> (usize, History) {
    let mut history = History::default();
    for seq in 0.. {
        let value = format!("round{round}-w{writer}-{seq}");
        let token = if seq % 4 == 3 {
            1
        } else {
            tokens.fetch_add(1, Ordering::SeqCst)
        };
        let path = format!("/v1/kv/crash/w{writer}");
        history.in_flight = Some(value.clone());
        let header = token.to_string();
        let Ok(reply) = client
            .try_request(
                Method::PUT,
                &path,
                &[("fencing-token", &header)],
                value.clone(),
            )
            .await
        else {
            return (writer, history);
        };
        history.in_flight = None;
        match reply.status {
            200 | 201 => {
                history.acked = Some((reply.json()["version"].as_u64().unwrap(), value));
                history.highest_acked_token = history.highest_acked_token.max(token);
            }
            409 => history.rejected.push(value),
            other => panic!("unexpected status {other}: {:?}", reply.body),
        }
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_under_load_loses_no_acknowledged_write() {
    let mut deployment = Deployment::start(Backend::Embedded).await;
    // Tokens start above the stale token 1, which is written first so that it is stale.
    assert_eq!(
        deployment
            .client()
            .put("crash", "seed", 2, "seed")
            .await
            .status,
        201
    );
    let tokens = Arc::new(AtomicU64::new(3));
    let mut expected: HashMap<usize, (u64, String)> = HashMap::new();
    let mut rejected_total = 0;

    for round in 0..ROUNDS {
        let client = deployment.client();
        let mut writers = JoinSet::new();
        for writer in 0..WRITERS {
            writers.spawn(write_until_killed(
                client.clone(),
                writer,
                round,
                Arc::clone(&tokens),
            ));
        }
        // Let the load build up, then pull the plug while writes are in flight.
        let progress = Arc::new(AtomicBool::new(false));
        let watcher = progress.clone();
        let watch_client = client.clone();
        let watch = tokio::spawn(async move {
            while !watcher.load(Ordering::SeqCst) {
                if watch_client.fence("crash").await.json()["highest"]
                    .as_u64()
                    .unwrap_or(0)
                    > 20 * (round as u64 + 1)
                {
                    watcher.store(true, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        tokio::time::timeout(Duration::from_secs(30), watch)
            .await
            .expect("writes make progress")
            .unwrap();
        deployment.gateway.kill().await;
        let histories: Vec<(usize, History)> = writers.join_all().await;

        deployment.gateway = deployment.builder().spawn().await;
        let max_acked = histories
            .iter()
            .map(|(_, h)| h.highest_acked_token)
            .max()
            .unwrap();
        let highest = deployment.highest("crash").await.expect("the fence exists");
        assert!(
            highest >= max_acked,
            "round {round}: fence {highest} is below the acknowledged token {max_acked}"
        );

        for (writer, history) in histories {
            rejected_total += history.rejected.len();
            let stored = deployment.object("crash", &format!("w{writer}")).await;
            let acked = history.acked.or_else(|| expected.get(&writer).cloned());
            match (&stored, &acked) {
                // Nothing acknowledged and nothing stored: consistent.
                (None, None) => {}
                (None, Some(acked)) => {
                    panic!("round {round}: writer {writer}'s acknowledged write {acked:?} is lost")
                }
                (Some((value, _, version)), acked) => {
                    let value = String::from_utf8(value.clone()).unwrap();
                    assert!(
                        !history.rejected.contains(&value),
                        "round {round}: rejected write {value} is stored"
                    );
                    let acked_version = acked.as_ref().map_or(0, |(v, _)| *v);
                    if Some(&value) == history.in_flight.as_ref() {
                        assert_eq!(
                            *version,
                            acked_version + 1,
                            "round {round}: writer {writer}"
                        );
                    } else {
                        assert_eq!(
                            Some((*version, value.clone())),
                            acked.clone(),
                            "round {round}: writer {writer}"
                        );
                    }
                    expected.insert(writer, (*version, value));
                }
            }
        }
    }
    assert!(rejected_total > 0, "the load included stale writes");
}

#[tokio::test]
async fn a_second_gateway_on_the_same_file_fails_to_start() {
    let deployment = Deployment::start(Backend::Embedded).await;
    let failure = deployment
        .builder()
        .try_spawn()
        .await
        .err()
        .expect("the second gateway must not start");
    assert!(failure.status.is_some_and(|s| !s.success()), "{failure}");
    assert!(
        failure.logs.contains("in use by another fencegate process"),
        "{failure}"
    );
    // The first one is unaffected.
    assert_eq!(deployment.client().put("r", "k", 1, "v").await.status, 201);
}

#[tokio::test]
async fn refuses_a_file_that_is_not_a_fencegate_store() {
    let dir = DataDir::create();
    std::fs::write(
        dir.0.join("fencegate.redb"),
        b"these are not the bytes of a redb file, at all".repeat(100),
    )
    .unwrap();
    let failure = Gateway::builder()
        .arg("--data-dir")
        .arg(dir.0.to_string_lossy())
        .try_spawn()
        .await
        .err()
        .expect("the gateway must not start");
    assert!(
        failure.logs.contains("is not a fencegate store"),
        "{failure}"
    );
}

#[tokio::test]
async fn starts_with_no_database_and_creates_its_file() {
    let dir = DataDir::create();
    let data_dir = dir.0.join("nested").join("data");
    let gateway = Gateway::builder()
        .arg("--data-dir")
        .arg(data_dir.to_string_lossy())
        .spawn()
        .await;
    assert!(data_dir.join("fencegate.redb").exists());
    let ready = gateway.events("fencegate ready");
    let backend = ready[0]["fields"]["backend"].as_str().unwrap();
    assert!(
        backend.starts_with("embedded store at") && backend.contains("fencegate.redb"),
        "{backend}"
    );
    assert_eq!(gateway.client().put("r", "k", 41, "v").await.status, 201);
}

/// Endpoints that need Postgres say so, and name the flag that enables it.
#[tokio::test]
async fn sql_transactions_answer_501_with_the_flag_to_use() {
    let deployment = Deployment::start(Backend::Embedded).await;
    let body = r#"{"statements":[{"sql":"SELECT 1","params":[]}]}"#;
    let reply = deployment
        .client()
        .request(
            Method::POST,
            "/v1/sql/jobs",
            &[("fencing-token", "1")],
            body,
        )
        .await;
    assert_eq!(reply.status, 501, "{:?}", reply.body);
    assert_eq!(reply.error_code(), "not_supported_by_backend");
    let message = reply.json()["message"].as_str().unwrap().to_owned();
    assert!(message.contains("--database-url"), "{message}");
    assert_eq!(
        deployment.highest("jobs").await,
        None,
        "a refused transaction raises no fence"
    );
}
