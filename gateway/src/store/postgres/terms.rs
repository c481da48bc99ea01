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

use super::{classify, statements, with_client_until, PgStore, Sent};
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

/// The sessions ended since an id of the takeover log: the records, and the last id
/// issued. Ids are issued by a sequence, which a rollback does not take back: a session
/// ended by a raise that then failed leaves a gap, counted though its record is gone.
#[derive(Debug, Clone, Default)]
pub struct Takeovers {
    pub records: Vec<Takeover>,
    pub last_id: i64,
}

impl PgStore {
    /// The sessions ended since `after` (`fencegate.takeovers`), in order.
    pub async fn takeovers_since(&self, after: i64) -> Result<Takeovers, StoreError> {
        self.with_client(async |client| {
            let rows = client
                .query(statements::TAKEOVERS_SINCE, &[&after])
                .await
                .map_err(|e| classify(e, Sent::NoCommit))?;
            let records: Vec<Takeover> = rows
                .iter()
                .map(|row| Takeover {
                    id: row.get(0),
                    resource: row.get(1),
                    token: row.get(2),
                    pid: row.get(3),
                    role: row.get(4),
                    ended_by: row.get(5),
                })
                .collect();
            let issued = last_takeover_id(client).await?;
            let last_id = records.last().map_or(issued, |last| last.id.max(issued));
            Ok(Takeovers { records, last_id })
        })
        .await
    }

    /// The last id the takeover log issued (0 if none).
    pub async fn last_takeover(&self) -> Result<i64, StoreError> {
        self.with_client(async |client| last_takeover_id(client).await)
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
        .map_err(|e| classify(e, Sent::NoCommit))?;
    Ok(row.get(0))
}

/// The last id the takeover log's sequence issued, committed or not (0 if none).
async fn last_takeover_id(client: &tokio_postgres::Client) -> Result<i64, StoreError> {
    let row = client
        .query_one(statements::TAKEOVER_LAST_ID, &[])
        .await
        .map_err(|e| classify(e, Sent::NoCommit))?;
    Ok(row.get(0))
}
