//! `--sql` starts only with a writer-only login: one that is, or can become, more than
//! a writer is refused at start, with the reason and the fix.

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::{Gateway, StartFailure};

async fn start_as(db: &TestDb, sql_url: &str) -> Result<Gateway, StartFailure> {
    Gateway::builder()
        .database(&db.url())
        .sql_as(sql_url)
        .try_spawn()
        .await
}

/// A fresh database with the gateway's schema in it.
async fn migrated() -> TestDb {
    let db = TestDb::create().await;
    fencegate_gateway::admin::connect(&db.url())
        .await
        .expect("the schema migrates");
    db
}

#[tokio::test]
async fn logins_that_can_reach_the_gateway_are_refused() {
    let db = migrated().await;
    let creator = db.create_role("creator", "LOGIN CREATEROLE").await;
    let owner = db.create_role("owner", "LOGIN").await;
    let privileged = db.create_role("privileged", "NOLOGIN").await;
    let member = db.create_role("member", "LOGIN NOINHERIT").await;
    let reader = db.create_role("reader", "LOGIN").await;
    db.execute(&format!(
        "GRANT INSERT ON fencegate.fences TO {privileged};
         GRANT {privileged} TO {member};
         GRANT SELECT ON fencegate.objects TO {reader};"
    ))
    .await;
    let cases = [
        ("postgres".to_owned(), "\"postgres\", which is a superuser".to_owned()),
        (creator.clone(), format!("\"{creator}\", which may create roles")),
        (
            member.clone(),
            format!("\"{member}\", which can act as {privileged}, which has privileges on fencegate's tables"),
        ),
        (
            reader.clone(),
            format!("\"{reader}\", which has privileges on fencegate's tables"),
        ),
    ];
    for (login, reason) in cases {
        let failure = match start_as(&db, &db.url_as(&login)).await {
            Ok(_) => panic!("--sql started as {login}"),
            Err(failure) => failure,
        };
        assert!(failure.logs.contains(&reason), "{login}: {}", failure.logs);
        assert!(
            failure.logs.contains("CREATE ROLE fencegate_sql LOGIN"),
            "the refusal says how to fix it: {}",
            failure.logs
        );
        assert!(!failure.status.unwrap().success());
    }

    // The schema's owner is refused too.
    db.execute(&format!("ALTER SCHEMA fencegate OWNER TO {owner}"))
        .await;
    let failure = start_as(&db, &db.url_as(&owner)).await.err().unwrap();
    assert!(
        failure.logs.contains("which owns schema fencegate"),
        "{}",
        failure.logs
    );
}

/// The writer's login must be in the database of the fences.
#[tokio::test]
async fn another_database_is_refused() {
    let db = migrated().await;
    let other = TestDb::create().await;
    db.writer().await;
    let elsewhere = other.url_as(&db.writer_role());
    let failure = start_as(&db, &elsewhere).await.err().unwrap();
    assert!(
        failure.logs.contains("must be the same database"),
        "{}",
        failure.logs
    );
}

/// A writer-only login starts, and is given what it needs to take the fence step of
/// `/v1/sql`, and nothing more: not `fencegate.fence()`, nothing granted by hand.
#[tokio::test]
async fn a_writer_only_login_starts_with_just_the_fence_step_granted() {
    let db = migrated().await;
    let gateway = start_as(&db, &db.writer().await).await.expect("starts");
    let privileges: (bool, bool, bool, bool, bool) = {
        let row = db
            .client()
            .await
            .query_one(
                "SELECT has_schema_privilege($1, 'fencegate', 'USAGE'),
                        has_function_privilege($1, 'fencegate.sql_fence(text, bigint, bytea)', 'EXECUTE'),
                        has_function_privilege($1, 'fencegate.fence(text, bigint)', 'EXECUTE'),
                        has_table_privilege($1, 'fencegate.fences', 'SELECT'),
                        has_function_privilege($1, 'fencegate.fence_check(text, bigint, regclass, text, integer)', 'EXECUTE')",
                &[&db.writer_role()],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4))
    };
    assert_eq!(privileges, (true, true, false, false, false));
    drop(gateway);
}
