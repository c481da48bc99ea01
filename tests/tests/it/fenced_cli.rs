//! `fencegate protect`, `unprotect` and `check`, run as the built binary against a
//! real database.

use std::process::{Command, Output};

use fencegate_tests::fenced::{fence_error, FencedDb};
use fencegate_tests::gateway::binary;

fn fencegate(args: &[&str], url: &str) -> Output {
    Command::new(binary())
        .args(args)
        .env_clear()
        .env("DATABASE_URL", url)
        .output()
        .expect("the fencegate binary runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Protect, check clean, unprotect: the table is fenced exactly in between.
#[tokio::test]
async fn protect_check_unprotect() {
    let fenced = FencedDb::create().await;
    fenced
        .execute(
            "CREATE SCHEMA app;
             CREATE TABLE app.\"Orders\" (id int PRIMARY KEY);",
        )
        .await;
    let url = fenced.db.url();

    let protect = fencegate(&["protect", "app.\"Orders\"", "--resource", "orders"], &url);
    assert!(protect.status.success(), "{}", stderr(&protect));
    assert_eq!(
        stdout(&protect),
        "fenced app.\"Orders\" for resource orders\n"
    );
    let refused = fenced
        .run_as_writer(None, "INSERT INTO app.\"Orders\" VALUES (1)")
        .await;
    // The writer has no privilege on schema app: grant it, then the fence answers.
    assert!(refused.is_err());
    fenced
        .execute(&format!(
            "GRANT USAGE ON SCHEMA app TO {0}; GRANT INSERT ON app.\"Orders\" TO {0};",
            fenced.db.writer_role()
        ))
        .await;
    let refused = fenced
        .run_as_writer(None, "INSERT INTO app.\"Orders\" VALUES (1)")
        .await
        .unwrap_err();
    assert_eq!(fence_error(&refused).code().code(), "ZF002");

    let check = fencegate(&["check"], &url);
    assert!(
        check.status.success(),
        "{}{}",
        stdout(&check),
        stderr(&check)
    );
    assert_eq!(
        stdout(&check),
        format!(
            "fenced   app.\"Orders\"                 for resource orders\n\
             info     role_can_reach_fence         {}: may call fence; holds *\n\
             1 fenced tables, 0 problems, 0 warnings\n",
            fenced.db.writer_role()
        )
    );

    let unprotect = fencegate(&["unprotect", "app.\"Orders\""], &url);
    assert!(unprotect.status.success(), "{}", stderr(&unprotect));
    assert_eq!(stdout(&unprotect), "unfenced app.\"Orders\"\n");
    fenced
        .run_as_writer(None, "INSERT INTO app.\"Orders\" VALUES (1)")
        .await
        .expect("an unprotected table takes writes without a token");
}

/// Mistakes are refused with Postgres's reason and a non-zero exit; nothing changes.
#[tokio::test]
async fn protect_refuses_what_it_cannot_fence() {
    let fenced = FencedDb::create().await;
    fenced
        .execute("CREATE TABLE t (id int); CREATE VIEW v AS SELECT * FROM t;")
        .await;
    let url = fenced.db.url();
    for (args, says) in [
        (
            &["protect", "missing", "--resource", "r"][..],
            "relation \"missing\" does not exist",
        ),
        (
            &["protect", "t", "--resource", "a b"],
            "invalid resource name",
        ),
        (
            &["protect", "t", "--resource", ".."],
            "invalid resource name",
        ),
        (&["protect", "v", "--resource", "r"], "v is not a table"),
        (&["protect", "t"], "--resource"),
    ] {
        let output = fencegate(args, &url);
        assert!(!output.status.success(), "{args:?} succeeded");
        assert!(
            stderr(&output).contains(says),
            "{args:?}: {}",
            stderr(&output)
        );
    }
    assert!(fencegate(&["protect", "t", "--resource", "first"], &url)
        .status
        .success());
    let again = fencegate(&["protect", "t", "--resource", "second"], &url);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("already fenced for resource \"first\""),
        "{}",
        stderr(&again)
    );
    let bad_url = fencegate(&["check"], "postgres://nobody@127.0.0.1:1/none");
    assert!(!bad_url.status.success());
    assert!(
        stderr(&bad_url).contains("could not connect to the database"),
        "{}",
        stderr(&bad_url)
    );
    assert!(
        !stderr(&bad_url).contains("nobody"),
        "no connection string in errors"
    );
}

/// `check` finds each kind of hole, names it, and exits 1.
#[tokio::test]
async fn check_finds_the_holes() {
    let fenced = FencedDb::create().await;
    let writer = fenced.db.writer_role();
    let intruder = fenced.db.create_role("intruder", "LOGIN").await;
    fenced
        .execute(
            "CREATE TABLE events (id int, at date NOT NULL) PARTITION BY RANGE (at);
             CREATE TABLE events_2026 PARTITION OF events FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
             CREATE TABLE events_2027 PARTITION OF events FOR VALUES FROM ('2027-01-01') TO ('2028-01-01');
             CREATE TABLE owned (id int);",
        )
        .await;
    fenced.protect("events", "events").await;
    fenced.protect("owned", "owned").await;
    let url = fenced.db.url();
    let clean = fencegate(&["check"], &url);
    assert!(clean.status.success(), "{}", stdout(&clean));

    // Without the partition guard first: it would put back the dropped trigger at the
    // next ALTER TABLE.
    fenced
        .execute(&format!(
            "DROP EVENT TRIGGER fencegate_partitions;
             DROP TRIGGER fencegate_fence ON events_2026;
             ALTER TABLE events_2027 DISABLE TRIGGER fencegate_fence;
             ALTER TABLE owned OWNER TO {writer};
             GRANT UPDATE ON fencegate.fences TO {intruder};
             GRANT CREATE ON SCHEMA fencegate TO {intruder};
             GRANT EXECUTE ON FUNCTION fencegate.fence_check(text, bigint, regclass, text, integer) TO PUBLIC;
             CREATE TABLE rogue (id int);
             CREATE TRIGGER sneaky BEFORE INSERT ON rogue FOR EACH STATEMENT EXECUTE FUNCTION fencegate.enforce();"
        ))
        .await;
    let check = fencegate(&["check"], &url);
    assert_eq!(check.status.code(), Some(1), "{}", stdout(&check));
    let report = stdout(&check);
    for expected in [
        "problem  trigger_not_always           public.events_2026: the fencegate trigger is missing",
        "problem  trigger_not_always           public.events_2027: the fencegate trigger is disabled",
        &format!("problem  writer_owns_protected_table  public.owned: writer role {writer}"),
        &format!("problem  role_can_write_fences        {intruder}:"),
        &format!("problem  role_can_create_in_fencegate {intruder}:"),
        "problem  public_can_execute           fencegate.fence_check(text,bigint,regclass,text,integer):",
        "problem  unregistered_fence_trigger   public.rogue: trigger sneaky calls fencegate.enforce()",
        "warning  no_partition_guard           fencegate_partitions:",
        "7 problems, 1 warnings",
    ] {
        assert!(report.contains(expected), "missing {expected:?} in:\n{report}");
    }

    // Protecting again mends the partitions; the rest is the operator's to fix.
    assert!(
        fencegate(&["protect", "events", "--resource", "events"], &url)
            .status
            .success()
    );
    let report = stdout(&fencegate(&["check"], &url));
    assert!(!report.contains("trigger_not_always"), "{report}");
}
