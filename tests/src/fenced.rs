//! Fenced tables in a fresh database, written by writers that talk to Postgres
//! themselves — no gateway in between.
//!
//! [`FencedDb::create`] brings a new database to the gateway's schema (the same
//! migration the gateway runs) and prepares its writer role the way
//! docs/fenced-tables.md describes: it may write the tables of schema `public` and
//! holds every resource (`fencegate grant writer --resource '*'`), and nothing else of
//! fencegate's. [`FencedDb::tenant`] makes roles that hold some resources only.

use fencegate_gateway::auth::Pattern;
use tokio_postgres::error::DbError;
use tokio_postgres::{Client, NoTls};

use crate::db::TestDb;

/// A database with the in-database fence installed, and its writer role.
pub struct FencedDb {
    pub db: TestDb,
    /// A superuser connection, for setting up and looking at what writers did.
    pub admin: Client,
    writer: String,
}

impl FencedDb {
    pub async fn create() -> FencedDb {
        let db = TestDb::create().await;
        let admin = fencegate_gateway::admin::connect(&db.url())
            .await
            .unwrap_or_else(|e| panic!("migrating {}: {e}", db.name()));
        let writer = db.writer().await;
        let everything = [Pattern::parse("*").expect("a pattern")];
        fencegate_gateway::admin::grant(&admin, &db.writer_role(), &everything, false)
            .await
            .unwrap_or_else(|e| panic!("granting the writer every resource: {e}"));
        FencedDb { db, admin, writer }
    }

    /// A login role `<db>_<name>` that may write the tables of schema `public` and
    /// holds the resources of `patterns` only (`fencegate grant`); its connection
    /// string.
    pub async fn tenant(&self, name: &str, patterns: &[&str]) -> String {
        let role = self.db.create_role(name, "LOGIN").await;
        self.db
            .execute(&format!(
                "GRANT USAGE ON SCHEMA public TO {role};
                 GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO {role};"
            ))
            .await;
        let patterns: Vec<Pattern> = patterns
            .iter()
            .map(|p| Pattern::parse(p).expect("a pattern"))
            .collect();
        fencegate_gateway::admin::grant(&self.admin, &role, &patterns, false)
            .await
            .unwrap_or_else(|e| panic!("granting {role}: {e}"));
        self.db.url_as(&role)
    }

    /// Runs `sql` as the superuser; panics with the SQL if it fails. The fence applies
    /// to superusers too: see [`FencedDb::unfenced`].
    pub async fn execute(&self, sql: &str) {
        self.admin
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }

    /// Runs `sql` on `table` with its fence trigger disabled for the transaction: test
    /// set-up that must not touch the fence.
    pub async fn unfenced(&self, table: &str, sql: &str) {
        self.execute(&format!(
            "BEGIN;
             ALTER TABLE {table} DISABLE TRIGGER fencegate_fence;
             {sql};
             ALTER TABLE {table} ENABLE ALWAYS TRIGGER fencegate_fence;
             COMMIT;"
        ))
        .await;
    }

    /// `fencegate protect TABLE --resource RESOURCE`, in-process.
    pub async fn protect(&self, table: &str, resource: &str) -> Vec<String> {
        fencegate_gateway::admin::protect(&self.admin, table, resource)
            .await
            .unwrap_or_else(|e| panic!("protecting {table}: {e}"))
    }

    /// Raises `resource`'s fence to `token` in a transaction of its own, as a new
    /// leader does first.
    pub async fn raise(&self, resource: &str, token: i64) {
        self.admin
            .query_one("SELECT fencegate.fence($1, $2)", &[&resource, &token])
            .await
            .unwrap_or_else(|e| panic!("raising {resource} to {token}: {e}"));
    }

    /// The durable highest token of `resource`.
    pub async fn highest(&self, resource: &str) -> Option<i64> {
        self.db.highest(resource).await
    }

    /// The writer role's connection string.
    pub fn writer_url(&self) -> &str {
        &self.writer
    }

    /// A connection as the writer role, with the start-up `options` given (e.g.
    /// `-c fencegate.token=5`; empty for none).
    pub async fn writer(&self, options: &str) -> Client {
        connect_with(&self.writer, options).await
    }

    /// A writer connection presenting `token` for the whole session
    /// (`options=-c fencegate.token=N`).
    pub async fn writer_with_token(&self, token: &str) -> Client {
        self.writer(&format!("-c fencegate.token={token}")).await
    }

    /// Runs `sql` (one or more statements) on a new writer connection presenting
    /// `token` for the session, or no token.
    pub async fn run_as_writer(
        &self,
        token: Option<&str>,
        sql: &str,
    ) -> Result<(), tokio_postgres::Error> {
        let writer = match token {
            Some(token) => self.writer_with_token(token).await,
            None => self.writer("").await,
        };
        writer.batch_execute(sql).await
    }

    /// `SELECT count(*) FROM table`, as the superuser.
    pub async fn count(&self, table: &str) -> i64 {
        self.admin
            .query_one(&format!("SELECT count(*) FROM {table}"), &[])
            .await
            .unwrap_or_else(|e| panic!("counting {table}: {e}"))
            .get(0)
    }
}

/// Connects to `url` with start-up `options`; panics if it cannot.
pub async fn connect_with(url: &str, options: &str) -> Client {
    let mut config: tokio_postgres::Config = url.parse().expect("a valid URL");
    if !options.is_empty() {
        config.options(options);
    }
    let (client, connection) = config
        .connect(NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting as {url}: {e}"));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// The fencegate error of `error`: its SQLSTATE and server error fields; panics with
/// the error if it is not one of the in-database fence's (class `ZF`).
pub fn fence_error(error: &tokio_postgres::Error) -> &DbError {
    let db = error
        .as_db_error()
        .unwrap_or_else(|| panic!("not a database error: {error}"));
    assert!(
        db.code().code().starts_with("ZF"),
        "expected a fencegate error, got {} {}: {:?}",
        db.code().code(),
        db.message(),
        db.detail()
    );
    db
}

/// A fence error's DETAIL without its proof, the `key=value` fields before
/// ` proof=<hex>`; panics if a stale or unissued token's DETAIL carries no proof.
pub fn detail_fields(error: &DbError) -> Option<&str> {
    let detail = error.detail()?;
    match detail.rsplit_once(" proof=") {
        Some((fields, proof)) => {
            assert!(
                proof.len() == 64 && proof.bytes().all(|b| b.is_ascii_hexdigit()),
                "a proof is 64 hex digits: {detail}"
            );
            Some(fields)
        }
        None => {
            assert!(
                !matches!(error.code().code(), "ZF001" | "ZF005"),
                "a {} without a proof: {detail}",
                error.code().code()
            );
            Some(detail)
        }
    }
}

/// The SQLSTATE of `result`'s error; panics if it succeeded.
pub fn sqlstate<T: std::fmt::Debug>(result: Result<T, tokio_postgres::Error>) -> String {
    match result {
        Ok(value) => panic!("expected an error, got {value:?}"),
        Err(error) => match error.as_db_error() {
            Some(db) => db.code().code().to_owned(),
            None => panic!("not a database error: {error}"),
        },
    }
}

/// Checks commits of a counter `(value counted, token)` against the counter's final
/// value `n`: each commit counted exactly once, and tokens never going down in commit
/// order — what a fence guarantees to concurrent writers of one resource.
pub fn assert_counted_once_in_token_order<T>(commits: &mut [(i64, T)], n: i64)
where
    T: Ord + Copy + std::fmt::Display,
{
    commits.sort();
    let counts: Vec<i64> = commits.iter().map(|(n, _)| *n).collect();
    assert_eq!(
        counts,
        (1..=n).collect::<Vec<_>>(),
        "each commit counted once"
    );
    for pair in commits.windows(2) {
        assert!(
            pair[0].1 <= pair[1].1,
            "commit {} had token {} after commit {} with token {}",
            pair[1].0,
            pair[1].1,
            pair[0].0,
            pair[0].1
        );
    }
}
