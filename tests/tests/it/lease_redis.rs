//! fencegate-lease on Redis (127.0.0.1:6379, `FENCEGATE_TEST_REDIS` to override): the
//! seed's steps with a minted token, safe release, and an elector stepping down when
//! replaced. Each test uses its own key prefix.

use std::time::Duration;

use fencegate_lease::{Elector, LeaseStore, LossReason, RedisStore, Term, Transition};
use fencegate_proto::Token;
use fencegate_tests::lease::{lost, next_term, next_transition, steady_timing, PATIENCE};
use tokio_util::sync::CancellationToken;

const LEASE: &str = "invoice-sweeper";
const LONG: Duration = Duration::from_secs(15);

fn token(value: u64) -> Token {
    Token::new(value).unwrap()
}

fn server() -> String {
    std::env::var("FENCEGATE_TEST_REDIS").unwrap_or_else(|_| "redis://127.0.0.1:6379".to_owned())
}

/// A store with a prefix of its own, and a raw connection to look at its keys.
/// Panics with instructions if Redis is not running.
async fn fresh() -> (RedisStore, redis::aio::MultiplexedConnection, String) {
    let prefix = format!(
        "fencegate-test:{}:{:08x}:",
        std::process::id(),
        rand::random::<u32>()
    );
    let raw = redis::Client::open(server())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot reach Redis at {}: {e}\nThese tests need a real Redis. Start one with\n  \
             redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save \"\" --appendonly no",
                server()
            )
        });
    (RedisStore::new(&server(), &prefix).unwrap(), raw, prefix)
}

async fn value(raw: &mut redis::aio::MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query_async(raw).await.unwrap()
}

async fn cleanup(raw: &mut redis::aio::MultiplexedConnection, store: &RedisStore) {
    let _: () = redis::cmd("DEL")
        .arg(store.lease_key(LEASE))
        .arg(store.counter_key(LEASE))
        .query_async(raw)
        .await
        .unwrap();
}

/// Seed 000's steps on Redis: acquire (token 1, minted with the SET NX PX), rival
/// blocked, renew keeps the token, after expiry the rival gets token 2, the old
/// holder's renewal with token 1 matches nothing.
#[tokio::test]
async fn seed_steps_with_a_minted_token() {
    let (store, mut raw, _) = fresh().await;
    let key = store.lease_key(LEASE);

    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(1))
    );
    assert_eq!(value(&mut raw, &key).await.as_deref(), Some("1:node-a"));
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        ttl > 0 && ttl <= 15_000,
        "the lease key expires: PTTL {ttl}"
    );

    assert_eq!(store.acquire(LEASE, "node-b", LONG).await.unwrap(), None);

    assert!(store.renew(LEASE, "node-a", token(1), LONG).await.unwrap());
    assert_eq!(value(&mut raw, &key).await.as_deref(), Some("1:node-a"));

    // Expiry forced: the key expires now.
    let _: i64 = redis::cmd("PEXPIRE")
        .arg(&key)
        .arg(1)
        .query_async(&mut raw)
        .await
        .unwrap();
    fencegate_tests::eventually(PATIENCE, "the lease key to expire", || {
        let mut raw = raw.clone();
        let key = key.clone();
        async move { value(&mut raw, &key).await.is_none() }
    })
    .await;

    assert_eq!(
        store.acquire(LEASE, "node-b", LONG).await.unwrap(),
        Some(token(2))
    );
    assert_eq!(value(&mut raw, &key).await.as_deref(), Some("2:node-b"));
    assert!(!store.renew(LEASE, "node-a", token(1), LONG).await.unwrap());
    assert_eq!(value(&mut raw, &key).await.as_deref(), Some("2:node-b"));
    cleanup(&mut raw, &store).await;
}

/// The compare-then-delete release: a replaced holder's late release leaves the
/// successor's key alone; the successor's own release deletes it, and the counter
/// keeps rising.
#[tokio::test]
async fn a_late_release_does_not_free_the_successors_lease() {
    let (store, mut raw, _) = fresh().await;
    let key = store.lease_key(LEASE);
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(1))
    );
    let _: i64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        store.acquire(LEASE, "node-b", LONG).await.unwrap(),
        Some(token(2))
    );

    assert!(!store.release(LEASE, "node-a", token(1)).await.unwrap());
    assert!(!store.release(LEASE, "node-b", token(1)).await.unwrap());
    assert_eq!(value(&mut raw, &key).await.as_deref(), Some("2:node-b"));
    assert!(store.release(LEASE, "node-b", token(2)).await.unwrap());
    assert_eq!(value(&mut raw, &key).await, None);
    assert_eq!(
        store.acquire(LEASE, "node-a", LONG).await.unwrap(),
        Some(token(3))
    );
    cleanup(&mut raw, &store).await;
}

/// The elector on Redis: it acquires, renews, and steps down (`replaced`) when another
/// holder takes the key; a clean shutdown deletes its key.
#[tokio::test]
async fn an_elector_on_redis_steps_down_when_replaced() {
    let (store, mut raw, prefix) = fresh().await;
    let key = store.lease_key(LEASE);
    let config = steady_timing();
    let elector = Elector::new(store, LEASE, "node-a", config).unwrap();
    let mut events = elector.subscribe();
    let shutdown = CancellationToken::new();
    let (terms_tx, mut terms) = tokio::sync::mpsc::unbounded_channel::<Term>();
    let run = tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            elector
                .run(shutdown, |term| {
                    let _ = terms_tx.send(term.clone());
                    async move { term.cancelled().await }
                })
                .await
        }
    });
    let term = next_term(&mut terms).await;
    assert_eq!(term.epoch(), token(1));
    next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Renewed { .. })
    })
    .await;

    // Another holder takes the key (as after an expiry).
    let rival = RedisStore::new(&server(), &prefix).unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        rival.acquire(LEASE, "node-b", LONG).await.unwrap(),
        Some(token(2))
    );
    assert_eq!(lost(&mut events).await, LossReason::Replaced);
    assert_eq!(term.loss_reason(), Some(LossReason::Replaced));
    assert_eq!(value(&mut raw, &key).await.as_deref(), Some("2:node-b"));

    // node-b hands the lease back; node-a acquires again (token 3) and, shut down,
    // deletes its key.
    assert!(rival.release(LEASE, "node-b", token(2)).await.unwrap());
    let acquired = next_transition(&mut events, PATIENCE, |t| {
        matches!(t, Transition::Acquired { .. })
    })
    .await;
    assert_eq!(acquired.epoch(), token(3));
    shutdown.cancel();
    run.await.unwrap();
    assert_eq!(
        value(&mut raw, &key).await,
        None,
        "shutdown released the lease"
    );
    cleanup(&mut raw, &rival).await;
}
