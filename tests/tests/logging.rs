//! One structured event per stale rejection by default; a cap when asked for, with
//! every rejection still counted.

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
    async fn every_rejection_is_logged_by_default(deployment) {
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
        // Lines logged plus lines reported as left out never exceed the rejections.
        let unlogged: u64 = events.iter().map(|e| e["fields"]["unlogged"].as_u64().unwrap_or(0)).sum();
        assert!(events.len() as u64 + unlogged <= REJECTIONS as u64);
    }
}
