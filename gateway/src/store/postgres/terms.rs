//! Authority that outlives a term, bounded: the sessions of older terms that hold a
//! fence a new term raises are ended, and recorded (`fencegate.takeovers`) for every
//! gateway on the database to follow.
//!
//! # Behavior
//!
//! - Every call of the store that may raise a fence — a write, an advance, a
//!   transaction or keyed write, a lease acquire — runs through
//!   [`PgStore::taking_over`]: if it has not completed after `--term-takeover-timeout`,
//!   the sessions that hold those fences for an older term are ended
//!   (`fencegate.end_older_terms()`), on a connection of their own while the call keeps
//!   waiting: open transactions through the Postgres door, `/v1/sql`, or writers' own
//!   connections. Their transactions roll back; the raise then completes. A fence that
//!   is not below the call's token ends nothing: a term never ends its own sessions.
//! - The in-database fence does the same for raises through `fencegate.fence()`,
//!   `/v1/sql` and fenced tables, inside `fencegate.raise_fence()`.

use std::future::Future;

use fencegate_proto::{ResourceName, Token};
use tokio::time::Instant;

use super::{classify, statements, with_client_until, PgStore};
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

    /// Runs `call`, which may raise the fences `raises` names (each with its token);
    /// see the module doc. `raises` is asked only once the call has waited.
    pub(super) async fn taking_over<T>(
        &self,
        raises: impl FnOnce() -> Vec<(ResourceName, Token)>,
        call: impl Future<Output = T>,
    ) -> T {
        if self.term_takeover.is_zero() {
            return call.await;
        }
        let mut call = std::pin::pin!(call);
        tokio::select! {
            biased;
            done = &mut call => return done,
            () = tokio::time::sleep(self.term_takeover) => {}
        }
        let (pool, timeout) = (self.pool.clone(), self.timeout);
        let raises = raises();
        tokio::spawn(async move {
            for (resource, token) in raises {
                let ended = with_client_until(&pool, Instant::now() + timeout, async |client| {
                    end_older_terms(client, &resource, token).await
                })
                .await;
                match ended {
                    Ok(0) => {}
                    Ok(ended) => tracing::warn!(
                        resource = resource.as_str(),
                        token = token.get(),
                        ended,
                        "ended sessions of an older term that held the fence a new term raises"
                    ),
                    Err(error) => tracing::warn!(
                        resource = resource.as_str(),
                        %error,
                        "could not end the sessions of an older term"
                    ),
                }
            }
        });
        call.await
    }
}

/// Ends the sessions that hold `resource`'s fence for a term older than `token`
/// (`fencegate.end_older_terms()`); returns how many.
async fn end_older_terms(
    client: &tokio_postgres::Client,
    resource: &ResourceName,
    token: Token,
) -> Result<i32, StoreError> {
    let row = client
        .query_one(
            statements::END_OLDER_TERMS,
            &[&resource.as_str(), &token.as_i64()],
        )
        .await
        .map_err(|e| classify(e, false))?;
    Ok(row.get(0))
}
