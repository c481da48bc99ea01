//! The store's own checks, end to end: a gateway started with the test-only
//! `--no-cache-rejections` never rejects from its fence cache, so every stale write,
//! delete, advance and If-Match write reaches the database's or the embedded store's
//! statement, and must be refused there. With the cache in front (as in every other
//! test) a token one below the fence never gets that far, so an off-by-one in those
//! statements would go unseen.

use fencegate_tests::backend_tests;
use fencegate_tests::http::kv_path;
use http::Method;

const RESOURCE: &str = "ledger";

backend_tests! {
    /// At the fence's own token everything is applied; one below, each kind of write is
    /// refused by the store with the fence's highest, and nothing changes.
    async fn the_store_refuses_a_token_one_below_the_fence(deployment) ["--no-cache-rejections"] {
        let client = deployment.client();
        assert_eq!(client.advance(RESOURCE, 5).await.status, 200);
        assert_eq!(client.put(RESOURCE, "k", 5, "v5").await.status, 201);

        let stale = client.put(RESOURCE, "k", 4, "late").await;
        assert_eq!((stale.status, stale.error_code()), (409, "stale_token".to_owned()));
        assert_eq!(stale.header("fencing-highest"), Some("5"));

        let if_match = client
            .request(
                Method::PUT,
                &kv_path(RESOURCE, "k"),
                &[("fencing-token", "4"), ("if-match", "\"1\"")],
                "late",
            )
            .await;
        assert_eq!(if_match.error_code(), "stale_token", "{if_match:?}");

        let delete = client.delete(RESOURCE, "k", 4).await;
        assert_eq!(delete.error_code(), "stale_token", "{delete:?}");

        let advance = client.advance(RESOURCE, 4).await;
        assert_eq!(advance.error_code(), "stale_token", "{advance:?}");

        assert_eq!(deployment.highest(RESOURCE).await, Some(5));
        let (value, token, version) = deployment.object(RESOURCE, "k").await.expect("stored");
        assert_eq!((value.as_slice(), token, version), (&b"v5"[..], 5, 1));

        // The fence's own token still writes, with If-Match too.
        let current = client
            .request(
                Method::PUT,
                &kv_path(RESOURCE, "k"),
                &[("fencing-token", "5"), ("if-match", "\"1\"")],
                "v5b",
            )
            .await;
        assert_eq!(current.status, 200, "{current:?}");
        // Every refusal came from the store, none from the cache.
        assert_eq!(client.metric("fencegate_cache_rejections_total").await, Some(0.0));
        assert_eq!(
            client
                .metric(&format!("fencegate_stale_rejections_total{{resource=\"{RESOURCE}\"}}"))
                .await,
            Some(4.0)
        );
    }

    /// Without the setting the cache, which knows the fence, answers first.
    async fn the_cache_rejects_first_otherwise(deployment) {
        let client = deployment.client();
        assert_eq!(client.advance(RESOURCE, 5).await.status, 200);
        assert_eq!(client.put(RESOURCE, "k", 4, "late").await.error_code(), "stale_token");
        assert_eq!(client.metric("fencegate_cache_rejections_total").await, Some(1.0));
    }
}
