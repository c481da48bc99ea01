use super::*;
use crate::sql::checker::{Checker, GUARD_STACK};
use fencegate_proto::body::SqlStatement;

/// The policy of the tests: no DDL.
fn policy() -> SqlPolicy {
    SqlPolicy {
        role: None,
        allow_ddl: false,
        max_statements: 100,
        max_statement_size: 64 << 10,
        statement_timeout: Duration::from_secs(2),
        max_rows: 100,
        max_response: 1 << 20,
        max_keyed_response: 1 << 20,
    }
}

/// As [`policy`], with `--sql-allow-ddl`.
fn policy_with_ddl() -> SqlPolicy {
    SqlPolicy {
        allow_ddl: true,
        ..policy()
    }
}

fn allowed(sql: &str) -> bool {
    check(sql, &policy()).is_ok()
}

fn allowed_with_ddl(sql: &str) -> bool {
    check(sql, &policy_with_ddl()).is_ok()
}

#[test]
fn data_statements_run() {
    for sql in [
        "SELECT 1",
        "select * from invoices where id = $1",
        "UPDATE sweep_state SET note = $1 WHERE id = 1",
        "INSERT INTO t (a) VALUES ($1) ON CONFLICT (a) DO UPDATE SET a = EXCLUDED.a RETURNING *",
        "DELETE FROM t WHERE a = $1",
        "MERGE INTO t USING s ON t.id = s.id WHEN MATCHED THEN UPDATE SET v = s.v",
        "WITH d AS (DELETE FROM q WHERE id = 1 RETURNING *) INSERT INTO done SELECT * FROM d",
        "VALUES (1), (2)",
        "SELECT 1;",
        "  /* leading comment */ -- and another\n SELECT pg_advisory_xact_lock(1)",
        "SELECT * FROM t FOR UPDATE",
        "SELECT current_setting('role')",
    ] {
        assert!(allowed(sql), "{sql}: {:?}", check(sql, &policy()));
    }
}

#[test]
fn escapes_are_refused() {
    for sql in [
        "COMMIT",
        "commit",
        "  /* x */ CoMmIt -- y",
        "END",
        "ROLLBACK",
        "BEGIN",
        "START TRANSACTION",
        "SAVEPOINT a",
        "RELEASE SAVEPOINT a",
        "PREPARE TRANSACTION 'x'",
        "SET ROLE postgres",
        "set local role postgres",
        "RESET ROLE",
        "SET statement_timeout = 0",
        "SET SESSION AUTHORIZATION postgres",
        "RESET ALL",
        "GRANT ALL ON t TO PUBLIC",
        "REVOKE ALL ON t FROM PUBLIC",
        "DO $$ BEGIN PERFORM 1; END $$",
        "LISTEN chan",
        "NOTIFY chan",
        "COPY t FROM '/etc/passwd'",
        "COPY t TO STDOUT",
        "CALL p()",
        "PREPARE s AS SELECT 1",
        "EXECUTE s",
        "DISCARD ALL",
        "SELECT 1; COMMIT",
        "SELECT 1; SELECT 2",
        "UPDATE t SET a = 1; SET ROLE postgres",
        "",
        "   ",
        "-- only a comment",
        "/* /* nested */ COMMIT */ SELECT 1; COMMIT",
        "SELECT set_config('role', 'postgres', true)",
        "SELECT pg_catalog.SET_CONFIG('statement_timeout', '0', true)",
        "SELECT * FROM set_config('role', 'none', true)",
        "WITH x AS (SELECT set_config('role', 'none', true)) UPDATE t SET a = 1",
        "UPDATE t SET a = (SELECT 1 FROM set_config('role', 'none', true))",
        "SELECT pg_advisory_lock(1)",
        "SELECT dblink_exec('dbname=x', 'DELETE FROM t')",
        "SELECT query_to_xml('select 1', true, false, '')",
        "UPDATE fencegate.fences SET highest = 1",
        "SELECT fencegate.fence('victim', 9223372036854775807)",
        "SELECT \"fencegate\".\"fence\"('victim', 2)",
        "SELECT fence('victim', 9223372036854775807)",
        "UPDATE t SET a = (SELECT FENCE('orders', 21))",
        "SELECT * FROM fencegate.sql_fence('victim', 2, '\\x00')",
        "SELECT sql_fence('victim', 2, '\\x00')",
        "WITH f AS (SELECT fencegate.end_older_terms('victim', 2, 'x')) SELECT 1",
        "DELETE FROM FenceGate.fences",
        "SELECT * FROM \"fencegate\".fences",
        "WITH f AS (UPDATE fencegate.fences SET highest = 1 RETURNING 1) SELECT 1",
        "EXPLAIN ANALYZE DELETE FROM t",
        "VACUUM t",
        "LOCK TABLE t",
        "CREATE FUNCTION f() RETURNS int AS 'select 1' LANGUAGE sql",
        "CREATE EXTENSION dblink",
        "CREATE ROLE r",
        "CREATE TRIGGER tr AFTER INSERT ON t EXECUTE FUNCTION f()",
        "ALTER ROLE writer SUPERUSER",
        "UPDATE pg_settings SET setting = 'off' WHERE name = 'synchronous_commit'",
        "update PG_CATALOG.PG_SETTINGS set setting = '0' where name = 'statement_timeout'",
        "WITH s AS (UPDATE pg_settings SET setting = 'x' WHERE name = 'search_path' RETURNING 1) SELECT 1",
        "DELETE FROM pg_catalog.pg_largeobject",
        "INSERT INTO information_schema.sql_features SELECT * FROM information_schema.sql_features",
        "SELECT lo_create(0)",
        "SELECT lo_from_bytea(0, '\\x00')",
        "SELECT pg_catalog.lowrite(0, 'x')",
        "SELECT pg_notify('chan', 'x')",
    ] {
        assert!(!allowed(sql), "{sql} was allowed");
        assert!(!allowed_with_ddl(sql), "{sql} was allowed with DDL");
    }
}

#[test]
fn ddl_needs_the_flag() {
    for sql in [
        "CREATE TABLE t (id int PRIMARY KEY)",
        "create index on t (a)",
        "ALTER TABLE t ADD COLUMN b text",
        "DROP TABLE t",
        "TRUNCATE t",
        "CREATE VIEW v AS SELECT 1",
        "SELECT 1 AS a INTO newtable",
        "CREATE TABLE t2 AS SELECT * FROM t",
    ] {
        assert!(!allowed(sql), "{sql} was allowed without --sql-allow-ddl");
        assert!(
            allowed_with_ddl(sql),
            "{sql}: {:?}",
            check(sql, &policy_with_ddl())
        );
    }
    for sql in [
        "DROP SCHEMA fencegate CASCADE",
        "drop schema public, FenceGate cascade",
        "DROP TABLE fencegate.fences",
        "TRUNCATE fencegate.objects",
        "CREATE TABLE t (a text DEFAULT set_config('role', 'none', true))",
        "CREATE TEMP TABLE t (a int)",
        "CREATE TEMPORARY VIEW v AS SELECT 1",
        "CREATE TEMP SEQUENCE s",
        "SELECT 1 AS a INTO TEMP t",
    ] {
        assert!(!allowed_with_ddl(sql), "{sql} was allowed with DDL");
    }
}

#[test]
fn catalogs_can_be_read() {
    for sql in [
        "SELECT setting FROM pg_settings WHERE name = 'search_path'",
        "SELECT count(*) FROM pg_catalog.pg_class",
        "UPDATE t SET a = 1 WHERE EXISTS (SELECT 1 FROM pg_my_table)",
    ] {
        let verdict = check(sql, &policy());
        assert_eq!(
            verdict.is_ok(),
            !sql.starts_with("UPDATE"),
            "{sql}: {verdict:?}"
        );
    }
}

#[test]
fn size_is_bounded_before_parsing() {
    let mut policy = policy();
    policy.max_statement_size = 20;
    assert!(check("SELECT 1", &policy).is_ok());
    let refused = check("SELECT 1 FROM a_rather_long_table_name", &policy).unwrap_err();
    assert!(refused.0.contains("--sql-max-statement-size"), "{refused}");
}

/// Chains of operators as long as the bound allows are checked within half of
/// [`GUARD_STACK`]; one more operator is refused before parsing.
#[test]
fn operator_chains_are_bounded() {
    let shapes: [(&str, &str, &str); 5] = [
        ("SELECT 1", " + 1", ""),
        ("SELECT x", "::int", " FROM t"),
        ("SELECT * FROM t WHERE a", " AND a", ""),
        ("SELECT 'a'", " || 'a'", ""),
        ("UPDATE t SET a = b", " * b", " WHERE c = $1"),
    ];
    let operators = |sql: &str| {
        Tokenizer::new(&PostgreSqlDialect {}, sql)
            .tokenize()
            .unwrap()
            .iter()
            .filter(|token| deepens(token))
            .count()
    };
    for (head, link, tail) in shapes {
        let statement = |links: usize| format!("{head}{}{tail}", link.repeat(links));
        let at_bound = statement(MAX_OPERATORS - operators(head) - operators(tail));
        assert_eq!(operators(&at_bound), MAX_OPERATORS);
        let verdict = std::thread::Builder::new()
            .stack_size(GUARD_STACK / 2)
            .spawn(move || {
                let mut policy = policy();
                policy.max_statement_size = usize::MAX;
                check(&at_bound, &policy)
            })
            .unwrap()
            .join()
            .expect("checking a chain at the bound must not overflow the stack");
        assert_eq!(verdict, Ok(()), "{head}{link}...");
        let mut policy = policy();
        policy.max_statement_size = usize::MAX;
        let refused = check(
            &statement(MAX_OPERATORS + 1 - operators(head) - operators(tail)),
            &policy,
        )
        .unwrap_err();
        assert!(refused.0.contains("operators"), "{refused}");
    }
}

#[tokio::test]
async fn the_checker_answers_in_order() {
    let checker = Checker::start(2).unwrap();
    let statements = |sqls: &[&str]| -> Vec<SqlStatement> {
        sqls.iter()
            .map(|sql| SqlStatement {
                sql: (*sql).to_owned(),
                params: Vec::new(),
            })
            .collect()
    };
    let (back, verdict) = checker
        .check_all(statements(&["SELECT 1", "UPDATE t SET a = 1"]), &policy())
        .await;
    assert_eq!((back.len(), verdict), (2, Ok(())));
    let deep = format!("SELECT 1{}", " + 1".repeat(MAX_OPERATORS));
    let (_, verdict) = checker
        .check_all(statements(&["SELECT 1", &deep, "COMMIT"]), &policy())
        .await;
    assert_eq!(verdict.map_err(|(index, _)| index), Err(2));
}

#[test]
fn refusals_name_the_command() {
    let refused = check("  /* hi */ commit", &policy()).unwrap_err();
    assert!(refused.0.contains("COMMIT"), "{refused}");
    let refused = check("CREATE TABLE t (a int)", &policy()).unwrap_err();
    assert!(
        refused.0.contains("CREATE TABLE") && refused.0.contains("--sql-allow-ddl"),
        "{refused}"
    );
}
