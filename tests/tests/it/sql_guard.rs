//! Fenced SQL transactions: statements that would end or escape the transaction, the
//! role or the limits are refused before anything runs, however they are dressed up.
//! (The least-privilege set-up of docs/sql.md is `sql_setup.rs`.)

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use serde_json::json;

async fn marks(db: &TestDb) -> i64 {
    db.value("SELECT count(*) FROM marks").await
}

/// Each smuggling attempt comes second, after a harmless INSERT: the whole request is
/// refused with the attempt's index, and neither the INSERT nor the fence raise happen.
#[tokio::test]
async fn escapes_are_refused_before_anything_runs() {
    let db = TestDb::create().await;
    db.execute("CREATE TABLE marks (id serial PRIMARY KEY, note text)")
        .await;
    let gateway = Gateway::with_sql(&db).await;
    let client = gateway.client();

    let attempts = [
        "COMMIT",
        "  commit  ",
        "/* the fence is checked */ CoMmIt -- now run unfenced",
        "ROLLBACK",
        "END",
        "BEGIN",
        "START TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        "SAVEPOINT s",
        "ROLLBACK TO SAVEPOINT s",
        "RELEASE SAVEPOINT s",
        "PREPARE TRANSACTION 'escape'",
        "SET ROLE postgres",
        "set\tlocal\nrole postgres",
        "RESET ROLE",
        "SET SESSION AUTHORIZATION DEFAULT",
        "SET statement_timeout = 0",
        "SET LOCAL statement_timeout TO DEFAULT",
        "RESET ALL",
        "GRANT ALL ON marks TO PUBLIC",
        "REVOKE ALL ON marks FROM PUBLIC",
        "DO $$ BEGIN EXECUTE 'COMMIT'; END $$",
        "LISTEN events",
        "COPY marks FROM PROGRAM 'true'",
        "COPY marks TO STDOUT",
        "CREATE TABLE smuggled (id int)",
        "DROP TABLE marks",
        "TRUNCATE marks",
        "ALTER TABLE marks ADD COLUMN x int",
        "SELECT 1 INTO smuggled",
        "INSERT INTO marks (note) VALUES ('a'); COMMIT",
        "SELECT 1; SET ROLE postgres",
        "SELECT set_config('role', 'postgres', true)",
        "select PG_CATALOG.Set_Config('statement_timeout', '0', true)",
        "SELECT * FROM set_config('role', 'none', true)",
        "WITH s AS (SELECT set_config('role', 'none', true)) INSERT INTO marks (note) SELECT 'x' FROM s",
        "SELECT pg_advisory_lock(42)",
        "SELECT query_to_xml('select 1', true, false, '')",
        "UPDATE fencegate.fences SET highest = 1",
        "WITH f AS (DELETE FROM fencegate.fences RETURNING 1) SELECT count(*) FROM f",
        "SELECT * FROM \"fencegate\".\"fences\"",
        "EXPLAIN ANALYZE DELETE FROM marks",
        "VACUUM marks",
        "CALL anything()",
        "PREPARE p AS SELECT 1",
        "DISCARD ALL",
        "",
    ];
    let insert = json!({"sql": "INSERT INTO marks (note) VALUES ('must not land')"});
    for attempt in attempts {
        let reply = client
            .sql(
                "guarded",
                7,
                json!({"statements": [insert, {"sql": attempt}]}),
            )
            .await;
        assert_eq!(reply.status, 400, "{attempt:?} got {:?}", reply.body);
        let body = reply.json();
        assert_eq!(
            body["error"], "statement_not_allowed",
            "{attempt:?}: {body}"
        );
        assert_eq!(body["statement"], 1, "{attempt:?}");
    }
    assert_eq!(marks(&db).await, 0, "no refused request ran anything");
    assert_eq!(
        db.highest("guarded").await,
        None,
        "no refused request raised the fence"
    );

    // Nested block comments are read as Postgres reads them: this is one SELECT.
    let nested = client
        .sql(
            "guarded",
            7,
            json!({"statements": [{"sql": "/* a /* nested */ COMMIT */ SELECT 1 AS one"}]}),
        )
        .await;
    assert_eq!(nested.status, 200, "{:?}", nested.body);
    assert_eq!(nested.json()["results"][0]["rows"], json!([[1]]));
    // Transaction-scoped advisory locks end with the transaction, and are allowed.
    let xact = client
        .sql(
            "guarded",
            7,
            json!({"statements": [{"sql": "SELECT pg_advisory_xact_lock(42)"}]}),
        )
        .await;
    assert_eq!(xact.status, 200, "{:?}", xact.body);
}

/// With `--sql-allow-ddl` writers may manage their own tables, and still not escape.
#[tokio::test]
async fn ddl_runs_only_with_the_flag() {
    let db = TestDb::create().await;
    let without = Gateway::with_sql(&db).await;
    let create = json!({"statements": [{"sql": "CREATE TABLE jobs (id int PRIMARY KEY)"}]});
    assert_eq!(
        without
            .client()
            .sql("jobs", 1, create.clone())
            .await
            .error_code(),
        "statement_not_allowed"
    );

    // DDL needs the privilege to create tables as well as the flag.
    let writer = db.writer().await;
    db.execute(&format!(
        "GRANT CREATE ON SCHEMA public TO {}",
        db.writer_role()
    ))
    .await;
    let with = Gateway::builder()
        .database(&db.url())
        .sql_as(&writer)
        .arg("--sql-allow-ddl")
        .spawn()
        .await;
    let client = with.client();
    let reply = client
        .sql(
            "jobs",
            1,
            json!({"statements": [
                {"sql": "CREATE TABLE jobs (id int PRIMARY KEY)"},
                {"sql": "INSERT INTO jobs VALUES ($1)", "params": [1]},
            ]}),
        )
        .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    let count: i64 = db.value("SELECT count(*) FROM jobs").await;
    assert_eq!(count, 1);
    for escape in [
        "COMMIT",
        "SET ROLE postgres",
        "CREATE FUNCTION f() RETURNS int AS 'select 1' LANGUAGE sql",
        "DROP TABLE fencegate.fences",
    ] {
        let reply = client
            .sql("jobs", 1, json!({"statements": [{"sql": escape}]}))
            .await;
        assert_eq!(reply.error_code(), "statement_not_allowed", "{escape}");
    }
}
