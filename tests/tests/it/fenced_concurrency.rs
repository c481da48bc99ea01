//! The in-database fence under concurrency, with writers connected straight to
//! Postgres: one term's writers run side by side, a new term waits for the old term's
//! open transactions and then shuts them out, and tokens never go down in commit order.

use std::time::Duration;

use fencegate_tests::fenced::{
    assert_counted_once_in_token_order, detail_fields, fence_error, FencedDb,
};

async fn counter() -> FencedDb {
    let fenced = FencedDb::create().await;
    fenced
        .execute(
            "CREATE TABLE counter (id int PRIMARY KEY, n bigint NOT NULL);
             INSERT INTO counter VALUES (1, 0);
             CREATE TABLE log (writer int, token bigint);",
        )
        .await;
    fenced.protect("counter", "counter").await;
    fenced.protect("log", "counter").await;
    fenced
}

/// Starts a term-8 raise (and write) on a connection of its own while a term-7
/// transaction is open, and checks that it waits for that transaction (300 ms) without
/// raising the fence. The raise's task hands its connection back.
async fn raise_to_8_behind_term_7(
    fenced: &FencedDb,
) -> tokio::task::JoinHandle<Result<tokio_postgres::Client, tokio_postgres::Error>> {
    let new = fenced.writer("").await;
    let raise = tokio::spawn(async move {
        new.batch_execute(
            "BEGIN; SELECT fencegate.fence('counter', 8); INSERT INTO log VALUES (2, 8); COMMIT",
        )
        .await
        .map(|()| new)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !raise.is_finished(),
        "the raise must wait for the open term-7 transaction"
    );
    assert_eq!(fenced.highest("counter").await, Some(7));
    raise
}

/// Two writers of the same term hold open transactions on one resource at once: the
/// second neither waits for the first (a lock timeout of 300 ms would fail it) nor is
/// refused, and both commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_of_one_term_do_not_wait_for_each_other() {
    let fenced = counter().await;
    fenced.raise("counter", 7).await;
    let first = fenced.writer("-c lock_timeout=300ms").await;
    let second = fenced.writer("-c lock_timeout=300ms").await;
    for (writer, id) in [(&first, 1), (&second, 2)] {
        writer
            .batch_execute(&format!(
                "BEGIN; SELECT fencegate.fence('counter', 7); INSERT INTO log VALUES ({id}, 7)"
            ))
            .await
            .unwrap_or_else(|e| panic!("writer {id}: {e:?}"));
    }
    // Both hold the fence row now; the second commits first.
    second.batch_execute("COMMIT").await.unwrap();
    first.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fenced.count("log").await, 2);
}

/// A new term's raise waits for the old term's open transaction — which may still
/// write, because it holds the fence — and once the raise commits, the old term's
/// next transaction is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raise_waits_for_the_old_term_then_shuts_it_out() {
    let fenced = counter().await;
    fenced.raise("counter", 7).await;
    let old = fenced.writer("").await;
    old.batch_execute("BEGIN; SELECT fencegate.fence('counter', 7); INSERT INTO log VALUES (1, 7)")
        .await
        .unwrap();

    let raise = raise_to_8_behind_term_7(&fenced).await;

    old.batch_execute("INSERT INTO log VALUES (1, 7); COMMIT")
        .await
        .expect("the old term's open transaction still holds the fence and commits");
    let _new = tokio::time::timeout(Duration::from_secs(10), raise)
        .await
        .expect("the raise completes once the old term's transaction ends")
        .unwrap()
        .unwrap();
    assert_eq!(fenced.highest("counter").await, Some(8));

    let refused = old
        .batch_execute("BEGIN; SELECT fencegate.fence('counter', 7)")
        .await
        .unwrap_err();
    let error = fence_error(&refused);
    assert_eq!(
        (error.code().code(), detail_fields(error)),
        ("ZF001", Some("resource=counter presented=7 highest=8"))
    );
    old.batch_execute("ROLLBACK").await.unwrap();
    let by_term: Vec<(i32, i64)> = fenced
        .admin
        .query("SELECT writer, token FROM log ORDER BY writer, token", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(by_term, [(1, 7), (1, 7), (2, 8)]);
}

/// `fencegate.fence()` alone holds the fence for the rest of its transaction at READ
/// COMMITTED, before the transaction writes anything: a new term's raise waits for it,
/// and its later write still lands under its term, before the new term's commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_step_alone_holds_the_fence_until_its_transaction_ends() {
    let fenced = counter().await;
    fenced.raise("counter", 7).await;
    let old = fenced.writer("").await;
    old.batch_execute("BEGIN; SELECT fencegate.fence('counter', 7)")
        .await
        .unwrap();
    let raise = raise_to_8_behind_term_7(&fenced).await;
    old.batch_execute("INSERT INTO log VALUES (1, 7); COMMIT")
        .await
        .expect("the fence step's transaction still writes under its term");
    tokio::time::timeout(Duration::from_secs(10), raise)
        .await
        .expect("the raise completes once that transaction ends")
        .unwrap()
        .unwrap();
    assert_eq!(fenced.highest("counter").await, Some(8));
    assert_eq!(fenced.count("log").await, 2);
}

/// The same with the token presented per connection (`fencegate.token`), through the
/// trigger alone, at READ COMMITTED: the old term's open transaction holds the fence
/// row, so the new term's raise waits for it instead of committing first — else the
/// old term's write would land after the new term's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_per_connection_token_holds_the_fence_for_its_transaction() {
    let fenced = counter().await;
    fenced.raise("counter", 7).await;
    let old = fenced.writer("-c fencegate.token=counter=7").await;
    old.batch_execute("BEGIN; INSERT INTO log VALUES (1, 7)")
        .await
        .unwrap();
    let raise = raise_to_8_behind_term_7(&fenced).await;
    old.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), raise)
        .await
        .expect("the raise completes once the old term's transaction ends")
        .unwrap()
        .unwrap();
    // The old term's later transaction is refused.
    let refused = old
        .batch_execute("INSERT INTO log VALUES (1, 7)")
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF001");
    assert_eq!(fenced.count("log").await, 2);
}

/// Many writers with random tokens, some through `fencegate.fence()` and some through
/// the `fencegate.token` setting alone, increment one counter: the counter counts
/// exactly the committed transactions, and along the commit order tokens never go
/// down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_tokens_never_go_down_in_commit_order() {
    let fenced = counter().await;
    let mut writers = Vec::new();
    for writer in 0..8 {
        let client = fenced.writer("").await;
        writers.push(tokio::spawn(async move {
            let mut committed = Vec::new();
            let mut refused = 0;
            for _ in 0..25 {
                let token = rand::random_range(1..=30i64);
                let present = if writer % 2 == 0 {
                    format!("SELECT fencegate.fence('counter', {token})")
                } else {
                    format!("SET LOCAL fencegate.token = {token}")
                };
                let outcome = async {
                    client.batch_execute(&format!("BEGIN; {present}")).await?;
                    let n: i64 = client
                        .query_one("UPDATE counter SET n = n + 1 WHERE id = 1 RETURNING n", &[])
                        .await?
                        .get(0);
                    client.batch_execute("COMMIT").await?;
                    Ok::<_, tokio_postgres::Error>(n)
                }
                .await;
                match outcome {
                    Ok(n) => committed.push((n, token)),
                    Err(error) => {
                        assert_eq!(fence_error(&error).code().code(), "ZF001");
                        client.batch_execute("ROLLBACK").await.unwrap();
                        refused += 1;
                    }
                }
            }
            (committed, refused)
        }));
    }
    let mut committed = Vec::new();
    let mut refused = 0;
    for writer in writers {
        let (mine, theirs) = writer.await.unwrap();
        committed.extend(mine);
        refused += theirs;
    }
    assert_eq!(committed.len() + refused, 8 * 25);
    let n: i64 = fenced
        .admin
        .query_one("SELECT n FROM counter", &[])
        .await
        .unwrap()
        .get(0);
    assert_counted_once_in_token_order(&mut committed, n);
    assert_eq!(
        fenced.highest("counter").await,
        committed.last().map(|(_, token)| *token)
    );
}
