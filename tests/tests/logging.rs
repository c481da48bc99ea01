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
