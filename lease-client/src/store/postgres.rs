//! The seed's lease on a Postgres row.
//!
//! ```sql
//! CREATE TABLE leader_lease (
//!   name        text PRIMARY KEY,
//!   holder      text,
//!   epoch       bigint NOT NULL DEFAULT 0,          -- the fencing token
//!   expires_at  timestamptz NOT NULL DEFAULT '-infinity'
//! );
//! ```
//!
//! Each operation is one `UPDATE ... WHERE <who may> RETURNING epoch`: Postgres
//! re-checks the predicate after taking the row lock, so of two racing statements at
//! most one matches. Expiry is written and compared with the database's `now()`, so
//! the clocks of the application servers never matter.
//!
//! # Connection
//!
//! One connection, opened on first use and replaced after it breaks. Calls made while
//! it is down fail with [`StoreError::Unavailable`]; the elector retries them.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_proto::Token;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls};

use super::{ForgetOnDrop, LeaseStore, StoreError};

/// The seed's table name.
pub const DEFAULT_TABLE: &str = "leader_lease";
/// How long opening a connection may take before the call counts as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Leases in a Postgres table compatible with the seed's `leader_lease`.
pub struct PostgresStore {
    config: tokio_postgres::Config,
    table: String,
    create_missing: bool,
    sql: Sql,
    /// The open connection, if any; cloned out so that calls never hold the lock
    /// across an await.
    conn: Mutex<Option<Arc<Conn>>>,
    /// Lease rows known to exist (inserted or checked once per store).
    rows: Mutex<HashSet<String>>,
}

struct Sql {
    acquire: String,
    renew: String,
    release: String,
}

/// An open connection; statements are sent by text (the table may not exist when
/// the connection opens, and a lease call every few seconds gains nothing from
/// preparing).
struct Conn {
    client: Client,
}

impl PostgresStore {
    /// A store on `url` using table `table` (optionally schema-qualified, e.g.
    /// `ops.leader_lease`). With `create_missing`, the table and each lease's row are
    /// created on first use; without it they must exist.
    pub fn new(url: &str, table: &str, create_missing: bool) -> Result<PostgresStore, StoreError> {
        let mut config: tokio_postgres::Config = url
            .parse()
            .map_err(|_| StoreError::Invalid("the Postgres URL does not parse".into()))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_TIMEOUT);
        }
        let quoted = quote_table(table)?;
        let sql = Sql {
            // The seed's statements; the epoch rises on every acquisition, also when
            // the holder is already us (see the store module's rule on re-acquiring).
            acquire: format!(
                "UPDATE {quoted} SET holder = $2, epoch = epoch + 1, \
                 expires_at = now() + make_interval(secs => $3) \
                 WHERE name = $1 AND (holder IS NULL OR holder = $2 OR expires_at < now()) \
                 RETURNING epoch"
            ),
            // Never bumps the epoch, and names the epoch we believe we hold.
            renew: format!(
                "UPDATE {quoted} SET expires_at = now() + make_interval(secs => $3) \
                 WHERE name = $1 AND holder = $2 AND epoch = $4 AND expires_at > now() \
                 RETURNING epoch"
            ),
            // Only our own term; the epoch stays, so the next acquisition still rises.
            release: format!(
                "UPDATE {quoted} SET holder = NULL, expires_at = '-infinity' \
                 WHERE name = $1 AND holder = $2 AND epoch = $3 \
                 RETURNING epoch"
            ),
        };
        Ok(PostgresStore {
            config,
            table: quoted,
            create_missing,
            sql,
            conn: Mutex::new(None),
            rows: Mutex::new(HashSet::new()),
        })
    }

    /// Creates the table (if `create_missing`) and the lease's row if they are missing;
    /// without `create_missing`, checks that the row exists.
    pub async fn ensure_lease(&self, lease: &str) -> Result<(), StoreError> {
        if self.rows.lock().unwrap().contains(lease) {
            return Ok(());
        }
        let conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| self.forget(&conn));
        let result = self.create(&conn.client, lease).await;
        abandoned.completed();
        self.check(&conn, &result);
        if !result.map_err(classify)? {
            return Err(StoreError::Unexpected(format!(
                "lease {lease:?} has no row in {}: insert it, or let the store create it",
                self.table
            )));
        }
        self.rows.lock().unwrap().insert(lease.to_owned());
        Ok(())
    }

    /// Whether the lease row exists afterwards.
    async fn create(&self, client: &Client, lease: &str) -> Result<bool, tokio_postgres::Error> {
        let table = &self.table;
        if self.create_missing {
            // Look first: CREATE TABLE IF NOT EXISTS on an existing table logs a
            // notice on every start.
            let exists: bool = client
                .query_one("SELECT to_regclass($1) IS NOT NULL", &[table])
                .await?
                .get(0);
            if !exists {
                let create = format!(
                    "CREATE TABLE IF NOT EXISTS {table} (\
                       name text PRIMARY KEY, holder text, epoch bigint NOT NULL DEFAULT 0, \
                       expires_at timestamptz NOT NULL DEFAULT '-infinity')"
                );
                if let Err(error) = client.batch_execute(&create).await {
                    // Two processes creating the table at once: one of them loses on
                    // the catalog's unique index, and the table exists either way.
                    if error.code() != Some(&SqlState::UNIQUE_VIOLATION) {
                        return Err(error);
                    }
                }
            }
            let insert =
                format!("INSERT INTO {table} (name) VALUES ($1) ON CONFLICT (name) DO NOTHING");
            client.execute(&insert, &[&lease]).await?;
            Ok(true)
        } else {
            let select = format!("SELECT 1 FROM {table} WHERE name = $1");
            Ok(client.query_opt(&select, &[&lease]).await?.is_some())
        }
    }

    async fn conn(&self) -> Result<Arc<Conn>, StoreError> {
        if let Some(conn) = self.conn.lock().unwrap().as_ref() {
            if !conn.client.is_closed() {
                return Ok(Arc::clone(conn));
            }
        }
        let (client, connection) = self.config.connect(NoTls).await.map_err(unavailable)?;
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "lease store connection closed");
            }
        });
        let conn = Arc::new(Conn { client });
        *self.conn.lock().unwrap() = Some(Arc::clone(&conn));
        Ok(conn)
    }

    /// Forgets a connection that broke, so the next call opens a new one.
    fn check<T>(&self, conn: &Arc<Conn>, result: &Result<T, tokio_postgres::Error>) {
        if result.is_err() && conn.client.is_closed() {
            self.forget(conn);
        }
    }

    /// Forgets `conn` if it is still the open connection.
    fn forget(&self, conn: &Arc<Conn>) {
        let mut slot = self.conn.lock().unwrap();
        if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            *slot = None;
        }
    }
}

impl LeaseStore for PostgresStore {
    async fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Token>, StoreError> {
        self.ensure_lease(lease).await?;
        let conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| self.forget(&conn));
        let result = conn
            .client
            .query_opt(&self.sql.acquire, &[&lease, &holder, &ttl.as_secs_f64()])
            .await;
        abandoned.completed();
        self.check(&conn, &result);
        match result.map_err(classify)? {
            None => Ok(None),
            Some(row) => epoch(row.get(0)).map(Some),
        }
    }

    async fn renew(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| self.forget(&conn));
        let result = conn
            .client
            .query_opt(
                &self.sql.renew,
                &[&lease, &holder, &ttl.as_secs_f64(), &epoch.as_i64()],
            )
            .await;
        abandoned.completed();
        self.check(&conn, &result);
        Ok(result.map_err(classify)?.is_some())
    }

    async fn release(&self, lease: &str, holder: &str, epoch: Token) -> Result<bool, StoreError> {
        let conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| self.forget(&conn));
        let result = conn
            .client
            .query_opt(&self.sql.release, &[&lease, &holder, &epoch.as_i64()])
            .await;
        abandoned.completed();
        self.check(&conn, &result);
        Ok(result.map_err(classify)?.is_some())
    }
}

fn epoch(value: i64) -> Result<Token, StoreError> {
    u64::try_from(value)
        .ok()
        .and_then(|v| Token::new(v).ok())
        .ok_or_else(|| StoreError::Unexpected(format!("epoch {value} is not a valid token")))
}

/// Quotes `name` or `schema.name` as SQL identifiers; plain identifiers only.
fn quote_table(table: &str) -> Result<String, StoreError> {
    let parts: Vec<&str> = table.split('.').collect();
    let valid = |part: &&str| {
        let mut chars = part.chars();
        part.len() <= 63
            && chars
                .next()
                .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if parts.len() > 2 || !parts.iter().all(valid) {
        return Err(StoreError::Invalid(format!(
            "table name {table:?}: use an identifier of [A-Za-z_][A-Za-z0-9_]*, optionally schema-qualified"
        )));
    }
    Ok(parts
        .iter()
        .map(|p| format!("\"{p}\""))
        .collect::<Vec<_>>()
        .join("."))
}

fn unavailable(error: tokio_postgres::Error) -> StoreError {
    StoreError::Unavailable(error.to_string())
}

/// Errors with an SQL state are answers (a missing table, a permission); the rest
/// mean the database could not be asked.
fn classify(error: tokio_postgres::Error) -> StoreError {
    match error.code() {
        Some(code) if *code == SqlState::T_R_SERIALIZATION_FAILURE => {
            StoreError::Unavailable(error.to_string())
        }
        Some(_) => StoreError::Unexpected(error.to_string()),
        None => StoreError::Unavailable(error.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_quoted_identifiers() {
        assert_eq!(quote_table("leader_lease").unwrap(), "\"leader_lease\"");
        assert_eq!(quote_table("ops.Lease_2").unwrap(), "\"ops\".\"Lease_2\"");
        for bad in ["", "a.b.c", "1abc", "a-b", "a\"b", "a;drop"] {
            assert!(quote_table(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
