//! Older-term sessions that a new term ended (`fencegate.takeovers`), followed by every
//! gateway on the database, and the ending itself.

use fencegate_proto::{ResourceName, Token};

use super::{classify, statements, PgStore};
use crate::store::StoreError;

/// An older-term session that a new term ended (`fencegate.takeovers`).
#[derive(Debug, Clone)]
pub struct Takeover {
    pub id: i64,
    pub resource: String,
    pub token: i64,
    pub pid: i32,
    pub role: String,
    pub ended_by: String,
}

impl PgStore {
    /// The older-term sessions ended since `after` (`fencegate.takeovers`), in order:
    /// id, resource, token, pid, role, who ended them.
    pub async fn takeovers_since(&self, after: i64) -> Result<Vec<Takeover>, StoreError> {
        self.with_client(async |client| {
            let rows = client
                .query(statements::TAKEOVERS_SINCE, &[&after])
                .await
                .map_err(|e| classify(e, false))?;
            Ok(rows
                .iter()
                .map(|row| Takeover {
                    id: row.get(0),
                    resource: row.get(1),
                    token: row.get(2),
                    pid: row.get(3),
                    role: row.get(4),
                    ended_by: row.get(5),
                })
                .collect())
        })
        .await
    }

    /// The id of the last entry of the takeover log (0 if none).
    pub async fn last_takeover(&self) -> Result<i64, StoreError> {
        self.with_client(async |client| {
            let row = client
                .query_one("SELECT coalesce(max(id), 0) FROM fencegate.takeovers", &[])
                .await
                .map_err(|e| classify(e, false))?;
            Ok(row.get(0))
        })
        .await
    }

    /// Ends the sessions that hold `resource`'s fence for a term older than `token`
    /// (`fencegate.end_older_terms()`); returns how many.
    pub async fn end_older_terms(
        &self,
        resource: &ResourceName,
        token: Token,
    ) -> Result<i32, StoreError> {
        self.with_client(async |client| {
            let row = client
                .query_one(
                    statements::END_OLDER_TERMS,
                    &[&resource.as_str(), &token.as_i64()],
                )
                .await
                .map_err(|e| classify(e, false))?;
            Ok(row.get(0))
        })
        .await
    }
}
