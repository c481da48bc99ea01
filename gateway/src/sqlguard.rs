//! What a writer's SQL may do inside a fenced transaction: the statement classifier
//! and the limits of `POST /v1/sql/{resource}`.
//!
//! # Behavior
//!
//! Every statement is parsed (sqlparser, PostgreSQL dialect) before anything runs, and
//! the transaction is refused whole if one of them is not allowed. The rules fail
//! closed: SQL the parser cannot read is refused, not passed through.
//!
//! - Exactly one command per `sql` string.
//! - Allowed: `SELECT`, `VALUES`, `TABLE`, `INSERT`, `UPDATE`, `DELETE`, `MERGE`, and
//!   `WITH` queries whose parts are these. With `--sql-allow-ddl`, also creating,
//!   altering and dropping tables, views, indexes, sequences, types and schemas,
//!   `TRUNCATE`, `COMMENT` and `SELECT ... INTO`.
//! - Refused always: whatever would end or escape the fenced transaction, the role or
//!   the gateway's limits — transaction control, `SET`/`RESET`, `GRANT`/`REVOKE`, `DO`,
//!   `CALL`, `COPY`, `LISTEN`/`NOTIFY`, `PREPARE`/`EXECUTE`, functions, triggers,
//!   extensions, roles, temporary tables (they outlive the transaction on a pooled
//!   connection) — and calls of functions that do the same from inside a query
//!   ([`DENIED_FUNCTIONS`]), and any object in the gateway's own `fencegate` schema.
//!
//! The function list is defence in depth, not the boundary: the boundary is the
//! database role given with `--sql-role`, whose privileges are all a writer gets.

use std::ops::ControlFlow;
use std::time::Duration;

use sqlparser::ast::{
    Expr, ObjectName, ObjectNamePart, Query, SetExpr, Statement, TableFactor, Visit, Visitor,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

use crate::config::Config;

/// Functions refused anywhere in a statement, whatever their schema:
///
/// - `set_config` changes settings from inside a query — `role` (undoing `SET LOCAL
///   ROLE`: the session user may always return to itself), `statement_timeout`,
///   `search_path`;
/// - session-level advisory locks outlive the transaction on a pooled connection;
/// - `dblink*` and the `query_to_xml` family run SQL text the classifier never saw,
///   the former outside the fenced transaction;
/// - server administration and server file access.
pub const DENIED_FUNCTIONS: &[&str] = &[
    "set_config",
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
    "pg_advisory_unlock",
    "pg_advisory_unlock_shared",
    "pg_advisory_unlock_all",
    "query_to_xml",
    "query_to_xmlschema",
    "query_to_xml_and_xmlschema",
    "cursor_to_xml",
    "cursor_to_xmlschema",
    "pg_terminate_backend",
    "pg_cancel_backend",
    "pg_reload_conf",
    "pg_read_file",
    "pg_read_binary_file",
    "pg_ls_dir",
    "pg_stat_file",
    "lo_import",
    "lo_export",
];

/// The gateway's own schema: fence rows must only change through the fence step.
const GATEWAY_SCHEMA: &str = "fencegate";

/// How `POST /v1/sql/{resource}` is allowed to run; present only with `--sql`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlPolicy {
    /// The role every transaction switches to with `SET LOCAL ROLE`, if any.
    pub role: Option<String>,
    pub allow_ddl: bool,
    pub max_statements: usize,
    /// `SET LOCAL statement_timeout` for every transaction.
    pub statement_timeout: Duration,
    /// Most rows returned in one answer, over all its statements.
    pub max_rows: usize,
}

impl SqlPolicy {
    /// The policy `config` asks for; `None` unless `--sql` is given.
    pub fn from_config(config: &Config) -> Option<SqlPolicy> {
        config.sql.then(|| SqlPolicy {
            role: config.sql_role.clone(),
            allow_ddl: config.sql_allow_ddl,
            max_statements: config.sql_max_statements,
            statement_timeout: config.sql_statement_timeout,
            max_rows: config.sql_max_rows,
        })
    }
}

/// Why a statement is refused. The reason is safe to show the writer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Refuses `sql` unless it is one statement of an allowed kind; see the module doc.
pub fn check(sql: &str, allow_ddl: bool) -> Result<(), Refused> {
    let statements = Parser::parse_sql(&PostgreSqlDialect {}, sql)
        .map_err(|error| Refused(format!("the statement could not be parsed: {error}")))?;
    let statement = match statements.as_slice() {
        [statement] => statement,
        [] => return Err(Refused("the statement is empty".to_owned())),
        _ => {
            return Err(Refused(format!(
                "one command per statement: found {}",
                statements.len()
            )))
        }
    };
    let kind = kind(statement);
    match kind {
        Kind::Dml => {}
        Kind::Ddl if allow_ddl => {}
        Kind::Ddl => {
            return Err(Refused(format!(
                "{} is DDL, which this gateway does not run (--sql-allow-ddl)",
                command(statement)
            )))
        }
        Kind::Never => {
            return Err(Refused(format!(
                "{} is not allowed in a fenced transaction",
                command(statement)
            )))
        }
    }
    if let Some(name) = gateway_object(statement) {
        return Err(Refused(format!(
            "{name} belongs to the gateway's own schema"
        )));
    }
    match statement.visit(&mut Inspector { allow_ddl }) {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(refused) => Err(refused),
    }
}

enum Kind {
    Dml,
    Ddl,
    Never,
}

fn kind(statement: &Statement) -> Kind {
    match statement {
        // Temporary objects outlive the transaction on a pooled connection and would be
        // seen by the next request that gets it.
        Statement::CreateTable(create) if create.temporary => Kind::Never,
        Statement::CreateView {
            temporary: true, ..
        }
        | Statement::CreateSequence {
            temporary: true, ..
        } => Kind::Never,
        Statement::Query(_)
        | Statement::Insert(_)
        | Statement::Update { .. }
        | Statement::Delete(_)
        | Statement::Merge { .. } => Kind::Dml,
        Statement::CreateTable(_)
        | Statement::CreateView { .. }
        | Statement::CreateIndex(_)
        | Statement::CreateSequence { .. }
        | Statement::CreateSchema { .. }
        | Statement::CreateType { .. }
        | Statement::AlterTable { .. }
        | Statement::AlterIndex { .. }
        | Statement::AlterView { .. }
        | Statement::AlterType(_)
        | Statement::Drop { .. }
        | Statement::Truncate { .. }
        | Statement::Comment { .. } => Kind::Ddl,
        _ => Kind::Never,
    }
}

/// The statement's command, for messages: its first words as the parser prints them.
fn command(statement: &Statement) -> String {
    let text = statement.to_string();
    let words: Vec<&str> = text.split_whitespace().take(2).collect();
    let first = words.first().copied().unwrap_or_default();
    // Two words where one says little (`CREATE TABLE`, `START TRANSACTION`).
    let command = match (first, words.get(1)) {
        ("CREATE" | "ALTER" | "DROP" | "START" | "RELEASE" | "PREPARE", Some(second)) => {
            format!("{first} {second}")
        }
        _ => first.to_owned(),
    };
    command.trim_end_matches(';').to_owned()
}

/// Names a `DROP` or `TRUNCATE` target in the gateway's schema; the visitor below sees
/// the relations of every other statement.
fn gateway_object(statement: &Statement) -> Option<String> {
    let names: Vec<&ObjectName> = match statement {
        Statement::Drop { names, .. } => names.iter().collect(),
        Statement::Truncate { table_names, .. } => table_names.iter().map(|t| &t.name).collect(),
        _ => Vec::new(),
    };
    names
        .into_iter()
        .find(|name| in_gateway_schema(name))
        .map(ToString::to_string)
}

fn in_gateway_schema(name: &ObjectName) -> bool {
    let parts = &name.0;
    parts.len() >= 2
        && ident(&parts[parts.len() - 2]).is_some_and(|s| s.eq_ignore_ascii_case(GATEWAY_SCHEMA))
}

fn ident(part: &ObjectNamePart) -> Option<&str> {
    part.as_ident().map(|ident| ident.value.as_str())
}

/// The last part of a (possibly schema-qualified) name, e.g. `set_config` of
/// `pg_catalog.set_config`.
fn last_part(name: &ObjectName) -> Option<&str> {
    name.0.last().and_then(ident)
}

fn denied_function(name: &ObjectName) -> bool {
    last_part(name).is_some_and(|last| {
        DENIED_FUNCTIONS
            .iter()
            .any(|denied| last.eq_ignore_ascii_case(denied))
            || last.to_ascii_lowercase().starts_with("dblink")
    })
}

/// Walks every nested statement, query, relation and expression of an allowed
/// top-level statement.
struct Inspector {
    allow_ddl: bool,
}

impl Visitor for Inspector {
    type Break = Refused;

    fn pre_visit_statement(&mut self, statement: &Statement) -> ControlFlow<Refused> {
        // Statements nested in queries (`WITH d AS (DELETE ...)`) follow the same rules.
        match kind(statement) {
            Kind::Dml => ControlFlow::Continue(()),
            Kind::Ddl if self.allow_ddl => ControlFlow::Continue(()),
            _ => ControlFlow::Break(Refused(format!(
                "{} is not allowed inside a query",
                command(statement)
            ))),
        }
    }

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<Refused> {
        if selects_into(&query.body, true) {
            return ControlFlow::Break(Refused(
                "SELECT ... INTO TEMPORARY creates a table that outlives the transaction"
                    .to_owned(),
            ));
        }
        if !self.allow_ddl && selects_into(&query.body, false) {
            return ControlFlow::Break(Refused(
                "SELECT ... INTO creates a table, which is DDL (--sql-allow-ddl)".to_owned(),
            ));
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_relation(&mut self, relation: &ObjectName) -> ControlFlow<Refused> {
        if in_gateway_schema(relation) {
            return ControlFlow::Break(Refused(format!(
                "{relation} belongs to the gateway's own schema"
            )));
        }
        // `FROM set_config(...)` is parsed as a relation with arguments.
        if denied_function(relation) {
            return ControlFlow::Break(refused_function(relation));
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, factor: &TableFactor) -> ControlFlow<Refused> {
        if let TableFactor::Function { name, .. } = factor {
            if denied_function(name) {
                return ControlFlow::Break(refused_function(name));
            }
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_expr(&mut self, expr: &Expr) -> ControlFlow<Refused> {
        if let Expr::Function(function) = expr {
            if denied_function(&function.name) {
                return ControlFlow::Break(refused_function(&function.name));
            }
        }
        ControlFlow::Continue(())
    }
}

fn refused_function(name: &ObjectName) -> Refused {
    Refused(format!(
        "function {name} is not allowed in a fenced transaction"
    ))
}

/// Whether a `SELECT` in `body` has an `INTO` clause (only temporary ones if
/// `temporary_only`).
fn selects_into(body: &SetExpr, temporary_only: bool) -> bool {
    match body {
        SetExpr::Select(select) => select
            .into
            .as_ref()
            .is_some_and(|into| into.temporary || !temporary_only),
        SetExpr::Query(query) => selects_into(&query.body, temporary_only),
        SetExpr::SetOperation { left, right, .. } => {
            selects_into(left, temporary_only) || selects_into(right, temporary_only)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowed(sql: &str) -> bool {
        check(sql, false).is_ok()
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
            assert!(allowed(sql), "{sql}: {:?}", check(sql, false));
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
        ] {
            assert!(!allowed(sql), "{sql} was allowed");
            assert!(check(sql, true).is_err(), "{sql} was allowed with DDL");
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
            assert!(check(sql, true).is_ok(), "{sql}: {:?}", check(sql, true));
        }
        for sql in [
            "DROP TABLE fencegate.fences",
            "TRUNCATE fencegate.objects",
            "CREATE TABLE t (a text DEFAULT set_config('role', 'none', true))",
            "CREATE TEMP TABLE t (a int)",
            "CREATE TEMPORARY VIEW v AS SELECT 1",
            "CREATE TEMP SEQUENCE s",
            "SELECT 1 AS a INTO TEMP t",
        ] {
            assert!(check(sql, true).is_err(), "{sql} was allowed with DDL");
        }
    }

    #[test]
    fn refusals_name_the_command() {
        let refused = check("  /* hi */ commit", false).unwrap_err();
        assert!(refused.0.contains("COMMIT"), "{refused}");
        let refused = check("CREATE TABLE t (a int)", false).unwrap_err();
        assert!(
            refused.0.contains("CREATE TABLE") && refused.0.contains("--sql-allow-ddl"),
            "{refused}"
        );
    }
}
