//! What a writer's SQL may do inside a fenced transaction: the statement classifier
//! and the limits of `POST /v1/sql/{resource}`.
//!
//! This is defence in depth, not the boundary: the boundary is the writer-only login
//! the statements run as, and the in-database fence on the writer's tables (see the
//! [`crate::sql`] module doc). What it adds is refusing, before anything runs, what a
//! writer has no business sending.
//!
//! # Behavior
//!
//! A statement is first bounded, without recursion: its size (`--sql-max-statement-size`)
//! and the number of operators in it ([`MAX_OPERATORS`]), which bounds the depth of the
//! syntax tree that parsing, checking and dropping it walk recursively. Then it is
//! parsed (sqlparser, PostgreSQL dialect, which also caps nesting) and checked, and the
//! transaction is refused whole if one statement is not allowed. The rules fail closed:
//! SQL the parser cannot read is refused, not passed through.
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
//!   connection) — calls of functions that do the same from inside a query
//!   ([`DENIED_FUNCTIONS`], large objects), writes to the system catalogs (`UPDATE
//!   pg_settings` changes settings for the session), and any object in the gateway's
//!   own `fencegate` schema — its functions too, by whatever name they are called.

use std::ops::ControlFlow;
use std::time::Duration;

use sqlparser::ast::{
    Expr, ObjectName, ObjectNamePart, ObjectType, Query, SetExpr, Statement, TableFactor, Visit,
    Visitor,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::{Token, Tokenizer};

use crate::config::Config;

/// Most operators in one statement. Parsing builds a chain of binary operators
/// (`a + b + c ...`) as a left-deep tree without recursing, but walking the tree to check it
/// recurses once per link, with frames of several KiB in unoptimised builds; this bound
/// and [`super::checker::GUARD_STACK`] keep that walk inside its stack. Nesting by parentheses and
/// prefix operators is capped by the parser itself (50 levels).
pub const MAX_OPERATORS: usize = 1000;

/// Functions refused anywhere in a statement, whatever their schema:
///
/// - `set_config` changes settings from inside a query — `role` (undoing `SET LOCAL
///   ROLE`: the session user may always return to itself), `statement_timeout`,
///   `search_path`;
/// - session-level advisory locks outlive the transaction on a pooled connection;
/// - `dblink*` and the `query_to_xml` family run SQL text the classifier never saw,
///   the former outside the fenced transaction;
/// - `pg_notify` is `NOTIFY`;
/// - server administration and server file access;
/// - large objects (`lo_*`, `lowrite`), which no table trigger fences.
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
    "pg_notify",
    "pg_terminate_backend",
    "pg_cancel_backend",
    "pg_reload_conf",
    "pg_read_file",
    "pg_read_binary_file",
    "pg_ls_dir",
    "pg_stat_file",
    "lowrite",
];

/// Function name prefixes refused like [`DENIED_FUNCTIONS`]: `dblink*`, and the large
/// object functions (`lo_create`, `lo_import`, `lo_put`, `lo_unlink`...).
const DENIED_PREFIXES: &[&str] = &["dblink", "lo_"];

/// The gateway's own schema: fence rows must only change through the fence step.
const GATEWAY_SCHEMA: &str = "fencegate";

/// Schemas of the system catalogs, which a writer may read but not write.
const CATALOG_SCHEMAS: &[&str] = &["pg_catalog", "information_schema", "pg_toast"];

/// How `POST /v1/sql/{resource}` is allowed to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqlPolicy {
    /// The role every transaction switches to with `SET LOCAL ROLE`, if any.
    pub role: Option<String>,
    pub allow_ddl: bool,
    pub max_statements: usize,
    /// Longest SQL text of one statement, in bytes.
    pub max_statement_size: usize,
    /// `statement_timeout` (and `lock_timeout`) of every transaction.
    pub statement_timeout: Duration,
    /// Most rows returned in one answer, over all its statements.
    pub max_rows: usize,
    /// Most bytes of JSON the rows of one answer take, over all its statements.
    pub max_response: usize,
    /// The same for a keyed transaction, whose answer is stored for its retries: also
    /// at most `--idempotency-max-answer`.
    pub max_keyed_response: usize,
}

impl SqlPolicy {
    /// The policy of `config`'s `--sql-*` flags.
    pub fn from_config(config: &Config) -> SqlPolicy {
        SqlPolicy {
            role: config.sql.sql_role.clone(),
            allow_ddl: config.sql.sql_allow_ddl,
            max_statements: config.sql.sql_max_statements,
            max_statement_size: config.sql.sql_max_statement_size,
            statement_timeout: config.sql.sql_statement_timeout,
            max_rows: config.sql.sql_max_rows,
            max_response: config.sql.sql_max_response,
            max_keyed_response: config
                .sql
                .sql_max_response
                .min(config.idempotency.idempotency_max_answer),
        }
    }
}

/// Why a statement is refused. The reason is safe to show the writer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// Refuses `sql` unless it is one statement of an allowed kind, within the bounds; see
/// the module doc. Run it on a [`super::checker::Checker`] thread: its walk needs up to
/// [`super::checker::GUARD_STACK`].
pub fn check(sql: &str, policy: &SqlPolicy) -> Result<(), Refused> {
    if sql.len() > policy.max_statement_size {
        return Err(Refused(format!(
            "the statement is {} bytes long; the limit is {} (--sql-max-statement-size)",
            sql.len(),
            policy.max_statement_size
        )));
    }
    let dialect = PostgreSqlDialect {};
    let tokens = Tokenizer::new(&dialect, sql)
        .tokenize()
        .map_err(|error| Refused(format!("the statement could not be read: {error}")))?;
    let operators = tokens.iter().filter(|token| deepens(token)).count();
    if operators > MAX_OPERATORS {
        return Err(Refused(format!(
            "the statement has {operators} operators; the limit is {MAX_OPERATORS}: pass \
             values as parameters, or split it"
        )));
    }
    let statements = Parser::new(&dialect)
        .with_tokens(tokens)
        .parse_statements()
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
    let allow_ddl = policy.allow_ddl;
    let kind = kind(statement);
    match kind {
        StatementKind::Dml => {}
        StatementKind::Ddl if allow_ddl => {}
        StatementKind::Ddl => {
            return Err(Refused(format!(
                "{} is DDL, which this gateway does not run (--sql-allow-ddl)",
                command(statement)
            )))
        }
        StatementKind::Never => {
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
    match statement.visit(&mut Inspector {
        allow_ddl,
        writing: false,
    }) {
        ControlFlow::Continue(()) => Ok(()),
        ControlFlow::Break(refused) => Err(refused),
    }
}

/// Whether a token can add a level to the syntax tree without the parser recursing:
/// an operator symbol or an operator keyword.
fn deepens(token: &Token) -> bool {
    match token {
        Token::Word(word) => {
            word.quote_style.is_none()
                && matches!(
                    word.keyword,
                    Keyword::AND
                        | Keyword::OR
                        | Keyword::NOT
                        | Keyword::IS
                        | Keyword::IN
                        | Keyword::LIKE
                        | Keyword::ILIKE
                        | Keyword::SIMILAR
                        | Keyword::BETWEEN
                        | Keyword::COLLATE
                        | Keyword::AT
                        | Keyword::OPERATOR
                        | Keyword::OVERLAPS
                        | Keyword::ESCAPE
                        | Keyword::XOR
                )
        }
        Token::Whitespace(_)
        | Token::Number(..)
        | Token::Comma
        | Token::SemiColon
        | Token::LParen
        | Token::RParen
        | Token::Period
        | Token::Placeholder(_)
        | Token::EOF => false,
        Token::SingleQuotedString(_)
        | Token::DoubleQuotedString(_)
        | Token::DollarQuotedString(_)
        | Token::EscapedStringLiteral(_)
        | Token::UnicodeStringLiteral(_)
        | Token::NationalStringLiteral(_)
        | Token::HexStringLiteral(_)
        | Token::SingleQuotedByteStringLiteral(_) => false,
        _ => true,
    }
}

/// What a statement is to the guard: a query or data change, a schema change (allowed
/// with `--sql-allow-ddl`), or something never allowed.
enum StatementKind {
    Dml,
    Ddl,
    Never,
}

fn kind(statement: &Statement) -> StatementKind {
    match statement {
        // Temporary objects outlive the transaction on a pooled connection and would be
        // seen by the next request that gets it.
        Statement::CreateTable(create) if create.temporary => StatementKind::Never,
        Statement::CreateView {
            temporary: true, ..
        }
        | Statement::CreateSequence {
            temporary: true, ..
        } => StatementKind::Never,
        Statement::Query(_)
        | Statement::Insert(_)
        | Statement::Update { .. }
        | Statement::Delete(_)
        | Statement::Merge { .. } => StatementKind::Dml,
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
        | Statement::Comment { .. } => StatementKind::Ddl,
        _ => StatementKind::Never,
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
        Statement::Drop {
            object_type: ObjectType::Schema,
            names,
            ..
        } => {
            return names
                .iter()
                .find(|name| {
                    last_part(name).is_some_and(|s| s.eq_ignore_ascii_case(GATEWAY_SCHEMA))
                })
                .map(ToString::to_string)
        }
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
    schema_of(name).is_some_and(|s| s.eq_ignore_ascii_case(GATEWAY_SCHEMA))
}

/// The schema part of a qualified name (`pg_catalog` of `pg_catalog.pg_settings`).
fn schema_of(name: &ObjectName) -> Option<&str> {
    let parts = &name.0;
    parts.len().checked_sub(2).and_then(|at| ident(&parts[at]))
}

/// A system catalog: a relation in a catalog schema, or an unqualified `pg_*` name
/// (which resolves to `pg_catalog` first).
fn in_catalog(name: &ObjectName) -> bool {
    match schema_of(name) {
        Some(schema) => CATALOG_SCHEMAS
            .iter()
            .any(|catalog| schema.eq_ignore_ascii_case(catalog)),
        None => last_part(name).is_some_and(|last| last.to_ascii_lowercase().starts_with("pg_")),
    }
}

fn ident(part: &ObjectNamePart) -> Option<&str> {
    part.as_ident().map(|ident| ident.value.as_str())
}

/// The last part of a (possibly schema-qualified) name, e.g. `set_config` of
/// `pg_catalog.set_config`.
fn last_part(name: &ObjectName) -> Option<&str> {
    name.0.last().and_then(ident)
}

/// The functions of schema `fencegate`, as its SQL defines them: refused however they
/// are named, so that a statement cannot reach one through a `search_path` that lists
/// the schema. (Postgres refuses them anyway: the SQL login may execute none but the
/// gateway's fence step, which needs the gateway's key.)
fn gateway_functions() -> &'static [String] {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| {
        const DEFINITION: &str = "CREATE OR REPLACE FUNCTION fencegate.";
        crate::dbfence::FUNCTIONS_SQL
            .match_indices(DEFINITION)
            .filter_map(|(at, _)| {
                let rest = &crate::dbfence::FUNCTIONS_SQL[at + DEFINITION.len()..];
                rest.split('(').next().map(str::to_owned)
            })
            .collect()
    })
}

fn denied_function(name: &ObjectName) -> bool {
    if in_gateway_schema(name) {
        return true;
    }
    last_part(name).is_some_and(|last| {
        gateway_functions()
            .iter()
            .any(|function| last.eq_ignore_ascii_case(function))
            || DENIED_FUNCTIONS
                .iter()
                .any(|denied| last.eq_ignore_ascii_case(denied))
            || DENIED_PREFIXES
                .iter()
                .any(|prefix| last.to_ascii_lowercase().starts_with(prefix))
    })
}

/// Walks every nested statement, query, relation and expression of an allowed
/// top-level statement.
struct Inspector {
    allow_ddl: bool,
    /// Whether a data-modifying statement has been seen: from then on, no relation may
    /// be a system catalog.
    writing: bool,
}

impl Visitor for Inspector {
    type Break = Refused;

    fn pre_visit_statement(&mut self, statement: &Statement) -> ControlFlow<Refused> {
        self.writing |= matches!(
            statement,
            Statement::Insert(_)
                | Statement::Update { .. }
                | Statement::Delete(_)
                | Statement::Merge { .. }
        );
        // Statements nested in queries (`WITH d AS (DELETE ...)`) follow the same rules.
        match kind(statement) {
            StatementKind::Dml => ControlFlow::Continue(()),
            StatementKind::Ddl if self.allow_ddl => ControlFlow::Continue(()),
            _ => ControlFlow::Break(Refused(format!(
                "{} is not allowed inside a query",
                command(statement)
            ))),
        }
    }

    fn pre_visit_query(&mut self, query: &Query) -> ControlFlow<Refused> {
        if selects_into(&query.body, IntoTables::Temporary) {
            return ControlFlow::Break(Refused(
                "SELECT ... INTO TEMPORARY creates a table that outlives the transaction"
                    .to_owned(),
            ));
        }
        if !self.allow_ddl && selects_into(&query.body, IntoTables::Any) {
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
        if self.writing && in_catalog(relation) {
            return ControlFlow::Break(Refused(format!(
                "{relation} is a system catalog, which a fenced transaction may read but not \
                 write"
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

/// Which tables a `SELECT ... INTO` creates, for [`selects_into`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntoTables {
    Temporary,
    Any,
}

/// Whether a `SELECT` in `body` has an `INTO` clause that creates `tables`.
fn selects_into(body: &SetExpr, tables: IntoTables) -> bool {
    match body {
        SetExpr::Select(select) => select
            .into
            .as_ref()
            .is_some_and(|into| into.temporary || tables == IntoTables::Any),
        SetExpr::Query(query) => selects_into(&query.body, tables),
        SetExpr::SetOperation { left, right, .. } => {
            selects_into(left, tables) || selects_into(right, tables)
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests;
