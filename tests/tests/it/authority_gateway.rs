//! Authority beyond one statement: fence resets that cannot go below an accepted token
//! and need a credential; issuer bindings that one replica cannot weaken; older terms
//! that cannot hold a new term off; rejections that only the fence can report; and
//! prepared transactions, which `check` refuses. Real gateways, a real database.

use std::time::{Duration, Instant};

use fencegate_gateway::auth::{new_key, stored_hash};
use fencegate_tests::cluster::Cluster;
use fencegate_tests::db::{via, TestDb};
use fencegate_tests::deployment::DataDir;
use fencegate_tests::door::SweeperDoor;
use fencegate_tests::fenced::{connect_with, fence_error, FencedDb};
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::{Client, Reply};
use http::Method;
use serde_json::json;

const MAX: u64 = i64::MAX as u64;

/// A file holding the hash of `key`, for `--admin-key-file`; removed when dropped.
struct KeyFile(std::path::PathBuf);

impl KeyFile {
    fn new(key: &str) -> KeyFile {
        let path = std::env::temp_dir().join(format!(
            "fencegate-admin-{}-{:08x}.key",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::write(&path, stored_hash(key)).unwrap();
        KeyFile(path)
    }

    fn path(&self) -> String {
        self.0.display().to_string()
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

async fn reset(client: &Client, key: Option<&str>, resource: &str, to: u64) -> Reply {
    let bearer = key.map(|key| format!("Bearer {key}"));
    let mut headers = vec![("content-type", "application/json")];
    if let Some(bearer) = &bearer {
        headers.push(("authorization", bearer.as_str()));
    }
    let body = json!({"to": to, "reason": "a forged token"}).to_string();
    client
        .request(
            Method::POST,
            &format!("/v1/fences/{resource}/reset"),
            &headers,
            body,
        )
        .await
}

/// A reset may go past the one token it declares forged (the fence's), never below
/// another token the resource accepted — by an advance, a fenced transaction through
/// the door, an object written — on either backend; and without --auth-file it needs
/// --admin-key-file's key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_goes_past_the_forged_token_only() {
    let admin = new_key();
    let key_file = KeyFile::new(&admin);
    let door = SweeperDoor::start_with(&["--admin-key-file", &key_file.path()]).await;
    let client = door.gateway.client();

    // Accepted on three paths: an object at 3, an advance to 5, the door at 7.
    assert_eq!(client.put("sweeper", "k", 3, "v3").await.status, 201);
    assert_eq!(client.advance("sweeper", 5).await.status, 200);
    let writer = door.writer("").await;
    writer
        .batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 7); UPDATE sweep_state SET note = 'seven'; COMMIT;")
        .await
        .unwrap();
    // The forged one.
    assert_eq!(client.advance("sweeper", MAX).await.status, 200);

    // No credential, a wrong one: refused, nothing changes.
    let open = reset(&client, None, "sweeper", 7).await;
    assert_eq!(
        (open.status, open.error_code().as_str()),
        (401, "unauthenticated")
    );
    let wrong = reset(&client, Some(&new_key()), "sweeper", 7).await;
    assert_eq!(wrong.status, 401);
    for below in [6, 5, 3] {
        let refused = reset(&client, Some(&admin), "sweeper", below).await;
        assert_eq!(
            (refused.status, refused.error_code().as_str()),
            (409, "reset_refused"),
            "to {below}: {:?}",
            refused.json()
        );
    }
    assert_eq!(door.db.highest("sweeper").await, Some(i64::MAX));
    let done = reset(&client, Some(&admin), "sweeper", 7).await;
    assert_eq!(done.status, 200, "{:?}", done.json());
    assert_eq!(done.json()["from"], json!(MAX));
    assert_eq!(door.db.highest("sweeper").await, Some(7));
    let forged: Option<i64> = door
        .db
        .db
        .value("SELECT forged FROM fencegate.fence_resets")
        .await;
    assert_eq!(forged, Some(i64::MAX));
    // The term of 6 stays out; the term of 7 writes on.
    assert_eq!(
        client.put("sweeper", "k", 6, "old").await.error_code(),
        "stale_token"
    );
    assert_eq!(client.put("sweeper", "k", 7, "v7").await.status, 200);
    // A second reset declares 7 forged in turn, and may go past it only: to the
    // advance's 5, not below.
    let below = reset(&client, Some(&admin), "sweeper", 4).await;
    assert_eq!(below.error_code(), "reset_refused", "{:?}", below.json());
    let second = reset(&client, Some(&admin), "sweeper", 5).await;
    assert_eq!(second.json()["from"], json!(7), "{:?}", second.json());

    // Without --auth-file and without a key, resets are refused outright.
    let db = TestDb::create().await;
    let bare = Gateway::builder().database(&db.url()).spawn().await;
    let refused = reset(&bare.client(), Some(&admin), "sweeper", 1).await;
    assert_eq!(
        (refused.status, refused.error_code().as_str()),
        (403, "forbidden")
    );
}

/// Every way a fence comes to be is in the raise log, so a reset cannot go below a new
/// fence's first token: a fence made by an advance (one statement's insert), and one
/// made by a transaction in a write group (a placeholder the group claims). A
/// transaction the group refuses leaves neither a fence nor a raise behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_fences_first_raise_is_a_floor() {
    let admin = new_key();
    let key_file = KeyFile::new(&admin);
    let db = TestDb::create().await;
    let gateway = Gateway::builder()
        .database(&db.url())
        .args(&["--admin-key-file", &key_file.path()])
        .spawn()
        .await;
    let client = gateway.client();
    let txn = |operations: serde_json::Value| {
        let client = client.clone();
        async move {
            client
                .request(
                    Method::POST,
                    "/v1/txn",
                    &[("content-type", "application/json")],
                    json!({ "operations": operations }).to_string(),
                )
                .await
        }
    };
    assert_eq!(client.advance("made-by-advance", 5).await.status, 200);
    let grouped = txn(json!([
        {"op": "advance", "resource": "made-by-txn", "token": 5},
        {"op": "put", "resource": "other", "key": "k", "token": 1, "value": "v"}
    ]))
    .await;
    assert_eq!(grouped.status, 200, "{:?}", grouped.json());
    for resource in ["made-by-advance", "made-by-txn"] {
        assert_eq!(client.advance(resource, MAX).await.status, 200);
        let below = reset(&client, Some(&admin), resource, 4).await;
        assert_eq!(
            below.error_code(),
            "reset_refused",
            "{resource}: {:?}",
            below.json()
        );
        let back = reset(&client, Some(&admin), resource, 5).await;
        assert_eq!(back.status, 200, "{resource}: {:?}", back.json());
    }

    // Refused in the store (a precondition), not by the gateway's cache of fences.
    let refused = txn(json!([
        {"op": "advance", "resource": "never-made", "token": 5},
        {"op": "put", "resource": "other", "key": "k", "token": 1, "value": "w", "if_match": 0}
    ]))
    .await;
    assert_eq!(refused.status, 412, "{:?}", refused.json());
    assert_eq!(db.highest("never-made").await, None);
    let raises: i64 = db
        .value("SELECT count(*) FROM fencegate.raises WHERE resource = 'never-made'")
        .await;
    assert_eq!(raises, 0);
}

/// The embedded store keeps the same record: an advance is a floor.
#[tokio::test]
async fn the_embedded_store_records_every_raise() {
    let admin = new_key();
    let key_file = KeyFile::new(&admin);
    let dir = DataDir::create();
    let data_dir = dir.0.display().to_string();
    let gateway = Gateway::builder()
        .args(&[
            "--data-dir",
            &data_dir,
            "--admin-key-file",
            &key_file.path(),
        ])
        .spawn()
        .await;
    let client = gateway.client();
    assert_eq!(client.advance("orders", 5).await.status, 200);
    assert_eq!(client.advance("orders", MAX).await.status, 200);
    let refused = reset(&client, Some(&admin), "orders", 4).await;
    assert_eq!(
        refused.error_code(),
        "reset_refused",
        "{:?}",
        refused.json()
    );
    assert_eq!(reset(&client, Some(&admin), "orders", 5).await.status, 200);
    assert_eq!(
        client.put("orders", "k", 4, "old").await.error_code(),
        "stale_token"
    );
}

/// The issuer bindings in the database: a replica started with other flags refuses to
/// start; one told --replace-issuer-bindings replaces them, and the running replica
/// says so (metric and log); a change by hand is undone by the running replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_replica_cannot_weaken_the_bindings() {
    let db = TestDb::create().await;
    let bound = Gateway::builder()
        .database(&db.url())
        .args(&["--issued-by", "gateway:orders"])
        .spawn()
        .await;
    let other = Gateway::builder()
        .database(&db.url())
        .try_spawn()
        .await
        .err()
        .expect("a replica without the bindings does not start");
    assert!(
        other.logs.contains("--replace-issuer-bindings") && other.logs.contains("gateway:orders"),
        "{other}"
    );
    let recorded: i64 = db
        .value("SELECT count(*) FROM fencegate.issuer_bindings")
        .await;
    assert_eq!(recorded, 1, "the bindings are untouched");

    // A change by hand (or by a gateway of an older version) is undone.
    db.execute("DELETE FROM fencegate.issuer_bindings").await;
    let client = bound.client();
    wait_for(|| async {
        client
            .metric("fencegate_issuer_binding_restores_total")
            .await
            == Some(1.0)
    })
    .await;
    let recorded: i64 = db
        .value("SELECT count(*) FROM fencegate.issuer_bindings")
        .await;
    assert_eq!(recorded, 1, "restored");
    assert!(!bound
        .events("the issuer bindings in the database were changed without --replace-issuer-bindings; this gateway restored its own")
        .is_empty());

    // A deliberate replacement: the running replica reports it, and leaves it.
    let _replacing = Gateway::builder()
        .database(&db.url())
        .arg("--replace-issuer-bindings")
        .spawn()
        .await;
    wait_for(|| async { client.metric("fencegate_issuer_bindings_drift").await == Some(1.0) })
        .await;
    let recorded: i64 = db
        .value("SELECT count(*) FROM fencegate.issuer_bindings")
        .await;
    assert_eq!(recorded, 0);
}

async fn wait_for<F, Fut>(mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition().await {
        assert!(Instant::now() < deadline, "the condition never held");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An older term's session holds the fence row in an open transaction (through the
/// door, by fence() or by its per-connection token): a new term's raise — over HTTP,
/// keyed or not, in a /v1/txn, or in the database — ends it after
/// --term-takeover-timeout, and completes; the old transaction is rolled back, counted
/// and logged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_term_cannot_hold_a_new_one_off() {
    let door = SweeperDoor::start_with(&["--term-takeover-timeout", "300ms"]).await;
    door.db.raise("sweeper", 7).await;
    let client = door.gateway.client();

    // Over HTTP: an advance.
    let old = door.writer("").await;
    old.batch_execute(
        "BEGIN; SELECT fencegate.fence('sweeper', 7); UPDATE sweep_state SET note = 'old'",
    )
    .await
    .unwrap();
    let started = Instant::now();
    let advanced = client.advance("sweeper", 8).await;
    assert_eq!(advanced.status, 200, "{:?}", advanced.json());
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "the advance waited {:?}, past the backend timeout",
        started.elapsed()
    );
    let ended = old.batch_execute("COMMIT").await.unwrap_err();
    assert!(
        ended.is_closed() || ended.as_db_error().is_some(),
        "{ended:?}"
    );
    assert_eq!(
        door.note().await,
        "initial",
        "the old term's write is rolled back"
    );

    // A keyed advance and a /v1/txn: the paths every client takes, through the same
    // takeover.
    let raises: [(u64, &str); 2] = [(9, "advance"), (10, "txn")];
    for (token, path) in raises {
        let old = door.writer("").await;
        old.batch_execute(&format!(
            "BEGIN; SELECT fencegate.fence('sweeper', {}); UPDATE sweep_state SET note = 'old'",
            token - 1
        ))
        .await
        .unwrap();
        let started = Instant::now();
        let raised = match path {
            "advance" => {
                let token = token.to_string();
                client
                    .request(
                        Method::POST,
                        "/v1/fences/sweeper/advance",
                        &[("fencing-token", &token), ("idempotency-key", "raise-9")],
                        "",
                    )
                    .await
            }
            _ => {
                let body = json!({"operations": [
                    {"op": "put", "resource": "sweeper", "key": "k", "token": token, "value": "ten"}
                ]});
                client
                    .request(Method::POST, "/v1/txn", &[], body.to_string())
                    .await
            }
        };
        assert_eq!(raised.status, 200, "{path}: {:?}", raised.json());
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "{path} waited {:?}, past the backend timeout",
            started.elapsed()
        );
        assert!(old.batch_execute("COMMIT").await.is_err(), "{path}");
        assert_eq!(door.note().await, "initial", "{path}: rolled back");
    }

    // In the database: a new leader's fence() through the door ends the session that
    // holds the row by its per-connection token.
    let holder = door.writer("-c fencegate.token=sweeper=10").await;
    holder
        .batch_execute("BEGIN; UPDATE sweep_state SET note = 'ten'")
        .await
        .unwrap();
    let leader = door.writer("").await;
    tokio::time::timeout(
        Duration::from_secs(10),
        leader.batch_execute(
            "BEGIN; SELECT fencegate.fence('sweeper', 11); UPDATE sweep_state SET note = 'eleven'; COMMIT;",
        ),
    )
    .await
    .expect("the raise ends the older term's session instead of waiting for it")
    .expect("the raise completes");
    assert!(holder.batch_execute("COMMIT").await.is_err());
    assert_eq!(door.note().await, "eleven");
    assert_eq!(door.db.highest("sweeper").await, Some(11));

    let takeovers: i64 = door
        .db
        .db
        .value("SELECT count(*) FROM fencegate.takeovers")
        .await;
    assert_eq!(takeovers, 4);
    wait_for(|| async { client.metric("fencegate_term_takeovers_total").await == Some(4.0) }).await;
    assert_eq!(
        door.gateway
            .events("a new term ended a session of an older term that held its fence")
            .len(),
        4
    );
    // A session of the current term is never ended: the same token waits its turn.
    let current = door.writer("").await;
    current
        .batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 11)")
        .await
        .unwrap();
    let same = door.writer("").await;
    same.batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 11); COMMIT;")
        .await
        .unwrap();
    current.batch_execute("COMMIT").await.unwrap();

    // A raise that ends an older term's session and then fails takes its record back
    // with it; the session is counted all the same.
    let older = door.writer("").await;
    older
        .batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 11)")
        .await
        .unwrap();
    let failed = door
        .writer("")
        .await
        .batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 12); SELECT 1/0;")
        .await;
    assert!(failed.is_err());
    assert!(older.batch_execute("COMMIT").await.is_err());
    wait_for(|| async { client.metric("fencegate_term_takeovers_total").await == Some(5.0) }).await;
    assert_eq!(
        door.gateway
            .events("sessions were ended whose records are not in the takeover log: their raise failed and rolled the record back, or had not committed yet")
            .len(),
        1
    );
}

/// A write that gives up waiting for a fence row an older term holds (no takeover:
/// `--term-takeover-timeout 0`) never sent its COMMIT: it is answered `write_applied:
/// false`, keyed or not, and its retry with the same key applies it once the row is
/// free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_that_gave_up_on_a_lock_applied_nothing() {
    let door =
        SweeperDoor::start_with(&["--term-takeover-timeout", "0", "--backend-timeout", "1s"]).await;
    door.db.raise("sweeper", 7).await;
    let client = door.gateway.client();
    let old = door.writer("").await;
    old.batch_execute("BEGIN; SELECT fencegate.fence('sweeper', 7)")
        .await
        .unwrap();
    let keyed = || {
        client.request(
            Method::PUT,
            "/v1/kv/sweeper/k",
            &[("fencing-token", "8"), ("idempotency-key", "eight")],
            "v8",
        )
    };
    for reply in [keyed().await, client.advance("sweeper", 8).await] {
        assert_eq!(
            reply.error_code(),
            "backend_unavailable",
            "{:?}",
            reply.json()
        );
        assert_eq!(
            reply.json()["write_applied"],
            json!(false),
            "{:?}",
            reply.json()
        );
    }
    old.batch_execute("ROLLBACK").await.unwrap();
    let retry = keyed().await;
    assert_eq!(retry.status, 201, "{:?}", retry.json());
    assert_eq!(door.db.highest("sweeper").await, Some(8));
}

/// A ZF001 or ZF005 that a client's SQL raises itself, through the door or `/v1/sql`,
/// is not the fence's: counted apart, and no rejection of any resource is counted or
/// logged; the fence's own rejection is counted as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_rejections_are_not_counted_as_rejections() {
    let fenced = FencedDb::create().await;
    fenced
        .execute(&format!(
            "CREATE TABLE notes (id int);
             CREATE FUNCTION forge() RETURNS int LANGUAGE plpgsql AS $$
             BEGIN
                 RAISE EXCEPTION USING ERRCODE = 'ZF001', MESSAGE = 'stale',
                     DETAIL = 'resource=victim presented=1 highest={MAX} proof=00';
             END $$;
             GRANT EXECUTE ON FUNCTION forge() TO PUBLIC;"
        ))
        .await;
    let sql_login = fenced.db.create_role("sql", "LOGIN").await;
    fenced
        .db
        .execute(&format!("GRANT USAGE ON SCHEMA public TO {sql_login}"))
        .await;
    let gateway = Gateway::builder()
        .database(&fenced.db.url())
        .sql_as(&fenced.db.url_as(&sql_login))
        .spawn()
        .await;
    let client = gateway.client();
    let writer = connect_with(&via(fenced.writer_url(), gateway.pg_addr()), "").await;
    for sql in [
        format!(
            "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'ZF001', MESSAGE = 'stale', \
             DETAIL = 'resource=victim presented=1 highest={MAX}'; END $$"
        ),
        "DO $$ BEGIN RAISE EXCEPTION USING ERRCODE = 'ZF005', MESSAGE = 'not issued', \
         DETAIL = 'resource=victim presented=9 issued=0'; END $$"
            .to_owned(),
        "SELECT forge()".to_owned(),
    ] {
        let error = writer.batch_execute(&sql).await.unwrap_err();
        assert!(fence_error(&error).code().code().starts_with("ZF0"));
    }
    let sql = client
        .sql(
            "mine",
            1,
            json!({"statements": [{"sql": "SELECT forge()"}]}),
        )
        .await;
    assert_eq!(
        (
            sql.status,
            sql.json()["error"].as_str(),
            sql.json()["sqlstate"].as_str()
        ),
        (400, Some("sql_error"), Some("ZF001")),
        "a forged stale rejection is the writer's own SQL error, not a 409"
    );
    assert_eq!(
        client
            .metric(r#"fencegate_forged_refusals_total{door="pg"}"#)
            .await,
        Some(3.0)
    );
    assert_eq!(
        client
            .metric(r#"fencegate_forged_refusals_total{door="http"}"#)
            .await,
        Some(1.0)
    );
    let metrics = client.metrics().await;
    assert!(!metrics.contains(r#"resource="victim""#), "{metrics}");
    assert_eq!(
        client
            .metric(r#"fencegate_token_refusals_total{reason="not_issued"}"#)
            .await,
        Some(0.0)
    );
    assert!(gateway.events("stale write rejected").is_empty());

    // The fence's own rejection, through the door, is counted as ever.
    fenced.raise("victim", 5).await;
    let stale = writer
        .query_one("SELECT fencegate.fence('victim', 4)", &[])
        .await
        .unwrap_err();
    assert_eq!(fence_error(&stale).code().code(), "ZF001");
    wait_for(|| async {
        client
            .metric(r#"fencegate_stale_rejections_total{resource="victim"}"#)
            .await
            == Some(1.0)
    })
    .await;
}

/// `check` refuses a server that can prepare transactions (a prepared transaction holds
/// a fence row across disconnects and restarts, and no new term can end it), and names
/// a prepared transaction that holds one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_prepared_transactions() {
    let cluster = Cluster::builder()
        .setting("max_prepared_transactions", "4")
        .start()
        .await;
    let url = cluster.url();
    let admin = fencegate_gateway::admin::connect(&url).await.unwrap();
    admin
        .query_one("SELECT fencegate.fence('orders', 3)", &[])
        .await
        .unwrap();
    admin
        .batch_execute("BEGIN; SELECT fencegate.fence('orders', 3); PREPARE TRANSACTION 'held';")
        .await
        .unwrap();
    let findings = fencegate_gateway::admin::audit(&admin).await.unwrap();
    let problem = |name: &str| findings.iter().any(|f| f.finding == name && f.is_problem());
    assert!(problem("prepared_transactions_enabled"), "{findings:?}");
    assert!(problem("prepared_transaction_holds_fence"), "{findings:?}");
    admin
        .batch_execute("ROLLBACK PREPARED 'held'")
        .await
        .unwrap();
    let findings = fencegate_gateway::admin::audit(&admin).await.unwrap();
    assert!(
        !findings
            .iter()
            .any(|f| f.finding == "prepared_transaction_holds_fence"),
        "{findings:?}"
    );
}
