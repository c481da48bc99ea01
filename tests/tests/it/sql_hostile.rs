//! A hostile writer on `POST /v1/sql`: every route we know to change session state,
//! leave the role, reach `fencegate.*`, lower a fence, crash the process or starve
//! other resources fails — and leaves nothing changed, as seen afterwards from the
//! database, from a second replica, and from the next request on the same pooled
//! connection.

use std::time::{Duration, Instant};

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::http::Client;
use serde_json::{json, Value};

/// The seed's sweeper tables, fenced for resource `sweeper`, after node-b's epoch 2.
async fn sweeper() -> (TestDb, Gateway, Gateway) {
    let db = TestDb::create().await;
    db.execute(
        "CREATE TABLE sweep_state (id int PRIMARY KEY, last_epoch bigint NOT NULL, note text);
         INSERT INTO sweep_state VALUES (1, 0, 'never swept');
         CREATE TABLE invoices (id bigint PRIMARY KEY, reminded_by text);
         INSERT INTO invoices VALUES (123, NULL), (124, NULL);
         CREATE SEQUENCE tickets;",
    )
    .await;
    let writer = db.writer().await;
    // One connection in the SQL pool: every request reuses the last one's session.
    let start = || {
        Gateway::builder()
            .database(&db.url())
            .sql_as(&writer)
            .arg("--sql-pool-size")
            .arg("1")
            .arg("--backend-timeout")
            .arg("2s")
            .arg("--sql-statement-timeout")
            .arg("1s")
            .spawn()
    };
    let gateway = start().await;
    let replica = start().await;
    let admin = fencegate_gateway::admin::connect(&db.url()).await.unwrap();
    for table in ["sweep_state", "invoices"] {
        fencegate_gateway::admin::protect(&admin, table, "sweeper")
            .await
            .unwrap();
    }
    let sweep = gateway
        .client()
        .sql(
            "sweeper",
            2,
            json!({"statements": [{"sql": "UPDATE sweep_state SET last_epoch = 2, note = 'sweep by node-b' WHERE id = 1"}]}),
        )
        .await;
    assert_eq!(sweep.status, 200, "{:?}", sweep.body);
    (db, gateway, replica)
}

/// What a request finds of its session.
const SESSION: &str = "SELECT current_user::text, session_user::text, \
    current_setting('synchronous_commit'), current_setting('standard_conforming_strings'), \
    current_setting('statement_timeout'), current_setting('lock_timeout'), \
    current_setting('search_path'), current_setting('transaction_isolation'), \
    coalesce(current_setting('fencegate.token', true), ''), \
    (SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory')::int";

async fn session(client: &Client) -> Value {
    let reply = client
        .sql("probe", 1, json!({"statements": [{"sql": SESSION}]}))
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    reply.json()["results"][0]["rows"][0].clone()
}

/// Everything an attack could have changed, read from the database.
async fn state(db: &TestDb) -> Value {
    let client = db.client().await;
    let fences: Vec<(String, i64)> = client
        .query(
            "SELECT resource, highest FROM fencegate.fences ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let note: String = client
        .query_one("SELECT note FROM sweep_state", &[])
        .await
        .unwrap()
        .get(0);
    let reminded: i64 = client
        .query_one("SELECT count(reminded_by) FROM invoices", &[])
        .await
        .unwrap()
        .get(0);
    let triggers: i64 = client
        .query_one(
            "SELECT count(*) FROM fencegate.protected WHERE enabled = 'A'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let large_objects: i64 = client
        .query_one("SELECT count(*) FROM pg_largeobject_metadata", &[])
        .await
        .unwrap()
        .get(0);
    json!({"fences": fences, "note": note, "reminded": reminded, "triggers": triggers, "large_objects": large_objects})
}

fn statements(sqls: &[&str]) -> Value {
    json!({"statements": sqls.iter().map(|sql| json!({"sql": sql})).collect::<Vec<_>>()})
}

/// Each attack is sent by node-a (epoch 1, stale) on its own resource and on one of its
/// choosing; those that do not need a stale token also by a current writer (epoch 2).
/// Each is refused, and nothing it could have touched has changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_statements_change_nothing() {
    let (db, gateway, replica) = sweeper().await;
    let client = gateway.client();
    let clean_session = session(&client).await;
    assert_eq!(
        clean_session.as_array().unwrap()[2..],
        json!([
            "on",
            "on",
            "1s",
            "1s",
            "\"$user\", public",
            "read committed",
            "",
            // The transaction's own: the shared lock on its fence's key. A session lock
            // left by an earlier request would count too.
            1
        ])
        .as_array()
        .unwrap()[..]
    );
    let before = state(&db).await;

    let deep = format!("SELECT 1{}", " + 1".repeat(5_000));
    let long = format!("SELECT '{}'", "x".repeat(100 << 10));
    // (what, statements, whether a current writer is refused too)
    let attacks: &[(&str, &[&str], bool)] = &[
        // Change the session for whoever gets the connection next.
        (
            "settings through a catalog view",
            &["UPDATE pg_settings SET setting = 'off' WHERE name = 'synchronous_commit'"],
            true,
        ),
        (
            "settings through set_config",
            &["SELECT set_config('standard_conforming_strings', 'off', false)"],
            true,
        ),
        ("settings by SET", &["SET statement_timeout = 0"], true),
        (
            "a session advisory lock",
            &["SELECT pg_advisory_lock(42)"],
            true,
        ),
        (
            "a held cursor",
            &["DECLARE c CURSOR WITH HOLD FOR SELECT 1"],
            true,
        ),
        ("a temporary table", &["CREATE TEMP TABLE t (id int)"], true),
        ("a listener", &["LISTEN anything"], true),
        // Leave the transaction or the role.
        (
            "commit in the middle",
            &[
                "UPDATE invoices SET reminded_by = 'x' WHERE id = 124",
                "COMMIT",
                "UPDATE invoices SET reminded_by = 'x'",
            ],
            true,
        ),
        (
            "two commands in one statement",
            &["UPDATE invoices SET reminded_by = 'x'; COMMIT"],
            true,
        ),
        (
            "a literal that parses two ways",
            &["SELECT 'a\\'; UPDATE invoices SET reminded_by = 'x'; --'"],
            true,
        ),
        ("another role", &["SET ROLE postgres"], true),
        (
            "another session user",
            &["SET SESSION AUTHORIZATION postgres"],
            true,
        ),
        // Reach the gateway's own tables, or lower a fence.
        ("read the fences", &["SELECT * FROM fencegate.fences"], true),
        (
            "lower a fence",
            &["UPDATE fencegate.fences SET highest = 1"],
            true,
        ),
        (
            "delete a fence",
            &["WITH d AS (DELETE FROM fencegate.fences RETURNING 1) SELECT count(*) FROM d"],
            true,
        ),
        (
            "read the objects",
            &["SELECT * FROM fencegate.objects"],
            true,
        ),
        ("an unqualified name", &["SELECT * FROM fences"], true),
        (
            "the fence function's insides",
            &["SELECT fencegate.fence_check('sweeper', 1, NULL)"],
            true,
        ),
        (
            "a stale fence call",
            &["SELECT fencegate.fence('sweeper', 1)"],
            false,
        ),
        // Escape the fence on the writer's own tables.
        (
            "a resource of its own choosing",
            &["UPDATE sweep_state SET note = 'stale write by node-a'"],
            false,
        ),
        (
            "a forged fence record",
            &[
                "SELECT set_config('fencegate.fenced', 'sweeper=9', true)",
                "UPDATE sweep_state SET note = 'x'",
            ],
            true,
        ),
        ("large objects", &["SELECT lo_from_bytea(0, '\\x00')"], true),
        // Crash or stall the process.
        ("a deep expression", &[deep.as_str()], true),
        ("a huge statement", &[long.as_str()], true),
        ("a statement that fails", &["SELECT 1/0"], true),
    ];
    for (what, sqls, current_too) in attacks {
        let writers: &[(&str, u64)] = match current_too {
            true => &[("sweeper", 1), ("sweeper-x", 1), ("sweeper", 2)],
            false => &[("sweeper", 1), ("sweeper-x", 1)],
        };
        for &(resource, token) in writers {
            let reply = client.sql(resource, token, statements(sqls)).await;
            assert!(
                matches!(reply.status, 400 | 409),
                "{what} on {resource} with {token}: {} {:?}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            );
            assert_eq!(
                state(&db).await,
                before,
                "{what} on {resource} with {token}"
            );
            assert_eq!(
                session(&client).await,
                clean_session,
                "{what} on {resource} with {token}: the next request's session"
            );
        }
    }

    // The resource of its own choosing: refused by the fenced table itself, which is
    // fenced for another resource than the transaction holds.
    let reply = client
        .sql(
            "sweeper-x",
            1,
            statements(&["UPDATE sweep_state SET note = 'x'"]),
        )
        .await;
    assert_eq!(
        (
            reply.json()["error"].as_str(),
            reply.json()["sqlstate"].as_str()
        ),
        (Some("sql_error"), Some("ZF006"))
    );

    // Sequence state is reset between requests too.
    assert_eq!(
        client
            .sql("sweeper", 2, statements(&["SELECT nextval('tickets')"]))
            .await
            .status,
        200
    );
    let currval = client
        .sql("sweeper", 2, statements(&["SELECT currval('tickets')"]))
        .await;
    assert_eq!(currval.json()["sqlstate"], "55000", "{:?}", currval.body);

    // Both replicas still fence as before.
    for replica in [&gateway, &replica] {
        let client = replica.client();
        let stale = client
            .sql(
                "sweeper",
                1,
                statements(&["UPDATE sweep_state SET note = 'late'"]),
            )
            .await;
        assert_eq!(stale.status, 409, "{:?}", stale.body);
        assert_eq!(stale.json()["highest"], 2);
        let kv = client.put("sweeper", "k", 1, "late").await;
        assert_eq!(kv.status, 409);
    }
    assert_eq!(state(&db).await, before);
}

/// A transaction that sleeps while it holds a fence and a row lock: each statement is
/// stopped by the pinned statement timeout, and a transaction that outlasts the
/// backend timeout is cancelled in Postgres before the 503 — which says it was not
/// applied, truthfully. Meanwhile other resources' writes go on, and afterwards
/// nothing of it runs or holds a lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_transactions_are_stopped_and_do_not_stall_others() {
    let (db, gateway, replica) = sweeper().await;
    let client = gateway.client();

    let sleep = client
        .sql(
            "sweeper",
            2,
            statements(&[
                "SELECT * FROM sweep_state FOR UPDATE",
                "SELECT pg_sleep(30)",
            ]),
        )
        .await;
    assert_eq!(sleep.status, 400);
    assert_eq!(sleep.json()["sqlstate"], "57014", "statement timeout");

    let stall = {
        let client = client.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let reply = client
                .sql(
                    "sweeper",
                    2,
                    statements(&[
                        "UPDATE sweep_state SET note = 'never committed'",
                        "SELECT pg_sleep(0.9)",
                        "SELECT pg_sleep(0.9)",
                        "SELECT pg_sleep(0.9)",
                    ]),
                )
                .await;
            (reply, started.elapsed())
        })
    };
    // While it holds sweeper's fence and row: other resources are written at once.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = Instant::now();
    let other = replica.client().put("other", "k", 1, "v").await;
    assert_eq!(other.status, 201);
    let other_sql = replica
        .client()
        .sql("elsewhere", 1, statements(&["SELECT 1"]))
        .await;
    assert_eq!(other_sql.status, 200);
    assert!(
        started.elapsed() < Duration::from_millis(800),
        "other resources waited {:?}",
        started.elapsed()
    );

    let (reply, took) = stall.await.unwrap();
    assert_eq!(reply.status, 503, "{:?}", reply.body);
    assert_eq!(reply.json()["error"], "backend_unavailable");
    assert_eq!(
        reply.json()["write_applied"],
        false,
        "given up before COMMIT: certainly not applied"
    );
    assert!(took < Duration::from_secs(4), "answered after {took:?}");

    // Nothing of it runs on (the cancelled backend ends as it reads the closed
    // connection), and its locks are gone: the fence row and the state row are free for
    // the next writer at once.
    let observer = db.client().await;
    fencegate_tests::eventually(
        Duration::from_secs(2),
        "the cancelled statement to end",
        || {
            let (observer, role) = (&observer, db.writer_role());
            async move {
                let running: i64 = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND state = 'active'",
                    &[&role],
                )
                .await
                .unwrap()
                .get(0);
                running == 0
            }
        },
    )
    .await;
    let started = Instant::now();
    let next = replica
        .client()
        .sql(
            "sweeper",
            2,
            statements(&["UPDATE sweep_state SET note = 'next' WHERE id = 1"]),
        )
        .await;
    assert_eq!(next.status, 200, "{:?}", next.body);
    assert!(started.elapsed() < Duration::from_millis(800));
    let note: String = db.value("SELECT note FROM sweep_state").await;
    assert_eq!(note, "next");
    // And the gateway that gave up serves on.
    assert_eq!(
        client
            .sql("sweeper", 2, statements(&["SELECT 1"]))
            .await
            .status,
        200
    );
}

/// With `--sql-allow-ddl`, DDL runs with the writer's privileges only: it cannot drop
/// the gateway's schema, nor take the fence off a table it does not own.
#[tokio::test]
async fn ddl_cannot_remove_the_fence() {
    let (db, _gateway, _replica) = sweeper().await;
    db.execute(&format!(
        "GRANT CREATE ON SCHEMA public TO {}",
        db.writer_role()
    ))
    .await;
    let ddl = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .arg("--sql-allow-ddl")
        .spawn()
        .await;
    let client = ddl.client();
    let before = state(&db).await;
    // Sent by a current writer (epoch 2): even the leader cannot take the fence down.
    for (sql, answer) in [
        ("DROP SCHEMA fencegate CASCADE", "statement_not_allowed"),
        ("DROP TABLE fencegate.fences", "statement_not_allowed"),
        (
            "ALTER TABLE sweep_state DISABLE TRIGGER fencegate_fence",
            "42501",
        ),
        (
            "DROP TRIGGER fencegate_fence ON sweep_state",
            "statement_not_allowed",
        ),
        ("DROP TABLE sweep_state", "42501"),
        ("ALTER TABLE sweep_state RENAME TO swept", "42501"),
    ] {
        let reply = client.sql("sweeper", 2, statements(&[sql])).await;
        let body = reply.json();
        let got = body["sqlstate"].as_str().or(body["error"].as_str());
        assert_eq!(got, Some(answer), "{sql}: {} {body}", reply.status);
    }
    // DDL that writes a table fenced for another resource than the transaction's is
    // refused by its trigger: the transaction holds only its own resource.
    let truncate = client
        .sql("sweeper-x", 1, statements(&["TRUNCATE sweep_state"]))
        .await;
    assert_eq!(truncate.json()["sqlstate"], "ZF006", "{:?}", truncate.body);
    assert_eq!(state(&db).await, before);
    // The writer may create and drop its own tables; they are not fenced until protected.
    let own = client
        .sql(
            "sweeper",
            2,
            statements(&["CREATE TABLE scratch (id int)", "DROP TABLE scratch"]),
        )
        .await;
    assert_eq!(own.status, 200, "{:?}", own.body);
}
