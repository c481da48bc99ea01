//! The gateway's login and database, made by the very SQL of `deploy/patroni/README.md`
//! (the first `sql` block of its "The gateway" section), with a password of the test's:
//! a gateway on them runs as the README sets it up, not as the superuser.

use std::path::Path;

use super::{HaCluster, DEPLOY};

/// The README whose SQL makes the login.
const README: &str = "README.md";

/// The section of the README that holds the SQL.
const SECTION: &str = "## The gateway";

/// What stands for the password in the README's SQL.
const PASSWORD_PLACEHOLDER: &str = "'...'";

impl HaCluster {
    /// Runs the README's SQL for the gateway's login through HAProxy as the superuser,
    /// one statement at a time (as `psql` sends them: `CREATE DATABASE` may not share
    /// a transaction); the login's URL through HAProxy, e.g.
    /// `postgres://fencegate:pw@127.0.0.1:5000/fencegate`.
    pub async fn create_gateway_login(&self) -> String {
        let statements = gateway_sql(&self.password)
            .unwrap_or_else(|error| panic!("{DEPLOY}/{README}: {error}"));
        let (client, connection) =
            tokio_postgres::connect(&self.haproxy_url(), tokio_postgres::NoTls)
                .await
                .unwrap_or_else(|e| self.fail(&format!("the superuser cannot connect: {e}")));
        tokio::spawn(connection);
        for statement in &statements {
            if let Err(error) = client.batch_execute(statement).await {
                self.fail(&format!(
                    "the README's `{}` failed: {error}",
                    statement.replace(&self.password, "***")
                ));
            }
        }
        let (role, database) = login_names(&statements)
            .unwrap_or_else(|| panic!("{DEPLOY}/{README}: no CREATE ROLE and CREATE DATABASE"));
        format!(
            "postgres://{role}:{}@127.0.0.1:{}/{database}",
            self.password, self.haproxy_port
        )
    }
}

/// The statements of the README's SQL, `'...'` replaced by `password`.
fn gateway_sql(password: &str) -> Result<Vec<String>, String> {
    let text = std::fs::read_to_string(Path::new(DEPLOY).join(README))
        .map_err(|e| format!("cannot be read: {e}"))?;
    let section = text
        .split_once(SECTION)
        .ok_or_else(|| format!("no section {SECTION:?}"))?
        .1;
    let block = section
        .split_once("```sql\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .ok_or_else(|| format!("no ```sql block in {SECTION:?}"))?
        .0;
    if !block.contains(PASSWORD_PLACEHOLDER) {
        return Err(format!("the SQL has no password {PASSWORD_PLACEHOLDER}"));
    }
    // Comments run from `--` to the end of the line (the SQL has no `--` in a string).
    let sql: String = block
        .lines()
        .map(|line| line.split("--").next().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
        .replace(PASSWORD_PLACEHOLDER, &format!("'{password}'"));
    Ok(sql
        .split(';')
        .map(str::trim)
        .filter(|statement| !statement.is_empty())
        .map(str::to_owned)
        .collect())
}

/// The role of the first `CREATE ROLE` and the database of the first `CREATE DATABASE`.
fn login_names(statements: &[String]) -> Option<(String, String)> {
    let name_after = |prefix: &str| {
        statements.iter().find_map(|statement| {
            let rest = statement.strip_prefix(prefix)?;
            Some(rest.split_whitespace().next()?.to_owned())
        })
    };
    Some((name_after("CREATE ROLE ")?, name_after("CREATE DATABASE ")?))
}
