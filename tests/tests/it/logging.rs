//! One structured event per stale rejection, up to `--stale-log-limit` lines a second
//! (100 by default): past it, lines are left out and counted — in the next line and in a
//! summary line each second — and metrics still count every rejection.

use fencegate_tests::backend_tests;
use fencegate_tests::http::metric_value;

const REJECTIONS: usize = 40;

async fn flood(client: &fencegate_tests::http::Client) {
    assert_eq!(client.put("flood", "k", 10, "current").await.status, 201);
    for _ in 0..REJECTIONS {
        assert_eq!(client.put("flood", "k", 9, "stale").await.status, 409);
    }
    let metrics = client.metrics().await;
    let counted = metric_value(
        &metrics,
        "fencegate_stale_rejections_total{resource=\"flood\"}",
    );
    assert_eq!(
        counted,
        Some(REJECTIONS as f64),
        "metrics count every rejection"
    );
}

backend_tests! {
    async fn below_the_default_cap_every_rejection_is_logged(deployment) {
        flood(&deployment.client()).await;
        let events = deployment.gateway.events("stale write rejected");
        assert_eq!(events.len(), REJECTIONS);
        let counts: Vec<u64> = events.iter().map(|e| e["fields"]["rejections"].as_u64().unwrap()).collect();
        assert_eq!(counts, (1..=REJECTIONS as u64).collect::<Vec<_>>(), "the per-resource count rises by one");
    }

    async fn the_log_cap_leaves_lines_out_but_says_how_many(deployment) ["--stale-log-limit", "3"] {
        let started = std::time::Instant::now();
        flood(&deployment.client()).await;
        let seconds = started.elapsed().as_secs() + 1;
        let events = deployment.gateway.events("stale write rejected");
        assert!(!events.is_empty());
        assert!(events.len() as u64 <= 3 * seconds, "{} lines in {seconds} windows of 3", events.len());
        // Every rejection is either logged or counted as left out, once: in the next
        // line, or in the summary line of its second.
        let unlogged = |events: &[serde_json::Value]| -> u64 {
            events.iter().map(|e| e["fields"]["unlogged"].as_u64().unwrap_or(0)).sum()
        };
        fencegate_tests::eventually(std::time::Duration::from_secs(5), "the summary of what was left out", || async {
            let lines = deployment.gateway.events("stale write rejected");
            let summaries = deployment.gateway.events("stale write rejections not logged (--stale-log-limit); metrics count every one");
            lines.len() as u64 + unlogged(&lines) + unlogged(&summaries) == REJECTIONS as u64
        })
        .await;
    }

    async fn no_cap_logs_every_rejection(deployment) ["--stale-log-limit", "0"] {
        flood(&deployment.client()).await;
        assert_eq!(deployment.gateway.events("stale write rejected").len(), REJECTIONS);
    }
}

/// The connection pool's one warning per dropped connection ("could not be recycled")
/// is summarised: when the database ends every connection of the gateway, the log gets
/// one summary line with how many there were, not a line per connection — and the
/// gateway serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_pool_connections_are_summarised_not_repeated() {
    use fencegate_tests::deployment::{Backend, Deployment};
    let deployment = Deployment::start(Backend::Postgres).await;
    let client = deployment.client();
    // Every connection of the pool used once, so that each is recycled later.
    let writes: Vec<_> = (0..32)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move { client.put(&format!("r{i}"), "k", 1, "v").await })
        })
        .collect();
    for write in writes {
        assert!(write.await.unwrap().status < 300);
    }
    deployment
        .db()
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE application_name = 'fencegate' AND datname = current_database()
               AND pid <> pg_backend_pid()",
        )
        .await;
    let served = fencegate_tests::eventually(
        std::time::Duration::from_secs(10),
        "the gateway serves again",
        || async {
            let reads: Vec<_> = (0..16)
                .map(|i| {
                    let client = client.clone();
                    tokio::spawn(async move { client.get(&format!("r{i}"), "k").await.status })
                })
                .collect();
            let mut ok = true;
            for read in reads {
                ok &= read.await.unwrap() == 200;
            }
            ok
        },
    );
    served.await;
    let logs = deployment.gateway.logs();
    let per_connection = logs
        .iter()
        .filter(|e| e["target"].as_str() == Some("deadpool.postgres"))
        .count();
    assert_eq!(per_connection, 0, "the pool's own lines are not printed");
    let summaries: Vec<_> = logs
        .iter()
        .filter(|e| {
            e["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("the database connection pool dropped connections"))
        })
        .collect();
    assert_eq!(summaries.len(), 1, "{summaries:?}");
    assert!(
        summaries[0]["fields"]["last"]
            .as_str()
            .is_some_and(|m| m.starts_with("Connection")),
        "the summary quotes the pool's warning: {summaries:?}"
    );
}

/// The README's sample log line of a stale rejection is the gateway's own: the
/// walkthrough's two writes, sent to a gateway logging text as it does by default,
/// print that line, timestamp aside.
#[tokio::test]
async fn the_readmes_log_line_is_the_real_one() {
    use http::Method;
    use tokio::io::{AsyncBufReadExt, BufReader};

    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let documented = readme
        .lines()
        .find(|line| line.starts_with("WARN ") && line.contains("stale write rejected"))
        .expect("the README shows a stale rejection's log line");
    let data = fencegate_tests::deployment::DataDir::create();
    let mut child = tokio::process::Command::new(fencegate_tests::gateway::binary())
        .args([
            "--listen",
            "127.0.0.1:0",
            "--pg-listen",
            "off",
            "--data-dir",
        ])
        .arg(&data.0)
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines
            .next_line()
            .await
            .unwrap()
            .expect("the gateway starts");
        if let Some(at) = line.find(" addr=") {
            break line[at + 6..].split(' ').next().unwrap().to_owned();
        }
    };
    let client = fencegate_tests::http::Client::new(format!("http://{addr}"));
    for (token, holder, body, status) in [
        ("42", "node-b", "from 42", 201),
        ("41", "node-a", "late", 409),
    ] {
        let reply = client
            .request(
                Method::PUT,
                "/v1/kv/orders/o-1",
                &[("fencing-token", token), ("fencing-holder", holder)],
                body,
            )
            .await;
        assert_eq!(reply.status, status);
    }
    let printed = loop {
        let line = lines.next_line().await.unwrap().expect("a rejection line");
        if line.contains("stale write rejected") {
            break line;
        }
    };
    // `2026-12-06T23:29:39.207650Z  WARN target: ...`: the timestamp aside.
    let (_, rest) = printed.split_once(' ').unwrap();
    assert_eq!(rest.trim_start(), documented);
}
