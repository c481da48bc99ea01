//! `fencegate protect`, `fencegate unprotect` and `fencegate check`: the operator's
//! commands for fenced tables, each a call of the schema's SQL function of that name
//! after the schema is created or migrated.
//!
//! They connect with the operator's database URL and run with its privileges:
//! protecting a table needs its ownership, which writers must not have.

use std::fmt;

use tokio_postgres::Client;

use crate::config::TablesCommand;
use crate::pgtls::PgUrlError;
use crate::store::postgres::{error_text, migrate, PgStartError};

/// Why an administrative command failed. Database messages are the operator's own
/// business and are shown as Postgres wrote them; the connection string never is.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("--database-url: {0}")]
    InvalidUrl(PgUrlError),
    #[error("could not connect to the database: {0}")]
    Connect(String),
    #[error(transparent)]
    Schema(#[from] PgStartError),
    #[error("{0}")]
    Database(String),
}

impl From<tokio_postgres::Error> for AdminError {
    fn from(error: tokio_postgres::Error) -> AdminError {
        match error.as_db_error() {
            Some(db) => AdminError::Database(match db.hint() {
                Some(hint) => format!("{} ({hint})", db.message()),
                None => db.message().to_owned(),
            }),
            None => AdminError::Database(error.to_string()),
        }
    }
}

/// Runs `command`, printing what it did; `Ok(false)` if `check` found a problem.
pub async fn run(command: TablesCommand) -> Result<bool, AdminError> {
    match command {
        TablesCommand::Protect(args) => {
            let client = connect(&args.database.database_url).await?;
            for table in protect(&client, &args.table, &args.resource).await? {
                println!("fenced {table} for resource {}", args.resource);
            }
            Ok(true)
        }
        TablesCommand::Unprotect(args) => {
            let client = connect(&args.database.database_url).await?;
            for table in unprotect(&client, &args.table).await? {
                println!("unfenced {table}");
            }
            Ok(true)
        }
        TablesCommand::Check(args) => check(&connect(&args.database.database_url).await?).await,
    }
}

/// Connects to `url` and brings the `fencegate` schema to this binary's version — or,
/// for a role that may not change the schema (a table owner other than the gateway's
/// login), uses it as the gateway installed it.
pub async fn connect(url: &str) -> Result<Client, AdminError> {
    let url = crate::pgtls::parse(url).map_err(AdminError::InvalidUrl)?;
    let (mut client, connection) = url
        .config
        .connect(url.tls.make_tls_connect())
        .await
        .map_err(|e| AdminError::Connect(error_text(&e)))?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "admin connection ended");
        }
    });
    match migrate(&mut client).await {
        Ok(()) => Ok(client),
        Err(PgStartError::Migrate(error)) => {
            let installed: bool = client
                .query_one(
                    "SELECT EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                                    WHERE n.nspname = 'fencegate' AND p.proname = 'protect')",
                    &[],
                )
                .await?
                .get(0);
            match installed {
                true => Ok(client),
                false => Err(PgStartError::Migrate(error).into()),
            }
        }
        Err(error) => Err(error.into()),
    }
}

/// Fences `table` (and every partition and child below it) for `resource`; returns
/// the tables now fenced.
pub async fn protect(
    client: &Client,
    table: &str,
    resource: &str,
) -> Result<Vec<String>, AdminError> {
    let rows = client
        .query(
            "SELECT t::text FROM fencegate.protect($1::text::regclass, $2) AS t",
            &[&table, &resource],
        )
        .await?;
    Ok(rows.iter().map(|row| row.get(0)).collect())
}

/// Removes the fence from `table` and everything below it; returns those tables.
pub async fn unprotect(client: &Client, table: &str) -> Result<Vec<String>, AdminError> {
    let rows = client
        .query(
            "SELECT t::text FROM fencegate.unprotect($1::text::regclass) AS t",
            &[&table],
        )
        .await?;
    Ok(rows.iter().map(|row| row.get(0)).collect())
}

/// A fenced table and its resource.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Protected {
    pub table: String,
    pub resource: String,
}

pub async fn protected(client: &Client) -> Result<Vec<Protected>, AdminError> {
    let rows = client
        .query(
            "SELECT tbl::text, resource FROM fencegate.protected ORDER BY 1",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| Protected {
            table: row.get(0),
            resource: row.get(1),
        })
        .collect())
}

/// One finding of the audit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    /// `problem` (a hole in the fence) or `warning` (a risk).
    pub severity: String,
    /// A stable name: `unprotected_partition`, `trigger_not_always`,
    /// `writer_owns_protected_table`, `role_can_write_fences`,
    /// `role_can_create_in_fencegate`, `public_can_execute`, `no_partition_guard`.
    pub finding: String,
    pub object: String,
    pub detail: String,
}

impl Finding {
    pub fn is_problem(&self) -> bool {
        self.severity == "problem"
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<8} {:<28} {}: {}",
            self.severity, self.finding, self.object, self.detail
        )
    }
}

/// Everything `fencegate.audit()` finds.
pub async fn audit(client: &Client) -> Result<Vec<Finding>, AdminError> {
    let rows = client
        .query(
            "SELECT severity, finding, object, detail FROM fencegate.audit() ORDER BY 1, 2, 3",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| Finding {
            severity: row.get(0),
            finding: row.get(1),
            object: row.get(2),
            detail: row.get(3),
        })
        .collect())
}

/// `fencegate check`: prints the fenced tables and every finding; `Ok(false)` if a
/// finding is a problem.
pub async fn check(client: &Client) -> Result<bool, AdminError> {
    let tables = protected(client).await?;
    let findings = audit(client).await?;
    for table in &tables {
        println!(
            "fenced   {:<28} for resource {}",
            table.table, table.resource
        );
    }
    for finding in &findings {
        println!("{finding}");
    }
    let problems = findings.iter().filter(|f| f.is_problem()).count();
    println!(
        "{} fenced tables, {problems} problems, {} warnings",
        tables.len(),
        findings.len() - problems
    );
    Ok(problems == 0)
}
