//! The least-privilege set-up of docs/sql.md, run exactly as written: its SQL blocks
//! are read from the document (role and database names made unique to this test), and
//! its shell lines are run as the same commands of the built binary.

use std::process::Command;

use fencegate_tests::db::TestDb;
use fencegate_tests::fenced::connect_with;
use fencegate_tests::gateway::{binary, Gateway};
use serde_json::json;

/// The ```{language} block that follows `<!-- setup: {who} -->` in docs/sql.md.
fn setup_block(doc: &str, who: &str, language: &str) -> String {
    let marker = format!("<!-- setup: {who} -->");
    let after = &doc[doc
        .find(&marker)
        .unwrap_or_else(|| panic!("docs/sql.md has no {marker}"))
        + marker.len()..];
    let fence = format!("```{language}");
    let body = &after[after.find(&fence).expect("a block follows the marker") + fence.len()..];
    body[..body.find("```").expect("the block ends")].to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_least_privilege_setup_works() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/sql.md"))
        .expect("docs/sql.md is readable");
    let db = TestDb::create().await;
    let unique = |sql: &str| {
        let mut sql = sql.replace("DATABASE app", &format!("DATABASE {}", db.name()));
        for role in ["fg_gateway", "app_owner", "fg_sql"] {
            sql = sql.replace(role, &format!("{}_{role}", db.name()));
        }
        sql
    };
    let role = |name: &str| format!("{}_{name}", db.name());

    // As a superuser: the three roles.
    for name in ["fg_gateway", "app_owner", "fg_sql"] {
        db.drop_role_later(&role(name));
    }
    db.execute(&unique(&setup_block(&doc, "superuser", "sql")))
        .await;

    // As app_owner: the tables and the writers' grants.
    connect_with(&db.url_as(&role("app_owner")), "")
        .await
        .batch_execute(&unique(&setup_block(&doc, "app_owner", "sql")))
        .await
        .expect("app_owner creates its tables");

    // The gateway, as the documented logins.
    let gateway = Gateway::builder()
        .database(&db.url_as(&role("fg_gateway")))
        .sql_as(&db.url_as(&role("fg_sql")))
        .spawn()
        .await;

    // As fg_gateway: the owner may fence its tables.
    let block = setup_block(&doc, "fg_gateway", "sh");
    assert!(
        block.contains("fencegate grant app_owner --tables --database-url"),
        "{block}"
    );
    let grant = Command::new(binary())
        .args(["grant", &role("app_owner"), "--tables"])
        .env_clear()
        .env("DATABASE_URL", db.url_as(&role("fg_gateway")))
        .output()
        .expect("the binary runs");
    assert!(
        grant.status.success(),
        "{}",
        String::from_utf8_lossy(&grant.stderr)
    );

    // As app_owner: fence the tables, and audit.
    let owner_url = db.url_as(&role("app_owner"));
    let fencegate = |args: &[&str]| {
        Command::new(binary())
            .args(args)
            .env_clear()
            .env("DATABASE_URL", &owner_url)
            .output()
            .expect("the binary runs")
    };
    for table in ["sweep_state", "invoices"] {
        let protect = fencegate(&["protect", table, "--resource", "sweeper"]);
        assert!(
            protect.status.success(),
            "{}",
            String::from_utf8_lossy(&protect.stderr)
        );
    }
    let check = fencegate(&["check"]);
    let report = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "{report}");
    assert!(
        report.contains("2 fenced tables, 0 problems, 1 warnings")
            && report.contains("no_partition_guard"),
        "{report}"
    );

    // What the document promises of fg_sql.
    let client = gateway.client();
    let sweep = |epoch: u64, node: &str| {
        json!({"statements": [
            {"sql": "UPDATE sweep_state SET last_epoch = $1, note = $2 WHERE id = 1", "params": [epoch, format!("sweep by {node}")]},
            {"sql": "UPDATE invoices SET reminded_at = now() WHERE id = 123 AND reminded_at IS NULL"},
        ]})
    };
    let b = client.sql("sweeper", 2, sweep(2, "node-b")).await;
    assert_eq!(b.status, 200, "{:?}", b.body);
    assert_eq!(
        client.sql("sweeper", 1, sweep(1, "node-a")).await.status,
        409
    );
    let renamed = client.sql("sweeper-x", 1, sweep(1, "node-a")).await;
    assert_eq!(renamed.json()["sqlstate"], "ZF006", "{:?}", renamed.body);
    let payroll = client
        .sql(
            "sweeper",
            2,
            json!({"statements": [{"sql": "UPDATE payroll SET salary = 1000000"}]}),
        )
        .await;
    assert_eq!(payroll.json()["sqlstate"], "42501", "{:?}", payroll.body);
    let fences = client
        .sql(
            "sweeper",
            2,
            json!({"statements": [{"sql": "SELECT * FROM fencegate.fences"}]}),
        )
        .await;
    assert_eq!(fences.json()["error"], "statement_not_allowed");
    let direct = connect_with(&db.url_as(&role("fg_sql")), "").await;
    let denied = direct
        .query("SELECT * FROM fencegate.fences", &[])
        .await
        .unwrap_err();
    assert_eq!(denied.code().unwrap().code(), "42501");

    let note: String = db.value("SELECT note FROM sweep_state").await;
    assert_eq!(note, "sweep by node-b");
}
