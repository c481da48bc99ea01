//! The gateway speaks cleartext HTTP/2 (h2c, prior knowledge) on the same port as
//! HTTP/1.1, with the same answers.

use fencegate_tests::api_tests;
use fencegate_tests::http::Client;
use tokio::task::JoinSet;

api_tests! {
    async fn h2c_writes_are_fenced_like_http1(gateway) {
        let client = Client::new_h2(gateway.url());
        assert_eq!(client.put("orders", "o-1", 41, "from 41").await.status, 201);
        assert_eq!(client.put("orders", "o-1", 42, "from 42").await.status, 200);
        let stale = client.put("orders", "o-1", 41, "late").await;
        assert_eq!(stale.status, 409);
        assert_eq!(stale.header("fencing-highest"), Some("42"));

        // Many concurrent streams on the one connection.
        let mut streams = JoinSet::new();
        for i in 0..50u64 {
            let client = client.clone();
            streams.spawn(async move { client.put("orders", &format!("k{i}"), 42 + i % 2, "v").await.status });
        }
        let statuses = streams.join_all().await;
        assert!(statuses.iter().all(|s| *s == 201 || *s == 409), "{statuses:?}");
        assert!(statuses.contains(&201));
        assert_eq!(gateway.highest("orders").await, Some(43));
    }
}
