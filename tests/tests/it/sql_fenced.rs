//! Fenced SQL transactions (`POST /v1/sql/{resource}`) through the real gateway and a
//! real Postgres: the seed's sweeper, atomicity, concurrent writers, an outage.

use std::time::Duration;

use fencegate_tests::db::{server_addr, TestDb};
use fencegate_tests::eventually;
use fencegate_tests::fenced::assert_counted_once_in_token_order;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{metric_value, Client};
use fencegate_tests::proxy::Proxy;
use serde_json::{json, Value};

/// The seed's tables: the sweeper's own state row, and the invoices it reminds.
async fn sweeper_tables(db: &TestDb) {
    db.execute(
        "CREATE TABLE sweep_state (id int PRIMARY KEY, last_epoch bigint NOT NULL, note text);
         INSERT INTO sweep_state VALUES (1, 0, 'never swept');
         CREATE TABLE invoices (id bigint PRIMARY KEY, reminded_at timestamptz, reminded_by text);
         INSERT INTO invoices (id) VALUES (123), (124);",
    )
    .await;
}

/// One sweep: the sweeper's state row and one invoice, in one fenced transaction.
fn sweep(node: &str, epoch: u64, invoice: i64) -> Value {
    json!({"statements": [
        {"sql": "UPDATE sweep_state SET last_epoch = $1, note = $2 WHERE id = 1", "params": [epoch, format!("sweep by {node}")]},
        {"sql": "UPDATE invoices SET reminded_at = now(), reminded_by = $2 WHERE id = $1 AND reminded_at IS NULL RETURNING id", "params": [invoice, node]},
    ]})
}

async fn state_note(db: &TestDb) -> String {
    db.value("SELECT note FROM sweep_state WHERE id = 1").await
}

async fn reminded_by(db: &TestDb, invoice: i64) -> Option<String> {
    db.client()
        .await
        .query_one(
            "SELECT reminded_by FROM invoices WHERE id = $1",
            &[&invoice],
        )
        .await
        .unwrap()
        .get(0)
}

/// Seed 000: node-a (epoch 1) sends its sweep, which the network delays; node-b takes
/// over with epoch 2 and sweeps through the gateway; node-a's sweep arrives late and
/// is rejected: the row still says `sweep by node-b`, and node-a's invoice is untouched.
#[tokio::test]
async fn stale_sweeper_updates_never_reach_the_tables() {
    let db = TestDb::create().await;
    sweeper_tables(&db).await;
    let gateway = Gateway::with_sql(&db).await;
    let direct = gateway.client();
    let network = Proxy::start(gateway.addr()).await;
    let via_network = Client::new(format!("http://{}", network.addr()));

    // node-a, epoch 1: its sweep is held in the network.
    network.hold();
    let delayed =
        tokio::spawn(async move { via_network.sql("sweeper", 1, sweep("node-a", 1, 124)).await });
    eventually(
        Duration::from_secs(5),
        "node-a's sweep to reach the network",
        || async { network.held_bytes() > 0 },
    )
    .await;

    // node-b, epoch 2: accepted.
    let b = direct.sql("sweeper", 2, sweep("node-b", 2, 123)).await;
    assert_eq!(b.status, 200, "{:?}", b.body);
    let body = b.json();
    assert_eq!(
        (body["resource"].as_str(), body["token"].as_u64()),
        (Some("sweeper"), Some(2))
    );
    assert_eq!(body["results"][0]["rows_affected"], 1);
    assert_eq!(body["results"][0]["columns"], json!([]));
    assert_eq!(body["results"][1]["rows"], json!([[123]]));
    assert_eq!(
        body["results"][1]["columns"],
        json!([{"name": "id", "type": "int8"}])
    );

    // node-a's delayed sweep arrives.
    network.release();
    let late = delayed.await.unwrap();
    assert_eq!(late.status, 409, "{:?}", late.body);
    assert_eq!(late.header("fencing-highest"), Some("2"));
    let body = late.json();
    assert_eq!(body["error"], "stale_token");
    assert_eq!(
        (body["presented"].as_u64(), body["highest"].as_u64()),
        (Some(1), Some(2))
    );

    assert_eq!(state_note(&db).await, "sweep by node-b");
    assert_eq!(reminded_by(&db, 123).await.as_deref(), Some("node-b"));
    assert_eq!(
        reminded_by(&db, 124).await,
        None,
        "node-a's invoice update must not land"
    );
    assert_eq!(db.highest("sweeper").await, Some(2));

    // Counted and logged like every stale rejection.
    let metrics = direct.metrics().await;
    assert_eq!(
        metric_value(
            &metrics,
            "fencegate_stale_rejections_total{resource=\"sweeper\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric_value(
            &metrics,
            "fencegate_requests_total{outcome=\"stale_token\",route=\"sql\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric_value(
            &metrics,
            "fencegate_requests_total{outcome=\"ok\",route=\"sql\"}"
        ),
        Some(1.0)
    );
    let events = gateway.events("stale write rejected");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(
        (
            events[0]["fields"]["presented"].as_u64(),
            events[0]["fields"]["highest"].as_u64()
        ),
        (Some(1), Some(2))
    );

    // A rejection from the fence cache is the same answer.
    let again = direct.sql("sweeper", 1, sweep("node-a", 1, 124)).await;
    assert_eq!(again.status, 409);
    assert_eq!(reminded_by(&db, 124).await, None);
}

/// The control run: the same late UPDATE sent straight to Postgres lands, overwriting
/// node-b's sweep — what the gateway exists to prevent.
#[tokio::test]
async fn control_the_same_stale_update_sent_directly_lands() {
    let db = TestDb::create().await;
    sweeper_tables(&db).await;
    let gateway = Gateway::with_sql(&db).await;
    assert_eq!(
        gateway
            .client()
            .sql("sweeper", 2, sweep("node-b", 2, 123))
            .await
            .status,
        200
    );

    let postgres = db.client().await;
    let updated = postgres
        .execute(
            "UPDATE sweep_state SET last_epoch = $1, note = $2 WHERE id = 1",
            &[&1i64, &"sweep by node-a"],
        )
        .await
        .unwrap();
    assert_eq!(updated, 1);
    assert_eq!(
        state_note(&db).await,
        "sweep by node-a",
        "without the gateway the stale write wins"
    );
}

/// A failing statement rolls back everything: the earlier statements' effects and the
/// fence raise alike.
#[tokio::test]
async fn a_failing_statement_rolls_back_the_transaction_and_the_fence() {
    let db = TestDb::create().await;
    db.execute("CREATE TABLE ledger (id int PRIMARY KEY, amount int NOT NULL)")
        .await;
    let gateway = Gateway::with_sql(&db).await;
    let client = gateway.client();

    let insert = |id: i64| json!({"sql": "INSERT INTO ledger VALUES ($1, 10)", "params": [id]});
    let failed = client
        .sql("ledger", 5, json!({"statements": [insert(1), insert(1)]}))
        .await;
    assert_eq!(failed.status, 400, "{:?}", failed.body);
    let body = failed.json();
    assert_eq!(body["error"], "sql_error");
    assert_eq!(body["statement"], 1);
    assert_eq!(body["sqlstate"], "23505");
    assert!(
        body["message"].as_str().unwrap().contains("duplicate key"),
        "{body}"
    );

    let rows: i64 = db.value("SELECT count(*) FROM ledger").await;
    assert_eq!(rows, 0, "the first statement's insert was rolled back");
    assert_eq!(
        db.highest("ledger").await,
        None,
        "the fence raise was rolled back"
    );

    // With a fence in place, a failed transaction with a higher token leaves it as it was.
    assert_eq!(
        client
            .sql("ledger", 3, json!({"statements": [insert(1)]}))
            .await
            .status,
        200
    );
    let failed = client
        .sql(
            "ledger",
            9,
            json!({"statements": [insert(2), {"sql": "SELECT 1/0"}]}),
        )
        .await;
    assert_eq!(failed.json()["sqlstate"], "22012");
    assert_eq!(db.highest("ledger").await, Some(3));
    assert_eq!(
        client
            .sql("ledger", 4, json!({"statements": [insert(2)]}))
            .await
            .status,
        200,
        "token 4 >= 3 still accepted"
    );

    // An error at commit (a deferred constraint) names no statement.
    db.execute(
        "CREATE TABLE parent (id int PRIMARY KEY);
             CREATE TABLE child (id int REFERENCES parent DEFERRABLE INITIALLY DEFERRED);",
    )
    .await;
    let failed = client
        .sql(
            "ledger",
            4,
            json!({"statements": [{"sql": "INSERT INTO child VALUES (7)"}]}),
        )
        .await;
    assert_eq!(failed.status, 400);
    let body = failed.json();
    assert_eq!(body["sqlstate"], "23503");
    assert!(body.get("statement").is_none(), "{body}");
    let children: i64 = db.value("SELECT count(*) FROM child").await;
    assert_eq!(children, 0);
}

/// Many writers with random tokens increment one counter: the counter ends at the number
/// of accepted transactions, and in commit order no accepted token is below an earlier one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_commit_in_token_order() {
    let db = TestDb::create().await;
    db.execute(
        "CREATE TABLE counter (id int PRIMARY KEY, n bigint NOT NULL);
         INSERT INTO counter VALUES (1, 0);",
    )
    .await;
    let gateway = Gateway::with_sql(&db).await;
    let client = gateway.client();

    let mut writers = Vec::new();
    for _ in 0..8 {
        let client = client.clone();
        writers.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for _ in 0..15 {
                let token = rand::random_range(1..=40u64);
                let reply = client.sql("counter",
                    token,
                    json!({"statements": [{"sql": "UPDATE counter SET n = n + 1 WHERE id = 1 RETURNING n"}]}),
                )
                .await;
                match reply.status {
                    // The value this transaction committed orders it among the others.
                    200 => outcomes.push(Some((reply.json()["results"][0]["rows"][0][0].as_i64().unwrap(), token))),
                    409 => outcomes.push(None),
                    other => panic!("unexpected {other}: {:?}", reply.body),
                }
            }
            outcomes
        }));
    }
    let mut accepted = Vec::new();
    let mut rejected = 0;
    for writer in writers {
        for outcome in writer.await.unwrap() {
            match outcome {
                Some(commit) => accepted.push(commit),
                None => rejected += 1,
            }
        }
    }
    accepted.sort();
    let n: i64 = db.value("SELECT n FROM counter WHERE id = 1").await;
    assert_eq!(
        n as usize,
        accepted.len(),
        "the counter counts exactly the accepted transactions"
    );
    assert_eq!(accepted.len() + rejected, 8 * 15);
    assert_counted_once_in_token_order(&mut accepted, n);
    let highest = accepted.last().map(|(_, token)| *token as i64);
    assert_eq!(db.highest("counter").await, highest);
}

/// The database unreachable: 503 within the backend timeout, nothing applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_answers_503() {
    let db = TestDb::create().await;
    db.execute("CREATE TABLE t (id int)").await;
    let network = Proxy::start(server_addr().await).await;
    let url = db.url_via(network.addr());
    let writer = fencegate_tests::db::via(&db.writer().await, network.addr());
    let gateway = Gateway::builder()
        .database(&url)
        .sql_as(&writer)
        .arg("--backend-timeout")
        .arg("1s")
        .arg("--sql-statement-timeout")
        .arg("500ms")
        .spawn()
        .await;
    let client = gateway.client();
    let insert = json!({"statements": [{"sql": "INSERT INTO t VALUES (1)"}]});
    assert_eq!(client.sql("t", 1, insert.clone()).await.status, 200);

    network.cut();
    let reply = tokio::time::timeout(Duration::from_secs(10), client.sql("t", 2, insert.clone()))
        .await
        .expect("answered within 10 s, not a hang");
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    assert_eq!(reply.json()["error"], "backend_unavailable");
    let rows: i64 = db.value("SELECT count(*) FROM t").await;
    assert_eq!(rows, 1);
    assert_eq!(db.highest("t").await, Some(1));

    let _network = network.restore().await;
    eventually(
        Duration::from_secs(10),
        "SQL transactions to work again",
        || {
            let (client, insert) = (client.clone(), insert.clone());
            async move { client.sql("t", 2, insert).await.status == 200 }
        },
    )
    .await;
}

/// The fence step of a `/v1/sql` transaction marks its session as a holder of its
/// term: a new term's advance that has waited `--term-takeover-timeout` for it ends
/// that transaction and completes, instead of waiting for its statements to finish;
/// the ended transaction is not answered as committed.
#[tokio::test]
async fn a_takeover_ends_an_older_terms_sql_transaction() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .args(&[
            "--term-takeover-timeout",
            "300ms",
            "--sql-statement-timeout",
            "20s",
            "--backend-timeout",
            "20s",
        ])
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(client.advance("sweeper", 4).await.status, 200);
    let running = sleeping_transaction(&client, 10);
    // The transaction has taken its fence step and sleeps.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let sent = tokio::time::Instant::now();
    let advanced = client.advance("sweeper", 5).await;
    let advanced_at = tokio::time::Instant::now();
    assert_eq!(advanced.status, 200, "{:?}", advanced.json());
    assert!(
        advanced_at - sent < Duration::from_secs(5),
        // (the transaction's statement would run 10 s, within its 20 s bounds)
        "the advance waited {:?}: the older term's transaction was not ended",
        advanced_at - sent
    );
    let (reply, _) = running.await.unwrap();
    assert_ne!(reply.status, 200, "{:?}", reply.json());
}

/// A `/v1/sql` transaction of term 4 of `sweeper` that sleeps `seconds` after its fence
/// step, started in the background: its answer and the instant it came.
fn sleeping_transaction(
    client: &Client,
    seconds: u32,
) -> tokio::task::JoinHandle<(fencegate_tests::http::Reply, tokio::time::Instant)> {
    let client = client.clone();
    tokio::spawn(async move {
        let sql = format!("SELECT pg_sleep({seconds})");
        let reply = client
            .sql("sweeper", 4, json!({"statements": [{"sql": sql}]}))
            .await;
        (reply, tokio::time::Instant::now())
    })
}

/// The fence step of a `/v1/sql` transaction holds its term until the commit, whatever
/// the statements after it touch: a new term's advance, sent while a transaction of the
/// current term runs statements that write no fenced table, waits for that commit.
#[tokio::test]
async fn the_fence_step_holds_the_term_until_the_commit() {
    let db = TestDb::create().await;
    let gateway = Gateway::with_sql(&db).await;
    let client = gateway.client();
    assert_eq!(client.advance("sweeper", 4).await.status, 200);
    let running = sleeping_transaction(&client, 1);
    // The transaction has taken its fence step and sleeps.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let advanced = client.advance("sweeper", 5).await;
    let advanced_at = tokio::time::Instant::now();
    assert_eq!(advanced.status, 200, "{:?}", advanced.json());
    let (reply, committed_at) = running.await.unwrap();
    assert_eq!(reply.status, 200, "{:?}", reply.json());
    assert!(
        advanced_at >= committed_at,
        "the new term's advance completed {:?} before the older term's transaction did",
        committed_at - advanced_at
    );
}
