//! The operator's commands for the in-database fence: `fencegate protect`,
//! `unprotect` and `check` (each a call of the schema's SQL function of that name),
//! `grant`, `revoke` and `grants` (who holds which resources), and `leader-lease
//! guard` and `retire` (a seed `leader_lease` table its electors cannot forge). The
//! schema is created or migrated first, if the role may.
//!
//! They connect with the operator's database URL and run with its privileges:
//! protecting a table needs its ownership, which writers must not have; granting needs
//! the schema's ownership.

use std::fmt;

use tokio_postgres::Client;

use crate::auth::Pattern;
use crate::config::{AdminCommand, LeaderLeaseCommand};
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
    #[error("{0}")]
    Usage(String),
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
pub async fn run(command: AdminCommand) -> Result<bool, AdminError> {
    match command {
        AdminCommand::Protect(args) => {
            let client = connect(&args.database.database_url).await?;
            for table in protect(&client, &args.table, &args.resource).await? {
                println!("fenced {table} for resource {}", args.resource);
            }
            Ok(true)
        }
        AdminCommand::Unprotect(args) => {
            let client = connect(&args.database.database_url).await?;
            for table in unprotect(&client, &args.table).await? {
                println!("unfenced {table}");
            }
            Ok(true)
        }
        AdminCommand::Check(args) => check(&connect(&args.database.database_url).await?).await,
        AdminCommand::Grant(args) => {
            let client = connect(&args.database.database_url).await?;
            if args.resources.is_empty() && !args.tables {
                return Err(AdminError::Usage(
                    "say what to grant: --resource PATTERN (repeatable) and/or --tables".into(),
                ));
            }
            grant(&client, &args.role, &args.resources, args.tables).await?;
            for pattern in &args.resources {
                println!("granted {} resource {}", args.role, pattern_text(pattern));
            }
            if args.tables {
                println!("granted {} fencing its own tables", args.role);
            }
            Ok(true)
        }
        AdminCommand::Revoke(args) => {
            let client = connect(&args.database.database_url).await?;
            let taken = revoke(&client, &args.role, &args.resources, args.tables).await?;
            println!("revoked {taken} resource grants of {}", args.role);
            Ok(true)
        }
        AdminCommand::Grants(args) => {
            let client = connect(&args.database.database_url).await?;
            for held in grants(&client).await? {
                println!("{:<28} {}", held.role, held.pattern);
            }
            Ok(true)
        }
        AdminCommand::LeaderLease(LeaderLeaseCommand::Guard(args)) => {
            let client = connect(&args.database.database_url).await?;
            guard_leader_lease(&client, &args.table).await?;
            println!("guarded {}: electors move its leases only as the seed's statements do, for resources they hold", args.table);
            Ok(true)
        }
        AdminCommand::LeaderLease(LeaderLeaseCommand::Retire(args)) => {
            let mut client = connect(&args.table.database.database_url).await?;
            let from = retire_lease(
                &mut client,
                &args.table.table,
                &args.resource,
                args.epoch,
                &args.reason,
            )
            .await?;
            println!(
                "retired epoch {from} of lease {} in {}: back at {}; now reset the fence of {} \
                 (POST /v1/fences/{}/reset)",
                args.resource, args.table.table, args.epoch, args.resource, args.resource
            );
            Ok(true)
        }
    }
}

fn pattern_text(pattern: &Pattern) -> String {
    match pattern.parts() {
        (prefix, true) => format!("{prefix}*"),
        (name, false) => name.to_owned(),
    }
}

/// What a role needs to fence tables it owns: the commands' functions (which act with
/// its privileges, or check its ownership), and the trigger functions (creating a
/// trigger needs EXECUTE on its function).
const TABLE_OWNER_GRANTS: &[&str] = &[
    "GRANT EXECUTE ON FUNCTION fencegate.protect(regclass, text), fencegate.unprotect(regclass),
         fencegate.register_table(regclass, text), fencegate.unregister_table(regclass),
         fencegate.install_trigger(regclass), fencegate.cover_family(regclass),
         fencegate.family(regclass), fencegate.ancestors(regclass),
         fencegate.reachable_from_above(), fencegate.unprotected_descendants(),
         fencegate.family_coverage(regclass), fencegate.fence_trigger(regclass, boolean),
         fencegate.require_resource(text), fencegate.valid_resource(text),
         fencegate.audit(), fencegate.enforce(), fencegate.guard_leader_lease() TO %I",
    "GRANT SELECT ON fencegate.protected TO %I",
];

/// Lets `role` present and raise the fences of `resources`, and (with `tables`) fence
/// tables it owns; in one transaction.
pub async fn grant(
    client: &Client,
    role: &str,
    resources: &[Pattern],
    tables: bool,
) -> Result<(), AdminError> {
    let oid = role_oid(client, role).await?;
    client.batch_execute("BEGIN").await?;
    let done = async {
        for pattern in resources {
            let (text, prefix) = pattern.parts();
            client
                .execute(
                    "INSERT INTO fencegate.authority (role, pattern, prefix)
                     VALUES ($1::oid::regrole, $2, $3) ON CONFLICT DO NOTHING",
                    &[&oid, &text, &prefix],
                )
                .await?;
        }
        let mut statements = vec!["GRANT USAGE ON SCHEMA fencegate TO %I"];
        if !resources.is_empty() {
            statements.push("GRANT EXECUTE ON FUNCTION fencegate.fence(text, bigint) TO %I");
        }
        if tables {
            statements.extend_from_slice(TABLE_OWNER_GRANTS);
        }
        for statement in statements {
            run_for_role(client, statement, role).await?;
        }
        Ok::<(), AdminError>(())
    }
    .await;
    finish(client, done).await
}

/// Takes back `resources` from `role`, and (with `tables`) the right to fence tables;
/// with neither, every resource and EXECUTE on `fencegate.fence()`. USAGE on the
/// schema stays: alone it grants nothing. `role` may also be the oid of a dropped role
/// whose grants remain (`fencegate grants` shows them). Returns how many resource
/// grants it took back.
pub async fn revoke(
    client: &Client,
    role: &str,
    resources: &[Pattern],
    tables: bool,
) -> Result<u64, AdminError> {
    // A dropped role's grants are named by its oid.
    let (oid, role_exists) = match role_oid(client, role).await {
        Ok(oid) => (oid, true),
        Err(error) => match role.parse::<u32>() {
            Ok(oid) if !tables => (oid, false),
            _ => return Err(error),
        },
    };
    client.batch_execute("BEGIN").await?;
    let done = async {
        let mut taken = 0;
        if resources.is_empty() && !tables {
            taken = client
                .execute("DELETE FROM fencegate.authority WHERE role = $1::oid", &[&oid])
                .await?;
            if role_exists {
                run_for_role(
                    client,
                    "REVOKE EXECUTE ON FUNCTION fencegate.fence(text, bigint) FROM %I",
                    role,
                )
                .await?;
            }
        }
        for pattern in resources {
            let (text, prefix) = pattern.parts();
            taken += client
                .execute(
                    "DELETE FROM fencegate.authority WHERE role = $1::oid AND pattern = $2 AND prefix = $3",
                    &[&oid, &text, &prefix],
                )
                .await?;
        }
        if tables {
            for statement in TABLE_OWNER_GRANTS {
                let revoke = statement.replacen("GRANT", "REVOKE", 1).replace(" TO %I", " FROM %I");
                run_for_role(client, &revoke, role).await?;
            }
        }
        Ok::<u64, AdminError>(taken)
    }
    .await;
    finish(client, done).await
}

/// Ends the transaction `done` ran in: commits if it succeeded, else rolls back.
async fn finish<T>(client: &Client, done: Result<T, AdminError>) -> Result<T, AdminError> {
    match done {
        Ok(value) => {
            client.batch_execute("COMMIT").await?;
            Ok(value)
        }
        Err(error) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(error)
        }
    }
}

/// The oid of the role named exactly `role`.
async fn role_oid(client: &Client, role: &str) -> Result<u32, AdminError> {
    client
        .query_opt("SELECT oid FROM pg_roles WHERE rolname = $1", &[&role])
        .await?
        .map(|row| row.get(0))
        .ok_or_else(|| AdminError::Usage(format!("there is no role named {role:?}")))
}

/// Runs `statement` with `%I` replaced by `role`, quoted as an identifier.
async fn run_for_role(client: &Client, statement: &str, role: &str) -> Result<(), AdminError> {
    let sql: String = client
        .query_one(
            "SELECT format($1::text, $2::text, $2::text)",
            &[&statement, &role],
        )
        .await?
        .get(0);
    client.batch_execute(&sql).await?;
    Ok(())
}

/// A resource a role holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    pub role: String,
    /// A name, or a prefix followed by `*`.
    pub pattern: String,
}

/// Every role and the resources it holds, by role; and the roles that may fence tables
/// they own (pattern `--tables`). A dropped role's grants are listed by its oid.
pub async fn grants(client: &Client) -> Result<Vec<Held>, AdminError> {
    let rows = client
        .query(
            "SELECT coalesce(r.rolname::text, a.role::oid::text || ' (dropped)'),
                    a.pattern || CASE WHEN a.prefix THEN '*' ELSE '' END
             FROM fencegate.authority a LEFT JOIN pg_roles r ON r.oid = a.role
             UNION ALL
             SELECT r.rolname::text, '--tables' FROM pg_roles r
             WHERE NOT r.rolsuper AND r.rolname !~ '^pg_'
               AND r.oid <> (SELECT nspowner FROM pg_namespace WHERE nspname = 'fencegate')
               AND has_function_privilege(r.oid, 'fencegate.protect(regclass, text)', 'EXECUTE')
             ORDER BY 1, 2",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| Held {
            role: row.get(0),
            pattern: row.get(1),
        })
        .collect())
}

/// Guards a `leader_lease` table: the column `holder_role` and the triggers of
/// `fencegate.guard_leader_lease()`, enabled ALWAYS; in one transaction.
pub async fn guard_leader_lease(client: &Client, table: &str) -> Result<(), AdminError> {
    let table = quote_table(table);
    client.batch_execute("BEGIN").await?;
    let done = async {
        client
            .batch_execute(&format!(
                "ALTER TABLE {table} ADD COLUMN IF NOT EXISTS holder_role name;
                 DROP TRIGGER IF EXISTS fencegate_lease_guard ON {table};
                 DROP TRIGGER IF EXISTS fencegate_lease_guard_truncate ON {table};
                 CREATE TRIGGER fencegate_lease_guard BEFORE INSERT OR UPDATE OR DELETE ON {table}
                     FOR EACH ROW EXECUTE FUNCTION fencegate.guard_leader_lease();
                 CREATE TRIGGER fencegate_lease_guard_truncate BEFORE TRUNCATE ON {table}
                     FOR EACH STATEMENT EXECUTE FUNCTION fencegate.guard_leader_lease();
                 ALTER TABLE {table} ENABLE ALWAYS TRIGGER fencegate_lease_guard;
                 ALTER TABLE {table} ENABLE ALWAYS TRIGGER fencegate_lease_guard_truncate;"
            ))
            .await?;
        Ok::<(), AdminError>(())
    }
    .await;
    finish(client, done).await
}

/// Retires a forged `leader_lease` record: its epoch back to `epoch` (below the one
/// recorded), the lease free, and the retirement recorded by the guard with `reason`.
/// Returns the epoch retired.
pub async fn retire_lease(
    client: &mut Client,
    table: &str,
    resource: &str,
    epoch: i64,
    reason: &str,
) -> Result<i64, AdminError> {
    if reason.trim().is_empty() {
        return Err(AdminError::Usage("--reason must say why".into()));
    }
    let table = quote_table(table);
    let tx = client.transaction().await?;
    tx.execute(
        "SELECT set_config('fencegate.reason', $1, true)",
        &[&reason],
    )
    .await?;
    let current: Option<i64> = tx
        .query_opt(
            &format!("SELECT epoch FROM {table} WHERE name = $1 FOR UPDATE"),
            &[&resource],
        )
        .await?
        .map(|row| row.get(0));
    let Some(current) = current else {
        return Err(AdminError::Usage(format!(
            "{table} has no lease named {resource:?}"
        )));
    };
    if epoch < 0 || epoch >= current {
        return Err(AdminError::Usage(format!(
            "lease {resource:?} is at epoch {current}: --epoch must be below it (and not negative)"
        )));
    }
    tx.execute(
        &format!(
            "UPDATE {table} SET epoch = $2, holder = NULL, holder_role = NULL,
                 expires_at = '-infinity' WHERE name = $1"
        ),
        &[&resource, &epoch],
    )
    .await?;
    tx.commit().await?;
    Ok(current)
}

/// A table name as `--leader-lease-table` accepts it, quoted part by part.
fn quote_table(table: &str) -> String {
    table
        .split('.')
        .map(|part| format!("\"{}\"", part.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
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
            tracing::warn!(
                %error,
                "could not bring schema fencegate to this version as this role; using it as installed"
            );
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
    /// `problem` (a hole in the fence), `warning` (a risk) or `info` (who can reach
    /// the fence).
    pub severity: String,
    /// A stable name, as docs/fenced-tables.md lists them.
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
    let warnings = findings.iter().filter(|f| f.severity == "warning").count();
    println!(
        "{} fenced tables, {problems} problems, {warnings} warnings",
        tables.len()
    );
    Ok(problems == 0)
}
