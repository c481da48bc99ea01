//! What the gateway reads and sets in its database besides fences and objects: server
//! settings, the database's name, the `/v1/sql` login's grant of the fence step and
//! the authority it reaches, and the gateway's own settings for the schema's functions.

use super::{classify, statements, PgStore, Sent};
use crate::store::StoreError;

impl PgStore {
    /// The values of the server settings `names`, in order; `None` for a setting the
    /// server does not have.
    pub async fn server_settings(&self, names: &[&str]) -> Result<Vec<Option<String>>, StoreError> {
        self.with_client(async |client| {
            let mut values = Vec::with_capacity(names.len());
            for name in names {
                let row = client
                    .query_one("SELECT current_setting($1, true)", &[name])
                    .await
                    .map_err(|e| classify(e, Sent::NoCommit))?;
                values.push(row.get(0));
            }
            Ok(values)
        })
        .await
    }

    /// The name of the database the store is in.
    pub async fn database(&self) -> Result<String, StoreError> {
        self.with_client(async |client| {
            let row = client
                .query_one("SELECT current_database()::text", &[])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            Ok(row.get(0))
        })
        .await
    }

    /// Lets the SQL login `role` take the fence step of `/v1/sql` (`fencegate.sql_fence()`,
    /// which also needs the gateway's key), and nothing more: not `fencegate.fence()`,
    /// which earlier versions granted it.
    pub async fn grant_sql_fence(&self, role: &str) -> Result<(), StoreError> {
        self.with_client(async |client| {
            for grant in [
                "SELECT format('GRANT USAGE ON SCHEMA fencegate TO %I', $1::text)",
                "SELECT format('GRANT EXECUTE ON FUNCTION fencegate.sql_fence(text, bigint, bytea) TO %I', $1::text)",
                "SELECT format('GRANT EXECUTE ON FUNCTION fencegate.sql_idempotency_claim(text, text, bytea, bigint, bigint, bytea) TO %I', $1::text)",
                "SELECT format('GRANT EXECUTE ON FUNCTION fencegate.sql_idempotency_record(text, text, smallint, text, bytea, bytea) TO %I', $1::text)",
                "SELECT format('REVOKE EXECUTE ON FUNCTION fencegate.fence(text, bigint) FROM %I', $1::text)",
            ] {
                let statement: String = client
                    .query_one(grant, &[&role])
                    .await
                    .map_err(|e| classify(e, Sent::NoCommit))?
                    .get(0);
                client
                    .batch_execute(&statement)
                    .await
                    .map_err(|e| classify(e, Sent::NoCommit))?;
            }
            Ok(())
        })
        .await
    }

    /// The roles that `login` can act as and that hold resources in
    /// `fencegate.authority`, comma-separated; `None` if there are none.
    pub async fn authority_reached_by(&self, login: &str) -> Result<Option<String>, StoreError> {
        self.with_client(async |client| {
            let row = client
                .query_one(
                    "SELECT string_agg(DISTINCT r.rolname, ', ')
                     FROM fencegate.authority a JOIN pg_roles r ON r.oid = a.role
                     WHERE pg_has_role($1::text::name, r.oid, 'MEMBER')",
                    &[&login],
                )
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            Ok(row.get(0))
        })
        .await
    }

    /// Records a setting that the schema's functions read (`fencegate.settings`).
    pub async fn set_setting(&self, name: &str, value: &str) -> Result<(), StoreError> {
        self.with_client(async |client| {
            client
                .execute(statements::SET_SETTING, &[&name, &value])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            Ok(())
        })
        .await
    }
}
